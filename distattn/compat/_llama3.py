"""llama3's local convention (ring-flash-attention's ``llama3_flash_attn_varlen_func``) and the global stream.

``prepare`` gives one rank's local view (``cu_seqlens_q``, ``cu_seqlens_k``, their longest documents, the key span)
of a global ``cu_seqlens`` over contiguous shards; ``global_cu`` rebuilds the global ``cu_seqlens`` from every rank's
view and checks each view against ``prepare``. Host lists of ints; pure Python.
"""

from __future__ import annotations

import bisect
import json

__all__ = ["prepare", "global_cu"]


def prepare(cu: list[int], causal: bool, rank: int, world: int):
    """llama3's local view of rank ``rank`` from the global ``cu``: (cu_q, cu_k, max_q, max_k, (k_start, k_stop))."""
    n = cu[-1] // world
    lo, hi = rank * n, (rank + 1) * n
    left = bisect.bisect_left(cu, lo)  # the first boundary >= lo; back one if lo is inside a document
    if cu[left] != lo:
        left -= 1
    right = bisect.bisect_left(cu, hi)  # the first boundary >= hi: the end of the rank's last document
    span = cu[left:right + 1]
    cu_q = [0] + [c - lo for c in span[1:-1]] + [n]
    k_stop = hi if causal else cu[right]  # causal: the last document's keys up to the rank's last query
    cu_k = [c - cu[left] for c in span[:-1]] + [k_stop - cu[left]]
    longest = lambda c: max(b - a for a, b in zip(c, c[1:]))  # noqa: E731
    return cu_q, cu_k, longest(cu_q), longest(cu_k), (cu[left], k_stop)


def _dedup(c: list[int]) -> list[int]:
    return [x for i, x in enumerate(c) if i == 0 or x != c[i - 1]]


def global_cu(texts: list[str], n: int, causal: bool) -> list[int]:
    """The global ``cu_seqlens`` from every rank's llama3 arguments (the same on every rank, or the same
    ``ValueError`` everywhere): the boundaries inside each rank's range, and where its first document starts."""
    world, views = len(texts), [json.loads(t) for t in texts]
    bounds = {0, world * n}
    for r, view in enumerate(views):
        bounds.add(view["k_slice"][0])
        bounds.update(r * n + c for c in view["cu_q"][1:-1])
        if not causal:
            bounds.add(view["k_slice"][1])
    cu = sorted(bounds)

    def agrees(r: int, view: dict) -> bool:  # rank r's arguments are exactly the helper's for the rebuilt stream
        if not 0 <= cu[0] <= cu[-1] <= world * n:
            return False
        cu_q, cu_k, _, _, span = prepare(cu, causal, r, world)
        return (_dedup(cu_q), _dedup(cu_k), list(span)) == (_dedup(view["cu_q"]), _dedup(view["cu_k"]),
                                                             view["k_slice"])

    wrong = [r for r, view in enumerate(views) if not agrees(r, view)]
    if wrong:
        raise ValueError(f"llama3_flash_attn_varlen_func: the local cu_seqlens_q, cu_seqlens_k and local_k_slice of "
                         f"rank(s) {wrong} are not what llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal="
                         f"{causal}, rank, world_size) gives for the stream the ranks describe together (every "
                         f"rank: {views}); compute them with it from the global cu_seqlens, with the same causal as "
                         f"this call, or call distattn.dist_flash_attn_varlen_func with the global cu_seqlens")
    return cu
