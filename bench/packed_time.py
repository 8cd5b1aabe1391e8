"""One packed batch, each schedule: the attention's forward + backward time per call, beside the per-pair timeline.

    python bench/packed_time.py --out DIR                      # a GPU: P ranks on it over gloo, CUDA tensors, bf16
    python bench/packed_time.py --out DIR --device cpu --tokens-per-rank 128 --heads 4 2 --head-dim 32   # CPU

Issue 39's GPU measurement (``bench/gpu_check.sh``'s ``packed`` part): P processes (default 4) share one device,
joined by gloo (the distributed path over gloo with CUDA tensors), and run ``dist_flash_attn_varlen_func`` forward
+ backward on the same packed stream (``--docs``, ``distattn.schedule.cli.document_lengths``: ``longtail:M``,
``uniform:N`` or ``pile:B``) under each schedule, in this order: ``placed`` (``distattn.sharding.placement``),
then ``zigzag`` and ``balanced`` (the contiguous-shard layouts). Per schedule: the median over ``--reps`` calls of
the slowest rank's time per call (barrier, synchronize, call, synchronize), each rank's bytes sent (distattn's own
counters), and the modelled per-pair timeline's step for the same plan over perfect balance
(``distattn.schedule.timeline``, NVLink profile). Writes ``packed.csv`` and ``packed.md`` after every schedule, so
a run stopped at its budget keeps what it measured.

What it can and cannot say: the P ranks share one GPU, so their kernels take turns on it (no MPS) and a rank left
idle by imbalance hands the GPU to the others: imbalance barely shows in the time per call. Every transfer goes
through host memory and loopback TCP (gloo with CUDA tensors: copied to the CPU, sent, copied back), about 5 ms per
16 MiB of k/v against well under 1 ms of attention per block pair on an H100, so the time per call mostly ranks the
schedules by the bytes they move (read it beside ``max_sent_MiB``); the balance is the modelled ratio's. It proves
the three schedules run and are exact on CUDA, and what the bytes cost over gloo; it is not the speed of P GPUs over
NVLink. On CPU the numbers are gloo + the PyTorch backend on shared cores: a dry run, not a measurement of GPU speed.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

# placed and zigzag first: the comparison the issue asks for, kept if the run is stopped at its budget after them
SCHEDULES = ("placed", "zigzag", "balanced")


def _rank(rank: int, world: int, init: str, args: argparse.Namespace, cu: tuple, queue) -> None:
    import torch.distributed as dist

    import distattn
    from distattn import comm
    from distattn.sharding import placement

    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
        device = torch.device(args.device)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        n, (h_q, h_kv), d = args.tokens_per_rank, args.heads, args.head_dim
        total = n * world
        g = torch.Generator().manual_seed(args.seed)
        full = {name: torch.randn(total, h, d, generator=g) for name, h in (("q", h_q), ("k", h_kv), ("v", h_kv),
                                                                             ("dout", h_q))}
        cu_t = torch.tensor(cu, dtype=torch.int32)
        longest = int((cu_t[1:] - cu_t[:-1]).max())
        for schedule in SCHEDULES:
            kw = {"layout": placement(list(cu), n)} if schedule == "placed" else {"schedule": schedule}
            mine = {k: distattn.shard_sequence(t, 0, **kw).to(device, dtype) for k, t in full.items()}
            leaves = [mine[k].requires_grad_() for k in "qkv"]

            def call():
                for t in leaves:
                    t.grad = None
                out = distattn.dist_flash_attn_varlen_func(*leaves, cu_t, longest, causal=True, schedule=schedule)
                out.backward(mine["dout"])

            call()  # warm-up: kernel compilation, plan caches
            times, sent = [], 0
            for i in range(args.reps):
                dist.barrier()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                before = comm.COUNTERS.bytes_sent
                t0 = time.perf_counter()
                call()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                sent = comm.COUNTERS.bytes_sent - before
            slowest = [torch.zeros(args.reps, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(slowest, torch.tensor(times, dtype=torch.float64))
            sents = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
            dist.all_gather(sents, torch.tensor([sent]))
            if rank == 0:
                per_call = torch.stack(slowest).max(0).values.tolist()  # the slowest rank, call by call
                queue.put({"schedule": schedule, "ms": statistics.median(per_call) * 1e3,
                           "sent": [int(s) for s in sents]})
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        queue.put({"error": f"rank {rank}: {type(exc).__name__}: {exc}"})
        raise


def modelled(args, world: int, cu: tuple) -> dict[str, float]:
    """The per-pair timeline's step over perfect balance for each schedule's plan of this stream (NVLink)."""
    from distattn.schedule import MaskSpec, Shapes, make_plan
    from distattn.schedule.cluster import Cluster
    from distattn.schedule.timeline import step_timeline

    mask = MaskSpec(causal=True, cu_seqlens=cu)
    shapes = Shapes(seq_per_rank=args.tokens_per_rank, heads_q=args.heads[0], heads_kv=args.heads[1],
                    head_dim=args.head_dim, dtype_bytes=2 if args.device == "cuda" else 4)
    return {s: step_timeline(make_plan(world, True, s, mask=mask, chunk=args.tokens_per_rank), shapes,
                             Cluster.preset("nvlink"))["ratio"] for s in SCHEDULES}


def write(out: Path, rows: list[dict], header: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    fields = ["schedule", "ms_per_call", "vs_best", "max_sent_MiB", "modelled_ratio"]
    with open(out / "packed.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    lines = [header, "", "| " + " | ".join(fields) + " |", "|" + "---|" * len(fields)]
    lines += ["| " + " | ".join(str(r[k]) for k in fields) + " |" for r in rows]
    (out / "packed.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--world", type=int, default=4, help="ranks sharing the device")
    p.add_argument("--tokens-per-rank", type=int, default=4096)
    p.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("Q", "KV"))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--docs", default="longtail:2048")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    args = p.parse_args(argv)
    from distattn.schedule.cli import document_lengths

    world, out = args.world, Path(args.out)
    cu = tuple(int(c) for c in document_lengths(args.docs, world * args.tokens_per_rank, seed=args.seed))
    ratios = modelled(args, world, cu)
    header = (f"<!-- python bench/packed_time.py {' '.join(argv if argv is not None else sys.argv[1:])} -->\n"
              f"{world} ranks on one {args.device} device over gloo, {args.tokens_per_rank} tokens per rank, heads "
              f"{args.heads[0]}/{args.heads[1]}, d {args.head_dim}, {args.docs} (seed {args.seed}, {len(cu) - 1} "
              f"documents), causal, forward + backward; ms per call: the slowest rank, median of {args.reps}; "
              f"modelled ratio: the per-pair timeline's step over perfect balance (NVLink, modelled). The ranks "
              f"take turns on one device and every transfer goes through host memory (gloo): the time per call "
              f"mostly follows the bytes moved, not the balance (the module's docstring)."
              + ("" if args.device == "cuda" else " CPU: a dry run, not a GPU measurement."))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_rank, args=(r, world, init, args, cu, queue)) for r in range(world)]
        for proc in procs:
            proc.start()
        rows, deadline = [], time.monotonic() + args.timeout
        try:
            while len(rows) < len(SCHEDULES):
                try:
                    got = queue.get(timeout=max(1.0, deadline - time.monotonic()))
                except Exception:  # noqa: BLE001 - queue.Empty: past the deadline
                    print(f"packed_time: no result within --timeout {args.timeout:g} s", file=sys.stderr)
                    return 1
                if "error" in got:
                    print(got["error"], file=sys.stderr, flush=True)
                    return 1
                rows.append({"schedule": got["schedule"], "ms_per_call": round(got["ms"], 3),
                             "max_sent_MiB": round(max(got["sent"]) / 2**20, 3),
                             "modelled_ratio": round(ratios[got["schedule"]], 3)})
                best = min(r["ms_per_call"] for r in rows)
                for r in rows:
                    r["vs_best"] = round(r["ms_per_call"] / best, 3)
                write(out, rows, header)
                print(rows[-1], flush=True)
        finally:
            for proc in procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
    print(f"wrote {out}/packed.md, packed.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
