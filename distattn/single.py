"""Single-device exact attention with autograd (the layer under ``distattn.flash_attn_func``).

One registered op (``torch.ops.distattn.local_attention``, its backward an op too, fake implementations for
tracers) for every mask: causal, sliding windows and packed documents reach the kernels as data
(``kernels.KeyBounds``), never as separate code paths.

Legend: ``b`` batch, ``s_q``/``s_k`` query/key length, ``h_q``/``h_kv`` heads, ``d`` head dim.
"""

from __future__ import annotations

import torch

import distattn.kernels as kernels

__all__ = ["attention", "attention_with_bounds"]


# -- the registered ops ------------------------------------------------------------------------------------
# The attention is a registered op with a fake (shapes-only) implementation, so ``torch.compile`` sees one opaque
# call: it never traces the kernels' host loops (the torch/sdpa backends read the mask bounds to the host and walk
# tiles in Python; traced with ``capture_scalar_outputs`` that was one symbolic int per query row, a compile time
# that grew with the token count). The backend travels as its name and is resolved when the op runs.
# ``lo``/``hi``: the ``KeyBounds`` of the call, or None (``causal`` on positions then carries the mask).
@torch.library.custom_op("distattn::local_attention", mutates_args=())
def _local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor | None,
                     hi: torch.Tensor | None, scale: float, causal: bool, q_start: int, softcap: float,
                     backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``q (b, s_q, h_q, d)``, ``k, v (b, s_k, h_kv, d)`` -> ``out (b, s_q, h_q, d)``, ``lse (b, h_q, s_q)`` fp32."""
    out, lse = kernels.forward(q, k, v, **_kernel_kw(lo, hi, scale, causal, q_start, softcap, backend, q.device))
    return out.contiguous(), lse


@_local_attention.register_fake
def _local_attention_fake(q, k, v, *options):
    b, s_q, h_q, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h_q, s_q), dtype=torch.float32)


@torch.library.custom_op("distattn::local_attention_backward", mutates_args=())
def _local_attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 out: torch.Tensor, lse: torch.Tensor, lo: torch.Tensor | None,
                                 hi: torch.Tensor | None, scale: float, causal: bool, q_start: int, softcap: float,
                                 backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of ``distattn::local_attention`` (an op of its own: traced backward graphs stay opaque)."""
    kw = _kernel_kw(lo, hi, scale, causal, q_start, softcap, backend, q.device)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # fp32 accumulators, cast once at the end
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros_like(dk)
    delta = kernels.attn_delta(dout, out, backend=kw["backend"])
    kernels.backward_chunk_(dout, q, k, v, lse, delta, dq, dk, dv, **kw)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@_local_attention_backward_op.register_fake
def _local_attention_backward_fake(dout, q, k, v, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _kernel_kw(lo, hi, scale, causal, q_start, softcap, backend, device) -> dict:
    bounds = None if lo is None else kernels.KeyBounds(lo, hi)
    obj = _INSTANCES.get(backend)
    return dict(softmax_scale=scale, q_start=q_start, k_start=0, causal=causal, bounds=bounds, softcap=softcap,
                backend=obj if obj is not None else kernels.get_backend(backend, device))


def _setup_context(ctx, inputs, output):
    q, k, v, lo, hi, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.bounds, ctx.options = (lo, hi), options  # mask metadata, not activations: kept out of saved-tensor hooks
    ctx.mark_non_differentiable(lse)


def _local_attention_backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _local_attention_backward_op(dout, q, k, v, out, lse, *ctx.bounds, *ctx.options)
    return (dq, dk, dv) + (None,) * (2 + len(ctx.options))


_local_attention.register_autograd(_local_attention_backward, setup_context=_setup_context)


_INSTANCES: dict[str, object] = {}
"""Backend objects passed as such, not by name (e.g. a ``TorchBackend`` with other tile sizes): the op takes a name,
so each is registered here under ``"<name>#<id>"`` and found again when the op runs."""


def _backend_name(backend) -> str:
    if isinstance(backend, str):
        return backend
    key = f"{backend.name}#{id(backend)}"
    _INSTANCES[key] = backend  # kept alive while registered, so the id is never reused for another backend
    return key


def attention(q, k, v, *, scale: float, causal: bool, window: tuple[int, int], softcap: float, backend):
    """``(out, lse)`` of dense attention, bottom-right aligned; inputs already validated (``distattn.api``)."""
    s_q, s_k = q.shape[1], k.shape[1]
    bounds = None
    if window != (-1, -1):  # a window is an interval per row: the bounds path
        bounds = kernels.window_bounds(s_q, s_k, causal=causal, window=window, device=q.device)
    lo, hi = (None, None) if bounds is None else bounds
    return _local_attention(q, k, v, lo, hi, scale, causal and bounds is None, s_k - s_q, softcap,
                            _backend_name(backend))


def attention_with_bounds(q, k, v, bounds: kernels.KeyBounds, *, scale: float, softcap: float, backend):
    """``(out, lse)`` where query row ``i`` sees keys ``bounds.lo[i] .. bounds.hi[i]`` (packed documents)."""
    return _local_attention(q, k, v, bounds.lo, bounds.hi, scale, False, 0, softcap, _backend_name(backend))
