"""InfiniBand under a window: ``auto``'s pick with the placement the library solves for the window (issue 39).

    python bench/placement_ib_window.py --docs longtail:2048 --world 64 --seeds 60 --out <file>
    python bench/placement_ib_window.py --docs longtail:2048 --world 64 --seeds 60 --window -1   # causal masks

``bench/placement_sweep.py``'s IB table runs, for a windowed mask, the placement solved for *causal* work on the IB
cluster (its "placed" column; the window weighed only in the NVLink column). A windowed call of the library solves
its placement for the window (``distattn.sharding.placement(cu, n, window=)``, on the cluster ``auto`` assumes), so
here, per seed: ring, balanced and zigzag on the windowed mask, and the placement solved for that mask on IB (nodes
of 8 GPUs, NVLink inside, 100 Gb/s InfiniBand across), each a training step (forward + backward) on the per-pair
timeline; ``auto`` = the least of the four. Reports auto's median step, its picks, and the best of the other three over
auto (worst / median / best seed). ``--window -1``: causal masks, the placement the library solves for them on IB
(the same table for today's solver; ``bench/placement_sweep.py``'s causal IB rows are the solver of its run).
``--ulysses 8``: every schedule also on a grid of 8 (a Ulysses row per node) x P/8 ring ranks (``distattn.choose``'s
two-dimensional candidates, ``distattn.schedule.cost.predict``: the ring level's plan on links 8 global ranks apart and
the all-to-alls); ``auto`` is then the least of all eight, and "best other" the least of ring, balanced and zigzag flat
or on the grid ("best flat other": flat only, the comparison without the grid). The last columns hold the figures to
perfect balance (the total compute over P: no schedule's step is shorter): the best other's step and its busiest
rank's compute (a grid's: the forward's busiest rank plus the backward's; where that is near 1, the best other is
balanced already and what is left to gain is communication) and auto's. Modelled, not measured; no GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: bench.placement_sweep

from bench.placement_sweep import SHAPES  # noqa: E402
from distattn.schedule import MaskSpec, Shapes, make_plan  # noqa: E402
from distattn.schedule.cli import document_lengths  # noqa: E402
from distattn.schedule.cluster import Cluster  # noqa: E402
from distattn.schedule.cost import predict  # noqa: E402
from distattn.schedule.masked import make_masked_plan  # noqa: E402
from distattn.schedule.placement import _place_cached  # noqa: E402
from distattn.schedule.timeline import step_timeline  # noqa: E402

OTHERS = ("ring", "balanced", "zigzag")


def one(job) -> dict:
    """One seed: every schedule's modelled step (s) on IB, flat and, with ``ulysses`` = U > 1, on a U x P/U grid
    (``"2d U=8 x placed"``: the ring level's plan on the per-pair timeline with links U apart, plus the all-to-alls,
    ``distattn.schedule.cost.predict``), and the placement's note."""
    docs, p, seed, n, window, ulysses = job
    mask = MaskSpec(causal=True, window=(window, 0) if window >= 0 else (-1, -1),
                    cu_seqlens=document_lengths(docs, p * n, seed=seed))
    ib, shapes = Cluster.preset("ib"), Shapes(seq_per_rank=n, **SHAPES)
    timed = {s: step_timeline(make_plan(p, True, s, mask=mask, chunk=n), shapes, ib) for s in OTHERS}
    lay = _place_cached.__wrapped__(mask, p, n, None, ib)
    timed["placed"] = step_timeline(make_masked_plan.__wrapped__(p, "placed", mask, n, lay), shapes, ib)
    steps = {s: t["makespan"] for s, t in timed.items()}
    busiest = {s: t["busiest"] for s, t in timed.items()}
    if ulysses > 1:
        for s in OTHERS + ("placed",):  # DISTATTN_LINK unset: the grid's placement is solved on the ib preset too
            cand = predict(p, shapes, s, ulysses, mask=mask, cluster=ib)
            steps[f"2d U={ulysses} x {s}"] = cand.total
            busiest[f"2d U={ulysses} x {s}"] = cand.compute_fwd + cand.compute_bwd
    return {"docs": docs, "P": p, "seed": seed, "steps": steps, "busiest": busiest,
            "stream": "the stream deal" in lay.note, "perfect": min(t["perfect"] for t in timed.values())}


def others(steps: dict, flat: bool = False) -> str:
    """The fastest of ring, balanced and zigzag, flat or on the grid (``flat``: flat only)."""
    return min((s for s in steps if s.split(" x ")[-1] in OTHERS and (" x " not in s or not flat)), key=steps.get)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", nargs="+", default=["longtail:2048"])
    ap.add_argument("--world", type=int, nargs="+", default=[64])
    ap.add_argument("--seeds", type=int, default=60)
    ap.add_argument("--seq-per-rank", type=int, default=4096)
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--ulysses", type=int, default=1,
                    help="also every schedule on a U x P/U grid (U = 8: a Ulysses row fills a node of the ib preset)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.ulysses > 1 and (os.environ.get("DISTATTN_LINK", "ib") != "ib" or "DISTATTN_GPUS_PER_NODE" in os.environ):
        ap.error("the grid's placement is solved on DISTATTN_LINK's cluster: unset DISTATTN_LINK and "
                 "DISTATTN_GPUS_PER_NODE (the ib preset, nodes of 8)")
    jobs = [(d, p, s, args.seq_per_rank, args.window, args.ulysses) for d in args.docs for p in args.world
            for s in range(args.seeds)]
    with ProcessPoolExecutor(args.jobs) as pool:
        found = list(pool.map(one, jobs))
    what = (f"window ({args.window}, 0)" if args.window >= 0 else "causal")
    lines = [f"`python bench/placement_ib_window.py --docs {' '.join(args.docs)} --world "
             f"{' '.join(map(str, args.world))} --seeds {args.seeds}"
             f"{' --window -1' if args.window < 0 else ''}{f' --ulysses {args.ulysses}' if args.ulysses > 1 else ''}`: "
             f"{what}, {args.seq_per_rank} "
             f"tokens per rank, LLaMA-3-8B attention shapes, IB (nodes of 8, 100 Gb/s across); the placement solved "
             f"for that mask on IB, as the library's call. Modelled, not measured.", "",
             "| docs | P | seeds | auto ms (median) | auto's picks | the stream deal kept | best other / auto: worst / "
             "median / best | best flat other / auto (median) | best other / perfect balance (median) | its busiest "
             "rank's compute / perfect balance (median) | auto / perfect balance (median) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for docs in args.docs:
        for p in args.world:
            rows = [r for r in found if r["docs"] == docs and r["P"] == p]
            auto = np.array([min(r["steps"].values()) for r in rows])
            best = [others(r["steps"]) for r in rows]
            other = np.array([r["steps"][b] for r, b in zip(rows, best)]) / auto
            flat = np.array([r["steps"][others(r["steps"], flat=True)] for r in rows]) / auto
            imbalance = np.array([r["busiest"][b] / r["perfect"] for r, b in zip(rows, best)])
            perfect = np.array([r["perfect"] for r in rows])
            picks = {}
            for r in rows:
                pick = min(r["steps"], key=r["steps"].get)
                picks[pick] = picks.get(pick, 0) + 1
            lines.append(f"| {docs} | {p} | {len(rows)} | {np.median(auto) * 1e3:.2f} | "
                         f"{', '.join(f'{k} {v}' for k, v in sorted(picks.items(), key=lambda kv: -kv[1]))} | "
                         f"{sum(r['stream'] for r in rows)} | {other.min():.2f} / {np.median(other):.2f} / "
                         f"{other.max():.2f} | {np.median(flat):.2f} | {np.median(other * auto / perfect):.2f} | "
                         f"{np.median(imbalance):.2f} | {np.median(auto / perfect):.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
