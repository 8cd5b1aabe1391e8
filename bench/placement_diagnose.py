"""Where the placed plan's excess goes on the sweep's worst seeds (issue 39), NVLink, per-pair timeline.

    python bench/placement_diagnose.py --out bench/results/placement-sim/DIAGNOSIS.md

For every setting of ``sweep.csv`` (``bench/placement_sweep.py``) its worst seed for the placed layout, the step over
perfect balance (total compute / P):

* as is: the library's placement (solved from the documents alone, causal) on the call's mask;
* comm free: the same plan with free links (infinite bandwidth, no latency): what is left is compute imbalance and
  the executor's order (a rank waits for its peers' rounds);
* busiest rank: the busiest rank's compute over perfect balance (a lower bound of any order of that plan);
* returns on own stream: a what-if, NOT what the executor does: the timeline with the return rounds on a second side
  stream (they no longer queue behind the next fetch), patched into this process only;
* window weighed (windowed rows only): the solver given the call's window (``place`` with the windowed mask: dealt by
  windowed row work and timed on the windowed plan), which the library's callers do not pass today.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import time
from pathlib import Path

import numpy as np

import distattn.schedule.timeline as tl
from distattn.schedule import MaskSpec, Shapes
from distattn.schedule.cli import document_lengths
from distattn.schedule.cluster import Cluster, Link
from distattn.schedule.masked import make_masked_plan
from distattn.schedule.placement import _place_cached

SHAPES = dict(heads_q=32, heads_kv=8, head_dim=128, dtype_bytes=2)


def _two_side_streams(run):
    """``_Rounds.run`` with a side stream of each kind's own (fetch rounds on one, return rounds on another)."""
    def patched(self, t, ready, side):
        own = self.__dict__.setdefault("_own_side", np.zeros(len(side)))
        return run(self, t, ready, own)
    return patched


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
    args = ap.parse_args()
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
    lines = ["| docs | P | mask | seed | group | as is | comm free | busiest rank | returns on own stream (what-if) | "
             "window weighed (group) | solve s, window weighed |", "|" + "---|" * 11]
    for (docs, p, m), r in sorted(worst_seeds(args.sweep).items()):
        seed = int(r["seed"])
        cu = document_lengths(docs, p * n, seed=seed)
        win = (-1, -1) if m == "causal" else (int(m.split()[1]), 0)
        mask = MaskSpec(causal=True, window=win, cu_seqlens=cu)
        lay = _place_cached.__wrapped__(MaskSpec(causal=True, cu_seqlens=cu), p, n, None, cl)
        plan = make_masked_plan.__wrapped__(p, "placed", mask, n, lay)
        a, c = tl.step_timeline(plan, shapes, cl), tl.step_timeline(plan, shapes, free)
        run = tl._Rounds.run
        tl._Rounds.run = _two_side_streams(run)
        try:
            b = tl.step_timeline(plan, shapes, cl)
        finally:
            tl._Rounds.run = run
        weighed = "-"
        t_solve = "-"
        if m != "causal":
            t0 = time.process_time()
            wl = _place_cached.__wrapped__(mask, p, n, None, cl)
            t_solve = f"{time.process_time() - t0:.2f}"
            w = tl.step_timeline(make_masked_plan.__wrapped__(p, "placed", mask, n, wl), shapes, cl)
            weighed = f"{w['ratio']:.3f} ({wl.group})"
        lines.append(f"| {docs} | {p} | {m} | {seed} | {lay.group} | {a['ratio']:.3f} | {c['ratio']:.3f} | "
                     f"{a['busiest'] / a['perfect']:.3f} | {b['ratio']:.3f} | {weighed} | {t_solve} |")
        print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
