"""``launch/train.py --memory auto``: the planner's cheapest combination for the job's ``--seq-len``, applied.

The planner (``distattn.memory.plan.choose``) weighs remat or offloaded checkpoints, the tiled loss and MLP and
optimizer offload; this module asks it for what fits this GPU (``--gpu-mem``, else the device's memory) and this
node's host memory (``--host-mem``, else MemAvailable), sets the flags, and refuses (``UsageError``, before the
process group exists) a length nothing fits. It also gives ``train_memory`` the byte model of the techniques a job
runs with, so a job with offload or tiles is checked against what it really keeps on the GPU.
"""

from __future__ import annotations

import torch

from train_config import RunConfig, UsageError

GIB = 1 << 30
TILE = 4096  # tokens per loss/MLP tile: the loss tile's working set at V = 128K is ~4 GiB fp32 at most


def techniques(cfg: RunConfig):
    """The job's ``distattn.memory.techniques.Techniques``."""
    from distattn.memory.techniques import Techniques

    a = cfg.args
    return Techniques(loss_tile=a.tile_loss, mlp_tile=a.tile_mlp, offload_checkpoints=a.offload_checkpoints,
                      offload_optimizer=a.offload_optimizer)


def uses_techniques(cfg: RunConfig) -> bool:
    a = cfg.args
    return bool(a.tile_loss or a.tile_mlp or a.offload_checkpoints or a.offload_optimizer)


def technique_peak(cfg: RunConfig, config, precision: str, shard: int):
    """``TechniquePeak`` of one step of this job (checkpointing: remat, or layer-boundary when offloaded)."""
    from distattn.memory import model_spec
    from distattn.memory.techniques import technique_peak as peak

    a = cfg.args
    strategy = "remat" if a.remat else ("full" if a.offload_checkpoints else "none")
    return peak(model_spec(config), a.batch_size, a.seq_len, sp=cfg.sp_size, shard=shard, precision=precision,
                strategy=strategy, tech=techniques(cfg))


def apply_auto(cfg: RunConfig, config, precision: str, *, ddp: bool = False) -> str:
    """``--memory auto``: set the flags of the planner's pick; returns a line for the log."""
    from distattn.memory import model_spec
    from distattn.memory.plan import Cluster, choose
    from distattn.offload import host_memory_available

    a = cfg.args
    if a.gpu_mem is not None:  # the memory to plan for, as given
        gpu = a.gpu_mem * GIB
    elif cfg.device_type == "cuda":  # the device's, less what the byte model leaves out (context, fragmentation)
        gpu = torch.cuda.get_device_properties(cfg.cuda_index).total_memory / cfg.ranks_per_gpu - GIB
    else:
        raise UsageError("--memory auto on CPU needs --gpu-mem GIB (the memory to plan for)")
    host = (a.host_mem * GIB if a.host_mem is not None else host_memory_available()) / cfg.env.local_world_size
    cluster = Cluster(cfg.sp_size, gpu, int(host))
    # what train.py runs: remat with or without offload, layer-boundary checkpointing only when offloaded
    # (and optimizer offload only under FSDP2)
    runnable = lambda c: ((c.strategy == "remat" or c.tech.offload_checkpoints)  # noqa: E731
                          and not (ddp and c.tech.offload_optimizer))
    pick = choose(model_spec(config), a.seq_len, cluster, loss_tile=a.tile_loss or TILE, mlp_tile=a.tile_mlp or TILE,
                  batch=a.batch_size, precision=precision, allow=runnable)
    if pick is None:
        raise UsageError(f"--memory auto: nothing fits --seq-len {a.seq_len} on {cfg.sp_size} rank(s) of "
                         f"{gpu / GIB:.1f} GiB with {host / GIB:.0f} GiB of host memory each (python -m distattn.memory "
                         f"plan --model ... shows each combination's longest sequence); use more ranks or a shorter "
                         f"--seq-len")
    combo, peak = pick
    t = combo.tech
    a.remat = combo.strategy == "remat"
    a.tile_loss, a.tile_mlp = t.loss_tile, t.mlp_tile
    a.offload_checkpoints, a.offload_optimizer = t.offload_checkpoints, t.offload_optimizer
    return (f"--memory auto: {combo.label} (predicted peak {peak.total / GIB:.2f} GiB per rank, host "
            f"{peak.host_total / GIB:.2f} GiB)")
