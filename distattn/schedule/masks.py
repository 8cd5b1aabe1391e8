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

__all__ = ["MaskSpec", "pair_work"]


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
    total = p * n
    work = np.zeros((p, p), dtype=np.int64)
    segments = [layout.segments(r, n) if layout is not None else ((r * n, (r + 1) * n),) for r in range(p)]
    for i in range(p):
        for a, b in segments[i]:
            lo, hi = spec.bounds(total, a, b)
            for j in range(p):
                work[i, j] += sum(_segment_work(lo, hi, c, e) for c, e in segments[j])
    return tuple(tuple(int(x) for x in row) for row in work)
