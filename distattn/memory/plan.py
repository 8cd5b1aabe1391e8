"""Plan a long-sequence training run: the longest sequence each strategy fits into N GPUs of M GiB.

    python -m distattn.memory plan --model llama-7b --gpus 8 --gpu-mem 80
    python -m distattn.memory plan --model path/to/config.json --gpus 16 --gpu-mem 40 --strategy remat --plot m.png

Strategies (rows): distattn sequence parallelism over all GPUs (FSDP-sharded weights, grads and AdamW states)
without checkpointing, with full checkpointing at layer inputs, and with distattn's remat checkpointing; for
comparison Megatron-style tensor + sequence parallelism of degree ``--tp`` (selective and full recomputation,
FlashAttention, bf16 parameters and fp32 gradients split ``tp`` ways, fp32 master weights and AdamW states also
sharded over the data-parallel rest by the distributed optimizer; extra data-parallel GPUs do not lengthen the
sequence) and one GPU with
FlashAttention and full checkpointing. The peak per GPU is ``distattn.memory.model.step_peak`` (training
step peak: steady state + saved activations + the largest transient).

For ``launch/train.py``: :func:`predicted_peak_bytes` and :func:`check_fits`.
"""

from __future__ import annotations

from dataclasses import dataclass

from distattn.memory.model import ModelSpec, StepPeak, get_preset, spec_from_hf_config, step_peak
from distattn.memory.techniques import host_limit_bytes  # noqa: F401  (handed on: callers read it here)
from distattn.memory.techniques import Techniques, TechniquePeak, technique_peak

__all__ = ["Strategy", "STRATEGY_NAMES", "strategies_for", "longest_sequence", "predicted_peak_bytes", "check_fits",
           "Option", "weigh", "choose", "runner_up", "why_not"]

GIB = 2 ** 30
MAX_SEQ = 1 << 27


@dataclass(frozen=True)
class Strategy:
    """One way to lay a training step out on the GPUs."""

    name: str
    label: str
    gpus: int
    impl: str
    strategy: str
    sp: int = 1
    tp: int = 1
    shard: int = 1
    opt_shard: int = 1
    precision: str | None = None
    """Overrides the run's precision (Megatron: bf16 parameters, fp32 master weights in the optimizer)."""

    @property
    def seq_unit(self) -> int:
        """Sequence lengths are multiples of this (2 chunks per rank for the balanced causal schedule)."""
        return 2 * self.sp * self.tp * 64

    def peak(self, model: ModelSpec, seq: int, batch: int, precision: str, chunked_loss: bool) -> StepPeak:
        if self.impl == "distattn" and not chunked_loss and (self.precision or precision) == "bf16":
            # FSDP2 (launch/train.py): its root, head gradient and reduce-scatter buffers and the attention executor's
            # own buffers (the balanced schedule, launch/train.py's default) counted: technique_peak with no technique
            return technique_peak(model, batch, seq, sp=self.sp, shard=self.shard, precision="bf16",
                                  strategy=self.strategy, impl="distattn")
        return step_peak(model, batch, seq, impl=self.impl, precision=self.precision or precision,
                         strategy=self.strategy, sp=self.sp, tp=self.tp, shard=self.shard, opt_shard=self.opt_shard,
                         half_params=self.name.startswith("megatron"), chunked_loss=chunked_loss)


STRATEGY_NAMES = ("none", "full", "remat", "megatron", "megatron-full", "single")


def strategies_for(gpus: int, tp: int, names=STRATEGY_NAMES) -> list[Strategy]:
    out = {
        "none": Strategy("none", f"distattn SP={gpus}, no checkpointing", gpus, "distattn", "none", sp=gpus,
                         shard=gpus),
        "full": Strategy("full", f"distattn SP={gpus}, full checkpointing", gpus, "distattn", "full", sp=gpus,
                         shard=gpus),
        "remat": Strategy("remat", f"distattn SP={gpus}, remat checkpointing", gpus, "distattn", "remat", sp=gpus,
                          shard=gpus),
        "megatron": Strategy("megatron", f"Megatron TP+SP={tp}, selective recompute", gpus, "sdpa", "selective", tp=tp,
                             opt_shard=gpus // tp, precision="bf16"),
        "megatron-full": Strategy("megatron-full", f"Megatron TP+SP={tp}, full recompute", gpus, "sdpa", "full", tp=tp,
                                  opt_shard=gpus // tp, precision="bf16"),
        "single": Strategy("single", "1 GPU FlashAttention, full checkpointing", 1, "sdpa", "full"),
    }
    return [out[n] for n in names]


def longest_sequence(model: ModelSpec, strat: Strategy, limit_bytes: float, *, batch: int = 1,
                     precision: str = "bf16", chunked_loss: bool = False) -> tuple[int, StepPeak | None]:
    """The longest total sequence (a multiple of ``strat.seq_unit``) whose step peak fits ``limit_bytes``
    per GPU, and that peak; ``(0, None)`` if not even one unit fits."""
    unit = strat.seq_unit
    fits = lambda k: strat.peak(model, k * unit, batch, precision, chunked_loss).total <= limit_bytes  # noqa: E731
    if not fits(1):
        return 0, None
    lo, hi = 1, 2
    while hi * unit <= MAX_SEQ and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * unit, strat.peak(model, lo * unit, batch, precision, chunked_loss)


RESERVE_GIB = 2.0
"""GiB per GPU kept out of every plan by default, the planner's ``--reserve`` and ``launch/train.py``'s
``--gpu-reserve`` alike (assumed, not measured here): the CUDA context and cuBLAS workspaces (~0.5 GiB with CUDA 12),
NCCL's buffers for the job's communicators (FSDP2's group and distattn's two point-to-point groups; NCCL_BUFFSIZE is
4 MiB per channel, peer and protocol, NVIDIA/nccl#864 reports 1.6 GB for one communicator) and the caching
allocator's fragmentation, none of which the byte model counts."""


# -- technique combinations (issue 22) -------------------------------------------------------------------
@dataclass(frozen=True)
class Cluster:
    """What bounds a combination besides GPU memory: the host's memory and link, and the GPUs' rate."""

    gpus: int
    gpu_bytes: float
    """Usable bytes per GPU (``--gpu-mem`` less ``--reserve``)."""
    host_bytes: int
    """Host bytes per GPU (a node's ``--host-mem`` over the GPUs of the job on that node)."""
    link_bytes_s: float = 50e9
    """Host-device bytes per second per GPU, each direction (PCIe 5 x16: ~50 GB/s measured by peers)."""
    flops_s: float = 400e12
    """Sustained bf16 FLOP/s per GPU for the step's compute (H100: ~40% of 989 TFLOP/s dense)."""
    pinned: bool = True
    """Offloaded bytes live in pinned host memory (CUDA), each block rounded up to a power of two."""
    shard: int = 0
    """Ranks that shard weights, gradients and AdamW states (FSDP2; 1: DDP); 0: ``gpus``."""


@dataclass(frozen=True)
class Combo:
    """A checkpointing strategy with a set of techniques."""

    strategy: str
    tech: Techniques
    schedule: str = "balanced"
    """The attention schedule (``DistAttnConfig.schedule``): its executor's buffers are in the step's peak."""
    partials: str = "fp32"
    """``DistAttnConfig.partials``: the dtype of the partial results the executor sends back."""

    @property
    def label(self) -> str:
        attn = self.schedule + (", partials in the input dtype" if self.partials == "input" else "")
        return f"{self.strategy} ckpt" + ("" if self.tech.label() == "none" else f" + {self.tech.label()}") + \
            ("" if attn == "balanced" else f" [{attn}]")


@dataclass(frozen=True)
class ComboResult:
    combo: Combo
    seq: int
    peak: TechniquePeak | None
    bound: str
    """What stops a longer sequence: ``GPU memory`` or ``host memory``."""

    def traffic_vs_compute(self, cluster: Cluster) -> float:
        """Time the offload copies take over the step's compute time (> 1: they cannot hide behind it)."""
        if self.peak is None or not self.peak.traffic:
            return 0.0
        return (self.peak.traffic / 2 / cluster.link_bytes_s) / (self.peak.flops / cluster.flops_s)


def combos(loss_tile, mlp_tile, *, schedules=("balanced",), partials=("fp32",)) -> list[Combo]:
    """Every combination the planner weighs: full or remat checkpointing, with or without each technique, for each
    attention schedule and partial dtype; ``loss_tile``/``mlp_tile``: a tile size or a sequence of them to search."""
    as_tuple = lambda x: tuple(x) if isinstance(x, (tuple, list)) else (x,)  # noqa: E731
    tile_pairs = [(lt, mt) for lt in as_tuple(loss_tile) for mt in as_tuple(mlp_tile)]
    out = []
    for schedule in schedules:
        for part in partials:
            for strategy in ("full", "remat"):
                for tiles in [None] + tile_pairs:
                    for off_ckpt in (False, True):
                        for off_opt in (False, True):
                            tech = Techniques(loss_tile=tiles[0] if tiles else None,
                                              mlp_tile=tiles[1] if tiles else None,
                                              offload_checkpoints=off_ckpt, offload_optimizer=off_opt)
                            out.append(Combo(strategy, tech, schedule, part))
    return out


def combo_peak(model: ModelSpec, combo: Combo, seq: int, *, gpus: int, batch: int = 1, precision: str = "bf16",
               pinned: bool = True, shard: int = 0) -> TechniquePeak:
    return technique_peak(model, batch, seq, sp=gpus, shard=shard or gpus, precision=precision, strategy=combo.strategy,
                          tech=combo.tech, schedule=combo.schedule, partials=combo.partials, pinned=pinned)


def longest_with(model: ModelSpec, combo: Combo, cluster: Cluster, *, batch: int = 1, precision: str = "bf16"
                 ) -> ComboResult:
    """The longest sequence (a multiple of ``2 * 64 * gpus``) whose device peak and host bytes both fit."""
    unit = 2 * 64 * cluster.gpus

    def check(k):
        peak = combo_peak(model, combo, k * unit, gpus=cluster.gpus, batch=batch, precision=precision,
                          pinned=cluster.pinned)
        if peak.total > cluster.gpu_bytes:
            return "GPU memory", peak
        return ("host memory", peak) if peak.host_total > cluster.host_bytes else (None, peak)

    if check(1)[0] is not None:
        return ComboResult(combo, 0, None, check(1)[0])
    lo, hi = 1, 2
    while hi * unit <= MAX_SEQ and check(hi)[0] is None:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if check(mid)[0] is None else (lo, mid)
    bound = check(hi)[0] or "the planner's ceiling"
    return ComboResult(combo, lo * unit, check(lo)[1], bound)


def cost(result: ComboResult, cluster: Cluster) -> float:
    """Seconds a step spends beyond forward + backward: recomputation, plus offload copies that do not hide."""
    p = result.peak
    recompute = p.recompute_flops / cluster.flops_s
    compute = (p.flops - p.recompute_flops) / cluster.flops_s
    exposed = max(0.0, p.traffic / 2 / cluster.link_bytes_s - compute)
    return recompute + exposed


@dataclass(frozen=True)
class Option:
    """One combination weighed at one sequence length: its peak, what it lacks, and its modelled step seconds."""

    combo: Combo
    peak: TechniquePeak
    gpu_short: int
    """Bytes of the device peak over the cluster's ``gpu_bytes`` (0: it fits)."""
    host_short: int
    """Host bytes (pinned blocks rounded as allocated) over the cluster's ``host_bytes`` (0: it fits)."""
    recompute_s: float
    """Seconds of recomputation per step (checkpointing, tiles; attention's forward is in ``attention_s``)."""
    copies_s: float
    """Seconds of offload copies per step that do not hide behind compute."""
    attention_s: float = 0.0
    """Seconds of the step's attention calls with this schedule (``distattn.schedule.cost``; 0: not weighed)."""
    attention: object = None
    """The cost model's ``Candidate`` of this schedule (per layer), when weighed."""

    @property
    def fits(self) -> bool:
        return not (self.gpu_short or self.host_short)

    @property
    def seconds(self) -> float:
        return self.recompute_s + self.copies_s + self.attention_s

    @property
    def techniques(self) -> int:
        t = self.combo.tech
        return sum(x not in (None, False) for x in (t.loss_tile, t.mlp_tile, t.offload_checkpoints,
                                                      t.offload_optimizer))

    def order(self) -> tuple:
        """Cheapest first; ties: fewer bytes moved to the host, fewer techniques, larger tiles (fewer launches, not
        modelled), a lower peak, then the schedules' fixed order (``distattn.schedule.cost.TIE_ORDER``)."""
        from distattn.schedule.cost import TIE_ORDER

        t = self.combo.tech
        sched = TIE_ORDER.index(self.combo.schedule) if self.combo.schedule in TIE_ORDER else len(TIE_ORDER)
        return (round(self.seconds, 9), self.peak.traffic, self.techniques, -(t.loss_tile or 0), -(t.mlp_tile or 0),
                self.peak.total, sched, self.combo.partials)


def weigh(model: ModelSpec, seq: int, cluster: Cluster, *, loss_tile, mlp_tile, batch: int = 1,
          precision: str = "bf16", allow=None, schedules=("balanced",), partials=("fp32",), attention=None
          ) -> list[Option]:
    """Every combination (``combos``; ``allow``: a predicate on ``Combo``) at ``seq``: those that fit first, cheapest
    first (``Option.order``), then the others, closest first (fewest bytes short on device and host together).

    ``attention``: ``{schedule: cost-model Candidate}`` (per layer, ``distattn.schedule.cost.predict``) to weigh the
    schedules by their attention time (with full checkpointing the attention forward runs twice); ``None``: the
    schedules differ only in their executors' buffers (the peak)."""
    from distattn.memory.techniques import step_flops

    att_flops = step_flops(model, batch, seq, cluster.gpus)[1] * model.layers
    out = []
    for combo in combos(loss_tile, mlp_tile, schedules=schedules, partials=partials):
        if allow is not None and not allow(combo):
            continue
        peak = combo_peak(model, combo, seq, gpus=cluster.gpus, batch=batch, precision=precision,
                          pinned=cluster.pinned, shard=cluster.shard)
        recompute, copies = peak.recompute_flops / cluster.flops_s, 0.0
        copies = cost(ComboResult(combo, seq, peak, ""), cluster) - recompute
        att_s, cand = 0.0, None
        if attention is not None:
            cand = attention[combo.schedule]
            again = combo.strategy == "full"  # full checkpointing recomputes the layer, attention's forward too
            att_s = model.layers * (cand.total + (cand.forward if again else 0.0))
            if again:  # counted once, by the cost model
                recompute -= att_flops / cluster.flops_s
        out.append(Option(combo, peak, max(0, int(peak.total - cluster.gpu_bytes)),
                          max(0, int(peak.host_total - cluster.host_bytes)), recompute, copies, att_s, cand))
    fitting = sorted((o for o in out if o.fits), key=Option.order)
    return fitting + sorted((o for o in out if not o.fits), key=lambda o: (o.gpu_short + o.host_short, o.order()))


def choose(model: ModelSpec, seq: int, cluster: Cluster, *, loss_tile, mlp_tile, batch: int = 1,
           precision: str = "bf16", allow=None, schedules=("balanced",), partials=("fp32",), attention=None
           ) -> tuple[Combo, TechniquePeak] | None:
    """The cheapest combination (least recomputation and exposed traffic, and attention time when ``attention`` is
    given) that fits ``seq``; ``None``: none fits. Arguments as :func:`weigh`."""
    options = weigh(model, seq, cluster, loss_tile=loss_tile, mlp_tile=mlp_tile, batch=batch, precision=precision,
                    allow=allow, schedules=schedules, partials=partials, attention=attention)
    if not options or not options[0].fits:
        return None
    return options[0].combo, options[0].peak


def runner_up(options: list[Option]) -> Option | None:
    """The best fitting option after the first that is not the same choice with other tile sizes or partials (the
    cost model's attention time is the fp32 partials'; the partials' dtype is an accuracy choice, fp32 first)."""
    win = options[0]

    def same(o):  # the choice without its tile sizes and partials
        c, t = o.combo, o.combo.tech
        return c.strategy, c.schedule, t.loss_tile is None, t.mlp_tile is None, t.offload_checkpoints, \
            t.offload_optimizer

    return next((o for o in options[1:] if o.fits and same(o) != same(win)), None)


def why_not(win: Option, other: Option) -> str:
    """Why ``other`` lost to ``win`` (both fit), in a few words: the part of the modelled time that separates them,
    else the tie-break that did."""
    if round(other.seconds, 9) > round(win.seconds, 9):
        diffs = {"recompute": other.recompute_s - win.recompute_s, "copies": other.copies_s - win.copies_s,
                 "attention": other.attention_s - win.attention_s}
        key = max(diffs, key=diffs.get)
        head = f"{other.seconds - win.seconds:.3g} s more per step"
        if key == "recompute":
            return (f"{head}: it recomputes {other.peak.recompute_flops / 1e12:.3g} vs "
                    f"{win.peak.recompute_flops / 1e12:.3g} TFLOP")
        if key == "copies":
            return (f"{head}: its offload copies ({other.peak.traffic / GIB:.3g} GiB per step vs "
                    f"{win.peak.traffic / GIB:.3g}) do not hide behind compute")
        if other.combo.schedule == win.combo.schedule:  # the same schedule: full checkpointing runs it again
            return (f"{head}: full checkpointing runs attention's forward again in backward: {other.attention_s:.3g} "
                    f"vs {win.attention_s:.3g} s of attention per step")
        a, b = other.attention, win.attention
        moved = lambda c: (c.bytes_fwd + c.bytes_bwd) / 2 ** 20  # noqa: E731  (MiB, the busiest rank, per layer)
        return (f"{head}: its attention ({other.combo.schedule}) takes {other.attention_s:.3g} vs "
                f"{win.attention_s:.3g} s per step (the cost model, per layer: {moved(a):.4g} vs {moved(b):.4g} MiB "
                f"moved by the busiest rank, {a.compute * 1e3:.4g} vs {b.compute * 1e3:.4g} ms of compute)")
    if other.peak.traffic > win.peak.traffic:
        return (f"the same modelled time, more bytes moved: {other.peak.traffic / GIB:.3g} vs "
                f"{win.peak.traffic / GIB:.3g} GiB of offload copies per step")
    if other.techniques > win.techniques:
        return "the same modelled time with more techniques"
    if other.peak.total > win.peak.total:
        return (f"the same modelled time, a higher peak: {other.peak.total / GIB:.3g} vs "
                f"{win.peak.total / GIB:.3g} GiB")
    return "the same modelled time and peak: a tie, broken by the fixed order (balanced, zigzag, ring, placed)"


# -- for launch/train.py --------------------------------------------------------------------------------
def model_spec(model) -> ModelSpec:
    """A ``ModelSpec`` from a preset name, a LlamaConfig-field dict, an HF config or a ``ModelSpec``."""
    return _as_spec(model)


def _as_spec(model) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str):
        return get_preset(model)
    if isinstance(model, dict):
        return spec_from_hf_config(model)
    if hasattr(model, "to_dict"):  # a transformers PretrainedConfig
        return spec_from_hf_config(model.to_dict())
    raise TypeError(f"model must be a ModelSpec, a preset name, a config dict or an HF config, not "
                    f"{type(model).__name__}")


def predicted_peak_bytes(model, *, batch: int, seq_len: int, sp_size: int, shard_size: int = 1,
                         precision: str = "bf16", remat: bool = False, impl: str = "distattn",
                         chunked_loss: bool = False) -> StepPeak:
    """Predicted peak allocated bytes of one training step on one rank (``StepPeak.total``, ``.parts``).

    Args:
        model: a ``ModelSpec``, a preset name, a LlamaConfig-field dict (with ``vocab_size``) or an HF config.
        batch: sequences per step per data-parallel replica; seq_len: tokens per sequence (global).
        sp_size: ranks that split one sequence; shard_size: ranks that shard weights/grads/AdamW (FSDP; 1: DDP).
        precision: ``bf16`` (FSDP2 mixed precision: bf16 compute, fp32 parameters), ``amp-bf16`` (fp32
            parameters under bf16 autocast: DDP) or ``fp32``.
        remat: distattn's remat checkpointing (else no checkpointing).
    """
    spec = _as_spec(model)
    return step_peak(spec, batch, seq_len, impl=impl, precision=precision, strategy="remat" if remat else "none",
                     sp=sp_size, shard=shard_size, chunked_loss=chunked_loss)


def check_fits(model, *, device_bytes: int, reserve_bytes: int = 0, **kwargs) -> StepPeak:
    """``predicted_peak_bytes(model, **kwargs)``; raises ``ValueError`` (one line, with the fix) if it exceeds
    ``device_bytes - reserve_bytes``."""
    peak = predicted_peak_bytes(model, **kwargs)
    limit = device_bytes - reserve_bytes
    if peak.total > limit:
        raise ValueError(f"predicted peak {peak.total / GIB:.2f} GiB per rank (mostly {peak.dominant}: "
                         f"{peak.parts[peak.dominant] / GIB:.2f} GiB) exceeds the {limit / GIB:.2f} GiB available; "
                         f"use more sequence-parallel ranks, --remat, a shorter --seq-len or a smaller --batch-size")
    return peak

