"""Single-device exact attention with autograd: ``flash_attn_func``.

Mirrors ``flash_attn.flash_attn_func``: tensors are ``(batch, seq, heads, head_dim)``, and with ``s_q != s_k``
the causal mask is aligned bottom-right (the last query sees every key)::

    s_q=2, s_k=5, causal       keys 0 1 2 3 4
                          q 0:      x x x x .      (global position 3)
                          q 1:      x x x x x      (global position 4)

    s_q=5, s_k=2, causal       keys 0 1
                          q 0:      . .            (position -3: sees nothing -> output 0, lse -inf)
                          ...
                          q 4:      x x
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distattn import kernels
from distattn._validate import check_qkv, resolve_scale


@dataclass(frozen=True, kw_only=True)
class _Options:
    """Static options of one call (kept out of ``backward``'s return tuple)."""

    scale: float
    causal: bool
    q_start: int  # global position of the first query; keys start at 0
    backend: object


class _FlashAttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, opts: _Options):
        out, lse = kernels.forward(q, k, v, softmax_scale=opts.scale, q_start=opts.q_start, k_start=0,
                                   causal=opts.causal, backend=opts.backend)
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
        kernels.backward_chunk_(dout, q, k, v, lse, delta, dq, dk, dv, softmax_scale=opts.scale,
                                q_start=opts.q_start, k_start=0, causal=opts.causal, backend=opts.backend)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def flash_attn_func(q, k, v, causal: bool = False, softmax_scale: float | None = None, return_lse: bool = False,
                    backend: str | None = None):
    """Exact attention on one device, differentiable in ``q, k, v``.

    Args:
        q: ``(batch, s_q, heads_q, head_dim)``, fp16/bf16/fp32.
        k, v: ``(batch, s_k, heads_kv, head_dim)``; ``heads_q % heads_kv == 0`` (GQA/MQA).
        causal: mask keys after the query, aligned bottom-right when ``s_q != s_k`` (as flash-attn >= 2.1).
        softmax_scale: defaults to ``head_dim ** -0.5``.
        return_lse: also return ``lse (batch, heads_q, s_q)``, fp32 natural log (not differentiable).
        backend: ``"triton"``, ``"torch"`` or ``None`` (``"triton"`` on CUDA, else ``"torch"``).

    Returns:
        ``out (batch, s_q, heads_q, head_dim)`` in the input dtype, or ``(out, lse)``.
    """
    check_qkv(q, k, v)
    be = kernels.get_backend(backend, q.device)
    opts = _Options(scale=resolve_scale(softmax_scale, q.shape[-1]), causal=bool(causal),
                    q_start=k.shape[1] - q.shape[1], backend=be)
    out, lse = _FlashAttnFunction.apply(q, k, v, opts)
    return (out, lse) if return_lse else out
