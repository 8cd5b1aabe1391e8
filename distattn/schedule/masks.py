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


def _segment_work(lo: np.ndarray, hi: np.ndarray, a: int, b: int) -> int:
    """Visible pairs between query rows with bounds ``lo, hi`` (nondecreasing) and the keys at ``[a, b)``."""
    if not len(lo) or hi[-1] < a or lo[0] >= b:
        return 0  # every row's interval ends before the keys or starts after them
    if lo[-1] <= a and hi[0] >= b - 1:
        return len(lo) * (b - a)  # every row sees every key
    seen = np.minimum(hi, b - 1) - np.maximum(lo, a) + 1
    return int(np.clip(seen, 0, None).sum())


@functools.lru_cache(maxsize=64)
def _pair_work_cached(spec: MaskSpec, p: int, n: int, layout) -> tuple[tuple[int, ...], ...]:
    """Per query rank ``i``: ``F(x)`` = visible keys at positions ``< x`` summed over ``i``'s rows, at every segment
    boundary of every rank (sorted bounds + prefix sums); a kv segment ``[a, b)`` holds ``F(b) - F(a)`` of them.
    O(P * (n + segments) log n): a placement of 256 ranks x 32 segments in well under a second."""
    total = p * n
    segments = [layout.segments(r, n) if layout is not None else ((r * n, (r + 1) * n),) for r in range(p)]
    owner = np.repeat(np.arange(p), [len(s) for s in segments])
    a, b = (np.asarray([seg[k] for segs in segments for seg in segs], dtype=np.int64) for k in (0, 1))
    work = np.zeros((p, p), dtype=np.int64)
    for i in range(p):
        q_pos = layout.positions(i, n) if layout is not None else np.arange(i * n, (i + 1) * n, dtype=np.int64)
        lo, hi = spec.bounds_at(total, q_pos)
        seen = _keys_before(np.sort(lo), np.sort(hi + 1))
        work[i] = np.bincount(owner, weights=seen(b) - seen(a), minlength=p).round().astype(np.int64)
    return tuple(tuple(int(x) for x in row) for row in work)


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
    """Per query rank: the union of its rows' key intervals (merged where they touch: rows are in position order, so
    both bounds are nondecreasing), then for every segment of every rank the first and last key inside that union,
    as local indices of the segment's rank. O(P * segments * log) numpy."""
    total = p * n
    segments = [layout.segments(r, n) if layout is not None else ((r * n, (r + 1) * n),) for r in range(p)]
    owner = np.repeat(np.arange(p), [len(s) for s in segments])
    sa, sb = (np.asarray([seg[k] for segs in segments for seg in segs], dtype=np.int64) for k in (0, 1))
    offset = np.concatenate([np.cumsum([0] + [b - a for a, b in segs])[:-1] for segs in segments])  # local index
    a_out = np.full((p, p), n, dtype=np.int64)
    b_out = np.zeros((p, p), dtype=np.int64)
    for i in range(p):
        q_pos = layout.positions(i, n) if layout is not None else np.arange(i * n, (i + 1) * n, dtype=np.int64)
        lo, hi = spec.bounds_at(total, q_pos)
        keep = hi >= lo
        lo, hi = lo[keep], hi[keep]
        if not len(lo):
            continue
        start = np.append(True, lo[1:] > hi[:-1] + 1)  # a row starts a new block unless it touches the last
        u_lo, u_hi = lo[start], np.maximum.reduceat(hi, np.flatnonzero(start))
        k = np.minimum(np.searchsorted(u_hi, sa, side="left"), len(u_hi) - 1)  # first block ending at or after sa
        ok = (u_hi[k] >= sa) & (u_lo[k] <= sb - 1)
        first = np.maximum(sa, u_lo[k])
        k2 = np.maximum(np.searchsorted(u_lo, sb - 1, side="right") - 1, 0)  # last block starting at or before sb-1
        last = np.minimum(sb - 1, u_hi[k2])
        ok &= (u_lo[k2] <= sb - 1) & (u_hi[k2] >= sa)
        np.minimum.at(a_out[i], owner[ok], (offset + first - sa)[ok])
        np.maximum.at(b_out[i], owner[ok], (offset + last - sa + 1)[ok])
    a_out[a_out >= b_out] = 0
    b_out[a_out >= b_out] = 0
    for arr in (a_out, b_out):
        arr.flags.writeable = False
    return a_out, b_out
