"""``launch/train.py --memory auto``: the planner's cheapest way to fit the job's ``--seq-len``, applied.

The planner (``distattn.memory.plan.weigh``) weighs remat or offloaded checkpoints, the tiled loss and MLP (tile
sizes searched: ``TILE_SEARCH``), optimizer offload and the attention schedule (balanced, zigzag, ring; placed when
the job packs documents) against this GPU (``--gpu-mem``, else what the device reports less ``--gpu-reserve``) and
this node's host memory (``--host-mem``, else MemAvailable), ranks what fits by modelled step time (recomputation,
offload copies that do not hide, and the schedule's attention time from ``distattn.schedule.cost``), sets the flags
and says what it chose, its predicted peak, and the runner-up with why it lost. A length nothing fits is refused
(``UsageError``, before the process group exists, the same on every rank: every input is deterministic) naming the
closest fit and what it lacks. It also gives ``train_memory`` the byte model of the techniques a job runs with.
"""

from __future__ import annotations

import torch

from distattn.memory.plan import RESERVE_GIB  # one default for the planner and this job
from train_config import RunConfig, UsageError

GIB = 1 << 30
TILE_SEARCH = (1024, 2048, 4096, 8192, 16384)  # tokens per loss/MLP tile weighed (tiles past the shard are one tile)


def techniques(cfg: RunConfig):
    """The job's ``distattn.memory.techniques.Techniques``."""
    from distattn.memory.techniques import Techniques

    a = cfg.args
    return Techniques(loss_tile=a.tile_loss, mlp_tile=a.tile_mlp, offload_checkpoints=a.offload_checkpoints,
                      offload_optimizer=a.offload_optimizer)


def uses_techniques(cfg: RunConfig) -> bool:
    a = cfg.args
    return bool(a.tile_loss or a.tile_mlp or a.offload_checkpoints or a.offload_optimizer)


def technique_peak(cfg: RunConfig, config, precision: str, shard: int, *, pinned: bool = True):
    """``TechniquePeak`` of one step of this job (checkpointing: remat, or layer-boundary when offloaded; the job's
    attention schedule; ``pinned``: host blocks rounded up to powers of two, as PyTorch's pinned allocator does)."""
    from distattn.memory import model_spec
    from distattn.memory.techniques import technique_peak as peak

    a = cfg.args
    strategy = "remat" if a.remat else ("full" if a.offload_checkpoints else "none")
    schedule = a.schedule if a.schedule in ("balanced", "zigzag", "ring", "placed") else "balanced"
    return peak(model_spec(config), a.batch_size, a.seq_len, sp=cfg.sp_size, shard=shard, precision=precision,
                strategy=strategy, tech=techniques(cfg), schedule=schedule, pinned=pinned)


def gpu_budget(cfg: RunConfig) -> tuple[float, str]:
    """Bytes per rank to plan for and where the number comes from: ``--gpu-mem`` as given, else the device's total
    (``get_device_properties``: the same on every rank of a job of one GPU model, unlike the free memory) less
    ``--gpu-reserve``, shared by the gloo ranks on one GPU. CPU: ``--gpu-mem`` is needed."""
    a = cfg.args
    if a.gpu_mem is not None:
        return a.gpu_mem * GIB, "--gpu-mem"
    if cfg.device_type != "cuda":
        raise UsageError("--memory auto on CPU needs --gpu-mem GIB (the memory to plan for)")
    props = torch.cuda.get_device_properties(cfg.cuda_index)
    reserve = RESERVE_GIB if a.gpu_reserve is None else a.gpu_reserve
    per = f" over {cfg.ranks_per_gpu} ranks" if cfg.ranks_per_gpu > 1 else ""
    return ((props.total_memory - reserve * GIB) / cfg.ranks_per_gpu,
            f"{props.name}'s {props.total_memory / GIB:.2f} GiB less {reserve:g} reserved{per}")


def _attention(cfg: RunConfig, config, dataset):
    """``(schedules, {schedule: cost-model Candidate} or None)``: the schedules ``--memory auto`` weighs. A given
    ``--schedule`` is kept; ``auto`` (the default with ``--memory auto``): balanced, ring, zigzag (``--seq-len`` a
    multiple of twice the sequence-parallel size) and, with ``--pack``, placed on the first batch's documents (as
    ``train_config.resolve_schedule``), each with its attention time from ``distattn.choose_schedule``."""
    import distattn

    a = cfg.args
    if a.schedule != "auto":
        return (a.schedule,), None
    if cfg.sp_size == 1:
        return ("balanced",), None
    allow, cu, total, batch = {"balanced", "ring"}, None, a.seq_len, a.batch_size
    if a.seq_len % (2 * cfg.sp_size) == 0:
        allow.add("zigzag")
    if a.pack and dataset is not None:
        positions = dataset.batch(0, a.batch_size)[1].flatten()  # the batch's samples are one stream
        total, batch = positions.numel(), 1
        cu = (positions == 0).nonzero().flatten().tolist() + [total]
        allow.add("placed")
    heads_q = config.num_attention_heads
    heads_kv = getattr(config, "num_key_value_heads", None) or heads_q
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads_q
    choice = distattn.choose_schedule(cfg.sp_size, heads_q, heads_kv, head_dim, total // cfg.sp_size, batch=batch,
                                      dtype=cfg.dtype, allow=allow, ulysses=cfg.ulysses, cu_seqlens=cu)
    found = {c.schedule: c for c in choice.candidates if c.runnable}
    return tuple(s for s in ("balanced", "zigzag", "ring", "placed") if s in found), found


def _describe(option) -> str:
    c = option.combo
    tech = c.tech.label()
    return f"{c.strategy} ckpt" + ("" if tech == "none" else f" + {tech}") + f", schedule {c.schedule}"


def _closest(option, gpu: float, host: float, pinned: bool) -> str:
    from distattn.offload import format_bytes

    p = option.peak
    lacks = []
    if option.gpu_short:
        lacks.append(f"peak {format_bytes(p.total)} per rank, {format_bytes(option.gpu_short)} short on the device")
    else:
        lacks.append(f"peak {format_bytes(p.total)} per rank fits")
    if option.host_short:
        rounded = " (pinned blocks rounded up to powers of two)" if pinned else ""
        lacks.append(f"host {format_bytes(p.host_total)} per rank{rounded}, {format_bytes(option.host_short)} short")
    return f"closest: {_describe(option)}: " + ", ".join(lacks)


def apply_auto(cfg: RunConfig, config, precision: str, *, ddp: bool = False, dataset=None) -> str:
    """``--memory auto``: set the flags of the planner's pick; returns a line for the log."""
    from distattn.memory import model_spec
    from distattn.memory.plan import Cluster, runner_up, weigh, why_not
    from distattn.offload import format_bytes, host_memory_available

    a = cfg.args
    gpu, source = gpu_budget(cfg)
    host = (a.host_mem * GIB if a.host_mem is not None else host_memory_available()) / cfg.env.local_world_size
    pinned = cfg.device_type == "cuda"  # CPU offload uses plain host memory: nothing to round
    cluster = Cluster(cfg.sp_size, gpu, int(host), pinned=pinned, shard=1 if ddp else cfg.env.world_size)
    shard_tokens = a.seq_len // cfg.sp_size
    tiles = [(t,) if t else tuple(sorted({min(x, shard_tokens) for x in TILE_SEARCH})) for t in (a.tile_loss,
                                                                                                a.tile_mlp)]
    schedules, attention = _attention(cfg, config, dataset)
    # what train.py runs: remat with or without offload, layer-boundary checkpointing only when offloaded
    # (and optimizer offload only under FSDP2)
    runnable = lambda c: ((c.strategy == "remat" or c.tech.offload_checkpoints)  # noqa: E731
                          and not (ddp and c.tech.offload_optimizer))
    options = weigh(model_spec(config), a.seq_len, cluster, loss_tile=tiles[0], mlp_tile=tiles[1],
                    batch=a.batch_size, precision=precision, allow=runnable, schedules=schedules,
                    attention=attention)
    if not options[0].fits:
        raise UsageError(f"--memory auto: nothing fits --seq-len {a.seq_len} on {cfg.sp_size} rank(s) of "
                         f"{format_bytes(gpu)} ({source}) with {format_bytes(host)} of host memory each; "
                         f"{_closest(options[0], gpu, host, pinned)}; use more ranks, a shorter --seq-len or more "
                         f"memory (python -m distattn.memory plan --model ... shows each combination's longest "
                         f"sequence)")
    win = options[0]
    combo, peak = win.combo, win.peak
    t = combo.tech
    a.remat = combo.strategy == "remat"
    a.tile_loss, a.tile_mlp = t.loss_tile, t.mlp_tile
    a.offload_checkpoints, a.offload_optimizer = t.offload_checkpoints, t.offload_optimizer
    a.schedule = combo.schedule
    second = runner_up(options)
    why = f"runner-up {_describe(second)}: {why_not(win, second)}" if second else "nothing else fits"
    sizes = "/".join(map(str, sorted(set(tiles[0]) | set(tiles[1]))))
    searched = f"weighed {len(options)} combinations: tiles {sizes}, schedules {'/'.join(schedules)}"
    return (f"--memory auto: {_describe(win)} (predicted peak {peak.total / GIB:.2f} of {gpu / GIB:.2f} GiB per rank, "
            f"{source}; host {peak.host_total / GIB:.2f} of {host / GIB:.2f} GiB; modelled {win.seconds:.3g} s per "
            f"step of recomputation {win.recompute_s:.3g}, exposed copies {win.copies_s:.3g}, attention "
            f"{win.attention_s:.3g}); {why}; {searched}")
