"""Where the placed plan's excess goes on the sweep's worst seeds (issue 39), NVLink, per-pair timeline.

    python bench/placement_diagnose.py --out bench/results/placement-sim/DIAGNOSIS.md
    python bench/placement_diagnose.py --windowed --out bench/results/placement-sim/diagnose-windowed.md

For every setting of ``sweep.csv`` (``bench/placement_sweep.py``) its worst seed for the placed layout, the step over
perfect balance (total compute / P):

* as is: the library's placement on the call's mask, through its public path (``make_plan(P, True, "placed",
  mask=, chunk=)``, what ``distattn.sharding.placement(cu, n, window=)`` shards by): the documents and the call's
  window (``distattn.schedule.build.placement_mask``) since the window reaches the placement;
* comm free: the same plan with free links (infinite bandwidth, no latency): what is left is compute imbalance and
  the executor's order (a rank waits for its peers' rounds);
* busiest rank: the busiest rank's compute over perfect balance (a lower bound of any order of that plan);
* one side stream: the timeline's former model, NOT what the executor does (``return_stream=False``: every round on
  one side stream, a return queued behind the next fetch; the executor's returns have a stream and, on NCCL, a
  communicator of their own);
* causal placement (windowed rows only): the plan of the call's mask on the placement solved for causal work (the
  documents alone), what the library ran for a windowed call before the window reached the placement; its group in
  brackets; and the solve time (CPU s) of the library's windowed placement.

``--windowed``: the windowed rows only. ``--seeds S``: instead, for every distribution, P and link, the windowed step
over seeds 0..S-1: worst / median / best of the library's placement (the call's window) against the causal
placement the library used before, both on the per-pair timeline of that link's cluster::

    python bench/placement_diagnose.py --seeds 10 --out bench/results/placement-sim/window-seeds.md

``--whatif K``: instead, the K worst seeds per setting of ``--sweep`` (NVLink; causal, and windowed placed for the
window) with the plan the library solves, as the executor runs it (fp32 partials, the plan's prefetch depth: 1, or up to
4 where the solver found a deeper depth faster, ``Layout.prefetch``), against the same plan at depth 1 and at the
deepest, 4, and what-ifs of it: ``partials="input"`` (the partials in the inputs' dtype, half the backward's return
bytes: an option users have, ``distattn.DistAttnConfig.partials``; the solver still times fp32), one more set of receive
buffers than the depth needs (``slots=depth + 2``: a fetch round then waits for an earlier compute than the one before
its posting; not what the executor does) and fresh buffers every round (``slots=None``: no such wait, memory growing
with how far the host runs ahead), free links (what is left: imbalance and the plan's step order) and the busiest rank's
compute (a lower bound of any order of that plan)::

    python bench/placement_diagnose.py --whatif 3 --world 8 16 64 256 --sweep
        bench/results/placement-sim/sweep-200.csv --out bench/results/placement-sim/WHATIF.md  (one line)
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import sys
import time
from pathlib import Path

import numpy as np

import distattn.schedule.timeline as tl
from distattn.schedule import MaskSpec, Shapes, make_plan
from distattn.schedule.cli import document_lengths
from distattn.schedule.cluster import Cluster, Link
from distattn.schedule.masked import make_masked_plan
from distattn.schedule.build import placement_mask
from distattn.schedule.placement import _place_cached

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: bench.placement_worst
from bench.placement_worst import sweep_rows  # noqa: E402

SHAPES = dict(heads_q=32, heads_kv=8, head_dim=128, dtype_bytes=2)


def worst_seeds(sweep: Path) -> dict:
    worst = {}
    for r in csv.DictReader(sweep.open()):
        if r["link"] != "nvlink" or r["schedule"] != "placed":
            continue
        k = (r["docs"], int(r["P"]), r["mask"])
        if k not in worst or float(r["per-pair / perfect"]) > float(worst[k]["per-pair / perfect"]):
            worst[k] = r
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", type=Path, default=Path("bench/results/placement-sim/sweep.csv"))
    ap.add_argument("--seq-per-rank", type=int, default=4096)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--groups", nargs=3, metavar=("DOCS", "P", "SEED"),
                    help="instead: every group size's step and busiest rank for one causal setting")
    ap.add_argument("--windowed", action="store_true", help="the windowed rows only")
    ap.add_argument("--seeds", type=int, help="instead: windowed before/after over seeds 0..SEEDS-1")
    ap.add_argument("--world", type=int, nargs="+", default=[8, 16, 64, 256])
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--whatif", type=int, metavar="K",
                    help="instead: K worst seeds per setting against what-ifs (partials, prefetch, receive slots, "
                         "free links)")
    args = ap.parse_args()
    if args.seeds:
        return over_seeds(args)
    if args.whatif:
        return whatif(args)
    os.environ["DISTATTN_LINK"] = "nvlink"  # the cluster the library's placement is timed on (make_plan's)
    n, cl = args.seq_per_rank, Cluster.preset("nvlink")
    if args.groups:
        docs, p, seed = args.groups[0], int(args.groups[1]), int(args.groups[2])
        cu = document_lengths(docs, p * n, seed=seed)
        mask, shapes = MaskSpec(causal=True, cu_seqlens=cu), Shapes(seq_per_rank=n, **SHAPES)
        for k in (k for k in range(1, p + 1) if p % k == 0):
            lay = _place_cached.__wrapped__(mask, p, n, k, cl)
            t = tl.step_timeline(make_masked_plan.__wrapped__(p, "placed", mask, n, lay), shapes, cl)
            print(f"group {k}: step / perfect {t['ratio']:.3f}, busiest rank {t['busiest'] / t['perfect']:.3f}")
        return
    free_link = Link(name="free", bandwidth=1e30, latency=0.0)
    free = dataclasses.replace(cl, intra=free_link, inter=free_link)
    shapes = Shapes(seq_per_rank=n, **SHAPES)
    lines = ["| docs | P | mask | seed | group | as is | comm free | busiest rank | one side stream (former model) | "
             "causal placement (group) | solve s |", "|" + "---|" * 11]
    for (docs, p, m), r in sorted(worst_seeds(args.sweep).items()):
        if args.windowed and m == "causal":
            continue
        seed = int(r["seed"])
        cu = document_lengths(docs, p * n, seed=seed)
        win = (-1, -1) if m == "causal" else (int(m.split()[1]), 0)
        mask = MaskSpec(causal=True, window=win, cu_seqlens=cu)
        t0 = time.process_time()
        _place_cached.__wrapped__(placement_mask(cu, win), p, n, None, cl)  # the library's solve, timed uncached
        t_solve = f"{time.process_time() - t0:.2f}"
        plan = make_plan(p, True, "placed", mask=mask, chunk=n)  # the public path: placed for the call's window
        lay = plan.layout
        a, c = tl.step_timeline(plan, shapes, cl), tl.step_timeline(plan, shapes, free)
        b = tl.step_timeline(plan, shapes, cl, return_stream=False)
        before = "-"
        if m != "causal":
            cl_lay = _place_cached.__wrapped__(MaskSpec(causal=True, cu_seqlens=cu), p, n, None, cl)
            w = tl.step_timeline(make_masked_plan.__wrapped__(p, "placed", mask, n, cl_lay), shapes, cl)
            before = f"{w['ratio']:.3f} ({cl_lay.group})"
        lines.append(f"| {docs} | {p} | {m} | {seed} | {lay.group} | {a['ratio']:.3f} | {c['ratio']:.3f} | "
                     f"{a['busiest'] / a['perfect']:.3f} | {b['ratio']:.3f} | {before} | {t_solve} |")
        print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


def over_seeds(args) -> None:
    """Worst / median / best over seeds of the windowed step (per-pair timeline / perfect balance): the library's
    placement (``make_plan``'s, solved for the call's window) and the causal placement it replaced."""
    n, shapes, win = args.seq_per_rank, Shapes(seq_per_rank=args.seq_per_rank, **SHAPES), (args.window, 0)
    lines = ["| docs | P | link | after: placed for the window (worst / median / best) | groups, after | before: "
             "causal placement (worst / median / best) | groups, before | worst before / worst after | median "
             "solve s, after |", "|" + "---|" * 9]
    for link in ("nvlink", "ib"):
        os.environ["DISTATTN_LINK"] = link  # make_plan's placement is timed on this cluster
        cl = Cluster.preset(link)
        for docs in ("uniform:8192", "longtail:2048", "pile:4"):
            for p in args.world:
                after, before, g_after, g_before, solve = [], [], {}, {}, []
                for seed in range(args.seeds):
                    cu = document_lengths(docs, p * n, seed=seed)
                    mask = MaskSpec(causal=True, window=win, cu_seqlens=cu)
                    t0 = time.process_time()
                    plan = make_plan(p, True, "placed", mask=mask, chunk=n)  # the public path
                    solve.append(time.process_time() - t0)
                    old = _place_cached.__wrapped__(MaskSpec(causal=True, cu_seqlens=cu), p, n, None, cl)
                    after.append(tl.step_timeline(plan, shapes, cl)["ratio"])
                    before.append(tl.step_timeline(make_masked_plan.__wrapped__(p, "placed", mask, n, old), shapes,
                                                   cl)["ratio"])
                    g_after[plan.layout.group] = g_after.get(plan.layout.group, 0) + 1
                    g_before[old.group] = g_before.get(old.group, 0) + 1

                def wmb(x):
                    return f"{max(x):.3f} / {float(np.median(x)):.3f} / {min(x):.3f}"

                def groups(g):
                    return ", ".join(f"{k} x{c}" for k, c in sorted(g.items()))
                lines.append(f"| {docs} | {p} | {link} | {wmb(after)} | {groups(g_after)} | {wmb(before)} | "
                             f"{groups(g_before)} | {max(before) / max(after):.2f} | {float(np.median(solve)):.2f} |")
                print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


def whatif(args) -> None:
    """The K worst seeds per setting (module docstring, ``--whatif``): the step over perfect balance as the executor
    runs the library's plan, and what-ifs of the same plan."""
    os.environ["DISTATTN_LINK"] = "nvlink"  # the cluster the library's placement is timed on (make_plan's)
    n, cl = args.seq_per_rank, Cluster.preset("nvlink")
    free_link = Link(name="free", bandwidth=1e30, latency=0.0)
    free = dataclasses.replace(cl, intra=free_link, inter=free_link)
    shapes = Shapes(seq_per_rank=n, **SHAPES)
    lines = ["| docs | P | mask | seed | group | depth | as is (fp32 partials, the plan's depth) | prefetch 1 | "
             "prefetch 4 | partials=\"input\" (what-if) | one more receive slot (what-if) | fresh receive buffers "
             "(what-if) | comm free | busiest rank |", "|" + "---|" * 14]
    for (docs, p, m), seeds in sorted(sweep_rows(args.sweep, set(args.world)).items()):
        for _, seed in seeds[:args.whatif]:
            win = (-1, -1) if m == "causal" else (int(m.split()[1]), 0)
            mask = MaskSpec(causal=True, window=win, cu_seqlens=document_lengths(docs, p * n, seed=seed))
            plan = make_plan(p, True, "placed", mask=mask, chunk=n)  # the public path: placed for the call's window
            runs = [tl.step_timeline(plan, shapes, cl), tl.step_timeline(plan, shapes, cl, prefetch=1),
                    tl.step_timeline(plan, shapes, cl, prefetch=4),
                    tl.step_timeline(plan, shapes, cl, partials="input"),
                    tl.step_timeline(plan, shapes, cl, slots=plan.prefetch + 2),
                    tl.step_timeline(plan, shapes, cl, slots=None), tl.step_timeline(plan, shapes, free)]
            ratios = [x["ratio"] for x in runs] + [runs[0]["busiest"] / runs[0]["perfect"]]
            lines.append(f"| {docs} | {p} | {m} | {seed} | {plan.layout.group} | {plan.prefetch} | " +
                         " | ".join(f"{x:.3f}" for x in ratios) + " |")
            print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
