"""Checkpointing of Hugging Face models: remat (``distattn.checkpoint``) and offloaded (``distattn.offload``).

Both use transformers' own per-layer checkpointing hook (``GradientCheckpointingLayer``), with a ``context_fn``
that says what each layer keeps; offloading adds forward hooks on the decoder layers that scope the host copies
to exactly the tensors the layer's checkpoint keeps. Public through ``distattn.integrations.hf``.
"""

from __future__ import annotations

from distattn._compat import check_hf_offload, hf_checkpointing_enable
from distattn.checkpoint import remat_context_fn
from distattn.integrations._hf_attention import ATTN_IMPLEMENTATION
from distattn.offload import CheckpointOffload


def enable_remat_checkpointing(model, offload: bool | CheckpointOffload = False):
    """Checkpoint every decoder layer at its attention output (``distattn.checkpoint``) instead of its input.

    Uses transformers' own per-layer checkpointing hook with PyTorch's selective checkpointing: per layer
    the layer input and attention's ``(out, lse)`` are kept, the rest is recomputed in backward, and
    attention's forward (with its communication) runs once per step. Only layers in training mode are
    checkpointed (``model.train()``). Undo with ``model.activation_checkpointing_disable()`` (older 5.x:
    ``model.gradient_checkpointing_disable()``). ``offload``: ``True`` or a ``CheckpointOffload(remat=True)``
    (whose ``layers`` then say where every kept byte is): what is kept waits in host memory
    (:func:`offload_checkpoints`).

    Raises:
        ValueError: the model does not use distattn attention (call ``use_distattn(model)`` first), or does
            not support checkpointing.
    """
    _check_distattn(model, "enable_remat_checkpointing")
    if offload is not False:
        offload_checkpoints(model, remat=True, offload=None if offload is True else offload)
        return model
    _enable_checkpointing(model, {"use_reentrant": False, "context_fn": remat_context_fn})
    return model


def offload_checkpoints(model, remat: bool = False, offload: CheckpointOffload | None = None) -> CheckpointOffload:
    """Checkpoint every decoder layer, keeping what the checkpoint keeps in host memory (``distattn.offload``).

    ``remat=False``: layer-boundary checkpointing (the layer input waits on the host); ``remat=True``: remat
    checkpointing (also attention's ``out, lse``; needs ``use_distattn(model)`` first). Returns the
    ``CheckpointOffload`` (``offload``, or a new one) whose ``layers`` account the bytes per layer.
    """
    offload = offload if offload is not None else CheckpointOffload(remat=remat)
    if offload.remat != remat:
        raise ValueError(f"offload_checkpoints(remat={remat}) got a CheckpointOffload(remat={offload.remat})")
    if remat:
        _check_distattn(model, "offload_checkpoints(remat=True)")
    check_hf_offload()
    _enable_checkpointing(model, {"use_reentrant": False, "context_fn": offload.context_fn})
    from transformers.modeling_layers import GradientCheckpointingLayer

    # the decoder layers, whose forward checkpoints itself (not the model, which carries the flag too)
    offload.attach(m for m in model.modules() if isinstance(m, GradientCheckpointingLayer))
    return offload


def _enable_checkpointing(model, ckpt_kwargs: dict) -> None:
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support activation checkpointing")
    hf_checkpointing_enable(model, ckpt_kwargs)  # activation_ (newer 5.x) or gradient_checkpointing_enable (5.17)


def _check_distattn(model, who: str) -> None:
    if not str(model.config._attn_implementation).startswith(ATTN_IMPLEMENTATION):
        raise ValueError(f"{who} needs distattn attention, but the model uses "
                         f"{model.config._attn_implementation!r}: call use_distattn(model) first")
