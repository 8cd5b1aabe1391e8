"""The placement's windowed deal: inside a group, each document's blocks over an aligned window of the ranks its work
needs, not over the whole group (issue 39, the worst seeds).

The group deal (``distattn.schedule.deal.deal``) snakes (or chunks) every document of a group over all ``k`` ranks, so
every pair of the group shares every document and each of its ``k - 1`` steps moves a whole shard's keys: with short
documents (little work per key) the per-pair timeline is bound by those bytes. Here, per group:

* each block belongs to one of its document pieces (a block shared by two documents goes with one of them, not to a
  third rank that would then need both documents' keys): the one whose rows in it have the most work (the solver's
  candidates ``by="work"``; a document's last few rows, which see all its keys, then stay with its window instead of
  drawing its keys to the next document's rank) or the one holding most of its tokens (``by="tokens"``); the
  solver times both, and a third deal (``by="near"``: the heaviest piece's rule, and a document of width 1 goes to the
  rank of a block next to it when that rank is within a slack of the window picked below, its first and last rows
  then beside its neighbour's); each rule wins on some seeds (the near one: the Pile at P = 16, seed 70, 1.264x ->
  1.230x of perfect balance on NVLink; it removes few pairs, since most of a block two short documents share
  still goes with one of them, and a document shorter than a block owns none);
* pieces heaviest first; a piece's width ``w`` is the smallest divisor of ``k`` with ``work / w <= share * mean``
  (``mean``: a rank's mean work; ``share``: the candidate's parameter), so a short document stays on one rank (no pair,
  no bytes) and a long one spreads as far as its work asks;
* the window: ``w`` neighbouring ranks at a multiple of ``w`` (aligned, so windows of one width never half overlap),
  the one whose most loaded rank is least loaded among those with room for ``ceil(blocks / w)`` blocks each; none
  with room: the next width;
* the piece's blocks snake over the window from the document's end: full cycles of ``2w`` from the heavy end (every
  window rank gets the same work from them), the light start going on in the snake; or (``chunks``, a candidate of its
  own) a piece of at least ``2w`` blocks in *mirrored chunks* over the window, zigzag sharding of the piece as the
  group deal's chunks (``distattn.schedule.deal``): the same balance, and a rank's queries see of an earlier rank only
  its first chunk, so the window's pairs borrow about a quarter fewer keys. Where a long document's window is
  communication bound that wins (causal, P = 64, on NVLink: the Pile seed 118, 1.231x -> 1.161x of perfect balance;
  longtail seed 42, 1.130x -> 1.070x).

Returns each block's rank, ``-1`` for the blocks it leaves (no window had room) to the group deal's own fill
(``_fill_rest``: heaviest first to the least loaded rank with room). The solver times this deal as one more
candidate and keeps it only where the per-pair timeline finds it faster. Deterministic; pure numpy + Python.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SHARES", "chunk_of", "window_owners"]

SHARES = (0.0625, 0.125, 0.25, 0.5, 1.0)
"""The candidates' ``share``: the most of a rank's mean work one window rank takes from a document (0.25: documents
spread wider, the balance of the group deal with fewer pairs; 1.0: over the fewest ranks, the fewest bytes). Which one
wins depends on the batch (``bench/results/placement-sim/REFINE.md``): each is timed. 0.0625 and 0.125 (a long
document over nearly the whole group, the short ones still on one rank) lowered worst seeds of uniform:8192 at P = 16
and 64 (seed 83 at P = 64: 1.265x -> 1.172x of perfect balance on NVLink)."""


def window_owners(top: np.ndarray, piece_group: np.ndarray, work: np.ndarray, k: int, slots: int, share: float,
                  mean: float, single: np.ndarray, near: float = 0.0, chunks: bool = False) -> np.ndarray:
    """Each block's rank (``-1``: left to the caller's fill). ``top[x]``: the piece block ``x`` goes with (blocks
    are numbered group by group, ``k * slots`` per group, in position order); ``piece_group``: each piece's group;
    ``work``: each block's work; ``slots``: blocks per rank; ``mean``: a rank's mean work;
    ``single``: the pieces kept on one rank (short pieces of documents cut across groups, as the group deal keeps
    them); ``near`` (> 0): a piece of width 1 goes to the rank of a block next to it (its neighbours' rows then share
    their rank, no pair) when that rank has room and is within ``near * mean`` of the window the rule picks;
    ``chunks``: a piece of at least ``2w`` blocks goes over its window in mirrored chunks (:func:`_chunked`), not in the
    snake."""
    owner = np.full(len(top), -1, dtype=np.int64)
    first = np.flatnonzero(np.append(True, top[1:] != top[:-1]))  # a piece's blocks are consecutive
    stop = np.append(first[1:], len(top))
    piece, piece_work = top[first], np.add.reduceat(work, first)
    widths = [w for w in range(1, k + 1) if k % w == 0]
    groups = int(piece_group.max(initial=0)) + 1
    load, used = np.zeros((groups, k)), np.zeros((groups, k), dtype=np.int64)
    chunked = 0  # pieces dealt in chunks so far: every other one mirrored
    for i in np.lexsort((first, -piece_work)).tolist():
        a, z, g = int(first[i]), int(stop[i]), int(piece_group[piece[i]])
        need = 1 if single[piece[i]] else next((w for w in widths if piece_work[i] <= share * mean * w), k)
        for w in (x for x in widths if x >= need):
            at = _window(load[g], used[g], w, -(-(z - a) // w), slots)
            if at is None:
                continue
            if near > 0 and w == 1:
                at = _near(owner, a, z, g, k, load[g], used[g], z - a, slots, load[g][at] + near * mean, at)
            if chunks and w > 1 and z - a >= 2 * w:
                blocks, rank = np.arange(a, z), at + _chunked(z - a, w, chunked % 2 == 1)
                chunked += 1
            else:
                t = np.arange(z - a)  # from the document's end: block z - 1 - t
                rnd, pos = np.divmod(t, w)
                rank = at + np.where(rnd % 2 == 0, pos, w - 1 - pos)
                blocks = z - 1 - t
            owner[blocks] = g * k + rank
            np.add.at(load[g], rank, work[blocks])
            np.add.at(used[g], rank, 1)
            break
    return owner


def _chunked(count: int, w: int, mirror: bool) -> np.ndarray:
    """The window rank (``0 .. w - 1``) of each of a piece's ``count >= 2w`` blocks, in position order, in mirrored
    chunks: ``2w`` chunks of ``s = count // 2w`` blocks, rank ``i`` holding chunks ``i`` and ``2w - 1 - i`` (zigzag
    sharding of the piece: every pair of the window gets an equal share of its work, and a rank's queries see of an
    earlier rank only its first chunk); the ``count - 2ws`` blocks left over, between chunk ``w - 1`` and chunk ``w``,
    in a snake; ``mirror``: rank ``i`` holds what rank ``w - 1 - i`` would (every other piece dealt in chunks,
    heaviest first, so a window's pairs borrow alike both ways over its pieces; balancing the orientations' blocks per
    window instead, tried on three of the worst P = 64 causal seeds, was faster on one and slower on two)."""
    x = np.arange(count)
    chunk = chunk_of(x, count, w)
    rnd, pos = np.divmod(x - w * (count // (2 * w)), w)  # the middle's place from its first block
    rank = np.where(chunk < 0, np.where(rnd % 2 == 0, pos, w - 1 - pos), np.where(chunk < w, chunk, 2 * w - 1 - chunk))
    return w - 1 - rank if mirror else rank


def chunk_of(t: np.ndarray, count, k: int) -> np.ndarray:
    """The chunk (``0 .. 2k - 1``) of block ``t`` (``0 .. count - 1``) of a piece of ``count`` blocks cut into ``2k``
    chunks of ``max(count // 2k, 1)`` blocks, ``-1`` for the blocks left over between chunk ``k - 1`` and chunk ``k``
    (the middle): the mirrored chunks of the group deal (``distattn.schedule.deal``, ``count`` per block) and of a
    window (:func:`_chunked`) alike."""
    s = np.maximum(count // (2 * k), 1)
    half, mid = k * s, count - 2 * k * s  # the first k chunks' blocks; the blocks left over
    return np.where(t < half, t // s, np.where(t >= half + mid, k + (t - half - mid) // s, -1))


def _window(load: np.ndarray, used: np.ndarray, w: int, each: int, slots: int) -> int | None:
    """The first rank of the aligned window of ``w`` ranks whose most loaded rank is least loaded among those where
    every rank has room for ``each`` more blocks (a tie: the first); ``None`` when none has."""
    room = (slots - used).reshape(-1, w).min(axis=1)
    top = load.reshape(-1, w).max(axis=1)
    ok = np.flatnonzero(room >= each)
    return None if not len(ok) else int(ok[np.argmin(top[ok])]) * w


def _near(owner: np.ndarray, a: int, z: int, g: int, k: int, load: np.ndarray, used: np.ndarray, count: int,
          slots: int, limit: float, at: int) -> int:
    """The rank in group ``g`` of a block next to blocks ``[a, z)`` (before first, then after) with room for ``count``
    more blocks and load at most ``limit``; else ``at``."""
    for x in (a - 1, z):
        if 0 <= x < len(owner) and owner[x] >= 0 and owner[x] // k == g:
            r = int(owner[x]) % k
            if used[r] + count <= slots and load[r] <= limit:
                return r
    return at
