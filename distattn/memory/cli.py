"""``python -m distattn.memory plan``: the planner's command line (the tables of ``distattn.memory.plan``).

``--gpu-mem`` defaults to what the GPU reports (``torch.cuda.mem_get_info``'s total) when one is present, else to the
real capacity of ``--gpu`` (default ``h100``: 79.65 GiB; an "80GB" H100 SXM reports 81,559 MiB, ``nvidia-smi``); the
plan fits that less ``--reserve`` (the CUDA context, cuBLAS workspaces, NCCL's communicators, allocator slack: not in
the byte model).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

from distattn.memory.executor import ATTENTION_SCHEDULES
from distattn.memory.model import PRECISIONS, PRESETS, ModelSpec, get_preset, spec_from_hf_config, steady_state_bytes
from distattn.memory.plan import (GIB, RESERVE_GIB, STRATEGY_NAMES, Cluster, combos, longest_sequence, longest_with,
                                  runner_up, strategies_for, weigh, why_not)
from distattn.memory.techniques import host_limit_bytes

__all__ = ["main", "EXIT_BAD_ARGS", "GPUS"]

EXIT_BAD_ARGS = 2
GPUS = {"h100": 81559 / 1024, "h200": 143771 / 1024, "a100-80gb": 81920 / 1024, "a100-40gb": 40960 / 1024}
"""GiB each GPU reports as its total memory (``nvidia-smi``'s MiB): what an "80GB" card really has."""


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
    q.add_argument("--gpu-mem", type=float, help="GiB per GPU (default: the total this machine's GPU reports, else "
                   "--gpu's real capacity)")
    q.add_argument("--gpu", default="h100", choices=sorted(GPUS), help="the GPU when none is present and --gpu-mem is "
                   "not given (default h100: 79.65 GiB, the 81,559 MiB an 80GB H100 SXM reports)")
    q.add_argument("--schedule", default="balanced", choices=ATTENTION_SCHEDULES + ("auto",),
                   help="the attention schedule whose executor buffers the technique rows count (default balanced, as "
                   "launch/train.py; auto: the one that fits the longest sequence, per row)")
    q.add_argument("--partials", default="fp32", choices=("fp32", "input", "auto"),
                   help="dtype of the executor's partial results (DistAttnConfig.partials; default fp32; auto: both)")
    q.add_argument("--reserve", type=float, default=RESERVE_GIB, help="GiB per GPU kept free (CUDA context, NCCL, "
                   f"allocator slack; default {RESERVE_GIB:g}, as launch/train.py's --gpu-reserve): the plan fits "
                   "--gpu-mem less this")
    q.add_argument("--batch", type=int, default=1, help="sequences per step")
    q.add_argument("--precision", default="bf16", choices=[x for x in PRECISIONS if x != "fp16"],
                   help="bf16: FSDP2 mixed precision (bf16 compute, fp32 sharded parameters: launch/train.py on "
                   "CUDA); amp-bf16: fp32 parameters under autocast (DDP); fp32")
    q.add_argument("--strategy", action="append", choices=STRATEGY_NAMES + ("auto",),
                   help="rows to print (repeatable; default: all); auto: the cheapest technique combination that "
                   "fits --seq-len (or the longest sequence when --seq-len is not given)")
    q.add_argument("--seq-len", type=int, help="with --strategy auto: the sequence length to fit")
    q.add_argument("--host-mem", type=float, default=2048.0, help="GiB of host memory per node (default 2048)")
    q.add_argument("--gpus-per-node", type=int,
                   help="GPUs per node sharing its host memory (default: DISTATTN_GPUS_PER_NODE, else the node size "
                   "of DISTATTN_LINK's links file, else 8)")
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


def _gpu_mem(args) -> tuple[float, str]:
    """GiB per GPU and where the number comes from: --gpu-mem, this machine's GPU, or --gpu's preset."""
    if args.gpu_mem is not None:
        return args.gpu_mem, "--gpu-mem"
    try:
        import torch

        if torch.cuda.is_available():
            total = torch.cuda.mem_get_info()[1] / GIB
            return total, f"reported by {torch.cuda.get_device_name()}"
    except (ImportError, RuntimeError):
        pass
    return GPUS[args.gpu], f"{args.gpu}'s reported total"


def _plan(args) -> str:
    args.gpu_mem, args.gpu_mem_source = _gpu_mem(args)
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
             f"{args.gpus} GPU x {args.gpu_mem:.2f} GiB ({args.gpu_mem_source}; {args.reserve:g} reserved), batch "
             f"{args.batch}, {args.precision}"
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


def _node_size(args) -> int:
    """``--gpus-per-node``, else the node size the links assume (``DISTATTN_GPUS_PER_NODE``, a links file's, 8)."""
    if args.gpus_per_node is None:
        from distattn.schedule.cluster import cluster_from_env

        args.gpus_per_node = cluster_from_env().gpus_per_node
    return args.gpus_per_node


def _cluster_from_args(args, limit: float) -> Cluster:
    _node_size(args)
    for name in ("loss_tile", "mlp_tile", "gpus_per_node"):
        if getattr(args, name) < 1:
            raise _Usage(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.host_mem <= 0 or args.link_gbps <= 0 or args.tflops <= 0:
        raise _Usage("--host-mem, --link-gbps and --tflops must be positive")
    per_node = min(args.gpus, args.gpus_per_node)  # a 1-GPU job has its node's host memory to itself
    return Cluster(args.gpus, limit, host_limit_bytes(args.host_mem, per_node), args.link_gbps * 1e9,
                   args.tflops * 1e12)


TILE_SEARCH = (1024, 2048, 4096, 8192, 16384)
"""Tile sizes ``--strategy auto`` weighs for the loss and the MLP (besides --loss-tile/--mlp-tile)."""


def _attention_options(args) -> tuple[tuple, tuple]:
    schedules = ATTENTION_SCHEDULES if args.schedule == "auto" else (args.schedule,)
    partials = ("fp32", "input") if args.partials == "auto" else (args.partials,)
    return schedules, partials


def _longest_over(model, base, cluster, args, schedules, partials):
    """The longest result of ``base`` over the attention options (ties: the first, balanced fp32 before others)."""
    best = None
    for schedule in schedules:
        for part in partials:
            res = longest_with(model, replace(base, schedule=schedule, partials=part), cluster, batch=args.batch,
                               precision=args.precision)
            best = res if best is None or res.seq > best.seq else best
    return best


def _technique_rows(args, model: ModelSpec, cluster: Cluster) -> list[str]:
    """One row per combination of checkpointing and long-sequence techniques (issue 22)."""
    schedules, partials = _attention_options(args)
    lines = [f"long-sequence techniques: host {args.host_mem:g} GiB per node of {args.gpus_per_node} GPUs "
             f"({cluster.host_bytes / GIB:.0f} GiB per GPU here, pinned blocks rounded up to powers of two), "
             f"loss/MLP tiles {args.loss_tile}/{args.mlp_tile} tokens, attention {'/'.join(schedules)} with "
             f"{'/'.join(partials)} partials, link {args.link_gbps:g} GB/s, {args.tflops:g} TFLOP/s per GPU",
             f"{'combination':62s} {'max seq':>8s} {'bound':>11s} {'peak/GPU':>8s} {'host/GPU':>8s} "
             f"{'recompute':>9s} {'offload/step':>12s} {'copy/compute':>12s}  dominant at the peak"]
    best = None
    for combo in combos(args.loss_tile, args.mlp_tile):
        res = _longest_over(model, combo, cluster, args, schedules, partials)
        if res.peak is None:
            lines.append(f"{res.combo.label:62s} {'-':>8s} {res.bound:>11s}")
            continue
        p = res.peak
        lines.append(f"{res.combo.label:62s} {_fmt_tokens(res.seq):>8s} {res.bound:>11s} {p.total / GIB:7.1f}G "
                     f"{p.host_total / GIB:7.0f}G {p.recompute_flops / (p.flops - p.recompute_flops):8.0%} "
                     f"{p.traffic / GIB:10.1f}G {res.traffic_vs_compute(cluster):11.2f}x  "
                     f"{p.dominant} {p.parts[p.dominant] / GIB:.1f} GiB ({_short(p.moment)})")
        best = res if best is None or res.seq > best.seq else best
    if best is not None:
        p = best.peak
        lines.append(f"longest: {_fmt_tokens(best.seq)} tokens ({best.seq:,}) with {best.combo.label} (bound: "
                     f"{best.bound}); its peak {p.total / GIB:.2f} GiB {p.moment}: "
                     + ", ".join(f"{k} {v / GIB:.2f}" for k, v in p.parts.items()) + " GiB; host "
                     + ", ".join(f"{k} {v / GIB:.1f}" for k, v in p.host.items()) + " GiB")
        lines.append("recompute is extra FLOPs over forward + backward; copy/compute is the offload copies' time over "
                     "the step's compute time (> 1: they cannot hide)")
    return lines


def _short(moment: str) -> str:
    return moment.split(" (")[0]


def _auto(args, model: ModelSpec, cluster: Cluster) -> str:
    """``--strategy auto``: the cheapest combination that fits ``--seq-len`` (else the longest sequence), weighing
    every attention schedule, both partial dtypes and the tile sizes of ``TILE_SEARCH``."""
    schedules, partials = ATTENTION_SCHEDULES, ("fp32", "input")
    tiles = tuple(sorted({*TILE_SEARCH, args.loss_tile})), tuple(sorted({*TILE_SEARCH, args.mlp_tile}))
    seq = args.seq_len
    if seq is None:
        best = max((longest_with(model, c, cluster, batch=args.batch, precision=args.precision)
                    for c in combos(*tiles, schedules=schedules, partials=partials)), key=lambda r: r.seq)
        if best.peak is None:
            raise _Usage(f"{model.name}: nothing fits {args.gpus} GPU(s) of {args.gpu_mem:g} GiB")
        seq = best.seq
    if seq < 1 or seq % args.gpus:
        raise _Usage(f"--seq-len ({seq}) must be a positive multiple of --gpus ({args.gpus})")
    attention = _attention_times(args, model, seq)
    if attention is not None:
        schedules = tuple(s for s in schedules if s in attention)
    options = weigh(model, seq, cluster, loss_tile=tiles[0], mlp_tile=tiles[1], batch=args.batch,
                    precision=args.precision, schedules=schedules, partials=partials, attention=attention)
    if not options[0].fits:
        raise _Usage(f"{model.name}: no combination fits {_fmt_tokens(seq)} tokens on {args.gpus} GPU(s) of "
                     f"{args.gpu_mem:g} GiB with {cluster.host_bytes / GIB:.0f} GiB of host memory per GPU; "
                     f"use more GPUs or a shorter sequence")
    win = options[0]
    combo, peak = win.combo, win.peak
    second = runner_up(options)
    why = (f"runner-up {second.combo.label} (schedule {second.combo.schedule}, partials {second.combo.partials}): "
           f"{why_not(win, second)}") if second else "nothing else fits"
    return (f"auto for {model.name} at {_fmt_tokens(seq)} tokens on {args.gpus} GPU(s): {combo.label} "
            f"(schedule {combo.schedule}, partials {combo.partials}); searched: schedules {', '.join(schedules)}, "
            f"partials fp32/input, loss and MLP tiles {', '.join(map(str, TILE_SEARCH))}; why: the least modelled "
            f"time (recomputation, exposed offload copies, the cost model's attention time: {win.recompute_s:.3g} + "
            f"{win.copies_s:.3g} + {win.attention_s:.3g} s per step) among the combinations that fit; {why}; peak "
            f"{peak.total / GIB:.1f} GiB per GPU (mostly {peak.dominant}, {peak.moment}), host "
            f"{peak.host_total / GIB:.0f} GiB per GPU, recompute "
            f"{peak.recompute_flops / (peak.flops - peak.recompute_flops):.0%}, offload {peak.traffic / GIB:.1f} GiB "
            f"per step")


def _attention_times(args, model: ModelSpec, seq: int):
    """``{schedule: cost-model Candidate}`` of one layer's attention at ``seq`` tokens on ``--gpus`` ranks (dense
    causal, bf16 inputs; NVLink inside nodes of ``--gpus-per-node``, ``DISTATTN_LINK``: ``ib`` (default) or
    ``nvlink`` across, or a links file, ``distattn.schedule.cluster.cluster_from_env``); ``None`` on one GPU."""
    if args.gpus == 1:
        return None
    from distattn.schedule.cluster import cluster_from_env
    from distattn.schedule.cost import choose
    from distattn.schedule.sim import Shapes

    lay = model.layer
    shapes = Shapes(batch=args.batch, seq_per_rank=seq // args.gpus, heads_q=lay.heads, heads_kv=lay.kv_heads,
                    head_dim=lay.head_dim, dtype_bytes=2)
    links = cluster_from_env(gpus_per_node=_node_size(args))
    choice = choose(args.gpus, shapes, causal=True, cluster=links, allow=set(ATTENTION_SCHEDULES), ulysses=1)
    return {c.schedule: c for c in choice.candidates if c.runnable}


def _plot(args, model, results, limit) -> str:
    import distattn.memory.plot as plot  # the room, not the package face

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
