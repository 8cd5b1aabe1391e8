"""Cost of the always-on rank agreement check (issue 14): an attention call with and without it, side by side.

    python -m torch.distributed.run --nproc-per-node 2 --standalone bench/agreement.py --out bench/results/agreement-cpu
    python -m torch.distributed.run --nproc-per-node 4 --standalone bench/agreement.py --out bench/results/agreement-cpu

Every call of ``dist_flash_attn_func`` (forward executor, and backward executor) runs two one-number
collectives on the library's own group: the agreement all-reduce before step 0 (``distattn.agreement.agree``)
and the completion all-reduce after the last step (``agreement.confirm``); ``DISTATTN_CHECK=0`` turns both
off. This script times, on the same inputs and alternating in one process (so machine load hits both
alike), a forward call with the check and without it (median over ``--iters`` calls, slowest rank), and
the check's collectives alone (median over ``--check-iters``: the direct cost, which the difference of two
noisy medians cannot resolve). It writes ``P<world>.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import distattn  # noqa: E402
from distattn import agreement  # noqa: E402
from distattn.comm import default_timeout  # noqa: E402
from distattn.communicators import open_call  # noqa: E402


def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="results folder")
    ap.add_argument("--tokens-per-rank", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--iters", type=int, default=7, help="calls per mode (median)")
    ap.add_argument("--check-iters", type=int, default=200, help="check-only repetitions (median)")
    return ap.parse_args(argv)


def _slowest(seconds: float) -> float:
    """The slowest rank's time: a call is as slow as its slowest rank."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _timed_call(q, k, v, check: bool) -> float:
    os.environ[agreement.CHECK_ENV] = "1" if check else "0"
    dist.barrier()  # start together: the time is the call's, not a straggler's
    start = time.perf_counter()
    distattn.dist_flash_attn_func(q, k, v, causal=True, backend="torch")
    return _slowest(time.perf_counter() - start)


def _check_only(q, k, v, iters: int) -> float:
    """Median seconds of the check's two collectives alone (slowest rank), as a call runs them."""
    from distattn.attention import DistAttnConfig

    cfg = DistAttnConfig(causal=True, scale=q.shape[-1] ** -0.5, backend="torch")
    cpu = torch.device("cpu")
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        comm, seq = open_call(None, default_timeout())
        fields = agreement.call_fields("forward", seq, {"q": q, "k": k, "v": v}, cfg.fingerprint_fields())
        agreement.agree(comm, fields, cpu, default_timeout(), "bench")
        agreement.confirm(comm, cpu, default_timeout(), "bench")
        times.append(_slowest(time.perf_counter() - start))
    return statistics.median(times)


def main(argv=None) -> None:
    args = _parse(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, args.tokens_per_rank, args.heads, args.head_dim, generator=g) for _ in range(3))
    _timed_call(q, k, v, True)  # warm-up (builds the library's communicator)
    _timed_call(q, k, v, False)
    on, off = [], []
    for _ in range(args.iters):  # alternate: load changes hit both modes alike
        on.append(_timed_call(q, k, v, True))
        off.append(_timed_call(q, k, v, False))
    check = _check_only(q, k, v, args.check_iters)
    if rank == 0:
        _write(args, world, statistics.median(on), statistics.median(off), check, on, off)
    dist.destroy_process_group()


def _write(args, world, on, off, check, all_on, all_off) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = f"b=1, {args.tokens_per_rank} tokens/rank, {args.heads} heads, d={args.head_dim}, fp32, causal, balanced"
    lines = [
        f"# Agreement check cost, {world} gloo ranks (measured)",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores shared by {world} ranks (and other jobs: loaded), "
        f"torch {torch.__version__}, CPU, torch kernel backend. Shape: {shape}; one forward call.",
        "",
        f"Command: `python -m torch.distributed.run --nproc-per-node {world} --standalone bench/agreement.py "
        f"--out {args.out}`",
        "",
        "| ranks | call with check (ms, median) | call without (ms, median) | difference | check alone (ms, median) "
        "| check / call |",
        "|---|---|---|---|---|---|",
        f"| {world} | {on * 1e3:.1f} | {off * 1e3:.1f} | {(on - off) / off * 100:+.2f}% | {check * 1e3:.3f} "
        f"| {check / off * 100:.3f}% |",
        "",
        f"Calls with the check (ms): {', '.join(f'{t * 1e3:.1f}' for t in all_on)}; without: "
        f"{', '.join(f'{t * 1e3:.1f}' for t in all_off)}. The check alone is the agreement all-reduce before "
        f"step 0 plus the completion all-reduce after the last step, timed {args.check_iters} times; the "
        f"difference of the two call medians is within the call's run-to-run noise.",
        "",
    ]
    (out / f"P{world}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
