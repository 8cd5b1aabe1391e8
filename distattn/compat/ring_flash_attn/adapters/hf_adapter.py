"""ring-flash-attention's Hugging Face adapter on distattn: ``substitute_hf_flash_attn`` and
``update_ring_flash_attn_params``.

How Axolotl (``context_parallel_size``), OpenRLHF (``--ds.ring_attn_size``) and similar trainers use it, unchanged:
once, ``substitute_hf_flash_attn(group, heads_k_stride)`` on a model loaded with
``attn_implementation="flash_attention_2"``; per batch, the packed stream (batch 1, documents concatenated, the
total padded to a multiple of ``P``) is split contiguously (rank r holds tokens ``[r*n, (r+1)*n)``, with position ids
restarting at every document), and ``update_ring_flash_attn_params(cu_seqlens, group)`` gets the GLOBAL
``cu_seqlens`` (the same tensor on every rank) before the forward.

``substitute_hf_flash_attn`` registers distattn under ``"flash_attention_2"`` in transformers' ``AttentionInterface``
(the public registry every transformers 5.x model dispatches through; transformers' private
``_flash_attention_forward``, which ring-flash-attention also patches for transformers 4.x, is left alone).
Each attention layer then runs ``distattn.dist_flash_attn_varlen_func`` on the stream with the kept ``cu_seqlens``:
documents of any length, sliding windows (``sliding_window``), soft-capping (``softcap``, Gemma-2), GQA without
repeats, and the model's ``is_causal``. ring-flash-attention's adapter asserts causal and no softcap, and turns a
sliding window ``W`` into ``window_size=(W, W)``; here ``W`` means what transformers means (the ``W`` latest keys).
Refused with a ``ValueError`` on every rank: batch > 1, attention dropout, a padding ``attention_mask``, a forward
before any ``update_ring_flash_attn_params``.
"""

from __future__ import annotations

import functools
import numbers

import torch
import torch.distributed as dist

from distattn.api import check_cu_seqlens, dist_flash_attn_varlen_func, validated_everywhere
from distattn.topology import is_2d

__all__ = ["substitute_hf_flash_attn", "update_ring_flash_attn_params", "check_heads_k_stride"]

HF_NAME = "flash_attention_2"
"""The attention implementation the adapter replaces (what ring-flash-attention's users load their models with)."""

_PARAMS: dict = {}  # the last update_ring_flash_attn_params: {"cu": tuple of ints, "group": process group}


def check_heads_k_stride(heads_k_stride, heads_kv: int | None = None) -> int:
    """llama3's ``heads_k_stride``: an int > 0 dividing the key/value heads (unused by distattn beyond this: it
    bounds llama3's all-gather buffer, and distattn never gathers k/v)."""
    if isinstance(heads_k_stride, bool) or not isinstance(heads_k_stride, numbers.Integral) or heads_k_stride < 1:
        raise ValueError(f"heads_k_stride must be an int >= 1, got {heads_k_stride!r}")
    if heads_kv is not None and heads_kv % heads_k_stride:
        raise ValueError(f"heads_k_stride ({heads_k_stride}) must divide the key/value heads ({heads_kv}), as in "
                         f"ring-flash-attention; distattn does not use it (k/v are never all-gathered), so 1 is fine")
    return int(heads_k_stride)


def update_ring_flash_attn_params(cu_seqlens: torch.Tensor, process_group) -> None:
    """Keep the global ``cu_seqlens`` of the next forward's packed stream (the same on every rank of
    ``process_group``): documents ``[cu[i], cu[i+1])`` of the stream whose contiguous shards the ranks hold.
    ``cu_seqlens[-1]`` may be less than the stream (the rest is a padding document no real token sees). One
    device-to-host copy per call (the boundaries are read once per batch, not per layer)."""
    if is_2d(process_group):
        raise TypeError("update_ring_flash_attn_params takes one flat process group (or None)")
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor of int32 or int64, got {type(cu_seqlens).__name__}")
    cu = check_cu_seqlens(cu_seqlens, None, "cu_seqlens", cu_seqlens.device)
    _PARAMS.update(cu=tuple(cu), group=process_group)


def substitute_hf_flash_attn(process_group, heads_k_stride: int) -> None:
    """Make transformers' ``"flash_attention_2"`` run distattn over ``process_group`` (module doc).

    Args:
        process_group: the sequence-parallel group (a flat ``ProcessGroup``, or None for the default group).
        heads_k_stride: validated (an int >= 1; with the model's key/value heads at the first call, that it divides
            them), otherwise unused.
    """
    if is_2d(process_group):
        raise TypeError("substitute_hf_flash_attn takes one flat process group (or None), as ring-flash-attention")
    check_heads_k_stride(heads_k_stride)
    from transformers import AttentionInterface

    AttentionInterface.register(HF_NAME, functools.partial(_attention, group=process_group,
                                                           heads_k_stride=heads_k_stride))


def _check_call(query, key, attention_mask, dropout, group, heads_k_stride):
    """Everything the call needs that is local to this rank; a failure raises on every rank (validated_everywhere)."""
    if "cu" not in _PARAMS:
        raise ValueError("substitute_hf_flash_attn: call update_ring_flash_attn_params(cu_seqlens, group) with the "
                         "global cu_seqlens of the packed batch before every forward")
    if _PARAMS["group"] is not group:
        raise ValueError("update_ring_flash_attn_params was given another process group than "
                         "substitute_hf_flash_attn; pass the same sequence-parallel group to both")
    if query.shape[0] != 1:
        raise ValueError(f"the ring-flash-attention adapter takes one packed stream (batch 1), got batch "
                         f"{query.shape[0]}; concatenate the documents and pass cu_seqlens")
    if dropout:
        raise ValueError(f"attention dropout ({dropout}) is not supported by distattn; set the model config's "
                         f"attention_dropout to 0.0")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("a padding attention_mask cannot be applied by the ring-flash-attention adapter (documents "
                         "are separated by cu_seqlens); pack the batch without padding and pass attention_mask=None")
    check_heads_k_stride(heads_k_stride, key.shape[1])


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
               softcap=None, *, group, heads_k_stride, **kwargs):
    """transformers' attention-function contract: ``query (1, h, n, d)``, ``key/value (1, h_kv, n, d)`` (this rank's
    tokens, RoPE applied) -> ``((1, n, h, d), None)``."""
    from distattn.integrations.hf import _common_dtype, _window

    validated_everywhere(lambda: _check_call(query, key, attention_mask, dropout, group, heads_k_stride), group,
                         None, query)
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    query, key, value = _common_dtype(query, key, value)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (h, n, d) -> (n, h, d) views
    cu = _PARAMS["cu"]
    total = q.shape[0] * dist.get_world_size(group)
    out = dist_flash_attn_varlen_func(
        q, k, v, torch.tensor(cu, dtype=torch.int64), max(b - a for a, b in zip(cu, cu[1:])),  # host: no sync
        softmax_scale=scaling, causal=causal, window_size=_window(sliding_window, causal, total),
        softcap=softcap or 0.0, group=group)
    return out.unsqueeze(0), None
