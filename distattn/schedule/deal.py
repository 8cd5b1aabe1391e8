"""The placement's second level: a group's blocks to its ranks (``distattn.schedule.placement`` chooses the groups).

Inside a group the group's tokens (its documents in position order, ``distattn.schedule.groups``) are cut into blocks
of ``B`` tokens and every rank of the group gets ``n / B`` of them. :func:`deal` deals them one of two ways:

* **the snake** (``chunks=False``): the whole blocks of every document, in full cycles of ``2k``, go to the group's
  ``k`` ranks in a snake (0, 1, .., k-1, k-1, .., 0), one block at a time: symmetric, so every (query rank, kv rank)
  pair of the group gets the same share of that stretch of the document's work, and the plan's steps stay equal across
  ranks;
* **mirrored chunks** (``chunks=True``): a document's whole blocks are cut into ``2k`` chunks of ``s`` blocks each
  (``s = whole blocks // 2k``; the few left over sit between chunk ``k - 1`` and chunk ``k``, dealt with the rest
  below), rank ``i`` holding chunks ``i`` and ``2k - 1 - i``: zigzag sharding of one document, so every pair still
  gets an equal share (two chunk-squares of full work each), but a rank's queries see of an earlier rank only its
  first chunk (and the middle): the pair borrows half the keys instead of nearly all of them (the snake interleaves
  every rank's blocks through the document, so any late block sees every rank's keys). That holds for one direction
  of each pair only (rank 0 would borrow every shard whole, rank ``k - 1`` half of each), so every other document is
  mirrored (rank ``i`` holding what rank ``k - 1 - i`` would), the documents longest first to the orientation with
  fewer blocks so far. Per document a rank then borrows three quarters of what the snake's pairs borrow; the rest
  (document ends, short documents) still borrow whole (uniform:8192, P = 16, seed 161, groups of 8: the busiest rank
  borrows 12% fewer rows, its kv fetches take 49-55 µs a step against 51-55 µs of compute on NVLink where the snake's
  took 55-60 µs against ~51, and the forward falls from 1.127x to 1.031x of perfect balance).

Either way the remaining blocks (document ends, short documents, the chunks' middle) go heaviest first to the least
loaded rank of the group with room, but for a short piece (at most half a rank's blocks) of a document cut across
groups, whose blocks go to one rank together: its keys then travel to one rank of the next group (or come from one),
not to all ``k`` of them. A windowed deal (``distattn.schedule.windows``) replaces the snake and the chunks by its own
owners (``chunks`` then deals its long pieces in mirrored chunks over their windows). Deterministic; pure Python +
numpy.
"""

from __future__ import annotations

import heapq

import numpy as np

from distattn.schedule.groups import RowWork
from distattn.schedule.streams import stream_owners
from distattn.schedule.windows import chunk_of, window_owners

__all__ = ["deal"]


def _fill_rest(owner: np.ndarray, work: np.ndarray, unit: np.ndarray, p: int, k: int, per_group: int,
               limit: float = float("inf")) -> np.ndarray | None:
    """Blocks without an owner (``-1``) to the ranks of their group: *items* heaviest first, each to the least loaded
    rank of the group with room for it whole. An item is the run of blocks with one ``unit`` id (``>= 0``: a short
    piece of a document cut across groups, kept on one rank) or a single block (``-1``); an item that no rank has
    room for goes block by block. ``None`` as soon as a rank's work exceeds ``limit``."""
    slots = per_group // k
    load = np.bincount(owner[owner >= 0], weights=work[owner >= 0], minlength=p).tolist()
    if max(load) > limit:
        return None
    used = np.bincount(owner[owner >= 0], minlength=p).tolist()
    rest = np.flatnonzero(owner < 0)
    if not len(rest):
        return owner
    ident = np.where(unit[rest] >= 0, unit[rest], -1 - rest)  # a block outside every unit is an item of its own
    first = np.flatnonzero(np.append(True, ident[1:] != ident[:-1]))  # the rest blocks of a unit are consecutive
    size = np.diff(np.append(first, len(rest)))
    item_work = np.add.reduceat(work[rest], first)
    heaps = [[(load[r], r) for r in range(g * k, (g + 1) * k) if used[r] < slots] for g in range(p // k)]
    for h in heaps:
        heapq.heapify(h)
    work_l, rest_l = work.tolist(), rest.tolist()
    order = np.lexsort((first, -item_work))[::-1]  # a stack: the heaviest item on top
    pending = list(zip(first[order].tolist(), size[order].tolist()))
    while pending:
        at, count = pending.pop()
        h = heaps[rest_l[at] // per_group]
        aside = []
        while h and slots - used[h[0][1]] < count:
            aside.append(heapq.heappop(h))
        if not h:  # no rank has room for the whole item: its blocks one by one, the heaviest first
            for item in aside:
                heapq.heappush(h, item)
            pending += [(i, 1) for i in sorted(range(at, at + count), key=lambda i: (work_l[rest_l[i]], -rest_l[i]))]
            continue
        w, r = heapq.heappop(h)
        for i in range(at, at + count):
            owner[rest_l[i]] = r
            w += work_l[rest_l[i]]
        if w > limit:
            return None
        used[r] += count
        if used[r] < slots:
            heapq.heappush(h, (w, r))
        for item in aside:
            heapq.heappush(h, item)
    return owner


def _units(key: np.ndarray, idx: np.ndarray, unit_piece: np.ndarray, blocks: int) -> np.ndarray:
    """Per block, the item it belongs to (``-1``: none): the block ranges of the unit pieces, merged where they
    share a block (two pieces meeting inside one block go to one rank together)."""
    unit = np.full(blocks, -1, dtype=np.int64)
    touched = unit_piece[idx]
    if not touched.any():
        return unit
    pieces, keys = idx[touched], key[touched]
    first = np.flatnonzero(np.append(True, pieces[1:] != pieces[:-1]))  # a piece's blocks: consecutive entries
    lo, hi = keys[first], np.maximum.reduceat(keys, first)
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    reach = np.maximum.accumulate(hi)
    ident = np.cumsum(np.append(True, lo[1:] > reach[:-1])) - 1  # a range overlapping the last one joins its item
    for a, b, i in zip(lo.tolist(), hi.tolist(), ident.tolist()):
        unit[a:b + 1] = i
    return unit


def deal(pieces: np.ndarray, starts, rows: RowWork, p: int, k: int, n: int, b: int, limit: float = float("inf"),
         share: float | None = None, mean: float = 0.0, by: str = "work", near: float = 0.0, chunks: bool = False,
         streams: int | None = None):
    """Every group's tokens in position order, cut into blocks of ``b`` and dealt to its ranks (module docstring: the
    snake's cycles, or mirrored chunks with ``chunks``, then the rest by load); every rank gets ``n / b`` blocks.
    ``pieces``: ``[start, stop, group, doc]`` rows (``distattn.schedule.groups.assign_groups``); ``share``, ``mean``,
    ``by``, ``near``: the windowed deal instead (``distattn.schedule.windows.window_owners``); ``streams``: the stream
    deal of each group's blocks in that many classes instead (``distattn.schedule.streams``). Returns every rank's
    segments (:func:`_segments`); ``None`` as soon as a rank's work (its rows' visible keys) exceeds ``limit``."""
    order = np.lexsort((pieces[:, 0], pieces[:, 2]))  # by group, then position
    start, stop, group, doc = (pieces[order, c] for c in range(4))
    length = stop - start
    first = np.searchsorted(group, np.arange(p // k), side="left")
    csum = np.cumsum(length) - length
    offset = csum - csum[first[group]]  # offset of each piece in its group's stream
    reps = (offset + length - 1) // b - offset // b + 1  # blocks a piece touches
    idx = np.repeat(np.arange(len(start)), reps)
    j = np.arange(len(idx)) - np.repeat(np.cumsum(reps) - reps, reps)  # 0 .. reps-1 within a piece
    block = offset[idx] // b + j
    lo = np.maximum(block * b, offset[idx]) - offset[idx] + start[idx]
    hi = np.minimum((block + 1) * b, offset[idx] + length[idx]) - offset[idx] + start[idx]
    d, d0 = doc[idx], starts[doc[idx]]
    per_group = k * n // b
    key = group[idx] * per_group + block  # every group has exactly k * n / b blocks
    piece_work = rows.prefix(d, hi - d0) - rows.prefix(d, lo - d0)  # each piece's part of a block: its rows' work
    work = np.bincount(key, weights=piece_work, minlength=p // k * per_group)
    # a block wholly inside one piece, in a full cycle of 2k of the piece's whole blocks: the snake (symmetric, so
    # every pair of the group gets the same share of that stretch of the document), or its chunk; the rest (document
    # ends, short documents, the chunks' middle): heaviest first to the least loaded rank of the group with room
    whole = (hi - lo == b)
    first_whole = np.repeat((offset + b - 1) // b, reps)  # first block wholly inside the piece
    n_whole = np.repeat((offset + length) // b, reps) - first_whole
    t = block - first_whole
    # a short piece (at most half a rank's blocks) of a document cut across groups is a *unit*: its blocks stay on one
    # rank, so the piece's keys go to one rank of the other group (or come from one), not to every rank of it
    unit_piece = (reps <= n // b // 2) & (np.bincount(doc)[doc] > 1)
    if chunks:  # the chunk of each whole block instead: rank i holds chunks i and 2k - 1 - i
        cyc, t, mirror = _chunks(t, n_whole, whole & ~unit_piece[idx], idx, group, p, k)
    else:
        cyc, mirror = whole & (t < n_whole // (2 * k) * (2 * k)) & ~unit_piece[idx], np.zeros(len(t), dtype=bool)
    rnd, pos = np.divmod(t, k)
    pos = np.where(mirror, k - 1 - pos, pos)
    owner = np.full(len(work), -1, dtype=np.int64)
    owner[key[cyc]] = group[idx][cyc] * k + np.where(rnd[cyc] % 2 == 0, pos[cyc], k - 1 - pos[cyc])
    if share is not None:  # the windowed deal instead (distattn.schedule.windows): a block with one of its pieces
        most = np.lexsort((-(hi - lo if by == "tokens" else piece_work), key))
        top = idx[most][np.flatnonzero(np.append(True, key[most][1:] != key[most][:-1]))]
        owner = window_owners(top, group, work, k, n // b, share, mean, unit_piece, near, chunks)
    if streams is not None:  # every rank of a group a run of each class of its group's blocks
        owner = np.concatenate([g * k + stream_owners(work[g * per_group:(g + 1) * per_group], k, n, b, streams)
                                for g in range(p // k)])
    owner = _fill_rest(owner, work, _units(key, idx, unit_piece, len(work)), p, k, per_group, limit)
    if owner is None:
        return None
    return _segments(lo, hi, owner[key], p, n)


def _segments(lo: np.ndarray, hi: np.ndarray, rank: np.ndarray, p: int, n: int):
    """Every rank's segments in position order, neighbouring pieces merged, from the pieces ``[lo, hi)`` of blocks and
    their ranks (:func:`deal`)."""
    order = np.lexsort((lo, rank))
    lo, hi, rank = lo[order], hi[order], rank[order]
    new = np.ones(len(lo), dtype=bool)
    new[1:] = (rank[1:] != rank[:-1]) | (lo[1:] != hi[:-1])  # a segment starts unless it continues the last
    seg_lo = lo[new]
    seg_hi = np.maximum.reduceat(hi, np.flatnonzero(new))
    seg_rank = rank[new]
    held = np.bincount(seg_rank, weights=seg_hi - seg_lo, minlength=p)
    assert (held == n).all(), "placement: a rank does not hold n tokens"
    bounds = np.searchsorted(seg_rank, np.arange(p + 1)).tolist()
    pairs = list(zip(seg_lo.tolist(), seg_hi.tolist()))
    return tuple(tuple(pairs[bounds[r]:bounds[r + 1]]) for r in range(p))


def _chunks(t: np.ndarray, n_whole: np.ndarray, eligible: np.ndarray, idx: np.ndarray, group: np.ndarray, p: int,
            k: int):
    """Mirrored chunks (module docstring), per block of :func:`deal`: ``t`` its place among its piece's whole blocks,
    ``n_whole`` the piece's whole blocks, ``eligible`` a whole block outside every unit, ``idx`` its piece, ``group``
    every piece's group. Returns ``(dealt, chunk, mirror)``: the blocks in a chunk (a piece of at least ``2k`` whole
    blocks, not the middle), each one's chunk ``0 .. 2k - 1``, and whether its piece is mirrored."""
    chunk = chunk_of(t, n_whole, k)
    dealt = eligible & (n_whole >= 2 * k) & (chunk >= 0)
    first = np.flatnonzero(np.append(True, idx[1:] != idx[:-1]))  # a piece's first block
    size = np.where(n_whole[first] >= 2 * k, n_whole[first], 0)
    flip, side = np.zeros(len(first), dtype=bool), np.zeros((p // k, 2), dtype=np.int64)
    for i in np.argsort(-size, kind="stable").tolist():  # the longest first, to the orientation with fewer blocks
        if not size[i]:
            break
        g = group[idx[first[i]]]
        flip[i] = side[g, 1] < side[g, 0]
        side[g, int(flip[i])] += size[i]
    return dealt, chunk, np.repeat(flip, np.diff(np.append(first, len(idx))))
