"""The CPU the packed path costs every training step: the plan of a new batch, and the executor's walk through it.

    python bench/plan_cpu.py --out bench/results/plan-cpu

Every batch of packed documents brings new ``cu_seqlens``, so every rank builds that batch's plan once (for
"placed": the placement, then the work and key spans of every pair, then the steps), and every attention call
(forward, backward, and the recomputed forward of each layer) walks the plan step by step for this rank's task and
transfers (``Plan.task``, ``Plan.rank_ops``). Both are pure Python + numpy on the host, the same on every rank.
For P in --world and both document distributions (seed 0, --seq-per-rank tokens per rank), the minimum thread CPU
time over --repeat new batches (every cache cleared) of: building the plan and rank 0's first walk of the forward
and the backward; a later walk (the other layers' calls on the same batch).

Before and after side by side: ``--before TREE`` (a checkout of an older commit, e.g. ``git worktree add
/tmp/before 930a0e6``; any tree whose ``distattn.schedule`` has ``make_plan`` and ``Plan.rank_ops``) runs this
script on that tree and on this one in turn, one subprocess per (documents, P), for --rounds rounds, and keeps
each cell's minimum, so both columns see the same drift of a shared machine. No GPU, no process group.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from distattn.schedule import MaskSpec, make_plan
from distattn.schedule.cli import document_lengths


def _clear_caches() -> None:
    """Forget every cached plan, placement and work matrix: the next build is a new batch's (every module of the
    schedule package, whichever the tree holds: a tree measured side by side may have other ones)."""
    for name, module in list(sys.modules.items()):
        if not name.startswith("distattn.schedule.") or module is None:
            continue
        for value in vars(module).values():
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()


def walk(plan, rank: int) -> None:
    """One rank's forward + backward walk: per step its task and its fetch and return rounds."""
    for phase in ("forward", "backward"):
        for step in range(plan.num_steps()):
            plan.task(step, rank)
            plan.rank_ops(step, rank, phase, "fetch")
            plan.rank_ops(step, rank, phase, "return")


def timings(p: int, schedule: str, spec: MaskSpec, n: int, repeat: int) -> tuple[float, float, int]:
    """Minimum thread CPU ms of a new batch's plan plus rank 0's first walk, and of a later walk; the steps."""
    first = later = float("inf")
    for _ in range(repeat):
        _clear_caches()
        t = time.thread_time()
        plan = make_plan(p, True, schedule, mask=spec, chunk=n)
        walk(plan, 0)
        t1 = time.thread_time()
        walk(plan, 0)
        first, later = min(first, t1 - t), min(later, time.thread_time() - t1)
    return first * 1e3, later * 1e3, plan.num_steps()


def rows(worlds, dists, schedules, n, repeat):
    for docs in dists:
        for p in worlds:
            spec = MaskSpec(causal=True, cu_seqlens=document_lengths(docs, p * n, seed=0))
            for schedule in schedules:
                first, later, steps = timings(p, schedule, spec, n, repeat)
                yield {"docs": docs, "P": p, "schedule": schedule, "steps": steps,
                       "new batch ms (plan + first walk)": f"{first:.1f}",
                       "later call ms (walk)": f"{later:.2f}"}


def side_by_side(args) -> list[dict]:
    """This script on ``args.before`` and on this tree, alternately, one subprocess per cell; each figure's minimum."""
    best: dict = {}
    for _ in range(args.rounds):
        for docs in args.docs:
            for p in args.world:
                for tree, path in (("before", args.before), ("after", Path(__file__).resolve().parents[1])):
                    env = dict(os.environ, PYTHONPATH=str(path))
                    cmd = [sys.executable, __file__, "--world", str(p), "--docs", docs, "--repeat", str(args.repeat),
                           "--seq-per-rank", str(args.seq_per_rank), "--schedules", *args.schedules]
                    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
                    for line in out.splitlines():
                        cells = [c.strip() for c in line.strip().strip("|").split("|")]
                        if len(cells) == 6 and cells[1].isdigit():
                            key, new = (cells[0], int(cells[1]), cells[2], tree), (float(cells[4]), float(cells[5]))
                            old = best.get(key, new)
                            best[key] = (min(old[0], new[0]), min(old[1], new[1]), int(cells[3]))
    return [{"docs": d, "P": p, "schedule": s, "steps": best[(d, p, s, "after")][2],
             "new batch ms, before": f"{best[(d, p, s, 'before')][0]:.1f}",
             "new batch ms, after": f"{best[(d, p, s, 'after')][0]:.1f}",
             "later call ms, before": f"{best[(d, p, s, 'before')][1]:.2f}",
             "later call ms, after": f"{best[(d, p, s, 'after')][1]:.2f}"}
            for d in args.docs for p in args.world for s in args.schedules]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write results.csv here (else print the table)")
    parser.add_argument("--world", type=int, nargs="+", default=[8, 16, 64, 256])
    parser.add_argument("--docs", nargs="+", default=["uniform:8192", "longtail:2048"])
    parser.add_argument("--schedules", nargs="+", default=["ring", "balanced", "zigzag", "placed"])
    parser.add_argument("--seq-per-rank", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--before", type=Path, default=None, help="a checkout of an older commit to compare against")
    parser.add_argument("--rounds", type=int, default=3, help="with --before: alternating rounds")
    args = parser.parse_args(argv)
    if args.before is not None:
        table = side_by_side(args)
    else:
        table = list(rows(args.world, args.docs, args.schedules, args.seq_per_rank, args.repeat))
    header = list(table[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(r[k]) for k in header) + " |" for r in table]
    rounds = f" x {args.rounds} alternating rounds" if args.before is not None else ""
    print(f"# {platform.machine()}, {platform.python_implementation()} {platform.python_version()}, "
          f"{args.seq_per_rank} tokens per rank, min of {args.repeat}{rounds}")
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "results.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=header)
            writer.writeheader()
            writer.writerows(table)


if __name__ == "__main__":
    main()
