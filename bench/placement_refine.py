"""The placement before and after the windowed deal (issue 39): the placed step over perfect balance, per seed.

    python bench/placement_refine.py --seeds 20 --world 8 16 64 --out /tmp/refine
    python bench/placement_refine.py --seed-list 57 197 113 --world 256 --out /tmp/refine-256

For every document distribution, P and seed (4096 tokens per rank, LLaMA-3-8B attention shapes, causal): the solver of
commit BEFORE (read from git) and today's, each solved and timed on the same cluster (NVLink, and with --ib the IB
preset too), on the per-pair timeline (``distattn.schedule.timeline``); the step over perfect balance, the group, and
the CPU time of one uncached solve. Only the placed schedule (``bench/placement_sweep.py`` has the others). Writes
refine.csv and REFINE.md (worst / median / best per setting). Modelled, not measured; no GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: bench.placement_sweep

from bench.placement_sweep import SHAPES, _old_place, _stats, run_jobs  # noqa: E402
from distattn.schedule import MaskSpec, Shapes  # noqa: E402
from distattn.schedule.cli import document_lengths  # noqa: E402
from distattn.schedule.cluster import Cluster  # noqa: E402
from distattn.schedule.masked import make_masked_plan  # noqa: E402
from distattn.schedule.placement import _place_cached  # noqa: E402
from distattn.schedule.timeline import step_timeline  # noqa: E402

BEFORE = "891bca2"  # main before the windowed deal


def one(job):
    docs, p, seed, n, links = job
    old = _old_place(BEFORE)
    shapes = Shapes(seq_per_rank=n, **SHAPES)
    spec = MaskSpec(causal=True, cu_seqlens=document_lengths(docs, p * n, seed=seed))
    rows = []
    for link in links:
        cluster = Cluster.preset(link)
        for name, solve in (("before", old._place_cached.__wrapped__), ("after", _place_cached.__wrapped__)):
            t = time.thread_time()
            lay = solve(spec, p, n, None, cluster)
            ms = (time.thread_time() - t) * 1e3
            tl = step_timeline(make_masked_plan.__wrapped__(p, "placed", spec, n, lay), shapes, cluster)
            rows.append({"docs": docs, "P": p, "seed": seed, "link": link, "solver": name,
                         "per-pair / perfect": round(tl["ratio"], 4), "step ms": round(tl["makespan"] * 1e3, 4),
                         "compute idle": round(tl["compute_idle"], 4), "group": lay.group,
                         "windowed": int("windows" in lay.note), "solver ms": round(ms, 2)})
    return rows


def _column(by_seed: dict, field: str) -> np.ndarray:
    return np.asarray([by_seed[s][field] for s in sorted(by_seed)], dtype=float)


def summary(rows) -> list[str]:
    head = ("| link | docs | P | seeds | before: worst / median / best | after: worst / median / best | seeds improved "
            "| windowed picked | solver ms before (median / max) | after (median / max) |")
    out = [head, "|" + "---|" * 10]
    for key in sorted({(r["link"], r["docs"], r["P"]) for r in rows}):
        sel = [r for r in rows if (r["link"], r["docs"], r["P"]) == key]
        b = {r["seed"]: r for r in sel if r["solver"] == "before"}
        a = {r["seed"]: r for r in sel if r["solver"] == "after"}
        better = sum(a[s]["step ms"] < b[s]["step ms"] * (1 - 1e-9) for s in a)
        mb, ma = _column(b, "solver ms"), _column(a, "solver ms")
        out.append(f"| {key[0]} | {key[1]} | {key[2]} | {len(a)} | {_stats(_column(b, 'per-pair / perfect'))} | "
                   f"{_stats(_column(a, 'per-pair / perfect'))} | {better} | {sum(r['windowed'] for r in a.values())} "
                   f"| {np.median(mb):.0f} / {mb.max():.0f} | {np.median(ma):.0f} / {ma.max():.0f} |")
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--world", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--docs", nargs="+", default=["uniform:8192", "longtail:2048", "pile:4"])
    parser.add_argument("--seeds", type=int, default=20, help="seeds 0 .. N-1")
    parser.add_argument("--seed-list", type=int, nargs="+", default=None, help="these seeds instead")
    parser.add_argument("--seq-per-rank", type=int, default=4096)
    parser.add_argument("--ib", action="store_true", help="also solve and time on the IB preset")
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args(argv)
    seeds = args.seed_list if args.seed_list is not None else list(range(args.seeds))
    links = ("nvlink", "ib") if args.ib else ("nvlink",)
    jobs = [(d, p, s, args.seq_per_rank, links) for d in args.docs for p in args.world for s in seeds]
    rows = run_jobs(one, jobs, args.jobs, args.out / "refine.csv", every=1)
    cmd = " ".join(["python bench/placement_refine.py", *(argv if argv is not None else sys.argv[1:])])
    head = (f"`{cmd}`: the placed step over perfect balance on the per-pair timeline, causal, {args.seq_per_rank} "
            f"tokens per rank, LLaMA-3-8B shapes; before = commit {BEFORE}'s solver. Modelled, not measured.")
    text = [head, "", *summary(rows), ""]
    (args.out / "REFINE.md").write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
