"""Masks as data: every query row sees one interval of keys, ``[lo, hi]`` in global key positions.

Causal attention, packed documents (``cu_seqlens``), sliding windows and their combinations are all of this form,
and in every one of them ``lo`` and ``hi`` are *nondecreasing* down the query rows. That is the whole contract
between a mask and a kernel (``KeyBounds``): a kernel loads the bounds of its block's first and last rows and
knows, in O(1), which key blocks no row can see (skipped), which every row sees whole (no mask to pay for) and
which straddle an edge (masked). A row with ``hi < lo`` sees nothing: output 0, lse -inf, zero gradients.

    packed documents [0, 3) [3, 8), causal, window (2, 0)      keys 0 1 2 3 4 5 6 7
        row 0 (doc 0, p=0)  lo=0 hi=0                          x . . . . . . .
        row 2 (doc 0, p=2)  lo=0 hi=2                          x x x . . . . .
        row 3 (doc 1, p=3)  lo=3 hi=3                          . . . x . . . .
        row 7 (doc 1, p=7)  lo=5 hi=7                          . . . . . x x x

The builders here run on the tensors' device (a few vectorized ops on ``s_q`` integers) and never read a tensor
back to the host.

Legend: ``s_q`` query rows of the chunk, ``s_k`` keys, ``cu`` cumulative document lengths (``cu[0] = 0``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["KeyBounds", "window_bounds", "varlen_bounds", "transpose_bounds"]


class KeyBounds(NamedTuple):
    """Per query row, the global positions of the first and last key it sees (inclusive), both nondecreasing."""

    lo: torch.Tensor  # (s_q,) int32
    hi: torch.Tensor  # (s_q,) int32; hi < lo: the row sees no key


def _window_edges(p: torch.Tensor, first: torch.Tensor, last: torch.Tensor, causal: bool,
                  window: tuple[int, int]) -> KeyBounds:
    """Rows at (virtual) key positions ``p`` whose document's keys are ``[first, last]``."""
    left, right = window
    lo = first if left < 0 else torch.maximum(first, p - left)
    if causal:
        hi = torch.minimum(last, p)
    elif right >= 0:
        hi = torch.minimum(last, p + right)
    else:
        hi = last
    # A side without limit is the document edge itself: a 0-dim tensor for dense bounds, broadcast per row.
    lo, hi = torch.broadcast_to(lo, p.shape), torch.broadcast_to(hi, p.shape)
    # Empty rows pinned to (first, first - 1): keeps hi nondecreasing across documents (a bottom-right
    # aligned row far above its document's keys would otherwise have hi below the previous document's).
    hi = torch.maximum(hi, lo - 1)
    return KeyBounds(lo.to(torch.int32).contiguous(), hi.to(torch.int32).contiguous())


def window_bounds(s_q: int, s_k: int, *, causal: bool, window: tuple[int, int], device,
                  q_start: int | None = None) -> KeyBounds:
    """Bounds for dense attention of ``s_q`` queries over ``s_k`` keys at positions ``[0, s_k)``.

    Query ``i`` sits at position ``q_start + i`` (default ``s_k - s_q``: bottom-right alignment, flash-attn's).
    """
    q_start = s_k - s_q if q_start is None else q_start
    p = torch.arange(q_start, q_start + s_q, device=device, dtype=torch.int64)
    zero = torch.zeros((), dtype=torch.int64, device=device)
    return _window_edges(p, zero, zero + (s_k - 1), causal, window)


def varlen_bounds(cu_q: torch.Tensor, cu_k: torch.Tensor, rows: tuple[int, int], *, causal: bool,
                  window: tuple[int, int]) -> KeyBounds:
    """Bounds of packed documents: query row ``r`` of document ``i`` sees only document ``i``'s keys.

    Document ``i`` holds query rows ``[cu_q[i], cu_q[i+1])`` and keys ``[cu_k[i], cu_k[i+1])``; causal mask and
    window are aligned bottom-right inside each document (flash-attn's varlen semantics). ``rows=(r0, r1)``:
    the bounds of query rows ``r0 .. r1-1`` (all rows: ``(0, total_q)``; a rank's chunk of a packed stream).
    """
    cu_q, cu_k = cu_q.to(torch.int64), cu_k.to(cu_q.device, torch.int64)
    r = torch.arange(rows[0], rows[1], device=cu_q.device, dtype=torch.int64)
    doc = torch.searchsorted(cu_q, r, right=True) - 1  # document of each row (empty documents are skipped)
    doc = doc.clamp(0, cu_q.numel() - 2)
    len_q = cu_q[doc + 1] - cu_q[doc]
    first, end = cu_k[doc], cu_k[doc + 1]
    p = first + (r - cu_q[doc]) + ((end - first) - len_q)  # bottom-right: the last query sits on the last key
    return _window_edges(p, first, end - 1, causal, window)


def transpose_bounds(bounds: KeyBounds, k_start: int, s_k: int) -> KeyBounds:
    """For each key ``j`` of a chunk at ``[k_start, k_start + s_k)``: the first and last *row index* that sees it.

    With nondecreasing bounds the rows that see key ``g`` are contiguous: from the first row with ``hi >= g`` to
    the last with ``lo <= g``. Both results are nondecreasing in ``j``; no row: ``last < first``.
    """
    g = torch.arange(k_start, k_start + s_k, device=bounds.lo.device, dtype=torch.int32)
    first = torch.searchsorted(bounds.hi, g, right=False)  # rows before it have hi < g
    last = torch.searchsorted(bounds.lo, g, right=True) - 1  # rows after it have lo > g
    return KeyBounds(first.to(torch.int32), last.to(torch.int32))
