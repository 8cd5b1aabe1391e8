"""The goal's settings on a Ulysses x ring grid: the flat placement's figure beside the grid's (issue 39; modelled).

    python bench/placement_grid.py --docs pile:4 --world 64 --mask causal --ulysses 2 4 --seeds 200
    python bench/placement_grid.py --docs longtail:2048 --world 256 --mask causal --ulysses 2 4 8 --only 191

``distattn.choose`` weighs two-dimensional candidates beside the flat ones: ``U`` ranks of a Ulysses row (an all-to-all
over heads) times ``P / U`` ring ranks of ``U * n`` tokens, the placement solved for the ring level on its links
(``U`` global ranks apart) and its share of the heads. Per seed of one setting of ``bench/placement_goal.py``'s table:
the flat placement's step over perfect balance, read from today's per-seed logs (the figure ``GOAL.md`` reports; the
seeds no log holds are solved), and each grid's (``distattn.schedule.cost.predict``: the ring level on the per-pair
timeline plus the all-to-alls, on the NVLink preset), then the least of them, which is what a library's ``auto``
choosing the degree would run. Reports worst / median / best of the flat figure and of the least, the seeds over the
goal's 1.10x, and which degree the least took. Modelled, not measured; no GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.placement_goal import GOAL, TODAY, figures  # noqa: E402
from bench.placement_sweep import SHAPES  # noqa: E402
from bench.placement_worst import nvlink, solve, spec_of  # noqa: E402
from distattn.schedule import Shapes, make_plan  # noqa: E402
from distattn.schedule.cost import predict  # noqa: E402
from distattn.schedule.timeline import step_timeline  # noqa: E402


def one(job) -> dict:
    """One seed: ``{degree: step over perfect balance}`` (1: the flat placement, from a log when given)."""
    docs, p, mask, seed, n, degrees, flat = job
    os.environ["DISTATTN_LINK"] = "nvlink"  # the grid's placement is solved on the cluster it is timed on
    spec, cluster, shapes = spec_of(docs, p, mask, seed, n), nvlink(), Shapes(seq_per_rank=n, **SHAPES)
    perfect = step_timeline(make_plan(p, True, "ring", mask=spec, chunk=n), shapes, cluster)["perfect"]
    out = {1: flat if flat is not None else solve(docs, p, mask, seed, n)[0]}
    for u in degrees:
        out[u] = predict(p, shapes, "placed", u, mask=spec, cluster=cluster).total / perfect
    return {"seed": seed, "steps": out}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--mask", default="causal", help='"causal" or "window 4096"')
    ap.add_argument("--ulysses", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--only", type=int, nargs="+", help="these seeds only")
    ap.add_argument("--seq-per-rank", type=int, default=4096)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    logged = {}  # today's logs are all at 4096 tokens per rank: other shards are solved
    if args.seq_per_rank == 4096:
        logged = figures(TODAY).get((args.docs, args.world, args.mask), {})
    seeds = args.only or list(range(args.seeds))
    jobs = [(args.docs, args.world, args.mask, s, args.seq_per_rank, tuple(args.ulysses), logged.get(s))
            for s in seeds]
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(one, jobs))
    for r in rows:
        print(f"{args.docs} P={args.world} {args.mask} seed {r['seed']}: "
              + ", ".join(f"{'flat' if u == 1 else f'U={u}'} {x:.3f}" for u, x in r["steps"].items()), flush=True)
    flat = np.array([r["steps"][1] for r in rows])
    least = np.array([min(r["steps"].values()) for r in rows])
    took: dict = {}
    for r in rows:
        u = min(r["steps"], key=r["steps"].get)
        took[u] = took.get(u, 0) + 1
    print(f"\n{args.docs} P={args.world} {args.mask}, {len(rows)} seeds, degrees {args.ulysses}: flat "
          f"{flat.max():.3f} / {np.median(flat):.3f} / {flat.min():.3f} (worst / median / best, "
          f"{int((flat > GOAL).sum())} over {GOAL}x) -> the least {least.max():.3f} / {np.median(least):.3f} / "
          f"{least.min():.3f} ({int((least > GOAL).sum())} over); the least's degree: "
          + ", ".join(f"{'flat' if u == 1 else f'U={u}'} {c}" for u, c in sorted(took.items())))


if __name__ == "__main__":
    main()
