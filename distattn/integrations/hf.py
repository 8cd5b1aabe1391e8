"""Hugging Face transformers (5.x) integration: sequence-parallel LLaMA-family training in a few lines.

Tested with transformers 5.23 on ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MistralForCausalLM`` (GQA) and
``Gemma2ForCausalLM`` (attention logit soft-capping);
any model whose attention goes through transformers' ``AttentionInterface`` with the same block shape
works the same way. Every rank runs the same model on its own shard of the sequence
(``torchrun --nproc-per-node N train.py``)::

    import distattn, torch.distributed as dist
    from distattn.integrations.hf import causal_lm_loss, enable_remat_checkpointing, shard_batch, use_distattn

    dist.init_process_group("nccl")        # "gloo" on CPU
    model = LlamaForCausalLM.from_pretrained(...).cuda()
    use_distattn(model)                    # attention = distattn over the default group, no 4-D mask
    enable_remat_checkpointing(model)      # optional: checkpoint at attention outputs (distattn.checkpoint);
                                           # offload=True: what it keeps waits in host memory (distattn.offload)
    model.train()

    batch = shard_batch(input_ids, labels=input_ids)   # full (batch, seq) on every rank -> this rank's shard
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    loss = causal_lm_loss(logits, batch["shift_labels"])   # global token mean, same value on every rank
    loss.backward()
    distattn.reduce_gradients(model)       # each rank holds its share of every gradient: sum over the group
    optimizer.step()

Layouts and groups: ``use_distattn(model, group, schedule)`` and ``shard_batch(..., group=group, schedule=schedule)``
take the same two choices. ``schedule="balanced"`` or ``"ring"`` shard the sequence contiguously (rank ``r`` holds
tokens ``[r*n, (r+1)*n)``); ``"zigzag"`` gives rank ``r`` chunks ``r`` and ``2P-1-r`` of ``2P``, which balances
causal work by layout. ``group`` may be two-dimensional, ``(ulysses_group, ring_group)`` from
``distattn.make_2d_groups(U)`` or a 2-D ``DeviceMesh`` named ``("ring", "ulysses")``: heads are split over the
``U`` Ulysses ranks by an all-to-all and the sequence goes around the ring; the sequence is split over all
``U * R`` ranks (sequence index ``r * U + u``), and the loss and the gradient sums cover all of them. A batch
sharded with another layout than the model's raises ``ValueError`` at the first forward, on every rank.

Gradients: after ``loss.backward()`` every parameter's ``.grad`` is only this rank's share of the
full-sequence gradient (the part that flows through this rank's tokens); the full-sequence gradient is the sum
over the sequence-parallel group (a two-dimensional group: all its ``U * R`` ranks), and stepping on the shares
trains on a part of the batch. DDP and FSDP *average* over their ranks (``1/P`` of the gradient, silently). One
call per way of training gives the right gradient (``distattn.gradients``; it also averages over data-parallel
replicas): a plain loop calls ``distattn.reduce_gradients(model, group)`` after each backward; DDP,
``distattn.register_ddp_gradient_hook(ddp_model, group)`` once; FSDP2, ``distattn.set_fsdp_gradient_divide_factor(
model, group)`` once, after ``fully_shard``.

What the pieces guarantee:
    * RoPE sees global positions (``position_ids`` from ``shard_batch``), so every token is embedded as in the
      single-device model; attention is exact over the whole sequence (``distattn.dist_flash_attn_func``).
    * Labels are shifted on the full sequence before sharding, so the last token of a shard keeps its target
      (the first token of the next shard); the sequence's last target is -100.
    * ``causal_lm_loss`` counts target tokens over all ranks, so the loss is the full-sequence mean and each
      rank's backward gives exactly its share of the full-sequence gradient.

Masks: distattn never applies a per-token mask it was not told about. ``use_distattn`` registers distattn in
transformers' mask interface (``AttentionMaskInterface``), which receives the model's 2-D ``attention_mask``: an
all-ones mask is accepted (it masks nothing); a mask with any zero (padding) raises ``ValueError`` on every rank
of the group (the ranks agree with one small all-reduce, only when a mask is passed). Remove the padding
instead: ``shard_batch(input_ids, labels, attention_mask=mask)`` packs the rows padding-free.

Packed (padding-free) batches: ``shard_batch`` packs a list of documents, a padded batch with its mask, or
transformers' flattened format (``position_ids`` restarting at 0) into one stream split over the ranks; a forward
pre-hook (installed by ``use_distattn``, see ``_hf_packing``) derives the whole stream's documents on every
forward, and attention stays inside each document (``distattn.dist_flash_attn_varlen_func``). Sliding-window
models (Mistral) and attention logit soft-capping (Gemma-2) are computed.

Sequence tiling (``_hf_tiling``, ``distattn.tiling``): ``tile_mlp(model, tokens=4096)`` runs every decoder layer's MLP
over 4096-token tiles, keeping only its input for backward; ``tile_loss(model, tokens=4096, group=group)`` makes
``model(..., shift_labels=batch["shift_labels"]).loss`` equal ``causal_lm_loss``'s, computed over tiles with no
``(batch, n, vocab)`` logits (``tiled_causal_lm_loss(hidden, head, labels)`` for your own loop). Both compose with
either checkpointing.

MoE models (``output_router_logits=True``): ``load_balancing_loss(outputs.router_logits, top_k, token_mask, group)``
is the router's load-balancing loss over the whole sequence (``_hf_router``; ``SequenceParallelTrainer`` adds it).

Not supported (each raises ``ValueError`` at the first forward): padding masks and prepared 4-D masks, attention
dropout in training, and generation with a KV cache (``use_distattn`` sets ``config.use_cache = False``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distattn import kernels
from distattn._compat import hf_checkpointing_enable
from distattn._ops import group_key, group_of
from distattn.api import dist_attn_with_documents, dist_flash_attn_func, dist_flash_attn_varlen_func
from distattn.integrations._hf_packing import (NO_PADDING_FIX, cu_seq_lens_documents, install_packing_hook,
                                                refuse_padding, stream_documents)
from distattn.integrations._hf_tiling import global_mean, tile_loss, tile_mlp, tiled_causal_lm_loss
from distattn.integrations._hf_checkpointing import enable_remat_checkpointing, offload_checkpoints
from distattn.integrations._hf_data import ReplicaSampler, check_same_batches, shard_inputs
from distattn.integrations._hf_router import load_balancing_loss
from distattn.schedule import SCHEDULES
from distattn.packing import (Packed, cu_seqlens_from_position_ids, pack_padded, pack_sequences,
                              shift_labels_by_document)
from distattn.schedule import ulysses_heads
from distattn.sharding import group_size as _group_size
from distattn.sharding import layout as _layout
from distattn.sharding import shard_sequence
from distattn.topology import split as _split_group

__all__ = ["use_distattn", "shard_batch", "causal_lm_loss", "enable_remat_checkpointing", "offload_checkpoints",
           "ATTN_IMPLEMENTATION", "IGNORE_INDEX", "tiled_causal_lm_loss", "tile_loss", "tile_mlp",
           "shard_inputs", "check_same_batches", "ReplicaSampler", "SequenceParallelTrainer", "SequenceParallelMixin",
           "load_balancing_loss"]
_TRAINER = ("SequenceParallelTrainer", "SequenceParallelMixin")  # import transformers.Trainer only when asked for


def __getattr__(name):
    if name in _TRAINER:
        from distattn.integrations import _hf_trainer

        return getattr(_hf_trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

ATTN_IMPLEMENTATION = "distattn"
"""Name (prefix) under which distattn is registered in transformers' ``AttentionInterface``."""
IGNORE_INDEX = -100
"""Target value that the loss skips (transformers' and PyTorch's convention)."""


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


def _resolve_schedule(schedule, group=None) -> str:
    """The concrete schedule that lays out the batch and runs attention, validated (the same on every rank).

    ``"auto"`` stays ``"auto"``: every attention call resolves it with the cost model among the schedules of
    contiguous shards (ring, balanced; ``distattn.dist_flash_attn_func``), so its layout is contiguous and
    ``shard_batch(..., schedule="auto")`` shards contiguously. To let the model pick the zigzag layout or a 2-D
    group, resolve before building the groups: ``distattn.choose_schedule(...)`` (``launch/train.py --schedule
    auto`` does). The schedule fixes the layout of the shards, so ``shard_batch`` and the model's attention must
    agree on it.
    """
    if schedule not in SCHEDULES + ("auto",):
        raise ValueError(f"schedule={schedule!r} is not one of {SCHEDULES + ('auto',)}; pass one of them (the same "
                         f"to use_distattn and shard_batch), e.g. schedule='balanced'")
    return schedule


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


# -- data and loss ------------------------------------------------------------------------------------------
def shard_batch(input_ids, labels=None, group=None, *, schedule: str = "balanced",
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                pad_id: int = 0) -> dict:
    """This rank's share of a batch: one long sequence per row, or documents packed padding-free.

    Four inputs, the same on every rank:

    * ``input_ids (batch, seq)``: every row one sequence (``seq`` divisible by the group size; ``"zigzag"``: by
      twice the group size);
    * a list of 1-D token tensors (documents of any length): packed into one stream, no padding but the tail
      up to a multiple of the group size (``"zigzag"``: of twice the group size);
    * ``input_ids (batch, seq)`` with a padding ``attention_mask`` (0 = pad): the pad tokens are removed and the
      rows packed as documents (``out["packed"].unpack(x, batch, seq)`` puts per-token results back);
    * transformers' flattened format: ``input_ids (1, T)`` with ``position_ids (1, T)`` restarting at 0 at every
      document (``DataCollatorWithFlattening``); ``T`` divisible as for a row.

    Every path lays the sequence (or stream) out with ``schedule``'s layout (``distattn.shard_sequence``):
    contiguous shards for ``"ring"``/``"balanced"``, chunks ``r`` and ``2P-1-r`` of ``2P`` for ``"zigzag"``, by
    sequence index ``r * U + u`` on a two-dimensional group. Position ids and labels are computed on the full
    sequence and sharded the same way, so RoPE sees every token's global position (packed: its position in its
    document) and every target stays with its token. Pass the same ``group`` and ``schedule`` to
    ``use_distattn``; a model whose schedule lays out differently raises ``ValueError`` at its first forward.

    Packed, a token attends only within its document (the model call is the same:
    ``model(input_ids=out["input_ids"], position_ids=out["position_ids"])``; ``use_distattn``'s hook reads the
    documents off the position ids), RoPE sees each token's position within its document, and
    ``shift_labels`` never predicts across a document boundary.

    Args:
        input_ids: ``(batch, seq)`` token ids, or a list of 1-D token tensors.
        labels: unshifted targets shaped like ``input_ids`` (a list for a list), usually the ids themselves with
            ``-100`` where no loss is wanted; ``None``: no ``shift_labels``.
        group: the sequence-parallel group (``None``: the default group; a ``(ulysses_group, ring_group)`` pair
            or a 2-D ``DeviceMesh``: all ``U * R`` ranks split the sequence).
        schedule: ``"balanced"``, ``"ring"``, ``"zigzag"`` or ``"placed"`` (packed streams on the work-balanced
            placement of their documents; pass ``cu_seq_lens_q=cu_seq_lens_k=out["cu_seq_lens"]`` to the model so
            that its hook knows the layout): the schedule given to ``use_distattn``.
        attention_mask: ``(batch, seq)``, 1 = token, 0 = padding.
        position_ids: ``(1, T)`` of the flattened format.
        pad_id: token id of the tail padding of packed streams.

    Returns:
        ``{"input_ids": (batch, n), "position_ids": (batch, n)}`` and, with ``labels``, ``"shift_labels"``: targets
        shifted on the full sequence (token ``i`` predicts ``labels[i + 1]``; the last token of a sequence or
        document gets -100). Pass them to ``causal_lm_loss``, not as the model's ``labels=`` (its loss would shift
        them again and average over this rank only)::

            "balanced", P = 2             "zigzag", P = 2 (chunks 0, 3 | 1, 2)
            rank 0        rank 1          rank 0              rank 1
            t0 t1 t2 | t3 t4 t5           t0 t1 t6 t7       | t2 t3 t4 t5      input_ids
            0  1  2  | 3  4  5            0  1  6  7        | 2  3  4  5       position_ids
            t1 t2 t3 | t4 t5 -100         t1 t2 t7 -100     | t3 t4 t5 t6      shift_labels

        Packed batches add ``"cu_seq_lens"`` (the whole stream's cumulative document lengths, int32),
        ``"max_length"`` (the longest document), ``"num_tokens"`` (real tokens, all ranks) and ``"packed"``
        (the :class:`distattn.packing.Packed` stream, in sequence order).
    """
    schedule = _resolve_schedule(schedule, group)
    world = _group_size(group)
    placed = schedule == "placed"  # packed: the placement of the documents; rows: contiguous (one document each)
    multiple = world * (1 if placed else _layout(group, schedule).divisor())  # zigzag: two chunks per rank
    shard = functools.partial(shard_sequence, dim=1, group=group, schedule="balanced" if placed else schedule)
    if isinstance(input_ids, (list, tuple)):
        packed = pack_sequences(input_ids, multiple_of=multiple, pad_id=pad_id)
        stream_labels = None if labels is None else pack_sequences(labels, multiple_of=multiple,
                                                                   pad_id=IGNORE_INDEX).input_ids
        return _shard_packed(packed, stream_labels, _placed(shard, packed, group) if placed else shard)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq) or a list of documents, got shape "
                         f"{tuple(input_ids.shape)}; add a batch dim with input_ids.unsqueeze(0)")
    if labels is not None and labels.shape != input_ids.shape:
        raise ValueError(f"labels {tuple(labels.shape)} must have the shape of input_ids {tuple(input_ids.shape)}")
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        packed = pack_padded(input_ids, attention_mask, multiple_of=multiple, pad_id=pad_id)
        stream_labels = None
        if labels is not None:
            stream_labels = torch.full_like(packed.input_ids, IGNORE_INDEX)
            stream_labels[:packed.num_tokens] = labels.flatten()[packed.index]
        return _shard_packed(packed, stream_labels, _placed(shard, packed, group) if placed else shard)
    if position_ids is not None:
        if position_ids.shape != input_ids.shape or input_ids.shape[0] != 1:
            raise ValueError(f"flattened position_ids must be (1, T) like input_ids, got {tuple(position_ids.shape)} "
                             f"and input_ids {tuple(input_ids.shape)}")
        cu = cu_seqlens_from_position_ids(position_ids)
        lengths = (cu[1:] - cu[:-1]).tolist()
        packed = Packed(input_ids[0], cu, position_ids[0], max(lengths))
        return _shard_packed(packed, None if labels is None else labels[0],
                             _placed(shard, packed, group) if placed else shard)
    batch, seq = input_ids.shape
    positions = torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(batch, seq)
    out = {"input_ids": shard(input_ids), "position_ids": shard(positions)}  # global positions, same layout
    if labels is not None:
        shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # token i predicts labels[i + 1], full sequence
        out["shift_labels"] = shard(shifted)
    return out


def _placed(shard, packed: Packed, group):
    """``shard`` on the placement of the packed stream's documents (``schedule="placed"``; the same on every rank)."""
    from distattn.sharding import placement

    total = packed.input_ids.shape[0]
    lay = placement(packed.cu_seqlens, total // _group_size(group), group)
    return functools.partial(shard, schedule="balanced", layout=lay)


def _shard_packed(packed: Packed, stream_labels, shard) -> dict:
    """This rank's tokens of a packed stream (one row), with document-aware shifted labels; ``shard`` lays a
    ``(1, T)`` stream out as the schedule does (the positions within documents go with their tokens)."""
    row = lambda t: shard(t.unsqueeze(0))  # noqa: E731  (T,) -> this rank's (1, n)
    out = {"input_ids": row(packed.input_ids), "position_ids": row(packed.position_ids),
           "cu_seq_lens": packed.cu_seqlens, "max_length": packed.max_seqlen, "num_tokens": packed.num_tokens,
           "packed": packed}
    if stream_labels is not None:
        out["shift_labels"] = row(shift_labels_by_document(stream_labels, packed.cu_seqlens))
    return out


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, group=None) -> torch.Tensor:
    """Mean cross-entropy over every target token of the full sequence (all ranks), on every rank.

    Args:
        logits: ``(batch, n, vocab)``, this rank's logits (upcast to fp32 here).
        labels: ``(batch, n)`` shifted targets of this rank (``shard_batch(...)["shift_labels"]``);
            ``-100`` is ignored.
        group: the sequence-parallel group (``None``: the default group; a two-dimensional group sums over all
            its ``U * R`` ranks), the one ``shard_batch`` used.

    Returns:
        A scalar: the same global mean on every rank (0 when no rank has a target). Its gradient with
        respect to this rank's logits is that of the global mean, so summing parameter gradients over the
        ranks gives the full-sequence gradient. Without the logits: ``tiled_causal_lm_loss``.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(f"logits must be (batch, n, vocab) and labels (batch, n) of this rank, got logits "
                         f"{tuple(logits.shape)} and labels {tuple(labels.shape)}")
    labels = labels.to(logits.device)
    local_sum = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                reduction="sum")
    return global_mean(local_sum, labels, group)  # sum and count over the group in fp64: one value on every rank
