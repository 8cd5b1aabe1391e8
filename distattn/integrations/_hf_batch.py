"""A batch as the ranks of a sequence-parallel group hold it, and the loss over it (re-exported by
``distattn.integrations.hf``).

Owns ``shard_batch`` (a dense, padded, packed or flattened batch -> this rank's tokens, global positions and shifted
labels, in the schedule's layout), ``causal_lm_loss`` (the token mean over the whole group from this rank's logits),
``IGNORE_INDEX`` and the schedule check that the attention registration (``_hf_attention``) shares. Imports downward
only: sharding, packing and the group mean of ``_hf_tiling``; nothing here imports another ``_hf_`` room that imports
it back.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from distattn.integrations._hf_tiling import global_mean
from distattn.packing import Packed, cu_seqlens_from_position_ids, pack_padded, pack_sequences, shift_labels_by_document
from distattn.schedule import SCHEDULES
from distattn.sharding import group_size as _group_size
from distattn.sharding import layout as _layout
from distattn.sharding import shard_sequence

__all__ = ["shard_batch", "causal_lm_loss", "resolve_schedule", "IGNORE_INDEX"]

IGNORE_INDEX = -100
"""Target value that the loss skips (transformers' and PyTorch's convention)."""


def resolve_schedule(schedule, group=None) -> str:
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


# -- data and loss ------------------------------------------------------------------------------------------
def shard_batch(input_ids, labels=None, group=None, *, schedule: str = "balanced",
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                pad_id: int = 0, window=(-1, -1)) -> dict:
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
        window: ``"placed"`` only: the attention window the placement is solved for (flash-attn's ``(left, right)``;
            a model with ``sliding_window = W`` on every layer: ``(W - 1, 0)``), so it balances the windowed work.
            The model's calls run on this placement whatever their own window (``distattn.sharding.placed_window``).

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
    schedule = resolve_schedule(schedule, group)
    world = _group_size(group)
    placed = schedule == "placed"  # packed: the placement of the documents; rows: contiguous (one document each)
    multiple = world * (1 if placed else _layout(group, schedule).divisor())  # zigzag: two chunks per rank
    shard = functools.partial(shard_sequence, dim=1, group=group, schedule="balanced" if placed else schedule)
    if isinstance(input_ids, (list, tuple)):
        packed = pack_sequences(input_ids, multiple_of=multiple, pad_id=pad_id)
        stream_labels = None if labels is None else pack_sequences(labels, multiple_of=multiple,
                                                                   pad_id=IGNORE_INDEX).input_ids
        return _shard_packed(packed, stream_labels, _placed(shard, packed, group, window) if placed else shard)
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
        return _shard_packed(packed, stream_labels, _placed(shard, packed, group, window) if placed else shard)
    if position_ids is not None:
        if position_ids.shape != input_ids.shape or input_ids.shape[0] != 1:
            raise ValueError(f"flattened position_ids must be (1, T) like input_ids, got {tuple(position_ids.shape)} "
                             f"and input_ids {tuple(input_ids.shape)}")
        cu = cu_seqlens_from_position_ids(position_ids)
        lengths = (cu[1:] - cu[:-1]).tolist()
        packed = Packed(input_ids[0], cu, position_ids[0], max(lengths))
        return _shard_packed(packed, None if labels is None else labels[0],
                             _placed(shard, packed, group, window) if placed else shard)
    batch, seq = input_ids.shape
    positions = torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(batch, seq)
    out = {"input_ids": shard(input_ids), "position_ids": shard(positions)}  # global positions, same layout
    if labels is not None:
        shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # token i predicts labels[i + 1], full sequence
        out["shift_labels"] = shard(shifted)
    return out


def _placed(shard, packed: Packed, group, window):
    """``shard`` on the placement of the packed stream's documents and ``window`` (``schedule="placed"``; the same on
    every rank)."""
    from distattn.sharding import placement

    total = packed.input_ids.shape[0]
    lay = placement(packed.cu_seqlens, total // _group_size(group), group, window=window)
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
