"""Single-device exact attention with autograd (the layer under ``distattn.flash_attn_func``).

One ``autograd.Function`` for every mask: causal, sliding windows and packed documents reach the kernels as
data (``kernels.KeyBounds``), never as separate code paths. Static options travel in a frozen dataclass.

Legend: ``b`` batch, ``s_q``/``s_k`` query/key length, ``h_q``/``h_kv`` heads, ``d`` head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import distattn.kernels as kernels

__all__ = ["attention", "attention_with_bounds"]


@dataclass(frozen=True, kw_only=True)
class _Options:
    """Static options of one call (kept out of ``backward``'s return tuple)."""

    scale: float
    causal: bool  # plain causal on positions (q_start + i vs j); False when ``bounds`` carry the mask
    q_start: int  # global position of the first query; keys start at 0
    bounds: kernels.KeyBounds | None  # per-row visible key interval, or None
    softcap: float
    backend: object

    def kernel_kw(self) -> dict:
        return dict(softmax_scale=self.scale, q_start=self.q_start, k_start=0, causal=self.causal,
                    bounds=self.bounds, softcap=self.softcap, backend=self.backend)


class _FlashAttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, opts: _Options):
        out, lse = kernels.forward(q, k, v, **opts.kernel_kw())
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.opts = opts
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        opts = ctx.opts
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros_like(dk)
        delta = kernels.attn_delta(dout, out, backend=opts.backend)
        kernels.backward_chunk_(dout, q, k, v, lse, delta, dq, dk, dv, **opts.kernel_kw())
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def attention(q, k, v, *, scale: float, causal: bool, window: tuple[int, int], softcap: float, backend):
    """``(out, lse)`` of dense attention, bottom-right aligned; inputs already validated (``distattn.api``)."""
    s_q, s_k = q.shape[1], k.shape[1]
    bounds = None
    if window != (-1, -1):  # a window is an interval per row: the bounds path
        bounds = kernels.window_bounds(s_q, s_k, causal=causal, window=window, device=q.device)
    opts = _Options(scale=scale, causal=causal and bounds is None, q_start=s_k - s_q, bounds=bounds,
                    softcap=softcap, backend=backend)
    return _FlashAttnFunction.apply(q, k, v, opts)


def attention_with_bounds(q, k, v, bounds: kernels.KeyBounds, *, scale: float, softcap: float, backend):
    """``(out, lse)`` where query row ``i`` sees keys ``bounds.lo[i] .. bounds.hi[i]`` (packed documents)."""
    opts = _Options(scale=scale, causal=False, q_start=0, bounds=bounds, softcap=softcap, backend=backend)
    return _FlashAttnFunction.apply(q, k, v, opts)
