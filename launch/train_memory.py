"""Memory of ``launch/train.py``: the predicted peak per rank before the first step, measured bytes after it.

The prediction is ``distattn.memory``'s byte model of one training step (steady state: parameters, gradients,
AdamW states, FSDP-sharded or not; saved activations per layer for the job's precision, sequence-parallel
degree and checkpointing; the largest transient, e.g. the fp32 logits at the start of backward). On CUDA a
configuration predicted not to fit the device is refused before anything is allocated (``--no-memory-check``
overrides). After the first step the JSON log gets the bytes the forward actually saved for backward
(``distattn.memory.saved_activations``) next to the model's prediction of them.
"""

from __future__ import annotations

import torch

import train_plan
from train_config import RunConfig, UsageError

_RESERVE = 1 << 30  # CUDA context, allocator fragmentation: not in the byte model
GIB = 1 << 30


def _precision(cfg: RunConfig) -> str:
    if cfg.dtype == torch.float32:
        return "fp32"
    # FSDP2 computes in bf16 with fp32 sharded parameters; DDP runs fp32 parameters under autocast
    return "amp-bf16" if cfg.args.shard == "ddp" else "bf16"


def _shard(cfg: RunConfig) -> int:
    return 1 if cfg.args.shard == "ddp" else cfg.env.world_size


def predicted_peak(cfg: RunConfig, config):
    """``distattn.memory.StepPeak`` of one step on one rank of this job (with tiles or offload: the techniques'
    byte model, ``distattn.memory.techniques``, whose peak has the same ``total``/``parts``/``dominant``)."""
    from distattn.memory import predicted_peak_bytes

    if train_plan.uses_techniques(cfg):
        return train_plan.technique_peak(cfg, config, _precision(cfg), _shard(cfg))
    return predicted_peak_bytes(config, batch=cfg.args.batch_size, seq_len=cfg.args.seq_len, sp_size=cfg.sp_size,
                                shard_size=_shard(cfg), precision=_precision(cfg), remat=cfg.args.remat)


def plan(cfg: RunConfig, config, log) -> None:
    """``--memory auto``: apply the planner's cheapest combination that fits (``train_plan``)."""
    if cfg.args.memory == "auto":
        log(train_plan.apply_auto(cfg, config, _precision(cfg), ddp=cfg.args.shard == "ddp"))


def check(cfg: RunConfig, config) -> None:
    """Refuse (UsageError, before the process group exists) a job predicted not to fit this rank's GPU."""
    if cfg.device_type != "cuda" or cfg.args.no_memory_check:
        return
    peak = predicted_peak(cfg, config)
    # gloo ranks sharing a GPU share its memory
    limit = torch.cuda.get_device_properties(cfg.cuda_index).total_memory // cfg.ranks_per_gpu - _RESERVE
    if peak.total > limit:
        raise UsageError(f"predicted peak {peak.total / GIB:.1f} GiB per rank (mostly {peak.dominant}: "
                         f"{peak.parts[peak.dominant] / GIB:.1f} GiB) does not fit the {limit / GIB:.1f} GiB of this "
                         f"GPU; use more ranks, --remat, a shorter --seq-len or a smaller --batch-size "
                         f"(python -m distattn.memory plan ... finds what fits), or --no-memory-check to try anyway")


def describe(cfg: RunConfig, config) -> str:
    peak = predicted_peak(cfg, config)
    return (f"predicted peak per rank {peak.total / GIB:.2f} GiB (mostly {peak.dominant}, "
            f"{peak.parts[peak.dominant] / GIB:.2f} GiB, {peak.moment})")


def predicted_activation_bytes(cfg: RunConfig, config) -> int:
    """The byte model's saved activations of one forward on one rank."""
    from distattn.memory import activation_bytes, model_spec

    return activation_bytes(model_spec(config), cfg.args.batch_size, cfg.args.seq_len, impl="distattn",
                            precision=_precision(cfg), strategy="remat" if cfg.args.remat else "none", sp=cfg.sp_size)
