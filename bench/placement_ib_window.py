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
(the same table for today's solver; ``bench/placement_sweep.py``'s causal IB rows are the solver of its run). Modelled,
not measured; no GPU.
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: bench.placement_sweep

from bench.placement_sweep import SHAPES  # noqa: E402
from distattn.schedule import MaskSpec, Shapes, make_plan  # noqa: E402
from distattn.schedule.cli import document_lengths  # noqa: E402
from distattn.schedule.cluster import Cluster  # noqa: E402
from distattn.schedule.masked import make_masked_plan  # noqa: E402
from distattn.schedule.placement import _place_cached  # noqa: E402
from distattn.schedule.timeline import step_timeline  # noqa: E402

OTHERS = ("ring", "balanced", "zigzag")


def one(job) -> dict:
    """One seed: every schedule's modelled step (s) on IB, and the placement's note."""
    docs, p, seed, n, window = job
    mask = MaskSpec(causal=True, window=(window, 0) if window >= 0 else (-1, -1),
                    cu_seqlens=document_lengths(docs, p * n, seed=seed))
    ib, shapes = Cluster.preset("ib"), Shapes(seq_per_rank=n, **SHAPES)
    timed = {s: step_timeline(make_plan(p, True, s, mask=mask, chunk=n), shapes, ib) for s in OTHERS}
    lay = _place_cached.__wrapped__(mask, p, n, None, ib)
    timed["placed"] = step_timeline(make_masked_plan.__wrapped__(p, "placed", mask, n, lay), shapes, ib)
    return {"docs": docs, "P": p, "seed": seed, "steps": {s: t["makespan"] for s, t in timed.items()},
            "stream": "the stream deal" in lay.note, "perfect": min(t["perfect"] for t in timed.values())}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", nargs="+", default=["longtail:2048"])
    ap.add_argument("--world", type=int, nargs="+", default=[64])
    ap.add_argument("--seeds", type=int, default=60)
    ap.add_argument("--seq-per-rank", type=int, default=4096)
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    jobs = [(d, p, s, args.seq_per_rank, args.window) for d in args.docs for p in args.world for s in range(args.seeds)]
    with ProcessPoolExecutor(args.jobs) as pool:
        found = list(pool.map(one, jobs))
    what = (f"window ({args.window}, 0)" if args.window >= 0 else "causal")
    lines = [f"`python bench/placement_ib_window.py --docs {' '.join(args.docs)} --world "
             f"{' '.join(map(str, args.world))} --seeds {args.seeds}"
             f"{' --window -1' if args.window < 0 else ''}`: {what}, {args.seq_per_rank} "
             f"tokens per rank, LLaMA-3-8B attention shapes, IB (nodes of 8, 100 Gb/s across); the placement solved "
             f"for that mask on IB, as the library's call. Modelled, not measured.", "",
             "| docs | P | seeds | auto ms (median) | auto's picks | the stream deal kept | best other / auto: worst / "
             "median / best |", "|---|---|---|---|---|---|---|"]
    for docs in args.docs:
        for p in args.world:
            rows = [r for r in found if r["docs"] == docs and r["P"] == p]
            auto = np.array([min(r["steps"].values()) for r in rows])
            other = np.array([min(r["steps"][s] for s in OTHERS) for r in rows]) / auto
            picks = {}
            for r in rows:
                pick = min(r["steps"], key=r["steps"].get)
                picks[pick] = picks.get(pick, 0) + 1
            lines.append(f"| {docs} | {p} | {len(rows)} | {np.median(auto) * 1e3:.2f} | "
                         f"{', '.join(f'{k} {v}' for k, v in sorted(picks.items(), key=lambda kv: -kv[1]))} | "
                         f"{sum(r['stream'] for r in rows)} | {other.min():.2f} / {np.median(other):.2f} / "
                         f"{other.max():.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
