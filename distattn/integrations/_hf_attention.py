"""distattn as a Hugging Face attention implementation (re-exported by ``distattn.integrations.hf``).

Owns the registration of distattn in transformers' ``AttentionInterface`` and ``AttentionMaskInterface``
(``use_distattn``, ``ATTN_IMPLEMENTATION``), the attention function transformers calls (``distattn_attention_forward``:
HF's ``(b, h, n, d)`` call onto ``torch.ops.distattn.attention``) and the refusals of what it cannot compute (prepared
masks, padding, attention dropout). Imports downward only: the public functions (``distattn.api``), the packing hook
(``_hf_packing``) and the schedule check shared with the batch helpers (``_hf_batch``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distattn import kernels
from distattn._ops import group_key, group_of
from distattn.api import dist_attn_with_documents, dist_flash_attn_func, dist_flash_attn_varlen_func
from distattn.integrations._hf_batch import resolve_schedule as _resolve_schedule
from distattn.integrations._hf_packing import (NO_PADDING_FIX, cu_seq_lens_documents, install_packing_hook,
                                                refuse_padding, stream_documents)
from distattn.schedule import ulysses_heads
from distattn.sharding import group_size as _group_size
from distattn.topology import split as _split_group

__all__ = ["ATTN_IMPLEMENTATION", "use_distattn", "distattn_attention_forward"]

ATTN_IMPLEMENTATION = "distattn"
"""Name (prefix) under which distattn is registered in transformers' ``AttentionInterface``."""


@dataclass(frozen=True, kw_only=True)
class _Options:
    """What one registered attention implementation runs with (a process group travels as its key)."""

    group_key: str
    schedule: str
    backend: str | None
    overlap: bool

    @property
    def name(self) -> str:
        if self == _DEFAULT_OPTIONS:
            return ATTN_IMPLEMENTATION
        return (f"{ATTN_IMPLEMENTATION}-{self.group_key}-{self.schedule}-{self.backend or 'auto'}"
                f"{'' if self.overlap else '-nooverlap'}")


_DEFAULT_OPTIONS = _Options(group_key=group_key(None), schedule="balanced", backend=None, overlap=True)


# -- attention ----------------------------------------------------------------------------------------------
# Names that transformers model configs use for the attention-probability dropout (LLaMA-style first).
_DROPOUT_FIELDS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout")


def _dropout_field(module) -> str:
    """The config field that sets this attention module's dropout (``attn_pdrop`` for GPT-2, ...)."""
    config = getattr(module, "config", None)
    fields = getattr(config, "__dict__", {})  # the config's own fields, not attribute_map aliases
    present = [name for name in _DROPOUT_FIELDS if name in fields]
    nonzero = [name for name in present if fields[name]]
    return (nonzero or present or ["attention_dropout"])[0]


def _check_call(module, attention_mask, dropout: float) -> None:
    """Refuse what the sequence-parallel op cannot compute exactly (same decision on every rank)."""
    if attention_mask is not None:
        # 2-D masks stop in _mask_interface; only a prepared (4-D) mask, passed as-is by transformers, gets here.
        raise ValueError(f"distattn attention takes no prepared attention mask (got one of shape "
                         f"{tuple(attention_mask.shape)}): every token attends causally to all earlier tokens of "
                         f"the whole sequence, so a mask cannot be applied; {NO_PADDING_FIX}")
    if dropout:
        field = _dropout_field(module)
        raise ValueError(f"attention dropout ({dropout}) is not supported by distattn; build the model with "
                         f"config.{field} = 0.0 (e.g. from_pretrained(..., {field}=0.0)), or run it in eval mode")



def _common_dtype(query, key, value):
    """Under autocast, HF's RoPE returns fp32 q/k while v stays in the autocast dtype: compute in that dtype
    (as transformers' own flash-attention integration does); otherwise the tensors must already agree."""
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return query.to(dtype), key.to(dtype), value.to(dtype)
    return query, key, value


def distattn_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *,
                               options: _Options, **kwargs):
    """transformers' attention-function contract, computed by ``torch.ops.distattn.attention``.

    Args:
        query: ``(batch, heads_q, n, head_dim)``, this rank's tokens (RoPE already applied).
        key, value: ``(batch, heads_kv, n, head_dim)``; GQA is native (key/value heads are never repeated).
        attention_mask: must be ``None``: ``_mask_interface`` turns an all-ones 2-D mask into ``None`` and
            refuses padding, so only a prepared 4-D mask can arrive here (refused by ``_check_call``).
        scaling: softmax scale (``None``: ``head_dim ** -0.5``).
        kwargs: transformers' extras; ``softcap`` (Gemma-2's ``attn_logit_softcapping``) soft-caps the scores.

    Returns:
        ``(attn_output (batch, n, heads_q, head_dim), None)``: no attention weights are ever materialized.
    """
    group = group_of(options.group_key)
    _check_call(module, attention_mask, dropout)
    is_causal = kwargs.get("is_causal")
    is_causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    query, key, value = _common_dtype(query, key, value)
    # (b, h, n, d) -> (b, n, h, d), the op's layout; transposed views (the kernels need unit stride in d only).
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    common = dict(softmax_scale=scaling, causal=is_causal, softcap=kwargs.get("softcap") or 0.0,
                  window_size=_window(kwargs.get("sliding_window"), is_causal, q.shape[1] * _group_size(group)),
                  group=group, schedule=options.schedule, backend=options.backend, overlap=options.overlap)
    known, stream = stream_documents(kwargs)
    if known:  # the packing hook's documents: a tensor read when the op runs (one graph for any documents)
        return dist_attn_with_documents(q, k, v, stream, **common), None
    documents = None
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        documents = cu_seq_lens_documents(kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"))
    if documents is not None:  # a packed stream: attention stays inside each document
        cu = torch.tensor(documents, dtype=torch.int32)
        out = dist_flash_attn_varlen_func(q[0], k[0], v[0], cu, max(b - a for a, b in zip(documents, documents[1:])),
                                          **common)
        return out.unsqueeze(0), None
    return dist_flash_attn_func(q, k, v, **common), None


def _window(sliding_window, causal: bool, total: int) -> tuple[int, int]:
    """transformers' ``sliding_window`` (a token sees the ``W`` latest keys, itself included) as flash-attn's
    ``window_size``; no window when it covers the whole stream anyway."""
    if sliding_window is None or sliding_window >= total:
        return (-1, -1)
    return (sliding_window - 1, 0 if causal else sliding_window - 1)


def placement_window(config, total: int) -> tuple[int, int]:
    """The window to place a packed stream of ``total`` tokens for (``shard_batch(..., schedule="placed", window=)``):
    the window most of the model's attention layers run with (transformers' ``layer_types`` where the config has
    them, else ``sliding_window`` on every layer unless ``use_sliding_window`` is off), as their calls pass it; causal
    ``(-1, -1)`` when most layers see the whole document. Every layer runs on the placement either way
    (``distattn.sharding.placed_window``); this only picks the work it balances."""
    types = getattr(config, "layer_types", None)
    if types:
        if 2 * sum(t == "sliding_attention" for t in types) <= len(types):
            return (-1, -1)
    elif getattr(config, "use_sliding_window", True) is False:
        return (-1, -1)
    return _window(getattr(config, "sliding_window", None), True, total)


def _mask_interface(*, attention_mask=None, options: _Options, **kwargs):
    """transformers' mask-interface contract (``AttentionMaskInterface``) for distattn: build no mask.

    ``create_causal_mask`` (and the sliding-window/bidirectional variants) call this once per model forward
    with the model's 2-D ``attention_mask`` as bool ``(batch, kv_length)`` (``None`` when the caller passed
    none). distattn applies no per-token mask, so a mask with any padding (a zero) is refused on every rank of
    the group: the ranks hold different shards of the mask, so they agree on "any rank has padding" with one
    all-reduce of a single flag before any attention communication starts (no collective when no mask is
    passed). An all-ones mask masks nothing and is accepted. The check is the ``distattn::refuse_padding`` op, so
    ``torch.compile`` traces a masked forward without a graph break and the check runs with the compiled graph.

    Returns:
        ``None``: the model passes ``attention_mask=None`` to every attention layer.

    Raises:
        ValueError: some rank's ``attention_mask`` has a zero.
    """
    if attention_mask is not None:
        refuse_padding(attention_mask, options.group_key)
    return None


def _check_heads(model, group) -> None:
    """A two-dimensional group splits the heads over its Ulysses ranks: refuse a model whose heads cannot be
    split before any forward (no communication: the Ulysses group's size is local knowledge)."""
    ulysses_group, _ = _split_group(group)
    config = getattr(model, "config", None)
    if ulysses_group is None or not hasattr(config, "num_attention_heads"):
        return
    heads_q = config.num_attention_heads
    heads_kv = getattr(config, "num_key_value_heads", None) or heads_q
    try:
        ulysses_heads(heads_q, heads_kv, dist.get_world_size(ulysses_group))
    except ValueError as err:
        raise ValueError(f"use_distattn with a two-dimensional group: {err}") from None


def _register(options: _Options) -> str:
    """Register distattn under ``options.name`` in transformers' attention and mask interfaces."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(options.name, functools.partial(distattn_attention_forward, options=options))
    # Without a mask-interface entry transformers drops the 2-D mask before any distattn code sees it.
    AttentionMaskInterface.register(options.name, functools.partial(_mask_interface, options=options))
    return options.name


def use_distattn(model, group=None, schedule: str = "balanced", *, backend: str | None = None,
                 overlap: bool = True):
    """Switch a transformers model's attention to distattn's sequence-parallel attention.

    Registers the attention function in transformers' ``AttentionInterface`` (so every attention layer of
    the model calls ``torch.ops.distattn.attention``) and sets the model's attention implementation to it.
    No attention mask is built: distattn's entry in transformers' ``AttentionMaskInterface`` returns ``None``
    (so the op applies the causal mask on global positions itself) and raises ``ValueError`` when the model
    is called with an ``attention_mask`` that has padding (zeros) on any rank; an all-ones mask is accepted.
    Sets ``config.use_cache = False`` (a sequence-parallel KV cache for generation is out of scope).

    After ``loss.backward()`` each rank holds its share of every parameter gradient: sum the gradients over
    ``group`` before the optimizer step with ``distattn.reduce_gradients(model, group)``; under DDP or FSDP2,
    which average, use ``distattn.register_ddp_gradient_hook`` / ``set_fsdp_gradient_divide_factor`` instead.

    Shard every batch with the same ``group`` and ``schedule`` (``shard_batch(..., group=group,
    schedule=schedule)``): the schedule fixes which tokens each rank holds. The first forward of a batch sharded
    with another layout raises ``ValueError`` on every rank (the packing hook puts the position ids back in the
    order of this schedule's layout, and a document that starts at a position other than 0 is refused).

    Args:
        model: a ``PreTrainedModel`` whose attention goes through ``AttentionInterface`` (LLaMA, Qwen2, Mistral...).
        group: the sequence-parallel group: ``None`` (the default group), a ``ProcessGroup``, or a two-dimensional
            group, ``(ulysses_group, ring_group)`` (``distattn.make_2d_groups``) or a 2-D ``DeviceMesh`` named
            ``("ring", "ulysses")``: heads are split over the ``U`` Ulysses ranks (query heads must divide by
            ``U``; key/value heads too, or divide ``U``), the sequence over all ``U * R`` ranks.
        schedule: ``"balanced"`` (DistFlashAttn load balancing) or ``"ring"`` (contiguous shards), or
            ``"zigzag"`` (rank ``r`` holds chunks ``r`` and ``2P-1-r`` of ``2P``).
        backend: kernel backend (``"triton"``, ``"torch"``, ``None``: best available on the model's device).
        overlap: prefetch key/value chunks while computing (``False`` only for ablations).

    Returns:
        ``model`` (changed in place).
    """
    schedule = _resolve_schedule(schedule, group)
    if backend is not None and backend not in kernels.BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; it must be one of {kernels.BACKENDS} or None")
    _check_heads(model, group)
    name = _register(_Options(group_key=group_key(group), schedule=schedule, backend=backend,
                              overlap=bool(overlap)))
    if not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"{type(model).__name__} is not a transformers PreTrainedModel (no "
                        f"set_attn_implementation); call attention through distattn.dist_flash_attn_func instead")
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise ValueError(f"{type(model).__name__} does not route attention through transformers' "
                         f"AttentionInterface, so distattn cannot be switched on for it; call "
                         f"distattn.dist_flash_attn_func from its attention module instead")
    model.config.use_cache = False
    # every forward: the stream's documents, and a check that the batch was sharded with this layout
    install_packing_hook(model, group_key(group), schedule)
    return model
