"""ring-flash-attention's Hugging Face adapter (``ring_flash_attn.adapters.hf_adapter``) on distattn.

Every name that module has (0.1.x), with its meaning: ``DATA_PARAMS``, ``RING_ATTN_SWITCH``, ``check_params``,
``update_ring_flash_attn_params``, ``use_ring_attn``, ``create_ring_flash_attention_forward``,
``flash_attention_forward``, ``substitute_hf_flash_attn``. Axolotl's releases import ``DATA_PARAMS``,
``check_params``, ``flash_attention_forward`` and ``create_ring_flash_attention_forward`` from here, replace
``create_ring_flash_attention_forward`` on the module with their own and then call ``substitute_hf_flash_attn``; other
trainers call ``use_ring_attn`` (off for generation) and write ``DATA_PARAMS`` themselves.

How it is used, unchanged: once, ``substitute_hf_flash_attn(group, heads_k_stride)``; per batch, the packed stream
(batch 1, documents concatenated, the total padded to a multiple of ``P``) is split contiguously (rank r holds tokens
``[r*n, (r+1)*n)``, position ids restarting at every document), and ``update_ring_flash_attn_params(cu_seqlens,
group)`` gets the GLOBAL ``cu_seqlens`` (the same tensor on every rank) before the forward.

``substitute_hf_flash_attn`` calls this module's ``create_ring_flash_attention_forward`` (looked up when called, so a
replacement set on the module is what runs), keeps the forward it returns, and registers ``flash_attention_forward``
in transformers' public ``AttentionInterface`` under every ``flash_attention_<n>`` name transformers has (2, 3 and,
since transformers 5.x, 4) and under :data:`HF_IMPLEMENTATION`. ring-flash-attention instead patches transformers'
private ``_flash_attention_forward``; distattn neither patches nor reads it.

Loading a model: transformers (5.x, ``PreTrainedModel._check_and_adjust_attn_implementation``) accepts the literal
names ``"flash_attention_2"``/``"flash_attention_3"`` only where the flash-attn (flash-attn-3) distribution is
installed and a CUDA device is present, or where the ``kernels`` package can fetch a Hub kernel in its place; no
registry is consulted for them, so a registered function does not lift that check. With flash-attn installed,
``from_pretrained(..., attn_implementation="flash_attention_2")`` runs distattn after the substitution. Without it,
load with ``attn_implementation=HF_IMPLEMENTATION`` (a name without "flash", which transformers treats as an ordinary
registered function, with FlashAttention-2's mask handling) or switch a loaded model with
``model.set_attn_implementation(HF_IMPLEMENTATION)``. Where the ``kernels`` package is installed and flash-attn is
not, transformers swaps ``"flash_attention_2"`` for a Hub kernel's name, which this substitution does not cover: use
``HF_IMPLEMENTATION`` there too.

The default forward (``create_ring_flash_attention_forward``'s) runs ``distattn.dist_flash_attn_varlen_func`` on the
stream with the kept global ``cu_seqlens`` while ``DATA_PARAMS`` holds what ``update_ring_flash_attn_params`` wrote
(ring-flash-attention's llama3 view of this rank); when a caller has written ``DATA_PARAMS`` itself, it runs
``llama3_flash_attn_varlen_func`` on those values, as ring-flash-attention does. Documents of any length, sliding
windows (``sliding_window`` as transformers means it: the ``W`` latest keys; ring-flash-attention passes
``window_size=(W, W)``), soft-capping (``softcap``, Gemma-2; ring-flash-attention asserts None), GQA without
repeats, and the model's ``is_causal`` (ring-flash-attention asserts causal). Refused with a ``ValueError`` on every
rank: batch > 1, attention dropout, a padding ``attention_mask``, a forward before any
``update_ring_flash_attn_params``.
"""

from __future__ import annotations

import inspect
import re

import torch
import torch.distributed as dist

from distattn.api import check_cu_seqlens, dist_flash_attn_varlen_func, validated_everywhere
from distattn.compat.ring_flash_attn._functions import (check_heads_k_stride, llama3_flash_attn_prepare_cu_seqlens,
                                                        llama3_flash_attn_varlen_func)
from distattn.topology import is_2d

__all__ = ["DATA_PARAMS", "RING_ATTN_SWITCH", "HF_IMPLEMENTATION", "check_params", "update_ring_flash_attn_params",
           "use_ring_attn", "create_ring_flash_attention_forward", "flash_attention_forward",
           "substitute_hf_flash_attn"]

HF_IMPLEMENTATION = "distattn_ring_adapter"
"""The adapter's own name in transformers' interfaces, for loading without the flash-attn package (module doc). It
holds no "flash": transformers treats every name containing "flash" as a flash kernel to import."""

_FLASH_NAME = re.compile(r"flash_attention_\d+")  # transformers' names for flash-attn versions (2, 3, 4 in 5.x)

DATA_PARAMS: dict = {}
"""ring-flash-attention's per-batch parameters: this rank's llama3 view of the stream (``cu_seqlens_q``,
``cu_seqlens_k``, ``max_seqlen_q``, ``max_seqlen_k``, ``local_k_slice``), written by
``update_ring_flash_attn_params`` and read by every forward."""

RING_ATTN_SWITCH = True
"""``use_ring_attn(False)``: the substituted names run what transformers had registered before (e.g. for generation)."""

_KEPT: dict = {}  # update_ring_flash_attn_params: "cu" (global, tuple), "group", "view" (what it wrote to DATA_PARAMS)
_SUB: dict = {}  # substitute_hf_flash_attn: "forward", "accepts" (its keyword names or None: any), "before" {name: fn}


def check_params(f1, f2) -> bool:
    """ring-flash-attention's test of two forwards: whether their signatures have as many parameters."""
    return len(inspect.signature(f1).parameters) == len(inspect.signature(f2).parameters)


def use_ring_attn(flag) -> None:
    """Turn the substituted attention on (default) or off; off, the substituted names run what transformers had
    registered under ``"flash_attention_2"`` before the substitution, as ring-flash-attention's switch runs the
    patched function's original (transformers' own flash attention: the flash-attn package and a model loaded with a
    ``flash_attention_<n>`` name)."""
    global RING_ATTN_SWITCH
    RING_ATTN_SWITCH = bool(flag)


def update_ring_flash_attn_params(cu_seqlens: torch.Tensor, process_group) -> None:
    """Keep the global ``cu_seqlens`` of the next forward's packed stream (the same on every rank of
    ``process_group``): documents ``[cu[i], cu[i+1])`` of the stream whose contiguous shards the ranks hold.

    ``cu_seqlens[-1]`` may be less than the stream (the rest is a padding document no real token sees). When it is
    a multiple of the group size, ``DATA_PARAMS`` gets this rank's llama3 view of it as ring-flash-attention's
    (``llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, True, rank, world_size)``); otherwise ``DATA_PARAMS`` is
    emptied (that view needs the stream's length). One device-to-host copy per call, none per layer.
    """
    if is_2d(process_group):
        raise TypeError("update_ring_flash_attn_params takes one flat process group (or None)")
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor of int32 or int64, got {type(cu_seqlens).__name__}")
    cu = check_cu_seqlens(cu_seqlens, None, "cu_seqlens", cu_seqlens.device)
    DATA_PARAMS.clear()
    world = dist.get_world_size(process_group)
    if cu[-1] % world == 0:
        view = llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, True, dist.get_rank(process_group), world)
        DATA_PARAMS.update(zip(("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "local_k_slice"),
                               view))
    _KEPT.update(cu=tuple(cu), group=process_group, view=dict(DATA_PARAMS))


def _kept_view() -> bool:
    """Whether ``DATA_PARAMS`` still holds exactly what ``update_ring_flash_attn_params`` wrote (the same objects)."""
    view = _KEPT.get("view")
    return view is not None and DATA_PARAMS.keys() == view.keys() and all(DATA_PARAMS[k] is v
                                                                           for k, v in view.items())


def _check_call(query_states, key_states, attention_mask, dropout, group, heads_k_stride):
    """Everything the call needs that is local to this rank; a failure raises on every rank (validated_everywhere)."""
    if "cu" not in _KEPT and not DATA_PARAMS:
        raise ValueError("substitute_hf_flash_attn: call update_ring_flash_attn_params(cu_seqlens, group) with the "
                         "global cu_seqlens of the packed batch before every forward")
    if "cu" in _KEPT and _KEPT["group"] is not group:
        raise ValueError("update_ring_flash_attn_params was given another process group than "
                         "substitute_hf_flash_attn; pass the same sequence-parallel group to both")
    if query_states.shape[0] != 1:
        raise ValueError(f"the ring-flash-attention adapter takes one packed stream (batch 1), got batch "
                         f"{query_states.shape[0]}; concatenate the documents and pass cu_seqlens")
    if dropout:
        raise ValueError(f"attention dropout ({dropout}) is not supported by distattn; set the model config's "
                         f"attention_dropout to 0.0")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("a padding attention_mask cannot be applied by the ring-flash-attention adapter (documents "
                         "are separated by cu_seqlens); pack the batch without padding and pass attention_mask=None")
    check_heads_k_stride(heads_k_stride, key_states.shape[2])


def _window(sliding_window, causal: bool, total: int) -> tuple[int, int]:
    from distattn.integrations.hf import _window as hf_window

    return hf_window(sliding_window, causal, total)


def create_ring_flash_attention_forward(process_group, heads_k_stride: int) -> list:
    """The forwards ``substitute_hf_flash_attn`` chooses from, in transformers' ``_flash_attention_forward``
    convention: ``query_states (1, n, h, d)``, ``key_states``/``value_states (1, n, h_kv, d)`` (this rank's tokens,
    RoPE applied), ``attention_mask``, ``query_length``, ``is_causal``, then keywords (``dropout``,
    ``softmax_scale``, ``sliding_window``, ``softcap``, ...) -> ``(1, n, h, d)``. One forward here (ring-flash-
    attention lists one per transformers signature; distattn calls it by keyword, so one fits every version)."""
    if is_2d(process_group):
        raise TypeError("create_ring_flash_attention_forward takes one flat process group (or None)")
    check_heads_k_stride(heads_k_stride)

    def _flash_attention_forward(query_states, key_states, value_states, attention_mask, query_length, is_causal,
                                 dropout=0.0, position_ids=None, softmax_scale=None, sliding_window=None,
                                 use_top_left_mask=False, softcap=None, deterministic=None, **kwargs):
        validated_everywhere(lambda: _check_call(query_states, key_states, attention_mask, dropout, process_group,
                                                 heads_k_stride), process_group, None, query_states)
        causal = bool(is_causal and not (use_top_left_mask and query_length == 1))
        q, k, v = (t[0] for t in (query_states, key_states, value_states))  # (n, h, d)
        total = q.shape[0] * dist.get_world_size(process_group)
        common = dict(softmax_scale=softmax_scale, causal=causal, window_size=_window(sliding_window, causal, total),
                      softcap=softcap or 0.0, group=process_group)
        if _kept_view():  # the global boundaries are kept: no regathering of the local views
            cu = _KEPT["cu"]
            out = dist_flash_attn_varlen_func(q, k, v, torch.tensor(cu, dtype=torch.int64),  # host: no sync
                                              max(b - a for a, b in zip(cu, cu[1:])), **common)
        else:  # the caller wrote DATA_PARAMS: read it as ring-flash-attention does
            p = DATA_PARAMS
            out = llama3_flash_attn_varlen_func(q, k, v, p["cu_seqlens_q"], p["cu_seqlens_k"], p["max_seqlen_q"],
                                                p["max_seqlen_k"], heads_k_stride, p["local_k_slice"], **common)
        return out.unsqueeze(0)

    return [_flash_attention_forward]


def _accepted(forward):
    """The keyword names ``forward`` takes (None: any, it has ``**kwargs``)."""
    params = inspect.signature(forward).parameters.values()
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def flash_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            sliding_window=None, softcap=None, **kwargs):
    """transformers' attention-function contract (``query (1, h, n, d)``, ``key/value (1, h_kv, n, d)``) ->
    ``((1, n, h, d), None)``, computed by the forward ``substitute_hf_flash_attn`` chose; with
    ``use_ring_attn(False)``, by transformers' own (see :func:`use_ring_attn`)."""
    if not RING_ATTN_SWITCH and "flash_attention_2" in _SUB.get("before", {}):
        return _SUB["before"]["flash_attention_2"](module, query, key, value, attention_mask, dropout=dropout,
                                                   scaling=scaling, sliding_window=sliding_window, softcap=softcap,
                                                   **kwargs)
    if "forward" not in _SUB:
        raise ValueError("flash_attention_forward runs the forward chosen by substitute_hf_flash_attn(group, "
                         "heads_k_stride); call it first (distattn does not read transformers' private "
                         "_flash_attention_forward, which ring-flash-attention forwards to)")
    from distattn.integrations.hf import _common_dtype

    is_causal = kwargs.pop("is_causal", None)
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    query, key, value = (t.transpose(1, 2) for t in _common_dtype(query, key, value))  # (1, n, h, d) views
    extra = {k: v for k, v in kwargs.items() if _SUB["accepts"] is None or k in _SUB["accepts"]}
    out = _SUB["forward"](query, key, value, attention_mask, query_length=query.shape[1], is_causal=causal,
                          dropout=dropout, softmax_scale=scaling, sliding_window=sliding_window, softcap=softcap,
                          **extra)
    return out, None


def substitute_hf_flash_attn(process_group, heads_k_stride: int) -> None:
    """Make transformers' flash-attention names (and :data:`HF_IMPLEMENTATION`) run distattn over ``process_group``
    (module doc: which names a model can be loaded with).

    Args:
        process_group: the sequence-parallel group (a flat ``ProcessGroup``, or None for the default group).
        heads_k_stride: validated (an int >= 1; at the first call, that it divides the key/value heads), otherwise
            unused.
    """
    if is_2d(process_group):
        raise TypeError("substitute_hf_flash_attn takes one flat process group (or None), as ring-flash-attention")
    check_heads_k_stride(heads_k_stride)
    from transformers import AttentionInterface, AttentionMaskInterface

    forwards = globals()["create_ring_flash_attention_forward"](process_group, heads_k_stride)  # a replacement too
    if not forwards:
        raise ValueError("create_ring_flash_attention_forward returned no forward")
    forward = max(forwards, key=lambda f: len(inspect.signature(f).parameters))  # the newest signature
    attention, masks = AttentionInterface(), AttentionMaskInterface()
    names = [n for n in attention if _FLASH_NAME.fullmatch(n)]
    before = _SUB.get("before") or {n: attention[n] for n in names if attention[n] is not flash_attention_forward}
    _SUB.update(forward=forward, accepts=_accepted(forward), before=before)
    for n in names + [HF_IMPLEMENTATION]:
        AttentionInterface.register(n, flash_attention_forward)
    # FlashAttention-2's mask handling for the adapter's own name: None, or the 2-D mask when there is padding
    AttentionMaskInterface.register(HF_IMPLEMENTATION, masks["flash_attention_2"])
