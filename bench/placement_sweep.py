"""The placement over many seeds (issue 39): worst / median / best, per-pair timeline beside lockstep, the IB table.

    python bench/placement_sweep.py --seeds 200 --out bench/results/placement-sim        # the issue's sweep
    python bench/placement_sweep.py --seeds 20 --world 8 16 64 256 --out bench/results/placement-sim

For every document distribution (uniform:8192, longtail:2048, pile:4 — the Pile's published mixture,
``distattn.schedule.corpora``), P and seed, at --seq-per-rank tokens per rank with LLaMA-3-8B attention shapes
(32 q / 8 kv heads, d = 128, bf16), causal and with a --window: the step (forward + backward) of every schedule on the
per-pair timeline (``distattn.schedule.timeline``) against perfect balance (total compute / P), its compute idle,
and the lockstep figure (the simulator's sum of step maxima over total work / P). "placed before" is the solver of
commit BEFORE (the smallest group whose dealt blocks balance within 4%, read from git), "placed" today's (judged by
the timeline on the cluster). IB: nodes of 8 GPUs, NVLink inside, 100 Gb/s InfiniBand across; ``auto`` = the least
modelled step time among ring, zigzag, balanced and placed (placed solved for IB). Solver times: CPU time of one
uncached solve. Writes results.csv (one row per seed, setting and schedule) and README.md. No GPU.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import platform
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from distattn.schedule import MaskSpec, Shapes, make_plan
from distattn.schedule.cli import document_lengths
from distattn.schedule.cluster import Cluster
from distattn.schedule.masked import make_masked_plan
from distattn.schedule.placement import _place_cached
from distattn.schedule.sim import step_costs
from distattn.schedule.timeline import step_timeline

BEFORE = "752ba83"  # main before issue 39: distattn/schedule/placement.py as dbcc8ef..752ba83 left it
SHAPES = dict(heads_q=32, heads_kv=8, head_dim=128, dtype_bytes=2)
OTHERS = ("ring", "balanced", "zigzag")
WEIGHED = "placed, window weighed"


def _old_place(commit: str = BEFORE):
    """The solver of ``commit``, loaded from git (it imports only modules that still hold its names)."""
    src = subprocess.run(["git", "show", f"{commit}:distattn/schedule/placement.py"], check=True, capture_output=True,
                         text=True).stdout
    spec = importlib.util.spec_from_loader("_placement_before", loader=None)
    mod = importlib.util.module_from_spec(spec)
    exec(compile(src, "placement_before.py", "exec"), mod.__dict__)  # noqa: S102  (our own file at a fixed commit)
    return mod


def _lockstep(plan) -> float:
    rt = plan.run_table
    work = float((rt.stop - rt.start) @ rt.cost)
    return float(step_costs(plan).sum()) * plan.world_size / work if work else 1.0


def one(job):
    docs, p, seed, n, window = job
    old = _old_place()
    shapes = Shapes(seq_per_rank=n, **SHAPES)
    clusters = {"nvlink": Cluster.preset("nvlink"), "ib": Cluster.preset("ib")}
    cu = document_lengths(docs, p * n, seed=seed)
    layouts, solve_ms = {}, {}
    for link, cluster in clusters.items():
        t = time.thread_time()
        layouts[link] = _place_cached.__wrapped__(MaskSpec(causal=True, cu_seqlens=cu), p, n, None, cluster)
        solve_ms[link] = (time.thread_time() - t) * 1e3
    before = old._place_cached.__wrapped__(MaskSpec(causal=True, cu_seqlens=cu), p, n)
    rows = []
    for win in ((-1, -1), (window, 0)):
        mask = MaskSpec(causal=True, window=win, cu_seqlens=cu)
        plans = {s: make_plan(p, True, s, mask=mask, chunk=n) for s in OTHERS}
        plans["placed before"] = make_masked_plan.__wrapped__(p, "placed", mask, n, before)
        for link, cluster in clusters.items():
            mine = dict(plans, placed=make_masked_plan.__wrapped__(p, "placed", mask, n, layouts[link]))
            if win[0] >= 0:  # the solver given the window: what the library's windowed calls run, on either link
                mine[WEIGHED] = make_masked_plan.__wrapped__(p, "placed", mask, n,
                                                             _place_cached.__wrapped__(mask, p, n, None, cluster))
            for name, plan in mine.items():
                tl = step_timeline(plan, shapes, cluster)
                rows.append({"docs": docs, "P": p, "seed": seed, "mask": "causal" if win[0] < 0 else f"window {window}",
                             "link": link, "schedule": name, "step ms": round(tl["makespan"] * 1e3, 4),
                             "per-pair / perfect": round(tl["ratio"], 4), "compute idle": round(tl["compute_idle"], 4),
                             "lockstep / perfect": round(_lockstep(plan), 4),
                             "group": ({"placed": layouts[link], "placed before": before}.get(name, plan.layout)).group
                             if "placed" in name else "",
                             "solver ms": round(solve_ms[link], 2) if name == "placed" else ""})
    return rows


def weighed(job):
    """Only the rows ``one`` makes for the placement solved for the window (``WEIGHED``, each link): the rows a change
    to the windowed solve alone can move (the causal solves and the other schedules stay as they were)."""
    docs, p, seed, n, window = job
    shapes = Shapes(seq_per_rank=n, **SHAPES)
    mask = MaskSpec(causal=True, window=(window, 0), cu_seqlens=document_lengths(docs, p * n, seed=seed))
    rows = []
    for link in ("nvlink", "ib"):
        cluster = Cluster.preset(link)
        plan = make_masked_plan.__wrapped__(p, "placed", mask, n, _place_cached.__wrapped__(mask, p, n, None, cluster))
        tl = step_timeline(plan, shapes, cluster)
        rows.append({"docs": docs, "P": p, "seed": seed, "mask": f"window {window}", "link": link,
                     "schedule": WEIGHED, "step ms": round(tl["makespan"] * 1e3, 4),
                     "per-pair / perfect": round(tl["ratio"], 4), "compute idle": round(tl["compute_idle"], 4),
                     "lockstep / perfect": round(_lockstep(plan), 4), "group": plan.layout.group, "solver ms": ""})
    return rows


def refresh_weighed(base: Path, jobs: list, workers: int, csv_path: Path) -> list[dict]:
    """``base``'s rows with its ``WEIGHED`` rows solved anew (:func:`weighed`), written to ``csv_path``."""
    new = {(r["docs"], r["P"], r["seed"], r["link"]): r for r in run_jobs(weighed, jobs, workers, csv_path)}
    rows = []
    with open(base, newline="") as f:
        for r in csv.DictReader(f):
            r = {k: (float(v) if k in NUMERIC and v != "" else int(v) if k in ("P", "seed") else v)
                 for k, v in r.items()}
            if r["schedule"] == WEIGHED:
                key = (r["docs"], r["P"], r["seed"], r["link"])
                if key not in new:
                    raise SystemExit(f"{base} holds {key}, which this run did not solve: pass its --docs, --world "
                                     f"and --seeds")
                r = new.pop(key)
            rows.append(r)
    assert all(key[3] == "ib" for key in new), f"{len(new)} re-solved rows have no row in {base}"
    rows += list(new.values())  # a base from before the IB rows of the windowed placement: added
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return rows


NUMERIC = ("step ms", "per-pair / perfect", "compute idle", "lockstep / perfect", "solver ms")


def _stats(values):
    v = np.asarray(values, dtype=float)
    return f"{v.max():.3f} / {np.median(v):.3f} / {v.min():.3f}"


def summary(rows, seeds) -> list[str]:
    key = lambda r: (r["docs"], r["P"], r["mask"])  # noqa: E731
    settings = sorted({key(r) for r in rows}, key=lambda k: (k[0], k[1], k[2]))
    out = ["## NVLink: the step on the per-pair timeline over perfect balance, worst / median / best seed", "",
           "| docs | P | mask | placed (after) | compute idle, worst | placed before | lockstep, placed after | "
           "lockstep, placed before | ring | balanced | zigzag | placed, window weighed |", "|" + "---|" * 12]
    for s in settings:
        sel = [r for r in rows if key(r) == s and r["link"] == "nvlink"]
        col = lambda name, f="per-pair / perfect": _stats([r[f] for r in sel if r["schedule"] == name])  # noqa: E731
        idle = max(r["compute idle"] for r in sel if r["schedule"] == "placed")
        out.append(f"| {s[0]} | {s[1]} | {s[2]} | {col('placed')} | {idle:.1%} | {col('placed before')} | "
                   f"{col('placed', 'lockstep / perfect')} | {col('placed before', 'lockstep / perfect')} | "
                   f"{col('ring')} | {col('balanced')} | {col('zigzag')} | "
                   f"{col(WEIGHED) if any(r['schedule'] == WEIGHED for r in sel) else '-'} |")
    out += ["", "## IB (nodes of 8, 100 Gb/s across): auto's modelled step against each schedule", "",
            "auto = the least step time of ring, balanced, zigzag and placed (solved for IB; under a window the "
            "placement solved for the window where the rows have it, as the library's windowed call). Columns: the "
            "schedule's "
            "step time over auto's, worst / median / best seed (>= 1 everywhere: auto is never worse); last column: "
            "the best of ring / balanced / zigzag / placed-before over auto on the median seed.", "",
            "| docs | P | mask | auto ms (median) | auto's picks | ring | balanced | zigzag | placed before | "
            "best other / auto, median |", "|" + "---|" * 10]
    for s in settings:
        sel = [r for r in rows if key(r) == s and r["link"] == "ib"]
        by_seed = {}
        for r in sel:
            by_seed.setdefault(r["seed"], {})[r["schedule"]] = r["step ms"]
        autos, picks, ratio = [], {}, {name: [] for name in (*OTHERS, "placed before")}
        best_other = []
        for times in by_seed.values():
            mine = WEIGHED if WEIGHED in times else "placed"  # a windowed call runs the placement for its window
            pick = min(("ring", "balanced", "zigzag", mine), key=lambda k: times[k])
            auto = times[pick]
            autos.append(auto)
            name = "placed" if pick == WEIGHED else pick
            picks[name] = picks.get(name, 0) + 1
            for name in ratio:
                ratio[name].append(times[name] / auto)
            best_other.append(min(times[name] for name in ratio) / auto)
        pick_s = ", ".join(f"{k} {v}" for k, v in sorted(picks.items()))
        out.append(f"| {s[0]} | {s[1]} | {s[2]} | {np.median(autos):.2f} | {pick_s} | "
                   + " | ".join(_stats(ratio[name]) for name in ratio) + f" | {np.median(best_other):.2f} |")
    out += ["", "## Solver time (CPU ms of one uncached solve; max / median / min over seeds)", "",
            "| docs | P | nvlink | ib |", "|---|---|---|---|"]
    for docs, p in sorted({(r["docs"], r["P"]) for r in rows}):
        sel = [r for r in rows if r["docs"] == docs and r["P"] == p and r["schedule"] == "placed"
               and r["mask"] == "causal"]
        out.append(f"| {docs} | {p} | " + " | ".join(
            _stats([r["solver ms"] for r in sel if r["link"] == link]) for link in ("nvlink", "ib")) + " |")
    return out


def run_jobs(fn, jobs: list, workers: int, csv_path: Path, every: int = 20) -> list[dict]:
    """Every job's rows (``fn(job)`` returns a list of dicts) over ``workers`` processes, in job order, written to
    ``csv_path``; progress on stderr every ``every`` jobs."""
    rows = []
    with ProcessPoolExecutor(workers) as pool:
        for i, part in enumerate(pool.map(fn, jobs, chunksize=1)):
            rows += part
            if i % every == 0 or i + 1 == len(jobs):
                print(f"{i + 1}/{len(jobs)}", file=sys.stderr, flush=True)
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/placement-sim"))
    parser.add_argument("--world", type=int, nargs="+", default=[8, 16, 64, 256])
    parser.add_argument("--docs", nargs="+", default=["uniform:8192", "longtail:2048", "pile:4"])
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--seq-per-rank", type=int, default=4096)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--refresh-windowed", type=Path, default=None, metavar="BASE_CSV",
                        help="re-solve only the placement solved for the window (rows 'placed, window weighed', "
                             "the only ones a change to the windowed solve moves) and keep BASE_CSV's other rows; the "
                             "settings and seeds must be BASE_CSV's")
    args = parser.parse_args(argv)
    jobs = [(d, p, s, args.seq_per_rank, args.window) for d in args.docs for p in args.world
            for s in range(args.seeds)]
    if args.refresh_windowed is not None:
        rows = refresh_weighed(args.refresh_windowed, jobs, args.jobs, args.out / "sweep.csv")
    else:
        rows = run_jobs(one, jobs, args.jobs, args.out / "sweep.csv")
    cmd = " ".join(["python bench/placement_sweep.py", *(argv if argv is not None else sys.argv[1:])])
    text = ["# Packed documents over many seeds: the placement on the per-pair timeline (issue 39)", "",
            f"`{cmd}`: seeds 0..{args.seeds - 1} per setting, {args.seq_per_rank} tokens per rank, LLaMA-3-8B "
            f"attention shapes (32 q / 8 kv heads, d = 128, bf16), causal and window ({args.window}, 0). Modelled "
            f"(no GPU): the per-pair timeline at the cost model's assumed rates. Machine: {platform.machine()}, "
            f"CPython {platform.python_version()}, 2 shared cores. Rows: sweep.csv."
            + ("" if args.refresh_windowed is None else
               f" Only the column '{WEIGHED}' was solved anew; every other figure is {args.refresh_windowed}'s (a "
               f"change to the windowed solve moves no other row: the causal solves and the other schedules stay)."),
            "", *summary(rows, args.seeds),
            ""]
    (args.out / "SWEEP.md").write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
