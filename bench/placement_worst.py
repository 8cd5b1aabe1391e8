"""The worst seed of a 200-seed sweep under today's solver, without re-running the sweep (issue 39).

    python bench/placement_worst.py --sweep bench/results/placement-sim/sweep-200.csv --world 256 --out <file>
    python bench/placement_worst.py --sweep bench/results/placement-sim/sweep-200-p8-64.csv --world 16 64 \
        --docs uniform:8192 --mask causal --max-seeds 200    (only those settings, every seed the bound needs)

A full ``bench/placement_sweep.py`` at P = 256 takes hours on 2 cores. When today's solver only *adds* candidates to
the solver the sweep ran (the same climb over group sizes, more windowed deals, the fastest kept), its step on the
per-pair timeline is never longer on any seed of a causal mask, so the worst seed follows from a few solves: re-solve
the seeds from the sweep's worst down, and stop once the next seed's step *in the sweep* (a bound of its step today)
is no longer than the worst found. The figure is then exact. Windowed masks have no such bound (a windowed solve also
falls back to the documents-only placement, whose choice can change): their worst seeds are re-solved up to
``--max-seeds`` and the figure is the largest of those, marked as such. The median is the sweep's (an upper bound
for causal masks). Every row names the seeds it re-solved; a causal seed that came out slower than in the sweep
breaks the premise and is reported. ``--log FILE``: the seeds' figures from an earlier run's per-seed log (its
stderr, ``docs P=.. mask seed S: old -> new (note)``) instead of the sweep; when the solver since then only added
candidates (the stream deal, ``distattn.schedule.streams``) they bound windowed seeds too (the documents-only
fallback is a causal solve, unchanged), and every mask stops early. ``--no-bound``: no early stop, causal or not,
for when the timeline itself changed since the sweep (the backward's head of the local pair, ``Plan.head_task``,
moved every plan's step, most down, some up: the sweep no longer bounds today); with ``--max-seeds 200`` every seed is
re-solved and the row is exact, with today's median.
``--breakdown``: and, per setting, where its worst seed's step goes (:func:`breakdown`: the busiest rank's compute,
free links, no latency, as is). ``--latency-us L``: a what-if, NVLink's per-message latency ``L`` microseconds
instead of the preset's 3 (an assumption: no measurement of it exists here); each seed is solved for that link and
timed on it, with no early stop, and "sweep worst" is the log's (or sweep's) figure at 3 us. How much of a worst
seed's excess the latency holds::

    python bench/placement_worst.py --log bench/results/placement-sim/worst-64-all.log --world 64 --mask causal \
        --max-seeds 8 --latency-us 0

Per setting (docs, P, mask) of the sweep, NVLink, the library's placement (causal: ``placed``; windowed: ``placed,
window weighed``, solved for the window), on the per-pair timeline (``distattn.schedule.timeline``) over perfect
balance. Modelled, not measured; no GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: bench.placement_sweep

from bench.placement_compare import load  # noqa: E402
from bench.placement_sweep import SHAPES  # noqa: E402
from distattn.schedule import MaskSpec, Shapes  # noqa: E402
from distattn.schedule.cli import document_lengths  # noqa: E402
from distattn.schedule.cluster import Cluster, Link  # noqa: E402
from distattn.schedule.masked import make_masked_plan  # noqa: E402
from distattn.schedule.placement import _place_cached  # noqa: E402
from distattn.schedule.timeline import step_timeline  # noqa: E402


ROUNDING = 5e-5
"""The sweep's CSV holds the ratios to 4 decimals: a seed's figure today may pass its CSV figure by this much."""


def sweep_rows(path: Path, worlds) -> dict:
    """``{(docs, P, mask): [(ratio, seed), ..]}``: the sweep's library placement on NVLink, the worst seed first."""
    out = {}
    for (docs, p, mask, seed), (ratio, _) in load(path).items():
        if p in worlds:
            out.setdefault((docs, p, mask), []).append((ratio, seed))
    return {k: sorted(v, key=lambda x: (-x[0], x[1])) for k, v in out.items()}


def nvlink(latency: float | None = None) -> Cluster:
    """The NVLink preset; ``latency`` (s per message, ``None``: the preset's) a what-if of another per-message latency
    (the placement is then solved for it, and timed on it)."""
    cluster = Cluster.preset("nvlink")
    if latency is None:
        return cluster
    link = dataclasses.replace(cluster.intra, latency=latency)
    return dataclasses.replace(cluster, intra=link, inter=link)


def solve(docs: str, p: int, mask: str, seed: int, n: int,
          latency: float | None = None) -> tuple[float, int, float, float, str]:
    """Today's library placement of one seed: (step over perfect balance, group, partials="input" what-if, CPU s of
    the uncached solve, the layout's note); ``latency``: :func:`nvlink`'s what-if."""
    layout, plan, cluster, shapes, t = _solved(docs, p, mask, seed, n, latency)
    return (step_timeline(plan, shapes, cluster)["ratio"], layout.group,
            step_timeline(plan, shapes, cluster, partials="input")["ratio"], t, layout.note)


def spec_of(docs: str, p: int, mask: str, seed: int, n: int) -> MaskSpec:
    """The mask of one seed of a setting: its documents over ``p * n`` tokens, causal or ``"window W"``."""
    win = (-1, -1) if mask == "causal" else (int(mask.split()[1]), 0)
    return MaskSpec(causal=True, window=win, cu_seqlens=document_lengths(docs, p * n, seed=seed))


def _solved(docs: str, p: int, mask: str, seed: int, n: int, latency: float | None):
    """One seed's placement solved uncached: ``(layout, its plan, the cluster, the shapes, CPU s of the solve)``."""
    spec = spec_of(docs, p, mask, seed, n)
    cluster, shapes = nvlink(latency), Shapes(seq_per_rank=n, **SHAPES)
    t = time.thread_time()
    layout = _place_cached.__wrapped__(spec, p, n, None, cluster)
    t = time.thread_time() - t
    return layout, make_masked_plan.__wrapped__(p, "placed", spec, n, layout), cluster, shapes, t


def breakdown(docs: str, p: int, mask: str, seed: int, n: int, latency: float | None = None) -> str:
    """Where one seed's step goes: its placement (solved as :func:`solve` does) timed with the busiest rank's compute
    alone (a bound of any order of that plan), on free links (no bytes, no latency: the plan's order), with the link's
    bandwidth and no latency, and as is, each over perfect balance: ``"busiest / free / no latency / as is"``."""
    _, plan, cluster, shapes, _ = _solved(docs, p, mask, seed, n, latency)
    free = Link(name="free", bandwidth=float("inf"), latency=0.0)
    links = (dataclasses.replace(cluster, intra=free, inter=free), nvlink(0.0), cluster)
    step = step_timeline(plan, shapes, cluster)
    return " / ".join(f"{x:.3f}" for x in [step["busiest"] / step["perfect"]] +
                      [step_timeline(plan, shapes, c)["ratio"] for c in links])


def log_rows(path: Path, worlds) -> dict:
    """:func:`sweep_rows` from a per-seed log of this script (the figure after the arrow: that run's solver)."""
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^(\S+) P=(\d+) (causal|window \d+) seed (\d+): [\d.]+ -> ([\d.]+) ", line)
        if m and int(m[2]) in worlds:
            out.setdefault((m[1], int(m[2]), m[3]), {})[int(m[4])] = float(m[5])
    return {k: sorted(((r, s) for s, r in v.items()), key=lambda x: (-x[0], x[1])) for k, v in out.items()}


def one(job) -> dict:
    (docs, p, mask), seeds, n, cap, *rest = job
    bound = rest[0] if rest else True  # the sweep's figures bound today's (causal): stop once the bound closes
    every = len(rest) > 1 and rest[1]  # figures of a solver this one only adds candidates to: windowed bound too
    latency = rest[2] if len(rest) > 2 else None  # the what-if of another per-message latency: no bound holds
    split = len(rest) > 3 and rest[3]  # the worst seed's breakdown (busiest / free / no latency / as is)
    bound = bound and latency is None
    exact, found, worse = (mask == "causal" or every) and bound, [], []
    rounding = 5e-4 if every else ROUNDING  # a log holds 3 decimals
    for i, (old, seed) in enumerate(seeds):
        if found and exact and old + rounding <= max(f[0] for f in found):
            break  # every seed left: today's step <= the sweep's <= the worst found
        if i >= cap:
            exact = False
            break
        ratio, group, half, t, note = solve(docs, p, mask, seed, n, latency)
        found.append((ratio, seed, group, half, old, t))
        if ratio > old + rounding:
            worse.append(f"{seed}: {old:.3f} -> {ratio:.3f}")
        print(f"{docs} P={p} {mask} seed {seed}: {old:.3f} -> {ratio:.3f} ({note})", file=sys.stderr, flush=True)
    if len(found) == len(seeds):
        exact = True  # every seed of the sweep re-solved
    top = max(found)
    return {"docs": docs, "P": p, "mask": mask, "sweep worst": f"{seeds[0][0]:.3f} (seed {seeds[0][1]})",
            "today worst": f"{top[0]:.3f} (seed {top[1]}, group {top[2]})" + (
                "" if exact or mask != "causal" and not every else " (cap reached)"),
            "exact": (f"yes: all {len(found)} re-solved" if len(found) == len(seeds) else "yes") if exact else
                     f"no: the {len(found)} worst re-solved",
            "partials input, that seed": f"{top[3]:.3f}",
            "sweep median": f"{float(np.median([s[0] for s in seeds])):.3f}",
            "today median": f"{float(np.median([f[0] for f in found])):.3f}" if len(found) == len(seeds) else "-",
            "re-solved": len(found),
            "solve CPU s (max / median)": f"{max(f[5] for f in found):.1f} / "
                                           f"{float(np.median([f[5] for f in found])):.1f}",
            "slower than the sweep": "; ".join(worse) or "none",
            **({"worst seed: busiest rank / free links / no latency / as is":
                breakdown(docs, p, mask, top[1], n, latency)} if split else {})}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", type=Path, default=Path("bench/results/placement-sim/sweep-200.csv"))
    ap.add_argument("--world", type=int, nargs="+", default=[256])
    ap.add_argument("--seq-per-rank", type=int, default=4096)
    ap.add_argument("--max-seeds", type=int, default=20, help="re-solve at most this many seeds per setting")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--docs", nargs="+", help="only these distributions (e.g. uniform:8192)")
    ap.add_argument("--mask", nargs="+", help="only these masks of the sweep ('causal', 'window 4096')")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--log", type=Path, help="the seeds' figures from an earlier run's per-seed log (module docstring)")
    ap.add_argument("--no-bound", action="store_true",
                    help="re-solve the worst --max-seeds seeds, no early stop (the timeline changed since the sweep)")
    ap.add_argument("--breakdown", action="store_true",
                    help="and the worst seed's step: its busiest rank alone, free links, no latency (one solve more)")
    ap.add_argument("--latency-us", type=float,
                    help="what-if: NVLink's per-message latency in microseconds (the preset: 3); no early stop")
    args = ap.parse_args(argv)
    rows = log_rows(args.log, set(args.world)) if args.log else sweep_rows(args.sweep, set(args.world))
    latency = None if args.latency_us is None else args.latency_us * 1e-6
    jobs = [(key, seeds, args.seq_per_rank, args.max_seeds, not args.no_bound, args.log is not None, latency,
             args.breakdown)
            for key, seeds in sorted(rows.items())
            if (not args.docs or key[0] in args.docs) and (not args.mask or key[2] in args.mask)]
    with ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(one, jobs))
    cols = list(results[0])
    only = "".join(f" --{k} " + " ".join(f"'{x}'" if " " in x else x for x in v)
                   for k, v in (("docs", args.docs), ("mask", args.mask)) if v)
    only += " --no-bound" if args.no_bound else ""
    only += f" --latency-us {args.latency_us:g}" if latency is not None else ""
    only += " --breakdown" if args.breakdown else ""
    source = f"--log {args.log}" if args.log else f"--sweep {args.sweep}"
    what_if = "" if latency is None else f" with {args.latency_us:g} us per message (a what-if; the preset: 3 us)"
    lines = [f"`python bench/placement_worst.py {source} --world {' '.join(map(str, args.world))} "
             f"--max-seeds {args.max_seeds}{only}`: NVLink{what_if}, {args.seq_per_rank} tokens per rank, "
             f"LLaMA-3-8B attention shapes; the library's placement over perfect balance on the per-pair timeline. "
             f"Modelled, not measured.",
             "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in results]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
