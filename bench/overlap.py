"""Does communication hide behind compute? A profiler trace of distattn's forward + backward, and its overlap.

    torchrun --nproc-per-node 8 bench/overlap.py --out runs/overlap --schedule zigzag     # one node, NCCL
    torchrun --nproc-per-node 2 bench/overlap.py --out runs/overlap-cpu                    # CPU/gloo: trace only

Each rank runs ``--warmup`` untimed steps, then ``--steps`` steps of ``dist_flash_attn_func`` forward + backward
under ``torch.profiler`` (CPU and CUDA activity) and writes ``trace-rank<r>.json`` (open it in
https://ui.perfetto.dev or chrome://tracing). On CUDA it also reads the trace's GPU kernels and reports, per
rank, the time NCCL kernels ran, the time attention kernels ran, and the fraction of NCCL time that ran while
an attention kernel was running on another stream ("hidden"): with overlap working, the fetches of step t + 1
(on the library's high-priority fetch communicator) and the returns of step t - 1 (on its return communicator)
run under step t's kernels, and the hidden fraction is high; with ``--no-overlap`` (the ablation) it is near 0.

What to look for in the trace, by eye: per rank, the compute stream shows one attention kernel per plan step
(``_fwd_kernel`` / ``_bwd_*``); the ``ncclDevKernel_SendRecv`` kernels of the next step sit on other streams under
it. A send/recv kernel that starts only after the compute kernel ends means the fetch waited (a stream
dependency, or a single communicator shared with FSDP). On CPU (gloo) there are no device kernels: the trace
shows the host side only and the overlap is not measurable.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import distattn  # noqa: E402


def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for the traces and overlap.json")
    ap.add_argument("--tokens-per-rank", type=int, default=None, help="default: 8192 on CUDA, 256 on CPU")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--heads-kv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--schedule", default="balanced", choices=("ring", "balanced", "zigzag"))
    ap.add_argument("--no-overlap", action="store_true", help="the ablation: wait for every fetch first")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    return ap.parse_args(argv)


def _union(intervals):
    merged = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def overlap_of(events) -> dict:
    """``events``: trace events ``{"name", "ts", "dur", "cat"}`` (microseconds). The NCCL kernel time, the
    attention kernel time, and the share of NCCL time during which some attention kernel ran."""
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" in e["name"].lower()]
    compute = _union((e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower())
    comm_time = sum(b - a for a, b in _union(comm))
    hidden = 0.0
    for a, b in _union(comm):
        hidden += sum(max(0.0, min(b, d) - max(a, c)) for c, d in compute)
    return {"nccl_us": comm_time, "compute_us": sum(b - a for a, b in compute),
            "hidden_fraction": hidden / comm_time if comm_time else None, "kernels": len(kernels)}


def main(argv=None) -> None:
    args = _parse(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        local = int(__import__("os").environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    n = args.tokens_per_rank or (8192 if cuda else 256)
    dtype = torch.bfloat16 if cuda else torch.float32
    heads = (args.heads, args.heads_kv) if cuda else (4, 2)
    d = args.head_dim if cuda else 32
    g = torch.Generator(device="cpu").manual_seed(rank)
    q, k, v = (torch.randn(1, n, h, d, generator=g).to(device, dtype).requires_grad_() for h in
               (heads[0], heads[1], heads[1]))

    def step():
        out = distattn.dist_flash_attn_func(q, k, v, causal=True, schedule=args.schedule, overlap=not args.no_overlap)
        out.sum().backward()

    for _ in range(args.warmup):
        step()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = out_dir / f"trace-rank{rank}.json"
    prof.export_chrome_trace(str(trace))
    report = {"rank": rank, "world": dist.get_world_size(), "schedule": args.schedule, "overlap": not args.no_overlap,
              "tokens_per_rank": n, "device": torch.cuda.get_device_name() if cuda else "cpu", "trace": trace.name}
    if cuda:
        report.update(overlap_of(json.loads(trace.read_text()).get("traceEvents", [])))
    else:
        report["note"] = "CPU/gloo: no device kernels, overlap not measurable (the trace shows the host side)"
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if rank == 0:
        (out_dir / "overlap.json").write_text(json.dumps(reports, indent=1) + "\n")
        for r in reports:
            print(json.dumps(r))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
