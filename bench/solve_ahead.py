"""The placement solver's time per batch, and what a training loop waits for it when it is solved ahead (issue 39).

    python bench/solve_ahead.py --out bench/results/placement-sim/SOLVE-AHEAD.md
    git worktree add /tmp/base ee65b2b && python bench/solve_ahead.py --before /tmp/base --out <file>
    git worktree add /tmp/base544 544df82 && python bench/solve_ahead.py --before /tmp/base544 \
        --out bench/results/placement-sim/SOLVE-SPEED.md

Part 1, the solve: CPU seconds of one uncached solve (``distattn.schedule.placement``, the library's placement on
NVLink, 4096 tokens per rank) on the worst seeds of ``bench/results/placement-sim`` at P = 16, 64 and 256, with the
solved layout's step on the per-pair timeline and a digest of its segments. ``--before PATH``: the same cases solved by
the checkout at PATH too (a worktree of an earlier commit), each case in both, one after the other: the table says
whether the layouts are the same.

Part 2, ahead: the loop of ``launch/train_placement.py`` over ``--batches`` batches of one setting, each batch: ask
for the next ``k`` (``solve_ahead``, ``k`` workers), take its own placement (``distattn.schedule.placement.place``),
then a step of ``--step-s`` seconds in which the loop's thread is idle (``time.sleep``: the GPU computing); the first
batch is solved inline (the workers started and warm: ``distattn.schedule.ahead.start``, as during a job's first
step). The wait per batch against the inline solve (the wait without it).
The step time is assumed, not measured. No GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
N = 4096
CASES = [("uniform:8192", 16, "causal", 3), ("uniform:8192", 16, "window 4096", 161), ("pile:4", 16, "window 4096", 37),
         ("longtail:2048", 16, "window 4096", 7), ("uniform:8192", 64, "causal", 188),
         ("uniform:8192", 64, "window 4096", 83), ("longtail:2048", 64, "causal", 94),
         ("longtail:2048", 64, "window 4096", 94), ("pile:4", 64, "causal", 102), ("pile:4", 64, "window 4096", 52),
         ("longtail:2048", 256, "causal", 162), ("pile:4", 256, "window 4096", 197),
         ("longtail:2048", 256, "causal", 191), ("pile:4", 256, "causal", 169),
         ("longtail:2048", 256, "window 4096", 32), ("pile:4", 256, "window 4096", 1)]
"""(docs, P, mask, seed): the worst or named seeds of WINDOW-CHUNKS.md, WORST-8-64.md and WORST-256.md, and the worst
of WORST-256-ALL.md and WORST-256-WINDOW-ALL.md."""

SOLVE = r"""
import hashlib, json, sys, time
sys.path.insert(0, sys.argv[1])
from distattn.schedule import MaskSpec, Shapes
from distattn.schedule.cli import document_lengths
from distattn.schedule.cluster import Cluster
from distattn.schedule.masked import make_masked_plan
from distattn.schedule.placement import _place_cached
from distattn.schedule.timeline import step_timeline
docs, p, mask, seed, n = json.loads(sys.argv[2])
win = (-1, -1) if mask == "causal" else (int(mask.split()[1]), 0)
spec = MaskSpec(causal=True, window=win, cu_seqlens=document_lengths(docs, p * n, seed=seed))
cluster = Cluster.preset("nvlink")
t = time.process_time()
lay = _place_cached.__wrapped__(spec, p, n, None, cluster)
t = time.process_time() - t
plan = make_masked_plan.__wrapped__(p, "placed", spec, n, lay)
ratio = step_timeline(plan, Shapes(seq_per_rank=n, heads_q=32, heads_kv=8, head_dim=128, dtype_bytes=2),
                      cluster)["ratio"]
digest = hashlib.sha256(repr((lay.placement, lay.order, lay.prefetch, lay.return_depth, lay.backward,
                              lay.head)).encode()).hexdigest()[:12]
print(json.dumps({"cpu_s": t, "ratio": ratio, "digest": digest, "group": lay.group}))
"""


def solve(tree: Path, case) -> dict:
    """One uncached solve of ``case`` by the library at ``tree``, in a fresh process."""
    out = subprocess.run([sys.executable, "-c", SOLVE, str(tree), json.dumps([*case, N])], check=True,
                         capture_output=True, text=True, cwd=tree)
    return json.loads(out.stdout.strip().splitlines()[-1])


def part_one(before: Path | None) -> list[str]:
    head = "| docs | P | mask | seed | solve CPU s | step / perfect | group |"
    rule = "|---|---|---|---|---|---|---|"
    if before is not None:
        head = "| docs | P | mask | seed | solve CPU s, before | now | speed-up | step / perfect | layout |"
        rule = "|---|---|---|---|---|---|---|---|---|"
    lines = [head, rule]
    for case in CASES:
        now = solve(ROOT, case)
        if before is None:
            lines.append(f"| {case[0]} | {case[1]} | {case[2]} | {case[3]} | {now['cpu_s']:.2f} | {now['ratio']:.4f} | "
                         f"{now['group']} |")
            continue
        old = solve(before, case)
        same = "the same" if old["digest"] == now["digest"] else f"other ({old['ratio']:.4f} before)"
        lines.append(f"| {case[0]} | {case[1]} | {case[2]} | {case[3]} | {old['cpu_s']:.2f} | {now['cpu_s']:.2f} | "
                     f"{old['cpu_s'] / now['cpu_s']:.2f}x | {now['ratio']:.4f} | {same} |")
        print(lines[-1], flush=True)
    return lines


def part_two(docs: str, p: int, mask: str, batches: int, step_s: float, k: int) -> str:
    """The loop of ``launch/train_placement.py``: before each step, the next ``k`` batches asked for (``k``
    workers), then this batch's placement taken; the first solved inline."""
    sys.path.insert(0, str(ROOT))
    from distattn.schedule import MaskSpec, ahead
    from distattn.schedule.cli import document_lengths
    from distattn.schedule.cluster import Cluster
    from distattn.schedule.placement import _place_cached, place, solve_ahead

    win = (-1, -1) if mask == "causal" else (int(mask.split()[1]), -1)
    specs = [MaskSpec(causal=True, window=win, cu_seqlens=tuple(document_lengths(docs, p * N, seed=1000 + b)))
             for b in range(batches)]
    cluster = Cluster.preset("nvlink")
    inline = []
    for spec in specs:
        _place_cached.cache_clear()  # a windowed solve also solves the causal one, cached: not across batches
        t = time.perf_counter()
        _place_cached.__wrapped__(spec, p, N, None, cluster)
        inline.append(time.perf_counter() - t)
    _place_cached.cache_clear()
    ahead.shutdown()
    ahead.start(k, wait=120.0)  # as during a job's first step, the workers import the library before the first ask
    waits = []
    for b, spec in enumerate(specs):
        for later in specs[b + 1:b + 1 + k]:
            solve_ahead(later, p, N, cluster, workers=k)
        t = time.perf_counter()
        place(spec, p, N, cluster)
        waits.append(time.perf_counter() - t)
        time.sleep(step_s)
    ahead.shutdown()
    rest = waits[1:]
    return (f"| {docs} | {p} | {mask} | {k} | {statistics.mean(inline):.2f} / {max(inline):.2f} | {waits[0]:.2f} | "
            f"{statistics.mean(rest) * 1e3:.0f} / {max(rest) * 1e3:.0f} | "
            f"{sum(w > 0.05 for w in rest)} of {len(rest)} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, default=None, help="a checkout whose solver to time beside this one")
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--step-s", type=float, default=1.0, help="the assumed step between two placements")
    ap.add_argument("--skip-solve", action="store_true", help="only part 2")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    lines = ["# The placement solver's time per batch, and solved ahead (issue 39)", "",
             f"`python bench/solve_ahead.py{' --before ' + str(args.before) if args.before else ''} --batches "
             f"{args.batches} --step-s {args.step_s}`; machine: {platform.machine()}, CPython "
             f"{platform.python_version()}, no GPU. Modelled steps (per-pair timeline, NVLink); CPU and wall seconds "
             f"measured.", "", "## The solve", ""]
    lines += ["(skipped: --skip-solve)"] if args.skip_solve else part_one(args.before)
    lines += ["", "## Solved ahead", "",
              f"{args.batches} batches (seeds 1000 on), a step of {args.step_s} s (assumed) after each placement.", "",
              "| docs | P | mask | batches ahead (workers) | inline solve s, mean / max (wall) | first batch's wait s "
              "(inline) | wait ms after it, mean / max | batches waiting > 50 ms |",
              "|---|---|---|---|---|---|---|---|"]
    for docs, p, mask in (("uniform:8192", 16, "causal"), ("longtail:2048", 64, "causal"),
                          ("pile:4", 64, "window 4096")):
        for k in (1, 2):
            lines.append(part_two(docs, p, mask, args.batches, args.step_s, k))
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
