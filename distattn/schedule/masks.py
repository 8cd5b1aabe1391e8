"""The mask of a sequence-parallel call as plain data, and the work it leaves in every (query chunk, kv chunk) pair.

A packed stream of ``T = P * n`` tokens is split into ``P`` contiguous chunks of ``n``. Every query at global
position ``p`` sees the keys ``[lo(p), hi(p)]`` (the same contract as the kernels' ``KeyBounds``)::

    causal                     [0, p]
    packed documents, causal   [doc_start(p), p]            (not causal: [doc_start(p), doc_end(p) - 1])
    + sliding window (l, r)    lo = max(doc_start(p), p - l),  hi = min(doc_end(p) - 1, p + r)  (r = 0 causal)

If the documents end before ``T`` (the stream's tail was padded to a multiple of ``P``), the tail is one extra
document of its own: nothing real sees it and its outputs are to be ignored.

From this description alone (no tensors, no communication) every rank computes the same *work matrix*:
``work[i][j]`` = number of visible (query, key) pairs between query chunk ``i`` and kv chunk ``j``. Pairs with
no work are dropped from the plan (no compute, no communication), and the balanced schedule balances by work.
Pure Python + numpy.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

__all__ = ["MaskSpec", "pair_work", "key_spans"]


@dataclass(frozen=True, kw_only=True)
class MaskSpec:
    """What every query sees, on global positions of a stream of ``world_size * chunk`` tokens."""

    causal: bool
    """Keys after the query are invisible."""
    window: tuple[int, int] = (-1, -1)
    """flash-attn's ``(left, right)``; -1: unlimited."""
    cu_seqlens: tuple[int, ...] | None = None
    """Cumulative document lengths of the packed stream (``None``: one document, the whole stream)."""

    @property
    def dense(self) -> bool:
        """Plain causal or full attention: the hand-made ring/balanced plans apply."""
        return self.cu_seqlens is None and self.window == (-1, -1)

    def documents(self, total: int) -> tuple[int, ...]:
        """Document boundaries covering ``[0, total)``: ``cu_seqlens`` plus a padding document if short."""
        cu = self.cu_seqlens if self.cu_seqlens is not None else (0, total)
        assert cu[-1] <= total, f"cu_seqlens ends at {cu[-1]}, past the stream's {total} tokens"
        return tuple(cu) if cu[-1] == total else tuple(cu) + (total,)

    def bounds(self, total: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """``(lo, hi)`` int64 arrays for the queries at positions ``[start, stop)``; ``hi < lo``: sees nothing."""
        return self.bounds_at(total, np.arange(start, stop, dtype=np.int64))

    def bounds_at(self, total: int, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(lo, hi)`` global key positions seen by the queries at (increasing) positions ``p``."""
        cu = np.asarray(self.documents(total), dtype=np.int64)
        p = np.asarray(p, dtype=np.int64)
        doc = np.searchsorted(cu, p, side="right") - 1
        first, last = cu[doc], cu[doc + 1] - 1
        left, right = self.window
        lo = first if left < 0 else np.maximum(first, p - left)
        hi = np.minimum(last, p) if self.causal else (last if right < 0 else np.minimum(last, p + right))
        return lo, np.maximum(hi, lo - 1)


def pair_work(spec: MaskSpec, world_size: int, chunk: int, layout=None) -> tuple[tuple[int, ...], ...]:
    """``work[i][j]``: visible (query, key) pairs of rank ``i``'s queries against rank ``j``'s keys (cached).

    ``layout`` (``distattn.schedule.layouts.Layout``; ``None``: contiguous) says which positions each rank holds."""
    return _pair_work_cached(spec, world_size, chunk, layout)


@functools.lru_cache(maxsize=64)
def _pair_work_cached(spec: MaskSpec, p: int, n: int, layout) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(x) for x in row) for row in _pairs(spec, p, n, layout)[0])


@functools.lru_cache(maxsize=8)
def _pairs(spec: MaskSpec, p: int, n: int, layout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(work, a, b)`` of every (query rank, kv rank) pair (``pair_work``, ``key_spans``), one query rank at a time.

    Query rank ``i``'s rows see the union of their key intervals: a few *blocks* (its rows are in position order
    and both bounds are nondecreasing, so touching intervals merge in one pass). Only the pieces of the ranks'
    segments inside those blocks can hold seen keys, and the segments of all ranks partition the stream, so the
    pieces are found by binary search in the position-sorted segments: a document's neighbourhood, not every
    segment of the stream.

    * work: ``F(x)`` = visible keys at positions ``< x`` summed over ``i``'s rows (``_keys_before``: sorted bounds
      and prefix sums); a piece ``[x0, x1)`` holds ``F(x1) - F(x0)`` of them, summed per owner.
    * spans: a piece's first and last key as local indices of its owner (its segment's local offset plus the
      piece's start), the smallest and largest per owner.

    O(P * n + pieces * log n) numpy, rank by rank (each rank's ``n`` rows stay in cache); pieces are about (length
    of the documents a rank touches) / (segment length) per rank."""
    total = p * n
    segments = [layout.segments(r, n) if layout is not None else ((r * n, (r + 1) * n),) for r in range(p)]
    counts = [len(s) for s in segments]
    flat = np.asarray([seg for segs in segments for seg in segs], dtype=np.int64).reshape(-1, 2)
    owner = np.repeat(np.arange(p, dtype=np.int64), counts)
    length = flat[:, 1] - flat[:, 0]
    first_row = np.cumsum(length) - length  # flat index of each segment's first position (rank by rank)
    order = np.argsort(flat[:, 0], kind="stable")  # the segments in position order: a partition of the stream
    g_a, g_b, g_owner = flat[order, 0], flat[order, 1], owner[order]
    g_local = (first_row - owner * n - flat[:, 0])[order]  # + a position: the owner's local index (n per rank)
    positions = np.repeat(flat[:, 0] - first_row, length) + np.arange(total, dtype=np.int64)
    work = np.zeros((p, p), dtype=np.int64)
    a_out = np.full((p, p), n, dtype=np.int64)
    b_out = np.zeros((p, p), dtype=np.int64)
    for i in range(p):
        lo, hi = spec.bounds_at(total, positions[i * n:(i + 1) * n])  # both nondecreasing: positions increase
        keep = hi >= lo
        lo_k, hi_k = lo[keep], hi[keep]
        if not len(lo_k):
            continue
        heads = np.flatnonzero(np.append(True, lo_k[1:] > hi_k[:-1] + 1))  # a row touching the last one merges
        u_lo, u_hi = lo_k[heads], np.maximum.reduceat(hi_k, heads)
        s0 = np.searchsorted(g_b, u_lo, side="right")  # the first segment ending after the block's start
        s1 = np.searchsorted(g_a, u_hi, side="right")  # past the last segment starting at or before its end
        m = s1 - s0
        seg = np.repeat(s0 - np.cumsum(m) + m, m) + np.arange(int(m.sum()))
        x0 = np.maximum(g_a[seg], np.repeat(u_lo, m))
        x1 = np.minimum(g_b[seg], np.repeat(u_hi, m) + 1)  # the piece [x0, x1) of segment seg
        seen = _keys_before(lo, hi + 1)
        who = g_owner[seg]
        work[i] = np.bincount(who, weights=seen(x1) - seen(x0), minlength=p).round().astype(np.int64)
        np.minimum.at(a_out[i], who, g_local[seg] + x0)
        np.maximum.at(b_out[i], who, g_local[seg] + x1)
    empty = a_out >= b_out
    a_out[empty] = 0
    b_out[empty] = 0
    for arr in (work, a_out, b_out):
        arr.flags.writeable = False
    return work, a_out, b_out


def _keys_before(lo_sorted: np.ndarray, end_sorted: np.ndarray):
    """``F(x) = sum over rows of |[lo, end) & [0, x)|`` for rows with key intervals ``[lo, end)`` (``end = hi + 1``;
    ``end == lo``: none), as a function of an array ``x``: a row adds ``end`` if ``end <= x``, ``x`` if
    ``lo < x < end``, else ``lo``, minus its ``lo`` (linear in the indicator counts, so empty rows add 0)."""
    cum_lo = np.concatenate(([0], np.cumsum(lo_sorted)))
    cum_end = np.concatenate(([0], np.cumsum(end_sorted)))
    rows = len(lo_sorted)

    def seen(x: np.ndarray) -> np.ndarray:
        k_end = np.searchsorted(end_sorted, x, side="right")  # rows with end <= x
        k_lo = np.searchsorted(lo_sorted, x, side="left")  # rows with lo < x
        return cum_end[k_end] + (cum_lo[rows] - cum_lo[k_lo]) + x * (k_lo - k_end) - cum_lo[rows]

    return seen


def key_spans(spec: MaskSpec, world_size: int, chunk: int, layout=None) -> tuple[np.ndarray, np.ndarray]:
    """``(a, b)``, int64 ``(P, P)`` arrays: the keys that rank ``i``'s queries see among rank ``j``'s lie in ``j``'s
    local indices ``[a[i, j], b[i, j])``, the shortest such range (``b <= a``: none). Only that slice of ``j``'s k/v
    travels to ``i`` (and only its dk/dv partial comes back), so a document that barely crosses a shard boundary, or a
    window shorter than a shard, moves a few rows instead of the whole shard. Cached, read-only."""
    return _key_spans_cached(spec, world_size, chunk, layout)


@functools.lru_cache(maxsize=64)
def _key_spans_cached(spec: MaskSpec, p: int, n: int, layout) -> tuple[np.ndarray, np.ndarray]:
    return _pairs(spec, p, n, layout)[1:]
