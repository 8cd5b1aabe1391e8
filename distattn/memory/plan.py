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

import argparse
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from distattn.memory.model import (PRECISIONS, PRESETS, ModelSpec, StepPeak, get_preset, spec_from_hf_config,
                                   steady_state_bytes, step_peak)
from distattn.memory.techniques import Techniques, TechniquePeak, host_limit_bytes, technique_peak

__all__ = ["Strategy", "STRATEGY_NAMES", "strategies_for", "longest_sequence", "predicted_peak_bytes", "check_fits",
           "main"]

GIB = 2 ** 30
EXIT_BAD_ARGS = 2
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


@dataclass(frozen=True)
class Combo:
    """A checkpointing strategy with a set of techniques."""

    strategy: str
    tech: Techniques

    @property
    def label(self) -> str:
        return f"{self.strategy} ckpt" + ("" if self.tech.label() == "none" else f" + {self.tech.label()}")


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


def combos(loss_tile: int, mlp_tile: int) -> list[Combo]:
    """Every combination the planner weighs: full or remat checkpointing, with or without each technique."""
    out = []
    for strategy in ("full", "remat"):
        for tiles in (False, True):
            for off_ckpt in (False, True):
                for off_opt in (False, True):
                    out.append(Combo(strategy, Techniques(loss_tile=loss_tile if tiles else None,
                                                          mlp_tile=mlp_tile if tiles else None,
                                                          offload_checkpoints=off_ckpt, offload_optimizer=off_opt)))
    return out


def combo_peak(model: ModelSpec, combo: Combo, seq: int, *, gpus: int, batch: int = 1, precision: str = "bf16"
               ) -> TechniquePeak:
    return technique_peak(model, batch, seq, sp=gpus, shard=gpus, precision=precision, strategy=combo.strategy,
                          tech=combo.tech)


def longest_with(model: ModelSpec, combo: Combo, cluster: Cluster, *, batch: int = 1, precision: str = "bf16"
                 ) -> ComboResult:
    """The longest sequence (a multiple of ``2 * 64 * gpus``) whose device peak and host bytes both fit."""
    unit = 2 * 64 * cluster.gpus

    def check(k):
        peak = combo_peak(model, combo, k * unit, gpus=cluster.gpus, batch=batch, precision=precision)
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


def choose(model: ModelSpec, seq: int, cluster: Cluster, *, loss_tile: int, mlp_tile: int, batch: int = 1,
           precision: str = "bf16", allow=None) -> tuple[Combo, TechniquePeak] | None:
    """The cheapest combination (least recomputation and exposed traffic) that fits ``seq``; ``None``: none fits.

    ``allow``: a predicate on ``Combo`` (e.g. what a launcher can run)."""
    fitting = []
    for combo in combos(loss_tile, mlp_tile):
        if allow is not None and not allow(combo):
            continue
        peak = combo_peak(model, combo, seq, gpus=cluster.gpus, batch=batch, precision=precision)
        if peak.total <= cluster.gpu_bytes and peak.host_total <= cluster.host_bytes:
            fitting.append((cost(ComboResult(combo, seq, peak, ""), cluster), combo, peak))
    if not fitting:
        return None
    # ties (copies that hide behind compute): less traffic, then fewer techniques
    _, combo, peak = min(fitting, key=lambda f: (f[0], f[2].traffic, f[1].tech.label().count(",")))
    return combo, peak


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


# -- command line ---------------------------------------------------------------------------------------
class _Usage(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _Usage(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m distattn.memory", description="Memory planning for long-sequence training.")
    sub = p.add_subparsers(dest="command")
    q = sub.add_parser("plan", help="the longest sequence each strategy fits")
    q.error = p.error
    q.add_argument("--model", default="llama-7b", help=f"a preset ({', '.join(PRESETS)}), a Hugging Face checkpoint "
                   "directory (its config.json, as launch/train.py --model DIR) or a config.json path")
    for flag in ("hidden", "layers", "heads", "ffn", "vocab"):
        q.add_argument(f"--{flag}", type=int, help=f"override the preset's {flag}")
    q.add_argument("--gqa", type=int, help="key/value heads (overrides the preset)")
    q.add_argument("--gpus", type=int, default=8)
    q.add_argument("--gpu-mem", type=float, default=80.0, help="GiB per GPU")
    q.add_argument("--reserve", type=float, default=1.0, help="GiB per GPU kept free (allocator slack, NCCL; "
                   "default 1): the plan fits --gpu-mem less this")
    q.add_argument("--batch", type=int, default=1, help="sequences per step")
    q.add_argument("--precision", default="bf16", choices=[x for x in PRECISIONS if x != "fp16"],
                   help="bf16: FSDP2 mixed precision (bf16 compute, fp32 sharded parameters: launch/train.py on "
                   "CUDA); amp-bf16: fp32 parameters under autocast (DDP); fp32")
    q.add_argument("--strategy", action="append", choices=STRATEGY_NAMES + ("auto",),
                   help="rows to print (repeatable; default: all); auto: the cheapest technique combination that "
                   "fits --seq-len (or the longest sequence when --seq-len is not given)")
    q.add_argument("--seq-len", type=int, help="with --strategy auto: the sequence length to fit")
    q.add_argument("--host-mem", type=float, default=2048.0, help="GiB of host memory per node (default 2048)")
    q.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node sharing its host memory (default 8)")
    q.add_argument("--loss-tile", type=int, default=4096, help="tokens per tile of the tiled loss (default 4096)")
    q.add_argument("--mlp-tile", type=int, default=4096, help="tokens per tile of the tiled MLP (default 4096)")
    q.add_argument("--link-gbps", type=float, default=50.0,
                   help="host-device GB/s per GPU and direction, for the offload traffic (default 50: PCIe 5 x16)")
    q.add_argument("--tflops", type=float, default=400.0,
                   help="sustained TFLOP/s per GPU for the step's compute (default 400: ~40%% of an H100's bf16)")
    q.add_argument("--tp", type=int, help="tensor-parallel degree of the Megatron baseline (default: min(gpus, 8, "
                   "kv heads))")
    q.add_argument("--chunked-loss", action="store_true", help="the head and loss run in sequence chunks")
    q.add_argument("--plot", help="write memory vs sequence length per strategy to this image (matplotlib)")
    return p


def _model_from_args(args) -> ModelSpec:
    path = name = Path(args.model)
    if path.is_dir():  # a Hugging Face checkpoint directory, as launch/train.py --model DIR takes
        if not (path / "config.json").is_file():
            raise _Usage(f"--model {args.model}: the directory has no config.json; give a Hugging Face checkpoint "
                         f"directory, its config.json, or a preset ({', '.join(PRESETS)})")
        path = path / "config.json"
    if path.suffix == ".json" or path.is_file():
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise _Usage(f"cannot read HF config {args.model!r}: {e}") from None
        spec = spec_from_hf_config(cfg, name=name.stem)  # a directory's name, or the file's
    else:
        spec = get_preset(args.model)
    layer = spec.layer
    changes = {k: v for k, v in (("hidden", args.hidden), ("heads", args.heads), ("ffn", args.ffn),
                                 ("kv_heads", args.gqa)) if v is not None}
    if args.heads is not None and args.gqa is None:
        changes["kv_heads"] = args.heads
    if changes:
        layer = replace(layer, **changes)
    return replace(spec, layer=layer, layers=args.layers or spec.layers, vocab=args.vocab or spec.vocab)


def _fmt_params(n: int) -> str:
    """6738415616 -> '6.74 B', 12345678 -> '12.3 M', 52000 -> '52.0 K', 700 -> '700' (decimal, as model cards)."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            x = n / scale
            return f"{x:.2f} {unit}" if x < 10 else f"{x:.1f} {unit}" if x < 100 else f"{x:.0f} {unit}"
    return str(n)


def _fmt_tokens(n: int) -> str:
    if n < 1024:
        return str(n)
    return f"{n / 1024:.0f}K" if n < 1 << 20 else f"{n / (1 << 20):.2f}M"


def _plan(args) -> str:
    if args.gpus < 1 or args.gpu_mem <= 0 or args.batch < 1:
        raise _Usage(f"--gpus ({args.gpus}), --gpu-mem ({args.gpu_mem}) and --batch ({args.batch}) must be positive")
    model = _model_from_args(args)
    limit = (args.gpu_mem - args.reserve) * GIB
    if limit <= 0:
        raise _Usage(f"--gpu-mem {args.gpu_mem:g} GiB leaves nothing after --reserve {args.reserve:g} GiB (kept free "
                     f"per GPU for allocator slack and NCCL): give each GPU's whole memory in GiB (e.g. --gpu-mem 80) "
                     f"or a smaller --reserve (e.g. --reserve 0)")
    tp = args.tp or max(1, math.gcd(min(args.gpus, 8), model.layer.kv_heads))
    if args.gpus % tp or model.layer.kv_heads % tp:
        raise _Usage(f"--tp {tp} must divide --gpus ({args.gpus}) and the key/value heads ({model.layer.kv_heads})")
    steady = sum(steady_state_bytes(model, shard=args.gpus).values())
    if steady > limit and not args.strategy:  # only the technique rows (optimizer offload) can fit it
        cluster = _cluster_from_args(args, limit)
        return "\n".join([f"{model.name}: weights, gradients and AdamW states alone need {steady / GIB:.1f} GiB per "
                          f"GPU sharded over {args.gpus} GPU(s): only optimizer offload fits", "",
                          *_technique_rows(args, model, cluster)])
    if steady > limit and "auto" not in (args.strategy or ()):
        raise _Usage(f"{model.name}: weights, gradients and AdamW states alone need {steady / GIB:.1f} GiB per GPU "
                     f"sharded over {args.gpus} GPUs, more than the {limit / GIB:.1f} GiB available per GPU "
                     f"({args.gpu_mem:g} GiB less --reserve {args.reserve:g}); use more GPUs or GPUs with more "
                     f"memory")
    cluster = _cluster_from_args(args, limit)
    if args.strategy and "auto" in args.strategy:
        return _auto(args, model, cluster)
    names = args.strategy or STRATEGY_NAMES
    lines = [f"{model.name}: {_fmt_params(model.params)} parameters, {model.layers} layers, "
             f"hidden {model.layer.hidden}, "
             f"heads {model.layer.heads}/{model.layer.kv_heads}, ffn {model.layer.ffn}, vocab {model.vocab}; "
             f"{args.gpus} GPU x {args.gpu_mem:g} GiB ({args.reserve:g} reserved), batch {args.batch}, {args.precision}"
             + (", chunked loss" if args.chunked_loss else ""),
             f"{'strategy':44s} {'GPUs':>4s} {'max seq':>9s} {'per GPU':>9s} {'peak/GPU':>9s}  dominant at the peak"]
    results = []
    for strat in strategies_for(args.gpus, tp, names):
        seq, peak = longest_sequence(model, strat, limit, batch=args.batch, precision=args.precision,
                                     chunked_loss=args.chunked_loss)
        results.append((strat, seq))
        if peak is None:
            need = sum(steady_state_bytes(model, shard=strat.shard, tp=strat.tp, opt_shard=strat.opt_shard,
                                          half_params=strat.precision == "bf16").values())
            lines.append(f"{strat.label:44s} {strat.gpus:4d} {'-':>9s} {'-':>9s} {'-':>9s}  does not fit: weights+grads"
                         f"+adam alone {need / GIB:.1f} GiB")
            continue
        per_gpu = seq // (strat.sp * strat.tp) if strat.name.startswith("megatron") else seq // strat.sp
        dom = peak.dominant
        lines.append(f"{strat.label:44s} {strat.gpus:4d} {_fmt_tokens(seq):>9s} {_fmt_tokens(per_gpu):>9s} "
                     f"{peak.total / GIB:8.1f}G  {dom} {peak.parts[dom] / GIB:.1f} GiB ({peak.moment})")
    if args.plot:
        lines.append(_plot(args, model, results, limit))
    if not args.strategy:
        lines += ["", *_technique_rows(args, model, cluster)]
    return "\n".join(lines)


def _cluster_from_args(args, limit: float) -> Cluster:
    for name in ("loss_tile", "mlp_tile", "gpus_per_node"):
        if getattr(args, name) < 1:
            raise _Usage(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.host_mem <= 0 or args.link_gbps <= 0 or args.tflops <= 0:
        raise _Usage("--host-mem, --link-gbps and --tflops must be positive")
    per_node = min(args.gpus, args.gpus_per_node)  # a 1-GPU job has its node's host memory to itself
    return Cluster(args.gpus, limit, host_limit_bytes(args.host_mem, per_node), args.link_gbps * 1e9,
                   args.tflops * 1e12)


def _technique_rows(args, model: ModelSpec, cluster: Cluster) -> list[str]:
    """One row per combination of checkpointing and long-sequence techniques (issue 22)."""
    lines = [f"long-sequence techniques: host {args.host_mem:g} GiB per node of {args.gpus_per_node} GPUs "
             f"({cluster.host_bytes / GIB:.0f} GiB per GPU here), loss/MLP tiles {args.loss_tile}/{args.mlp_tile} "
             f"tokens, link {args.link_gbps:g} GB/s, {args.tflops:g} TFLOP/s per GPU",
             f"{'combination':62s} {'max seq':>8s} {'bound':>11s} {'peak/GPU':>8s} {'host/GPU':>8s} "
             f"{'recompute':>9s} {'offload/step':>12s} {'copy/compute':>12s}"]
    best = None
    for combo in combos(args.loss_tile, args.mlp_tile):
        res = longest_with(model, combo, cluster, batch=args.batch, precision=args.precision)
        if res.peak is None:
            lines.append(f"{combo.label:62s} {'-':>8s} {res.bound:>11s}")
            continue
        p = res.peak
        lines.append(f"{combo.label:62s} {_fmt_tokens(res.seq):>8s} {res.bound:>11s} {p.total / GIB:7.1f}G "
                     f"{p.host_total / GIB:7.0f}G {p.recompute_flops / (p.flops - p.recompute_flops):8.0%} "
                     f"{p.traffic / GIB:10.1f}G {res.traffic_vs_compute(cluster):11.2f}x")
        best = res if best is None or res.seq > best.seq else best
    if best is not None:
        lines.append(f"longest: {_fmt_tokens(best.seq)} tokens with {best.combo.label} (bound: {best.bound}); "
                     f"recompute is extra FLOPs over forward + backward; copy/compute is the offload copies' time over "
                     f"the step's compute time (> 1: they cannot hide)")
    return lines


def _auto(args, model: ModelSpec, cluster: Cluster) -> str:
    """``--strategy auto``: the cheapest combination that fits ``--seq-len`` (else the longest sequence)."""
    seq = args.seq_len
    if seq is None:
        best = max((longest_with(model, c, cluster, batch=args.batch, precision=args.precision)
                    for c in combos(args.loss_tile, args.mlp_tile)), key=lambda r: r.seq)
        if best.peak is None:
            raise _Usage(f"{model.name}: nothing fits {args.gpus} GPU(s) of {args.gpu_mem:g} GiB")
        seq = best.seq
    if seq < 1 or seq % args.gpus:
        raise _Usage(f"--seq-len ({seq}) must be a positive multiple of --gpus ({args.gpus})")
    pick = choose(model, seq, cluster, loss_tile=args.loss_tile, mlp_tile=args.mlp_tile, batch=args.batch,
                  precision=args.precision)
    if pick is None:
        raise _Usage(f"{model.name}: no combination fits {_fmt_tokens(seq)} tokens on {args.gpus} GPU(s) of "
                     f"{args.gpu_mem:g} GiB with {cluster.host_bytes / GIB:.0f} GiB of host memory per GPU; "
                     f"use more GPUs or a shorter sequence")
    combo, peak = pick
    return (f"auto for {model.name} at {_fmt_tokens(seq)} tokens on {args.gpus} GPU(s): {combo.label}; peak "
            f"{peak.total / GIB:.1f} GiB per GPU (mostly {peak.dominant}), host {peak.host_total / GIB:.0f} GiB per "
            f"GPU, recompute {peak.recompute_flops / (peak.flops - peak.recompute_flops):.0%}, offload "
            f"{peak.traffic / GIB:.1f} GiB per step")


def _plot(args, model, results, limit) -> str:
    from distattn.memory import plot

    top = max([seq for _, seq in results] + [8192]) * 4
    lines = plot.curves([strat for strat, _ in results], model, batch=args.batch, precision=args.precision,
                        chunked_loss=args.chunked_loss, top=top)
    title = (f"{model.name} on {args.gpus} x {args.gpu_mem:g} GiB ({limit / GIB:g} GiB usable after --reserve "
             f"{args.reserve:g}), {args.precision}, batch {args.batch}: predicted by distattn.memory, not measured")
    return plot.write(args.plot, lines, limit / GIB, title)


def main(argv=None) -> int:
    try:
        args = _parser().parse_args(argv)
        if args.command != "plan":
            raise _Usage("a command is required: plan (python -m distattn.memory plan --help)")
        print(_plan(args))
        return 0
    except (_Usage, ValueError, TypeError) as e:
        print(f"distattn.memory: error: {e}", file=sys.stderr)
        return EXIT_BAD_ARGS
