"""Sequence tiling on Hugging Face models (``distattn.tiling``): the loss with its LM head, and the MLPs.

Re-exported by ``distattn.integrations.hf``::

    tile_mlp(model, tokens=4096)          # every decoder layer's mlp runs over 4096-token tiles
    tile_loss(model, tokens=4096)         # model(..., shift_labels=...) returns the loss, never the logits
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                shift_labels=batch["shift_labels"])
    out.loss.backward()                   # = causal_lm_loss(logits, shift_labels), no (n, vocab) logits made

Both replace a module's ``forward`` on the instance (``tokens=None`` puts the class's back); hooks that
FSDP2, DDP and checkpointing put on the modules are untouched. The head must not be an FSDP unit of its own
(``launch/train.py`` shards the decoder layers and the root): ``tile_loss`` reads its weight inside the model's
forward, where the root's parameters are gathered.
"""

from __future__ import annotations

import functools
import inspect

import torch

from distattn.sharding import group_size as _group_size
from distattn.tiling import IGNORE_INDEX, check_tile, tiled_head_loss_sum, tiled_mlp
from distattn.topology import all_reduce as all_reduce_group

__all__ = ["global_mean", "tiled_causal_lm_loss", "tile_loss", "tile_mlp"]

# Config fields of models whose logits are not just the head's output (soft-capped or scaled): refused.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def global_mean(local_sum: torch.Tensor, labels: torch.Tensor, group=None) -> torch.Tensor:
    """The mean over every target token of the group from this rank's loss sum (``causal_lm_loss``'s rule).

    Value: the global mean, identical bits on every rank (sum and count all-reduced in fp64). Gradient:
    ``d(local_sum) / count``, this rank's share of the global mean's gradient.
    """
    stats = torch.stack([local_sum.detach().double(), (labels != IGNORE_INDEX).sum().double()])
    if _group_size(group) > 1:
        all_reduce_group(stats, group)  # every rank of the group: U * R of a two-dimensional one
    total, count = stats[0], stats[1].clamp(min=1.0)
    return (total / count).float() + (local_sum - local_sum.detach()) / count.float()


def tiled_causal_lm_loss(hidden: torch.Tensor, head, labels: torch.Tensor, group=None, *,
                         tokens: int) -> torch.Tensor:
    """``causal_lm_loss(head(hidden), labels, group)`` without the logits: the head and the loss run over
    tiles of ``tokens`` tokens (``distattn.tiling.tiled_head_loss_sum``), recomputed tile by tile in backward.

    Args:
        hidden: ``(batch, n, hidden)`` this rank's final hidden states (after the final norm).
        head: the LM head, an ``nn.Linear`` (``model.get_output_embeddings()``) or its ``(vocab, hidden)``
            weight; a tied embedding is fine (its gradient adds up with the embedding's).
        labels: ``(batch, n)`` shifted targets (``shard_batch(...)["shift_labels"]``), ``-100`` ignored.
        group: the sequence-parallel group, as for ``causal_lm_loss``.
        tokens: tokens per tile, a positive int (more than ``batch * n`` is one tile).

    Returns:
        The same scalar as ``causal_lm_loss`` (to fp32 rounding), the same gradients.
    """
    weight, bias = (head, None) if isinstance(head, torch.Tensor) else (head.weight, getattr(head, "bias", None))
    if hidden.dim() != 3 or labels.shape != hidden.shape[:2]:
        raise ValueError(f"hidden must be (batch, n, hidden) and labels (batch, n) of this rank, got hidden "
                         f"{tuple(hidden.shape)} and labels {tuple(labels.shape)}")
    labels = labels.to(hidden.device)
    return global_mean(tiled_head_loss_sum(hidden, weight, labels, tokens=tokens, bias=bias), labels, group)


# -- the loss inside the model's forward --------------------------------------------------------------------
@functools.cache
def _output_class():
    """``CausalLMOutputWithPast`` plus ``loss_sum``: this rank's summed loss (what a training loop that forms its own
    mean, such as ``SequenceParallelTrainer``'s over a step's micro-batches, needs)."""
    from dataclasses import dataclass

    from transformers.modeling_outputs import CausalLMOutputWithPast

    @dataclass
    class TiledCausalLMOutput(CausalLMOutputWithPast):
        loss_sum: torch.FloatTensor | None = None

    return TiledCausalLMOutput


def _loss_forward(model, tokens: int, group, *args, shift_labels=None, **kwargs):
    """The causal LM's forward; with ``shift_labels``: its loss over tiles, and no logits."""
    if shift_labels is None:
        return type(model).forward(model, *args, **kwargs)
    if kwargs.pop("labels", None) is not None:
        raise ValueError("pass shift_labels= (already shifted, sharded: shard_batch(...)['shift_labels']) or "
                         "labels=, not both")
    kwargs.pop("logits_to_keep", None)
    outputs = model.base_model(*args, **kwargs)
    hidden, head = outputs.last_hidden_state, model.get_output_embeddings()
    if hidden.dim() != 3 or shift_labels.shape != hidden.shape[:2]:
        raise ValueError(f"hidden must be (batch, n, hidden) and labels (batch, n) of this rank, got hidden "
                         f"{tuple(hidden.shape)} and labels {tuple(shift_labels.shape)}")
    labels = shift_labels.to(hidden.device)
    local_sum = tiled_head_loss_sum(hidden, head.weight, labels, tokens=tokens, bias=getattr(head, "bias", None))
    return _output_class()(loss=global_mean(local_sum, labels, group), loss_sum=local_sum, logits=None,
                           past_key_values=outputs.past_key_values, hidden_states=outputs.hidden_states,
                           attentions=outputs.attentions)


def tile_loss(model, tokens: int | None, group=None):
    """Make ``model(..., shift_labels=labels)`` return ``causal_lm_loss``'s loss as ``.loss``, tiled.

    The head and the cross-entropy run over tiles of ``tokens`` tokens and recompute each tile's logits in
    backward, so the ``(batch, n, vocab)`` logits never exist (``.logits`` is ``None``). Without
    ``shift_labels`` the model runs as before. ``tokens=None`` undoes it.

    Args:
        model: a transformers causal LM whose logits are ``lm_head(final hidden states)`` (LLaMA, Qwen2,
            Mistral...); models that soft-cap or scale their logits (Gemma-2) are refused.
        tokens: tokens per tile (a positive int), or ``None``.
        group: the sequence-parallel group the loss averages over (as ``causal_lm_loss``'s).

    Returns:
        ``model`` (changed in place).
    """
    if tokens is None:
        model.__dict__.pop("forward", None)
        return model
    check_tile(tokens, "tile_loss tokens")
    config = getattr(model, "config", None)
    transforms = [name for name in _LOGIT_TRANSFORMS if getattr(config, name, None) not in (None, 1, 1.0)]
    if transforms:
        raise ValueError(f"tile_loss: {type(model).__name__} transforms its logits ({transforms[0]}="
                         f"{getattr(config, transforms[0])}), which the tiled head does not; use "
                         f"causal_lm_loss(model(...).logits, ...)")
    if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
        raise TypeError(f"tile_loss needs a transformers causal LM with an LM head, got {type(model).__name__}")
    forward = functools.partial(_loss_forward, model, tokens, group)
    forward.__signature__ = _signature_with_shift_labels(model)  # what Trainer reads to keep a dataset's columns
    model.forward = forward
    return model


def _signature_with_shift_labels(model) -> inspect.Signature:
    """The model's own ``forward`` signature plus a keyword-only ``shift_labels`` (before its ``**kwargs``)."""
    sig = inspect.signature(type(model).forward.__get__(model))
    params = [p for p in sig.parameters.values() if p.name != "shift_labels"]
    extra = inspect.Parameter("shift_labels", inspect.Parameter.KEYWORD_ONLY, default=None)
    at = next((i for i, p in enumerate(params) if p.kind == inspect.Parameter.VAR_KEYWORD), len(params))
    return sig.replace(parameters=params[:at] + [extra] + params[at:])


# -- MLP ----------------------------------------------------------------------------------------------------
def _mlp_forward(mlp, tokens: int, x):
    """``mlp``'s own forward over tiles of ``tokens`` tokens of ``x (..., hidden)``."""
    if mlp.training and any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in mlp.modules()):
        raise ValueError(f"tile_mlp: {type(mlp).__name__} has dropout in training, which the tiles' recompute in "
                         f"backward would draw anew; build the model with its dropout at 0.0, or tile_mlp(model, "
                         f"None)")
    own = functools.partial(type(mlp).forward, mlp)
    params = [p for p in mlp.parameters() if p.requires_grad]
    if not torch.is_grad_enabled() or not (x.requires_grad or params):
        return own(x)  # no backward: nothing to save, nothing to tile
    return tiled_mlp(own, x, params, tokens=tokens)


def tile_mlp(model, tokens: int | None):
    """Run every decoder layer's MLP (each submodule named ``mlp``) over tiles of ``tokens`` tokens.

    Forward and backward hold the ``(tokens, intermediate)`` tensors of one tile at a time; only the MLP's
    input is kept for backward (``distattn.tiling.tiled_mlp``). LLaMA-family (gate/up/down) and GPT-style
    (fc/act/proj) MLPs alike; composes with ``enable_remat_checkpointing`` and transformers' gradient
    checkpointing. ``tokens=None`` undoes it.

    Returns:
        ``model`` (changed in place).

    Raises:
        ValueError: a tile size that is not a positive int, or a model without ``mlp`` submodules.
    """
    if tokens is not None:
        check_tile(tokens, "tile_mlp tokens")
    mlps = [m.mlp for m in model.modules() if isinstance(getattr(m, "mlp", None), torch.nn.Module)]
    if not mlps:
        raise ValueError(f"tile_mlp: {type(model).__name__} has no submodule named 'mlp' (a decoder layer's MLP)")
    for mlp in mlps:
        if tokens is None:
            mlp.__dict__.pop("forward", None)
        else:
            mlp.forward = functools.partial(_mlp_forward, mlp, tokens)
    return model
