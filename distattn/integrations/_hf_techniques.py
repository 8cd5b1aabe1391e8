"""The length techniques and the model wrappers of ``SequenceParallelTrainer`` (``_hf_trainer``).

Owns what the Trainer does to its model besides the attention: the sequence-tiled loss and MLP (``_hf_tiling``),
remat and offloaded checkpoints (``_hf_checkpointing``), applied at construction from the Trainer's keywords
(``TrainerTechniques``); and, at the first step, the sequence-parallel gradient rule on whatever accelerate wrapped
the model in (``reduce_over_group``: DDP, FSDP2, either under ``torch.compile``). Imports downward only (the rooms
above, ``distattn.gradients``); nothing here imports ``_hf_trainer`` or ``hf``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from distattn.gradients import register_ddp_gradient_hook, set_fsdp_gradient_divide_factor
from distattn.integrations._hf_checkpointing import enable_remat_checkpointing, offload_checkpoints
from distattn.integrations._hf_router import outputs_router_logits
from distattn.integrations._hf_tiling import _loss_forward, tile_loss, tile_mlp
from distattn.tiling import check_tile

__all__ = ["TrainerTechniques", "loss_tile_of", "apply_techniques", "reduce_over_group", "refuse_ignored_fsdp"]


@dataclass(frozen=True, kw_only=True)
class TrainerTechniques:
    """The long-sequence techniques a ``SequenceParallelTrainer`` runs (``launch/train.py``'s flags of the same
    names; README "The longest sequence")."""

    tile_loss: int | None = None
    """Tokens per tile of the LM head + cross-entropy (``--tile-loss``): no ``(tokens, vocab)`` logits."""
    tile_mlp: int | None = None
    """Tokens per tile of every decoder layer's MLP (``--tile-mlp``): only the MLP input kept."""
    remat: bool = False
    """Checkpoint every decoder layer at attention's output (``--remat``): attention never recomputed."""
    offload_checkpoints: bool = False
    """What each layer's checkpoint keeps (its input; with ``remat`` also attention's ``out, lse``) waits in host
    memory between forward and backward (``--offload-checkpoints``)."""

    def __post_init__(self):
        for name in ("tile_loss", "tile_mlp"):
            if getattr(self, name) is not None:
                check_tile(getattr(self, name), name)

    @property
    def checkpointing(self) -> bool:
        return self.remat or self.offload_checkpoints


def loss_tile_of(model) -> int | None:
    """The tile size of a model already wrapped with ``tile_loss(model, tokens)`` (``None``: not wrapped)."""
    forward = model.__dict__.get("forward")
    if isinstance(forward, functools.partial) and forward.func is _loss_forward:
        return forward.args[1]
    return None


def apply_techniques(model, tech: TrainerTechniques, group, args) -> TrainerTechniques:
    """Apply ``tech`` to ``model`` (in place) for the sequence-parallel ``group``; returns what runs, with the tile of
    a model the user wrapped with ``tile_loss`` before the Trainer (re-wrapped here over the Trainer's group).

    Raises:
        ValueError: ``tile_loss`` on an MoE model that returns its router loss; remat/offloaded checkpoints with
            ``TrainingArguments(activation_checkpointing=True)`` (``Trainer.train`` would turn transformers' own
            checkpointing on over distattn's).
    """
    if tech.checkpointing and getattr(args, "activation_checkpointing", getattr(args, "gradient_checkpointing", 0)):
        raise ValueError("SequenceParallelTrainer(remat=/offload_checkpoints=) checkpoints the decoder layers itself; "
                         "TrainingArguments(activation_checkpointing=True) would replace it with transformers' own "
                         "when train() starts: set activation_checkpointing=False (or drop remat/offload_checkpoints "
                         "to use transformers' checkpointing, its offload included)")
    tokens = tech.tile_loss if tech.tile_loss is not None else loss_tile_of(model)
    if tokens is not None and outputs_router_logits(model):
        raise ValueError(f"tile_loss with {type(model).__name__}'s router loss (output_router_logits=True) is not "
                         f"supported: the tiled head runs the base model, whose router logits it does not return; "
                         f"drop tile_loss or build the model with output_router_logits=False")
    if tokens is not None:
        tile_loss(model, tokens, group)
        tech = TrainerTechniques(tile_loss=tokens, tile_mlp=tech.tile_mlp, remat=tech.remat,
                                 offload_checkpoints=tech.offload_checkpoints)
    if tech.tile_mlp is not None:
        tile_mlp(model, tech.tile_mlp)
    if tech.offload_checkpoints:
        offload_checkpoints(model, remat=tech.remat)
    elif tech.remat:
        enable_remat_checkpointing(model)
    return tech



def refuse_ignored_fsdp(args, fsdp_enabled: bool) -> None:
    """Raise when ``TrainingArguments(fsdp=...)`` asks for FSDP but accelerate set none up: accelerate (1.15,
    ``AcceleratorState``) turns FSDP on only for multi-accelerator runs; on CPU (gloo, ``DistributedType.MULTI_CPU``)
    it keeps DDP and drops the ``fsdp`` arguments silently, so no parameter, gradient or optimizer state would be
    sharded or offloaded as asked."""
    if getattr(args, "fsdp", None) and not fsdp_enabled:
        raise ValueError(f"TrainingArguments(fsdp={args.fsdp!r}) asks for FSDP, but accelerate did not set it up "
                         f"(it runs FSDP on GPUs/accelerators only; on CPU it trains with DDP and ignores fsdp): on "
                         f"CPU drop fsdp/fsdp_config; on GPUs launch with torchrun as usual")

# -- the gradient rule on accelerate's wrapper ----------------------------------------------------------------------
def _fsdp2_module():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    return FSDPModule


def reduce_over_group(model, group, world_size: int, done) -> object:
    """Make the wrapper of ``model`` sum the gradients over ``group`` and average them over the replicas, once.

    ``model`` is what ``Trainer`` hands ``training_step``: ``DistributedDataParallel`` (``torchrun``), a model sharded
    by FSDP2 (``TrainingArguments(fsdp=..., fsdp_config={"fsdp_version": 2})``: its modules are ``FSDPModule``s), or
    either inside ``torch.compile``'s ``OptimizedModule`` (``torch_compile=True``). ``done``: what the previous call
    returned (the wrapper already set up). Returns the wrapper now set up.

    Raises:
        TypeError: another wrapper (FSDP1, DeepSpeed), whose reduction distattn cannot make a sum over the group.
    """
    from torch.nn.parallel import DistributedDataParallel

    inner = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule around the DDP (or the model)
    if inner is done:
        return done
    fsdp2 = _fsdp2_module()
    if isinstance(inner, DistributedDataParallel):
        register_ddp_gradient_hook(inner, group)
        return inner
    if fsdp2 is not None and any(isinstance(m, fsdp2) for m in inner.modules()):
        set_fsdp_gradient_divide_factor(inner, group)  # FSDP2: plain sums, divided by the replicas
        return inner
    if world_size > 1:
        raise TypeError(f"SequenceParallelTrainer supports DistributedDataParallel (Trainer's wrapper under torchrun) "
                        f"and FSDP2 (fsdp_config={{'fsdp_version': 2}}), but the model is wrapped in "
                        f"{type(inner).__name__}: run without FSDP1/DeepSpeed (for those, see "
                        f"distattn.set_fsdp_gradient_divide_factor and the (loss * P) rule)")
    return done

