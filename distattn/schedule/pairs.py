"""The (query rank, kv rank) pairs with work under a mask, as a sparse table: bounded by the documents and the pairs.

A mask (``distattn.schedule.masks.MaskSpec``) over a stream of ``T = P * n`` tokens leaves work in few pairs when its
documents (or its window) are short against a shard: about ``P + documents`` of the ``P^2``. :func:`pair_table` finds
them without ever touching a position or a ``P x P`` matrix:

* *pieces*: the ranks' segments (``distattn.schedule.layouts``) cut at the document boundaries, in position order
  (a partition of the stream: O(segments + documents) of them);
* *combinations*: each query piece against the key pieces of its own document that its rows can see (causal: the
  pieces up to it; a window: those within reach), found by binary search; a document of ``m`` pieces gives at most
  ``m^2`` of them;
* per combination, the visible (query, key) pairs in closed form (the band ``-l <= k - q <= r`` inside a rectangle
  of query rows and key columns, :func:`_band_count`) and the local rows of the keys it sees; summed (work) and
  widened (spans) per (query rank, kv rank), combination by combination in bounded chunks;
* causal in whole documents (no window), a query rank's rows in a document see every key piece up to the rank's last
  piece there: one entry per (document, query rank, key piece seen) instead of one per combination (a document dealt
  in ``m`` blocks over ``k`` ranks: at most ``m k`` entries instead of ``m^2 / 2``), each entry's work the key piece
  against the rank's query pieces at or after it (:func:`_causal_entries`; the same table, 2-3x faster on the
  placement solver's deals at P = 64 and 256).

Memory: O(pieces + pairs + :data:`CHUNK` combinations); time: O(combinations) numpy; both bounded
(:data:`MAX_COMBINATIONS`, :data:`MAX_PAIRS`: past them, :class:`PlanTooLarge` names the size and what to do). Pure
Python + numpy.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

__all__ = ["PairTable", "pair_table", "PlanTooLarge", "out_of_memory", "MAX_COMBINATIONS", "MAX_PAIRS", "CHUNK"]

CHUNK = 1 << 20
"""Combinations evaluated per numpy pass: a dozen or so int64 temporaries of this length live at once (~100 MiB)."""
MAX_COMBINATIONS = 1 << 28
"""More (query piece, key piece) combinations than this (a minute of CPU) is refused with :class:`PlanTooLarge`."""
MAX_PAIRS = 1 << 22
"""More pairs with work than this is refused with :class:`PlanTooLarge`: a plan keeps a few Python objects per pair
(its task, its work), ~0.5 KiB, so 4M pairs are ~2 GiB. Documents of bounded length leave O(P + documents) pairs (a
P = 16384 placement of uniform:8192 documents: 137K); a placement that deals long documents over groups of thousands
of ranks leaves ~P^2 / groups."""


class PlanTooLarge(MemoryError):
    """A plan (or one of its tables) would not fit the memory or time it may take; the message names the size and
    what to do. A ``MemoryError``, so code that already handles running out of memory handles it too."""


def out_of_memory(what: str, exc: MemoryError) -> PlanTooLarge:
    """The clear error for ``what`` (a size: ranks, tokens, documents) that ran out of memory: the process's
    address-space limit if one is set, and what to do."""
    limit = ""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            limit = f" under an address-space limit of {soft / 2**30:.2f} GiB"
    except (ImportError, OSError, ValueError):  # no such limit on this platform
        pass
    detail = str(exc) or type(exc).__name__
    return PlanTooLarge(f"{what} ran out of memory{limit} ({detail}): raise the limit (ulimit -v, the cgroup's "
                        f"memory) or plan fewer ranks or tokens per rank")


@dataclass(frozen=True, eq=False)
class PairTable:
    """Every (query rank, kv rank) pair with work, sorted by query rank then kv rank (read-only int64 arrays, one
    entry per pair): ``work`` visible (query, key) pairs; ``a, b``: the keys seen lie in the kv rank's local rows
    ``[a, b)``, the shortest such range; ``seen``: how many of those rows the pair's queries see (the rows of other
    documents, or past every query's reach, between them are not). The pairs of query rank ``i`` are
    ``offsets[i]:offsets[i + 1]``. The seen rows as ranges: pair ``k``'s are ``[range_a[x], range_b[x])`` for ``x`` in
    ``range_offsets[k]:range_offsets[k + 1]``, ascending, disjoint and not touching (what an owner task borrows:
    ``Plan.key_ranges``)."""

    world_size: int
    q: np.ndarray
    kv: np.ndarray
    work: np.ndarray
    a: np.ndarray
    b: np.ndarray
    offsets: np.ndarray
    seen: np.ndarray
    range_offsets: np.ndarray
    range_a: np.ndarray
    range_b: np.ndarray

    def __len__(self) -> int:
        return len(self.q)

    def ranges(self, i: int, j: int) -> tuple[tuple[int, int], ...]:
        """The local rows of kv rank ``j`` that query rank ``i``'s queries see, as ranges; ``()`` without work."""
        k = self._index.get((i, j))
        if k is None:
            return ()
        lo, hi = self.range_offsets[k], self.range_offsets[k + 1]
        return tuple(zip(self.range_a[lo:hi].tolist(), self.range_b[lo:hi].tolist()))

    @functools.cached_property
    def rows(self) -> tuple[dict, ...]:
        """``rows[i][j]``: the work of pair ``(i, j)`` as a Python int, 0 for a pair without work."""
        out = tuple(_Row() for _ in range(self.world_size))
        for i, j, w in zip(self.q.tolist(), self.kv.tolist(), self.work.tolist()):
            out[i][j] = w
        return out

    @functools.cached_property
    def _index(self) -> dict:
        return {(i, j): k for k, (i, j) in enumerate(zip(self.q.tolist(), self.kv.tolist()))}

    def span(self, i: int, j: int) -> tuple[int, int]:
        """``(a, b)`` of pair ``(i, j)``; ``(0, 0)`` for a pair without work."""
        k = self._index.get((i, j))
        return (0, 0) if k is None else (int(self.a[k]), int(self.b[k]))

    def dense(self, what: str = "work") -> np.ndarray:
        """``work``, ``a`` or ``b`` as a ``P x P`` int64 array (0 where a pair has no work)."""
        p = self.world_size
        _check_dense(p)
        out = np.zeros((p, p), dtype=np.int64)
        out[self.q, self.kv] = getattr(self, what)
        return out


class _Row(dict):
    """One query rank's row of work: ``row[j]`` is 0 for a kv rank without work."""

    def __missing__(self, key):
        return 0


DENSE_LIMIT = 1 << 26
"""Most entries of a ``P x P`` matrix built on request (``pair_work``, ``key_spans``): 512 MiB of int64, P = 8192."""


def _check_dense(p: int) -> None:
    if p * p > DENSE_LIMIT:
        raise PlanTooLarge(f"a {p} x {p} matrix of pairs ({p * p * 8 / 2**30:.1f} GiB of int64 per matrix) is more "
                           f"than the {DENSE_LIMIT} entries built on request; read the sparse pairs instead "
                           f"(make_plan(...).work[i][j], Plan.key_span, distattn.schedule.pairs.pair_table)")


@dataclass(frozen=True, eq=False)
class WorkView:
    """``view[i][j]``: the work of pair ``(i, j)`` (0 without work), what ``Plan.work`` holds for a masked plan; a row
    of ``P`` entries at a time only on iteration (small ``P``)."""

    table: PairTable

    def __len__(self) -> int:
        return self.table.world_size

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.table.world_size:
            raise IndexError(i)
        return self.table.rows[i]

    def __iter__(self):
        p = self.table.world_size
        _check_dense(p)
        return (tuple(row[j] for j in range(p)) for row in self.table.rows)


@dataclass(frozen=True, eq=False)
class SpanView:
    """One side of the key spans, indexed ``[q rank, kv rank]`` like the ``P x P`` array it stands for."""

    table: PairTable
    stop: bool  # False: ``a``, the first row of the span; True: ``b``, the row after its last

    def __getitem__(self, ij: tuple[int, int]) -> int:
        return self.table.span(int(ij[0]), int(ij[1]))[1 if self.stop else 0]


def pair_table(spec, world_size: int, chunk: int, layout=None, cache: bool = True) -> PairTable:
    """The pairs with work of ``spec`` (a ``MaskSpec``) over ``world_size`` ranks of ``chunk`` tokens laid out by
    ``layout`` (``None``: contiguous). Cached unless ``cache=False`` (the placement solver's candidates, dropped once
    timed); deterministic (every rank derives the same table). The plan's order (``Layout.order``) moves no token: one
    table serves every order of a layout."""
    if layout is not None and layout.order != "rotation":
        layout = dataclasses.replace(layout, order="rotation")
    return (_pair_table_cached if cache else _pair_table_cached.__wrapped__)(spec, world_size, chunk, layout)


@functools.lru_cache(maxsize=16)
def _pair_table_cached(spec, p: int, n: int, layout) -> PairTable:
    total = p * n
    pieces = _pieces(spec, p, n, layout)
    start, stop, doc_lo, doc_hi = pieces[0], pieces[1], pieces[4], pieces[5]
    left, right = spec.window
    big = total + 2  # an unlimited window: wider than the stream (keeps every count inside int64)
    l_ = left if left >= 0 else big
    r_ = 0 if spec.causal else (right if right >= 0 else big)
    # the keys a query piece [qa, qb) sees lie in [lo(qa), hi(qb - 1)] (both bounds nondecreasing, every row of a
    # document sees at least itself, so the rows' intervals touch): the key pieces overlapping that range
    reach_lo = np.maximum(doc_lo, start - l_)
    reach_hi = np.minimum(doc_hi - 1, stop - 1 + r_)
    k0 = np.searchsorted(stop, reach_lo, side="right")  # the first piece ending after reach_lo
    k1 = np.searchsorted(start, reach_hi, side="right")  # past the last piece starting at or before reach_hi
    count = k1 - k0
    combos = int(count.sum())
    if combos > MAX_COMBINATIONS:
        raise PlanTooLarge(
            f"the mask over {p} ranks x {n} tokens on {_where(layout)} leaves {combos:,} (query piece, key piece) "
            f"combinations to count "
            f"(more than {MAX_COMBINATIONS:,}): its documents or window span too many shards; use fewer ranks, "
            f"shorter documents or a window, or the dense plans (no cu_seqlens)")
    if l_ >= big and r_ == 0:  # causal in whole documents: per (document, query rank), not per query piece
        groups = _causal_groups(pieces, k0)
        count, rows = groups[0], lambda qs: _causal_entries(qs, groups, pieces, p)
    else:
        rows = lambda qs: _combinations(qs, k0, count, pieces, (l_, r_, big), p)  # noqa: E731
    parts, held = [], 0
    bounds = np.searchsorted(np.cumsum(count), np.arange(CHUNK, int(count.sum()), CHUNK), side="right")
    for lo_q, hi_q in zip(np.concatenate(([0], bounds)), np.concatenate((bounds, [len(count)]))):
        if hi_q > lo_q:
            parts.append(rows(slice(lo_q, hi_q)))
            held += len(parts[-1][0])
        if held > 2 * MAX_PAIRS:  # the chunks' pairs so far, merged: memory stays O(pairs), and a bound on them
            parts = [_merge(parts)]
            held = len(parts[0][0])
            _check_pairs(held, p, n, layout)
    keys, work, a, b, r_key, r_a, r_b = _merge(parts)
    _check_pairs(len(keys), p, n, layout)
    q, kv = np.divmod(keys, p)
    offsets = np.searchsorted(q, np.arange(p + 1), side="left")
    range_offsets = np.searchsorted(r_key, keys, side="left")
    range_offsets = np.append(range_offsets, len(r_key))
    seen = np.add.reduceat(r_b - r_a, range_offsets[:-1]) if len(keys) else np.zeros(0, np.int64)
    for arr in (q, kv, work, a, b, offsets, seen, range_offsets, r_a, r_b):
        arr.flags.writeable = False
    return PairTable(p, q, kv, work, a, b, offsets, seen, range_offsets, r_a, r_b)


def _pieces(spec, p: int, n: int, layout):
    """The ranks' segments cut at the document boundaries, in position order: ``(start, stop, owner, base, doc_lo,
    doc_hi)``, int64 arrays (a position of the piece + ``base``: its local row in the owner's shard; ``doc_lo,
    doc_hi``: the piece's document)."""
    total = p * n
    if layout is None:
        seg_a = np.arange(p, dtype=np.int64) * n
        seg_owner = np.arange(p, dtype=np.int64)
        seg_local = np.zeros(p, dtype=np.int64)
    else:
        segments = [layout.segments(r, n) for r in range(p)]
        counts = np.fromiter(map(len, segments), dtype=np.int64, count=p)
        flat = np.fromiter((x for segs in segments for seg in segs for x in seg), dtype=np.int64,
                           count=2 * int(counts.sum())).reshape(-1, 2)
        length = flat[:, 1] - flat[:, 0]
        owner = np.repeat(np.arange(p, dtype=np.int64), counts)
        local = np.cumsum(length) - length - owner * n  # each segment's first local row in its rank's shard
        order = np.argsort(flat[:, 0], kind="stable")  # position order: the segments partition the stream
        seg_a, seg_owner, seg_local = flat[order, 0], owner[order], local[order]
    cu = np.asarray(spec.documents(total), dtype=np.int64)
    start = np.sort(np.concatenate((seg_a, cu[:-1])), kind="stable")  # two sorted runs: a merge
    start = start[np.append(True, start[1:] != start[:-1]) & (start < total)]  # every boundary, once (empty
    # documents at the end start at ``total``: no piece)
    stop = np.append(start[1:], total)
    seg = np.searchsorted(seg_a, start, side="right") - 1
    doc = np.searchsorted(cu, start, side="right") - 1  # an empty document shares its start: the last one holds it
    return start, stop, seg_owner[seg], seg_local[seg] - seg_a[seg], cu[doc], cu[doc + 1]


def _combinations(qs: slice, k0, count, pieces, window: tuple[int, int, int], p: int):
    """``(key, work, a, b)`` of the combinations of the query pieces ``qs``, reduced per pair (``key = i * P + j``).
    ``window``: ``(l, r, big)``, the keys ``[q - l, q + r]`` of a row, ``big``: unlimited."""
    start, stop, owner, base, doc_lo, doc_hi = pieces
    l_, r_, big = window
    m = count[qs]
    u = np.repeat(np.arange(qs.start, qs.stop, dtype=np.int64), m)  # query piece of each combination
    v = np.repeat(k0[qs] - np.cumsum(m) + m, m) + np.arange(int(m.sum()), dtype=np.int64)  # its key piece
    qa, qb, ka, kb = start[u], stop[u], start[v], stop[v]
    shift = base[v]  # a key position + shift: its local row in the owner's shard
    if l_ >= big and r_ in (0, big):  # causal or full attention in documents: every key piece wholly seen...
        work = (qb - qa) * (kb - ka)
        if r_ == 0:  # ... but the query piece's own causal triangle
            work -= np.where(u == v, (qb - qa) * (qb - qa - 1) // 2, 0)
        return _reduce(owner[u] * p + owner[v], work, ka + shift, kb + shift, ranges=True)
    work = (kb - ka) * (qb - qa) if r_ >= big else _band_count(qa, qb, ka, kb, r_)  # keys up to q + r
    if l_ < big:
        work = work - _band_count(qa, qb, ka, kb, -l_ - 1)  # less the keys before q - l
    lo = np.maximum(ka, np.maximum(doc_lo[u], qa - l_))  # the first key seen: lo(qa), inside the key piece
    hi = np.minimum(kb - 1, np.minimum(doc_hi[u] - 1, qb - 1 + r_))  # the last: hi(qb - 1)
    keep = work > 0
    return _reduce(owner[u][keep] * p + owner[v][keep], work[keep], (lo + shift)[keep], (hi + 1 + shift)[keep],
                   ranges=True)


def _causal_groups(pieces, k0):
    """A causal mask in whole documents: every query piece sees every key piece of its document up to itself, so the
    key pieces a query rank's rows see in a document are those up to the rank's last piece there. The pieces grouped
    by (document, owner): ``(count, first, last, keys, suffix)``: per group its entries (the key pieces it sees,
    ``last - first + 1``), its document's first piece and its own last piece; per member (sorted by group, then
    position) ``group * pieces + piece``, and the rows of the group's members from it on."""
    start, stop, owner = pieces[:3]
    member = np.lexsort((np.arange(len(owner)), owner, k0))  # by document (its first piece), owner, position
    cut = np.flatnonzero((k0[member][1:] != k0[member][:-1]) | (owner[member][1:] != owner[member][:-1])) + 1
    group_end = np.append(cut, len(member))  # past each group's members
    group = np.repeat(np.arange(len(group_end)), np.diff(group_end, prepend=0))  # each member's group
    size = (stop - start)[member]
    cum = np.cumsum(size)
    last = member[group_end - 1]
    first = k0[last]
    return last - first + 1, first, last, group * len(start) + member, cum[group_end - 1][group] - cum + size


def _causal_entries(gs: slice, groups, pieces, p: int):
    """``(key, work, a, b)`` of the groups ``gs`` (:func:`_causal_groups`), reduced per pair like
    :func:`_combinations`: one entry per (group, key piece seen), the key piece's work against every query piece of
    the group at or after it (the piece itself: its causal triangle)."""
    start, stop, owner, base = pieces[:4]
    count, first, last, keys, suffix = groups
    m = count[gs]
    g = np.repeat(np.arange(gs.start, gs.stop, dtype=np.int64), m)  # the group of each entry
    v = np.repeat(first[gs] - np.cumsum(m) + m, m) + np.arange(int(m.sum()), dtype=np.int64)  # its key piece
    at = np.searchsorted(keys, g * len(start) + v, side="left")  # the group's first member at or after v (one is)
    kv_len = stop[v] - start[v]
    work = kv_len * suffix[at] - np.where(keys[at] == g * len(start) + v, kv_len * (kv_len - 1) // 2, 0)
    return _reduce(owner[last[g]] * p + owner[v], work, start[v] + base[v], stop[v] + base[v], ranges=True)


def _band_count(qa, qb, ka, kb, c):
    """``#{(q, k) : qa <= q < qb, ka <= k < kb, k - q <= c}``: row ``q`` holds ``clamp(q + c + 1 - ka, 0, w)`` keys
    (``w = kb - ka``), summed in closed form as ``S(qb + c + 1 - ka) - S(qa + c + 1 - ka)``, with
    ``S(x) = sum_{t < x} clamp(t, 0, w)``."""
    w = kb - ka

    def s(x):
        x = np.maximum(x, 0)
        small = np.minimum(x, w + 1)  # the quadratic part never sees a large x: no int64 overflow
        return small * (small - 1) // 2 + np.maximum(x - 1 - w, 0) * w

    return s(qb + c + 1 - ka) - s(qa + c + 1 - ka)


def _merge(parts):
    """The chunks' ``(key, work, a, b, range key, range a, range b)`` as one, reduced per pair."""
    cols = [np.concatenate([x[c] for x in parts]) if parts else np.zeros(0, np.int64) for c in range(7)]
    return _reduce(*cols[:4]) + _union(*cols[4:])


def _where(layout) -> str:
    """The layout, for a message: its kind and how it was chosen."""
    if layout is None:
        return "contiguous shards"
    return f"the {layout.kind} layout" + (f" ({layout.note})" if layout.note else "")


def _check_pairs(pairs: int, p: int, n: int, layout) -> None:
    if pairs > MAX_PAIRS:
        raise PlanTooLarge(
            f"the mask over {p} ranks x {n} tokens on {_where(layout)} leaves {pairs:,} or more (query rank, kv rank) "
            f"pairs with work (more than {MAX_PAIRS:,}; a plan holds a Python task per pair, ~0.5 KiB each): its "
            f"documents span too many shards on this layout (a placement in few large groups deals every document "
            f"over its group); use fewer ranks, shorter documents, or another schedule (ring/balanced pair only the "
            f"shards a document touches)")


def _union(key, a, b):
    """The union of the row ranges ``[a, b)`` per ``key``: ``(key, a, b)`` of disjoint ranges that do not touch,
    by key then row. Vectorized: a range joins the one before it when it starts at or before the reach of that key's
    ranges so far (keys in the high bits keep every key's ranges apart)."""
    if not len(key):
        return key, a, b
    keys, at = np.unique(key, return_inverse=True)  # the keys numbered 0.. (fewer than 2^31), local rows < 2^31
    hi_a, hi_b = (at.astype(np.int64) << 32) | a, (at.astype(np.int64) << 32) | b
    order = np.argsort(hi_a, kind="stable")
    hi_a, hi_b = hi_a[order], hi_b[order]
    reach = np.maximum.accumulate(hi_b)
    first = np.flatnonzero(np.append(True, hi_a[1:] > reach[:-1]))
    lo, top = hi_a[first], np.maximum.reduceat(hi_b, first)
    low = np.int64((1 << 32) - 1)
    return keys[lo >> 32], lo & low, top & low


def _reduce(key, work, a, b, ranges: bool = False):
    """Per distinct ``key``: summed ``work``, smallest ``a``, largest ``b`` (keys ascending); ``ranges``: and the
    union of the ``[a, b)`` per key (:func:`_union`)."""
    if ranges and len(key) and int(key.max()) < 1 << 31:  # one sort, by key then a, serves both
        hi_a, hi_b = (key << 32) | a, (key << 32) | b
        order = np.argsort(hi_a)  # equal (key, a): the sums, extremes and union do not depend on their order
        hi_a, hi_b, work = hi_a[order], hi_b[order], work[order]
        low = np.int64((1 << 32) - 1)
        k = hi_a >> 32
        first = np.flatnonzero(np.append(True, k[1:] != k[:-1]))
        reach = np.maximum.accumulate(hi_b)
        joins = np.flatnonzero(np.append(True, hi_a[1:] > reach[:-1]))
        top = np.maximum.reduceat(hi_b, joins)
        return (k[first], np.add.reduceat(work, first), hi_a[first] & low, np.maximum.reduceat(hi_b, first) & low,
                hi_a[joins] >> 32, hi_a[joins] & low, top & low)
    if ranges:
        return _reduce(key, work, a, b) + _union(key, a, b)
    if not len(key):
        return key, work, a, b
    order = np.argsort(key)  # sums, minima and maxima: the order within a key does not matter
    key, work, a, b = key[order], work[order], a[order], b[order]
    first = np.flatnonzero(np.append(True, key[1:] != key[:-1]))
    return key[first], np.add.reduceat(work, first), np.minimum.reduceat(a, first), np.maximum.reduceat(b, first)
