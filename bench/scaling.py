"""Scaling benchmark: every method side by side, one torchrun job, a CSV + markdown table + PNG plots.

    python -m torch.distributed.run --nproc-per-node 8 --standalone bench/scaling.py \\
        --models llama-7b llama-gqa llama-33h --tokens-per-rank 4096 8192 16384 --find-max \\
        --out bench/results/scaling-8xGPU
    python -m torch.distributed.run --nproc-per-node 2 --standalone bench/scaling.py --smoke
        # CPU, gloo, tiny shapes: a CI smoke run, not a timing; writes runs/bench-smoke/scaling/ (ignored by
        # git; --out elsewhere is fine, never inside bench/results/)

For each model shape, workload (``attn``: the attention layer with its projections; ``layer``: a full LLaMA
decoder layer), tokens per rank and method (``bench/baselines``: megatron, ulysses, ring, balanced,
no_overlap; with ``--methods``, the real ones beside them: deepspeed-ulysses, megatron-core) it measures one
forward + backward: median time per iteration (slowest rank), model TFLOP/s
per rank (useful FLOPs: matmuls x3, attention core x3.5 fwd+bwd, causal halved -- padding not counted),
bytes each rank sent (the methods' own counters; max over ranks, next to ``bench/model.py``'s formula),
peak memory per rank (CUDA only), and with ``--find-max`` (CUDA only) the longest tokens per rank that
ran, doubling from the largest given. Methods that cannot run a shape (Ulysses when the library cannot
split the heads over the world size) get a row saying why. No activation checkpointing (one layer, forward + backward).
Without matplotlib the table and CSV are written and the plots are skipped (one line says so). On a
machine without CUDA the default models and sizes are the tiny ones (GPU-sized shapes would take hours).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record as _record_errors  # noqa: E402

import distattn.comm as dcomm  # noqa: E402
from bench._util import cpu_name, pyplot_or_note, smoke_out  # noqa: E402
from bench.baselines import METHODS, init_weights  # noqa: E402
from bench.baselines.deepspeed_ulysses import PEER_METHODS as _DS  # noqa: E402  (run only where installed)
from bench.baselines.megatron_core import PEER_METHODS as _MCORE  # noqa: E402  (run only where installed)
from bench.baselines import collectives  # noqa: E402
from bench.baselines.layers import flops_per_layer  # noqa: E402
from bench.peers.measure import count_bytes  # noqa: E402
from bench.model import MODELS, method_bytes  # noqa: E402
from distattn._plotstyle import figure_legend, same_values_note, style as plot_style, tight_with_legend  # noqa: E402

PEER_METHODS = {**_DS, **_MCORE}  # the real systems beside the home-made ones (bench/peers' one counter)

FIELDS = ["model", "workload", "world", "tokens_per_rank", "method", "status", "time_ms", "tflops_per_rank",
          "bytes_sent_max", "bytes_sent_mean", "model_bytes_max", "bytes_match", "peak_mem_mib"]
GPU_DEFAULTS = {"models": ["llama-7b", "llama-gqa", "llama-33h"], "tokens_per_rank": [4096, 8192]}
SMOKE = {"models": ["tiny-mha", "tiny-gqa", "tiny-odd"], "tokens_per_rank": [32, 64], "iters": 2, "warmup": 1}
CPU_BANNER = "**CPU smoke, not a performance number**: gloo on CPU, tiny shapes, fp32."
_BYTES_REL_TOL = 0.01


def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="results folder (CSV, markdown, PNGs); required except with "
                    "--smoke, whose default is runs/bench-smoke/scaling")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 2 iterations (CPU CI); never writes into "
                    "bench/results/")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS) + list(PEER_METHODS),
                    help="default: the home-made and distattn methods; deepspeed-ulysses is DeepSpeed's "
                    "DistributedAttention itself (the [peers] extra), megatron-core its SelfAttention and MLP with "
                    "TP + sequence parallel (installed beside it), their bytes from bench.peers' one counter")
    ap.add_argument("--models", nargs="+", default=None, choices=list(MODELS),
                    help=f"default {' '.join(GPU_DEFAULTS['models'])} on CUDA; the tiny ones on CPU")
    ap.add_argument("--workloads", nargs="+", default=["attn", "layer"], choices=["attn", "layer"])
    ap.add_argument("--tokens-per-rank", nargs="+", type=int, default=None,
                    help=f"default {' '.join(map(str, GPU_DEFAULTS['tokens_per_rank']))} on CUDA; "
                         f"{' '.join(map(str, SMOKE['tokens_per_rank']))} on CPU")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                    help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--backend", default=None, help="kernel backend for every method (default: best available)")
    ap.add_argument("--non-causal", action="store_true")
    ap.add_argument("--find-max", action="store_true", help="CUDA: double tokens per rank until a run fails")
    args = ap.parse_args(argv)
    if args.smoke:
        try:
            args.out = str(smoke_out("scaling", args.out))
        except ValueError as exc:
            ap.error(str(exc))
        args.models, args.tokens_per_rank = SMOKE["models"], SMOKE["tokens_per_rank"]
        args.iters, args.warmup = SMOKE["iters"], SMOKE["warmup"]
    elif args.out is None:
        ap.error("--out is required (a results folder, e.g. bench/results/scaling-8xGPU); "
                 "or use --smoke for a CPU check of the script")
    # GPU-sized shapes take hours on CPU: there the defaults are the tiny ones (explicit values are kept).
    defaults = GPU_DEFAULTS if torch.cuda.is_available() else SMOKE
    args.models = args.models or defaults["models"]
    args.tokens_per_rank = args.tokens_per_rank or defaults["tokens_per_rank"]
    return args


def _setup():
    cuda = torch.cuda.is_available()
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # ranks share the CPU cores
    dist.init_process_group("nccl" if cuda else "gloo")
    return device


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _one_iteration(method, fn, x, params, shape, dy, causal, backend):
    for t in params.values():
        t.grad = None
    x.grad = None
    y = fn(x, params, shape, causal=causal, backend=backend)
    y.backward(dy)


def _reduce(value: float, op) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=op)
    return t.item()


def measure(method_name, model, workload, n, args, device, dtype) -> dict:
    """One row: time, bytes, memory of ``method_name`` on ``model`` with ``n`` tokens per rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    shape, _ = MODELS[model]
    method = METHODS[method_name] if method_name in METHODS else PEER_METHODS[method_name]
    row = {"model": model, "workload": workload, "world": world, "tokens_per_rank": n, "method": method_name}
    try:
        method.check(shape, world)  # same answer on every rank, before any communication
    except ValueError as exc:
        return {**row, "status": str(exc).split(":")[0]}  # e.g. "Ulysses cannot run heads_q=3 on 2 ranks"
    causal = not args.non_causal
    params, _ = method.shard(init_weights(shape, seed=0, dtype=dtype, device=device), shape, rank, world)
    params = {k: v.detach().requires_grad_() for k, v in params.items()}
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, n, shape.hidden, generator=g).to(dtype).to(device).requires_grad_()
    dy = torch.randn(args.batch, n, shape.hidden, generator=g).to(dtype).to(device)
    fn = method.layer if workload == "layer" else method.attention
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.warmup):
        _one_iteration(method, fn, x, params, shape, dy, causal, args.backend)
    collectives.reset_counters()
    dcomm.reset_counters()
    times = []
    peer = method_name in PEER_METHODS  # a peer's own calls: counted by the peers harness's one counter
    with count_bytes() if peer else contextlib.nullcontext() as counter:
        for _ in range(args.iters):
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            _one_iteration(method, fn, x, params, shape, dy, causal, args.backend)
            _sync(device)
            times.append(time.perf_counter() - t0)
    if peer:
        sent = counter.sent / args.iters  # the barriers move nothing
    else:
        sent = (collectives.COUNTERS.bytes_sent + dcomm.COUNTERS.bytes_sent) / args.iters
    t_med = _reduce(statistics.median(times), dist.ReduceOp.MAX)
    elem = torch.finfo(dtype).bits // 8
    model_max = max(method_bytes(method_name, world, r, args.batch, n, shape, elem, causal=causal,
                                 full_layer=workload == "layer") for r in range(world))
    sent_max, sent_mean = _reduce(sent, dist.ReduceOp.MAX), _reduce(sent, dist.ReduceOp.SUM) / world
    flops = flops_per_layer(shape, args.batch * n * world, causal=causal, full_layer=workload == "layer")
    useful = (3 * flops["matmul"] + 3.5 * flops["attention"]) / world  # per rank, forward + backward
    row.update(status="ok", time_ms=f"{t_med * 1e3:.2f}", tflops_per_rank=f"{useful / t_med / 1e12:.4f}",
               bytes_sent_max=int(sent_max), bytes_sent_mean=int(sent_mean), model_bytes_max=model_max,
               bytes_match=abs(sent_max - model_max) <= _BYTES_REL_TOL * model_max)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
        row["peak_mem_mib"] = f"{_reduce(peak, dist.ReduceOp.MAX):.0f}"
    else:
        row["peak_mem_mib"] = "n/a (CPU)"
    return row


def _machine(device, dtype, args) -> str:
    world = dist.get_world_size()
    if device.type == "cuda":
        what = f"{world} x {torch.cuda.get_device_name(device)}, NCCL"
    else:
        what = f"{world} CPU processes (gloo) on {cpu_name()}, {os.cpu_count()} cores"
    return (f"{what}; torch {torch.__version__}; dtype {str(dtype).replace('torch.', '')}; batch {args.batch}; "
            f"{'non-causal' if args.non_causal else 'causal'}; backend {args.backend or 'default'}; "
            f"{args.iters} timed iterations after {args.warmup} warm-up; "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}")


def write_table(rows, out: Path, header: str, cpu: bool) -> Path:
    """Markdown table of ``rows`` (one per measurement), with the machine line and the CPU banner."""
    cols = ["model", "workload", "tokens_per_rank", "method", "status", "time_ms", "tflops_per_rank",
            "bytes_sent_max", "model_bytes_max", "bytes_match", "peak_mem_mib"]
    lines = [f"# Scaling benchmark, P = {rows[0]['world'] if rows else '?'}", "", header, ""]
    if cpu:
        lines += [CPU_BANNER, ""]
    lines += ["Time: median per iteration (forward + backward), slowest rank. Bytes: sent per rank per "
              "iteration, max over ranks, measured by the methods' counters; `model_bytes_max` is "
              "`bench/model.py`'s formula.", ""]
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "|".join("---" for _ in cols) + "|")
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    path = out / "results.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def write_plots(rows, out: Path, cpu: bool) -> None:
    """time.png and bytes.png (skipped, with a note, when matplotlib is not installed).

    One panel per (model, workload); each method keeps its colour (``distattn._plotstyle``) in every panel, one
    legend below the panels names every method drawn, and a panel says which methods could not run there."""
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return
    plt = pyplot_or_note(f"{out / 'time.png'} and bytes.png")
    if plt is None:
        return
    panels = sorted({(r["model"], r["workload"]) for r in rows})
    models, workloads = sorted({m for m, _ in panels}), sorted({w for _, w in panels})
    ticks = sorted({int(r["tokens_per_rank"]) for r in ok})
    for metric, label, scale, fname in (("time_ms", "ms / iteration", 1.0, "time.png"),
                                        ("bytes_sent_max", "KiB sent / rank / iteration", 1 / 1024, "bytes.png")):
        fig, axes = plt.subplots(len(models), len(workloads), figsize=(4.5 * len(workloads), 3 * len(models) + 0.6),
                                 squeeze=False)
        for i, model in enumerate(models):
            for j, workload in enumerate(workloads):
                note = _panel(axes[i][j], [r for r in rows if (r["model"], r["workload"]) == (model, workload)],
                              metric, scale, ticks)
                axes[i][j].set(xlabel="tokens per rank", ylabel=label)
                axes[i][j].set_title(f"{model} / {workload}" + (f"\n{note}" if note else ""), fontsize=9)
        figure_legend(fig, axes.flat, title="method")
        title = f"bench/scaling.py, P = {ok[0]['world']}" + (" — CPU smoke, not a performance number" if cpu else "")
        fig.suptitle(title)
        tight_with_legend(fig)
        fig.savefig(out / fname, dpi=100)
        plt.close(fig)


def _panel(ax, rows, metric: str, scale: float, ticks) -> str:
    """One panel: a line per method that ran (its fixed style); returns a note naming the methods that did not
    run there (with the reason) and those whose values coincide (their lines lie on top of each other)."""
    series, missing = {}, []
    for m in list(METHODS) + list(PEER_METHODS):
        mine = [r for r in rows if r["method"] == m]
        pts = sorted((int(r["tokens_per_rank"]), float(r[metric]) * scale) for r in mine if r.get("status") == "ok")
        if pts:
            ax.plot(*zip(*pts), label=m, gid=m, **plot_style(m))
            series[m] = tuple(pts)
        elif mine:
            missing.append(f"not run: {mine[0]['status']}")
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(ticks, [str(t) for t in ticks])
    return "\n".join(missing + same_values_note(series))


def _runs(args):
    for model in args.models:
        for workload in args.workloads:
            for n in args.tokens_per_rank:
                for method in args.methods:
                    yield model, workload, n, method


@_record_errors  # a failing rank's traceback reaches torchrun's summary, not only its peers' hang-ups
def main(argv=None) -> None:
    args = _parse(argv)
    device = _setup()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    out = Path(args.out)
    rank = dist.get_rank()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    rows = []
    csv_file = open(out / "results.csv", "w", newline="") if rank == 0 else None  # noqa: SIM115
    writer = csv.DictWriter(csv_file, FIELDS) if csv_file else None
    if writer:
        writer.writeheader()

    def record(row):
        rows.append(row)
        if writer:  # written as we go: a run that dies (e.g. out of memory inside a collective) keeps its rows
            writer.writerow(row)
            csv_file.flush()
            print(" ".join(f"{k}={row.get(k, '')}" for k in ("model", "workload", "tokens_per_rank", "method",
                                                            "status", "time_ms", "bytes_match")), flush=True)

    for model, workload, n, method in _runs(args):
        record(measure(method, model, workload, n, args, device, dtype))
    if args.find_max and device.type == "cuda":
        for model, workload, method in sorted({(m, w, me) for m, w, _, me in _runs(args)}):  # same order on every rank
            record(_find_max(method, model, workload, args, device, dtype))
    if rank == 0:
        csv_file.close()
        cpu = device.type != "cuda"
        write_table(rows, out, _machine(device, dtype, args), cpu)
        write_plots(rows, out, cpu)
        print(f"wrote {out / 'results.md'}", flush=True)
    dist.barrier()
    # Leave without tearing gloo down: destroying the groups (the library's own and the Ulysses baseline's) while
    # a peer's connections are closing can make gloo abort a finished rank ("terminate called without an active
    # exception", exit -6; seen in CI), as in launch/train.py's finish().
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _find_max(method, model, workload, args, device, dtype) -> dict:
    """Double tokens per rank from the largest given while a run succeeds (every rank agrees on OOM)."""
    n, best = max(args.tokens_per_rank), None
    while True:
        try:
            row = measure(method, model, workload, n, args, device, dtype)
            failed = row.get("status") != "ok"
        except torch.cuda.OutOfMemoryError:
            # A rank that runs out of memory inside a collective leaves its peers waiting: the job then dies
            # with NCCL's timeout, and the rows written so far remain in results.csv.
            failed = True
        torch.cuda.empty_cache()
        if _reduce(float(failed), dist.ReduceOp.MAX):
            break
        best, n = n, n * 2
    return {"model": model, "workload": workload, "world": dist.get_world_size(), "tokens_per_rank": best or 0,
            "method": method, "status": "longest that fits (tokens per rank)"}


if __name__ == "__main__":
    main()
