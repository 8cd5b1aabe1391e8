"""This rank's share of a torchtitan batch: tokens, labels, RoPE positions and document masks (``torchtitan`` face)."""

from __future__ import annotations

import torch

from distattn.integrations._titan_attention import DistAttention
from distattn.sharding import shard_sequence

__all__ = ["shard_batch", "attention_of", "sp_group"]

IGNORE_INDEX = -100
"""torchtitan's ``CrossEntropyLoss`` ignores this label (its default)."""


def attention_of(model) -> DistAttention:
    """The first :class:`DistAttention` of ``model`` (converted by ``DistAttnConverter``)."""
    for module in model.modules():
        if isinstance(module, DistAttention):
            return module
    raise ValueError(f"{type(model).__name__} has no DistAttention module: build it from a config converted with "
                     f"distattn.integrations.torchtitan.DistAttnConverter")


def sp_group(model):
    """The sequence-parallel group of ``model``'s attention, for ``distattn.set_fsdp_gradient_divide_factor`` and
    ``distattn.reduce_gradients`` (the first call is a collective: every rank makes it)."""
    return attention_of(model).group


def shard_batch(model, inputs: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None = None,
                *, ignore_index: int = IGNORE_INDEX) -> dict:
    """This rank's part of a torchtitan batch, the same full batch on every rank of the sequence-parallel group.

    Args:
        model: the model built from a converted config (its attention's group and schedule shard the batch).
        inputs: ``(b, S)`` token ids, the whole rows; ``S`` a multiple of the group size (zigzag: twice it).
        labels: ``(b, S)``, already shifted as torchtitan's datasets give them (label ``t`` is token ``t + 1``).
        positions: ``(b, S)`` per-document positions (restarting at 0 at each document, torchtitan's data path),
            or None (one document per row: positions ``0..S-1``).
        ignore_index: the label the loss ignores.

    Returns:
        ``{"tokens", "labels", "positions"}``: this rank's ``(b, n)`` shards (positions are the tokens' own,
        global, positions, what RoPE needs); ``"attention_masks"``: torchtitan's ``VarlenMetadata`` of the WHOLE
        rows (``model.get_attention_masks``), or None without positions (dense causal); ``"global_valid_tokens"``:
        the labels of the whole batch that count, as a float tensor (the loss's denominator, so each rank's
        ``sum / global_valid_tokens`` is its term of the replica's token mean and its backward gives its share).
        Pass ``model(tokens, positions=..., attention_masks=...)``.
    """
    att = attention_of(model)
    group, schedule = att.group, att.schedule
    if inputs.shape != labels.shape or (positions is not None and positions.shape != inputs.shape):
        raise ValueError(f"inputs {tuple(inputs.shape)}, labels {tuple(labels.shape)} and positions "
                         f"{None if positions is None else tuple(positions.shape)} must all be (batch, seq)")
    masks = None
    if positions is not None:
        masks = model.get_attention_masks(positions=positions)  # torchtitan's own: VarlenMetadata for our config
    full_pos = positions if positions is not None else torch.arange(inputs.shape[1], device=inputs.device).expand_as(
        inputs)

    def shard(x):
        return shard_sequence(x, dim=1, group=group, schedule=schedule)

    return {"tokens": shard(inputs), "labels": shard(labels), "positions": shard(full_pos).contiguous(),
            "attention_masks": masks,
            "global_valid_tokens": (labels != ignore_index).sum().to(torch.float32)}
