"""flash-attn's packed functions, on one device and across ranks: thin wrappers over ``distattn.api``.

``qkv`` packs q, k, v along a dim of size 3, ``kv`` packs k, v along a dim of size 2 (flash-attn's layouts). Each
wrapper takes views of the packed tensor (``unbind``: no copy) and calls the unpacked function, so every variant
runs the one op with its validation, and the gradients of the views flow back into the packed tensor (autograd
stacks them once). Signatures, defaults and returns are flash-attn 2.x's, then distattn's keyword-only options.

The distributed wrappers unpack inside the call's agreement (``api.validated_everywhere``): a rank whose packed
tensor has the wrong shape raises the same error on every rank instead of leaving its peers waiting.

Legend: ``b`` batch, ``s`` sequence (``n``: this rank's tokens), ``h``/``h_kv`` heads, ``d`` head dim.
"""

from __future__ import annotations

import torch

from distattn.api import (dist_flash_attn_func, dist_flash_attn_varlen_func, flash_attn_func, flash_attn_varlen_func,
                          validated_everywhere)

__all__ = ["flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func", "dist_flash_attn_qkvpacked_func", "dist_flash_attn_kvpacked_func",
           "dist_flash_attn_varlen_qkvpacked_func", "dist_flash_attn_varlen_kvpacked_func"]


def unpack(packed, parts: int, name: str, varlen: bool):
    """Views of ``packed`` along its pack dim: ``(b, s, parts, h, d)``, varlen ``(total, parts, h, d)``."""
    dims, layout = (4, "(total, {p}, heads, head_dim)") if varlen else (5, "(batch, seq, {p}, heads, head_dim)")
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dim() != dims or packed.shape[dims - 3] != parts:
        raise ValueError(f"{name} must have shape {layout.format(p=parts)}, got {tuple(packed.shape)}; stack the "
                         f"tensors with torch.stack(..., dim={dims - 3})")
    return packed.unbind(dim=dims - 3)


# -- one device -------------------------------------------------------------------------------------------
def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              return_lse=False, backend=None):
    """:func:`distattn.flash_attn_func` with ``qkv (b, s, 3, h, d)``; ``qkv.grad`` gets ``(dq, dk, dv)`` packed.

    Returns ``out (b, s, h, d)``; ``(out, softmax_lse, None)`` with ``return_attn_probs``. ``lse`` is -inf for a
    row that sees no key (flash-attn reports +inf there), see :func:`distattn.flash_attn_func`."""
    q, k, v = unpack(qkv, 3, "qkv", varlen=False)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, return_lse=return_lse, backend=backend)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             return_lse=False, backend=None):
    """:func:`distattn.flash_attn_func` with ``q (b, s_q, h, d)`` and ``kv (b, s_k, 2, h_kv, d)`` (GQA:
    ``h % h_kv == 0``). Returns as :func:`flash_attn_qkvpacked_func`."""
    k, v = unpack(kv, 2, "kv", varlen=False)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, return_lse=return_lse, backend=backend)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, return_lse=False, backend=None):
    """:func:`distattn.flash_attn_varlen_func` with ``qkv (total, 3, h, d)`` and one ``cu_seqlens``/``max_seqlen``
    for queries and keys. Returns ``out (total, h, d)``; ``lse (h, total)`` (-inf for rows that see no key)."""
    q, k, v = unpack(qkv, 3, "qkv", varlen=True)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                  return_lse=return_lse, backend=backend)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                                    return_lse=False, backend=None):
    """:func:`distattn.flash_attn_varlen_func` with ``q (total_q, h, d)`` and ``kv (total_k, 2, h_kv, d)``."""
    k, v = unpack(kv, 2, "kv", varlen=True)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, return_lse=return_lse, backend=backend)


# -- across ranks -----------------------------------------------------------------------------------------
def dist_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                   softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                                   group=None, **options):
    """:func:`distattn.dist_flash_attn_func` with this rank's ``qkv (b, n, 3, h, d)``; ``options``: its keyword-only
    options (``schedule``, ``backend``, ``return_lse``, ``overlap``, ``timeout``, ``partials``)."""
    q, k, v = validated_everywhere(lambda: unpack(qkv, 3, "qkv", varlen=False), group, options.get("timeout"), qkv)
    return dist_flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                deterministic, return_attn_probs, group=group, **options)


def dist_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                  softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                                  group=None, **options):
    """:func:`distattn.dist_flash_attn_func` with this rank's ``q (b, n, h, d)`` and ``kv (b, n, 2, h_kv, d)``."""
    k, v = validated_everywhere(lambda: unpack(kv, 2, "kv", varlen=False), group, options.get("timeout"), q)
    return dist_flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                deterministic, return_attn_probs, group=group, **options)


def dist_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                          causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                          deterministic=False, return_attn_probs=False, *, group=None, **options):
    """:func:`distattn.dist_flash_attn_varlen_func` with this rank's ``qkv (n, 3, h, d)`` and the WHOLE stream's
    ``cu_seqlens`` (the same on every rank; per-rank local ones raise)."""
    q, k, v = validated_everywhere(lambda: unpack(qkv, 3, "qkv", varlen=True), group, options.get("timeout"), qkv)
    return dist_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal,
                                       window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                       group=group, **options)


def dist_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                         causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                         deterministic=False, return_attn_probs=False, *, group=None, **options):
    """:func:`distattn.dist_flash_attn_varlen_func` with this rank's ``q (n, h, d)``, ``kv (n, 2, h_kv, d)`` and
    the WHOLE stream's ``cu_seqlens`` (one stream: queries and keys share it, as in the unpacked function)."""
    k, v = validated_everywhere(lambda: unpack(kv, 2, "kv", varlen=True), group, options.get("timeout"), q)
    return dist_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal,
                                       window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                       group=group, **options)
