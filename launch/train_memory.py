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

GIB = 1 << 30


def _precision(cfg: RunConfig) -> str:
    if cfg.dtype == torch.float32:
        return "fp32"
    # FSDP2 computes in bf16 with fp32 sharded parameters; DDP runs fp32 parameters under autocast
    return "amp-bf16" if cfg.args.shard == "ddp" else "bf16"


def _shard(cfg: RunConfig) -> int:
    return 1 if cfg.args.shard == "ddp" else cfg.env.world_size


def predicted_peak(cfg: RunConfig, config):
    """The step's device peak on one rank of this job, as it will run (``step_prediction``: the accounting the JSON
    summary reports and ``bench/step_memory.py`` holds to a measurement, with or without techniques)."""
    return step_prediction(cfg, config)


def plan(cfg: RunConfig, config, log, dataset=None) -> None:
    """``--memory auto``: apply the planner's cheapest combination that fits (``train_plan``; ``dataset``: the first
    batch's documents place the ``placed`` schedule when the job packs)."""
    if cfg.args.memory == "auto":
        log(train_plan.apply_auto(cfg, config, _precision(cfg), ddp=cfg.args.shard == "ddp", dataset=dataset))


def host_bytes(cfg: RunConfig, config) -> dict[str, int]:
    """Host bytes one rank of this job offloads at their peak, by kind: ``step_prediction``'s, the planner's
    accounting (on CUDA each pinned block rounded up to a power of two, as PyTorch's pinned allocator allocates it,
    and the checkpoints' blocks beside the optimizer's; in plain memory the larger of the two moments)."""
    a = cfg.args
    if not (a.offload_checkpoints or a.offload_optimizer):
        return {}
    host = step_prediction(cfg, config).host
    names = {"checkpoints": "checkpoints", "weights (pinned)": "optimizer params", "grads (pinned)": "optimizer grads",
             "adam": "AdamW states"}
    return {names.get(k, k): host[k] for k in sorted(host, key=lambda k: k != "checkpoints") if host[k]}


def check(cfg: RunConfig, config) -> None:
    """Refuse (UsageError, before the process group exists) a job predicted not to fit this rank's GPU."""
    if cfg.device_type != "cuda" or cfg.args.no_memory_check:
        return
    peak = predicted_peak(cfg, config)
    # gloo ranks sharing a GPU share its memory
    reserve = (train_plan.RESERVE_GIB if cfg.args.gpu_reserve is None else cfg.args.gpu_reserve) * GIB
    limit = (torch.cuda.get_device_properties(cfg.cuda_index).total_memory - reserve) // cfg.ranks_per_gpu
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


# -- the whole step's accounting: the byte model and the measure that is held to it (issue 36) --------------------
def _strategy(cfg: RunConfig) -> str:
    a = cfg.args
    return "remat" if a.remat else ("full" if a.offload_checkpoints else "none")


def expected_mode(cfg: RunConfig) -> str:
    """How ``train_model.shard`` will hold the parameters (before the process group exists): ``fsdp2``/``ddp``/``none``
    (FSDP2 assumed possible with ``--shard auto``)."""
    a = cfg.args
    if a.offload_optimizer:
        return "fsdp2"
    if cfg.env.world_size == 1:
        return "none" if cfg.dtype == torch.float32 else "fsdp2"
    return "ddp" if a.shard == "ddp" else "fsdp2"


def step_prediction(cfg: RunConfig, config, mode: str | None = None):
    """``distattn.memory.techniques.TechniquePeak`` of one step of this job, as it runs (``mode``: how the parameters
    are held; default ``expected_mode``): the device peak, its moment and parts, the host bytes."""
    from distattn.memory import model_spec
    from distattn.memory.techniques import Techniques, technique_peak

    a = cfg.args
    mode = mode or expected_mode(cfg)
    tech = Techniques(loss_tile=a.tile_loss, mlp_tile=a.tile_mlp, offload_checkpoints=a.offload_checkpoints,
                      offload_optimizer=a.offload_optimizer)
    schedule = a.schedule if a.schedule in ("balanced", "zigzag", "ring") else "balanced"
    return technique_peak(model_spec(config), a.batch_size, a.seq_len, sp=cfg.sp_size,
                          shard=cfg.env.world_size if mode == "fsdp2" else 1, precision=_precision(cfg),
                          strategy=_strategy(cfg), tech=tech, schedule=schedule, pinned=cfg.device_type == "cuda",
                          mode=mode, device=cfg.device_type)


def optimizer_tensors(optimizer) -> list:
    """The optimizer's state tensors (AdamW's moments and step counts)."""
    return [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]


def host_tensors(model, optimizer, cfg: RunConfig):
    """Two callables naming what this job keeps in host memory now, for ``distattn.memory.tiers.step_bytes``: ``host``,
    the checkpoints ``distattn.offload`` holds (``--offload-checkpoints``); ``host_compute``, with
    ``--offload-optimizer``, the parameter shards, their gradients and AdamW's states (FSDP2's ``CPUOffloadPolicy``:
    the optimizer steps on the CPU, so what it computes from them is host memory too). Pinned storages are host."""
    from distattn.offload import CheckpointOffload

    offloads = list({id(h.__self__): h.__self__ for m in model.modules() for h in m._forward_pre_hooks.values()
                     if isinstance(getattr(h, "__self__", None), CheckpointOffload)}.values())

    def host():
        return [t for off in offloads for ref in off._records if ref() is not None for t in ref().host]

    def host_compute():
        if not cfg.args.offload_optimizer:
            return []
        # the sharded parameters (DTensors); inside a forward or backward FSDP2 swaps in unsharded plain tensors,
        # which live on the device
        params = [p for p in model.parameters() if hasattr(p, "_local_tensor")]
        return params + [p.grad for p in params if p.grad is not None] + optimizer_tensors(optimizer)

    return host, host_compute


def prediction_fields(cfg: RunConfig, config, mode: str) -> dict:
    """The JSON summary's predicted side: the step's device peak, its moment, its host bytes (``step_prediction``)."""
    pred = step_prediction(cfg, config, mode)
    return {"predicted_peak_device_bytes": pred.total, "predicted_peak_host_bytes": pred.host_total,
            "predicted_peak_moment": pred.moment}


class StepMeasure:
    """The measured side of one step, from the same accounting as ``step_prediction``: on CUDA the allocator's
    ``max_memory_allocated``/``max_memory_reserved`` and the pinned host allocator's peak (``host_memory_stats``); on
    the CPU ``distattn.memory.tiers.step_bytes`` (device and host live bytes, the model's state counted). The largest
    over the job's ranks (one all-reduce at the end)."""

    def __init__(self, job):
        self.job, self.fields, self._mem = job, {}, None

    def __enter__(self):
        if self.job.cfg.device_type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            if hasattr(torch.cuda, "reset_peak_host_memory_stats"):
                torch.cuda.reset_peak_host_memory_stats()
            return self
        from distattn.memory.tiers import step_bytes

        model, optimizer = self.job.model, self.job.optimizer
        host, host_compute = host_tensors(model, optimizer, self.job.cfg)
        self._mem = step_bytes(host=host, host_compute=host_compute, model=model).__enter__()
        self._mem.count([list(model.parameters()), list(model.buffers()), optimizer_tensors(optimizer)])
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        if self._mem is not None:
            self._mem.__exit__(*exc)
            device, host, moment = self._mem.device_peak, self._mem.host_peak, str(self._mem.moment)
            reserved = device
        else:
            torch.cuda.synchronize()
            device, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
            stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
            host = int(stats.get("allocated_bytes.all.peak", stats.get("allocations.all.peak", 0)))
            moment = ""
        if exc[0] is not None:
            return False
        workspaces = cublas_workspace_bytes() if self._mem is None else 0
        peaks = torch.tensor([device, reserved, host, workspaces], dtype=torch.int64, device=self.job.device)
        if dist.is_initialized():
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        self.fields = {"measured_peak_device_bytes": int(peaks[0]), "measured_peak_reserved_bytes": int(peaks[1]),
                       "measured_peak_host_bytes": int(peaks[2]), "measured_peak_moment": moment,
                       "measured_cublas_workspace_bytes": int(peaks[3])}
        return False


def cublas_workspace_bytes() -> int:
    """The bytes the cuBLAS workspaces hold in the CUDA allocator (part of ``max_memory_allocated``; the byte model
    leaves them to the reserve): the allocated bytes freed by clearing them (the next GEMM makes them again). -1
    where this torch cannot clear them. The first GPU run measured the peak 88-138 MiB above the model's
    (``bench/results/gpu-2026-12-04``); this says how much of that the workspaces are."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return -1
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    clear()
    return int(before - torch.cuda.memory_allocated())
