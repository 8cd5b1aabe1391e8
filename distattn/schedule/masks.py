"""The mask of a sequence-parallel call as plain data, and the work it leaves in every (query chunk, kv chunk) pair.

A packed stream of ``T = P * n`` tokens is split into ``P`` contiguous chunks of ``n``. Every query at global
position ``p`` sees the keys ``[lo(p), hi(p)]`` (the same contract as the kernels' ``KeyBounds``)::

    causal                     [0, p]
    packed documents, causal   [doc_start(p), p]            (not causal: [doc_start(p), doc_end(p) - 1])
    + sliding window (l, r)    lo = max(doc_start(p), p - l),  hi = min(doc_end(p) - 1, p + r)  (r = 0 causal)

If the documents end before ``T`` (the stream's tail was padded to a multiple of ``P``), the tail is one extra
document of its own: nothing real sees it and its outputs are to be ignored.

From this description alone (no tensors, no communication) every rank computes the same *work*: ``work[i][j]`` =
number of visible (query, key) pairs between query chunk ``i`` and kv chunk ``j``, held sparsely (only the pairs with
work: ``distattn.schedule.pairs``, bounded by the documents and the pairs, never ``P * n`` positions or ``P x P``
matrices). Pairs with no work are dropped from the plan (no compute, no communication), and the balanced schedule
balances by work. Pure Python + numpy.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from distattn.schedule.pairs import pair_table

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

    ``layout`` (``distattn.schedule.layouts.Layout``; ``None``: contiguous) says which positions each rank holds.
    A ``P x P`` matrix, built from the sparse pairs (``distattn.schedule.pairs.pair_table``, what the plans read);
    refused with ``PlanTooLarge`` past ``P = 8192``."""
    return _pair_work_cached(spec, world_size, chunk, layout)


@functools.lru_cache(maxsize=64)
def _pair_work_cached(spec: MaskSpec, p: int, n: int, layout) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(row) for row in pair_table(spec, p, n, layout).dense("work").tolist())


def key_spans(spec: MaskSpec, world_size: int, chunk: int, layout=None) -> tuple[np.ndarray, np.ndarray]:
    """``(a, b)``, int64 ``(P, P)`` arrays: the keys that rank ``i``'s queries see among rank ``j``'s lie in ``j``'s
    local indices ``[a[i, j], b[i, j])``, the shortest such range (``b <= a``: none). Only that slice of ``j``'s k/v
    travels to ``i`` (and only its dk/dv partial comes back), so a document that barely crosses a shard boundary, or a
    window shorter than a shard, moves a few rows instead of the whole shard. Cached, read-only; the plans read the
    same spans sparsely (``Plan.key_span``)."""
    return _key_spans_cached(spec, world_size, chunk, layout)


@functools.lru_cache(maxsize=64)
def _key_spans_cached(spec: MaskSpec, p: int, n: int, layout) -> tuple[np.ndarray, np.ndarray]:
    table = pair_table(spec, p, n, layout)
    out = table.dense("a"), table.dense("b")
    for arr in out:
        arr.flags.writeable = False
    return out
