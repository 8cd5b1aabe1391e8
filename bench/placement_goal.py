"""Where issue 39's goal stands, every setting at once: worst / median / best seed before and after, from the logs.

    python bench/placement_goal.py --out bench/results/placement-sim/GOAL.md            # from the logs, seconds
    python bench/placement_goal.py --out bench/results/placement-sim/GOAL.md --lockstep # and each worst seed's plan
                                                                                         # on the lockstep model

No solve runs without ``--lockstep``: "before" is the first 200-seed sweep on the per-pair timeline (``sweep-200.csv``,
``SWEEP-200.md``: the library's placement of 97b1974, its per-pair and lockstep figures), "after" the per-seed logs of
``bench/placement_worst.py`` under today's solver (:data:`TODAY`, newest first: a seed's figure comes from the first
log that holds it). Where today's logs hold fewer than the sweep's seeds of a setting, the rest come from the logs of
an earlier solver (:data:`EARLIER`: every seed at P = 256), and the row says how many; for a causal mask the worst is
then called exact when the re-solved seeds' worst passes every earlier figure left (an earlier solver's figure bounds
today's, nearly: re-solved, 13 of 400 causal seeds at P = 256 came out 0.002-0.028 slower, none of them a worst seed),
and the median and the seeds over the goal are upper bounds. Compute idle is ``1 - 1 / ratio`` (the step over perfect
balance: the share of the ranks' time not computing). ``--lockstep``: each setting's worst seed after is solved again
and its plan put on the lockstep model (``distattn.schedule.sim``: every step as long as its largest pair, the figure
every balance claim used before the per-pair timeline), beside its per-pair figure. NVLink (the preset: 300 GB/s, an
assumed 3 us per message), 4096 tokens per rank, LLaMA-3-8B attention shapes. Modelled, not measured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: bench.placement_worst

from bench.placement_compare import WEIGHED, load  # noqa: E402
from bench.placement_worst import log_rows  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "placement-sim"
SWEEP = RESULTS / "sweep-200.csv"
TODAY = ("uniform-256.log", "causal-256.log", "pile-256-window.log", "goal-fill.log", "loose-256-longtail-window.log",
         "loose-64.log", "loose-8-16.log", "pool-8-16.log", "pool-64.log", "pool-u64.log", "pool-256.log")
"""Per-seed logs of today's solver, newest first (``EVEN-LOOSE.md``, ``DEEPER-POOL.md``, ``GOAL.md``)."""
EARLIER = ("worst-256-all.log", "worst-256-window-all.log")
"""Every seed at P = 256 under earlier solvers (``WORST-256-ALL.md``, ``WORST-256-WINDOW-ALL.md``)."""
WORLDS = (8, 16, 64, 256)
MARK = "<!-- the reading below is kept when the table above is written again -->"
GOAL = 1.10


def figures(names, results: Path = RESULTS) -> dict:
    """``(docs, P, mask) -> {seed: ratio}``, the first log holding a seed giving its figure."""
    out: dict = {}
    for name in names:
        path = results / name
        if not path.exists():
            continue
        for setting, rows in log_rows(path, WORLDS).items():
            seeds = out.setdefault(setting, {})
            for ratio, seed in rows:
                seeds.setdefault(seed, ratio)
    return out


def _wmb(values) -> str:
    v = np.asarray(values)
    return f"{v.max():.3f} / {np.median(v):.3f} / {v.min():.3f}"


def rows(results: Path = RESULTS, sweep: Path = SWEEP) -> list[dict]:
    """One row per setting of the sweep: before, after, seeds over the goal, where the figures come from."""
    import csv

    before = load(sweep)
    lock: dict = {}
    for r in csv.DictReader(sweep.open()):
        want = "placed" if r["mask"] == "causal" else WEIGHED  # the rows load() reads
        if r["link"] == "nvlink" and r["schedule"] == want:
            lock[(r["docs"], int(r["P"]), r["mask"], int(r["seed"]))] = float(r["lockstep / perfect"])
    today, earlier = figures(TODAY, results), figures(EARLIER, results)
    out = []
    for setting in sorted({k[:3] for k in before}, key=lambda s: (s[0], s[1], s[2] != "causal")):
        seeds = sorted(k[3] for k in before if k[:3] == setting)
        b = [before[(*setting, s)][0] for s in seeds]
        new = today.get(setting, {})
        old = earlier.get(setting, {})
        a = {s: new[s] if s in new else old.get(s) for s in seeds}
        missing = [s for s in seeds if a[s] is None]
        fresh = [s for s in seeds if s in new]
        after = [a[s] for s in seeds if a[s] is not None]
        if not after:
            continue  # no log of this setting
        worst_seed = max((s for s in seeds if a[s] is not None), key=lambda s: (a[s], -s))
        if len(fresh) == len(seeds):
            how = "every seed, today's solver"
        elif missing:
            how = f"{len(after)} of {len(seeds)} seeds"
        else:
            left = max((old[s] for s in seeds if s not in new), default=0.0)
            exact = setting[2] == "causal" and max(new[s] for s in fresh) >= left
            how = (f"{len(fresh)} worst re-solved today, {len(seeds) - len(fresh)} at an earlier solver: worst "
                   f"{'exact' if exact else 'a lower bound'}, median and seeds over upper bounds")
        out.append({"docs": setting[0], "P": setting[1], "mask": setting[2], "seeds": len(seeds),
                    "before": _wmb(b), "lockstep before": _wmb([lock[(*setting, s)] for s in seeds]),
                    "after": _wmb(after), "worst seed": worst_seed, "worst": a[worst_seed],
                    "idle": 1 - 1 / max(after), "over before": sum(x > GOAL for x in b),
                    "over after": sum(x > GOAL for x in after), "how": how})
    return out


def lockstep_of(docs: str, p: int, mask: str, seed: int) -> tuple[float, float]:
    """``(per-pair, lockstep)`` over perfect balance of one seed's placement, solved again."""
    from bench.placement_sweep import _lockstep
    from bench.placement_worst import _solved
    from distattn.schedule.timeline import step_timeline

    _, plan, cluster, shapes, _ = _solved(docs, p, mask, seed, 4096, None)
    return step_timeline(plan, shapes, cluster)["ratio"], _lockstep(plan)


def table(rows_: list[dict], lockstep: dict | None = None) -> list[str]:
    head = ("| docs | P | mask | seeds | before: worst / median / best | lockstep, before | after: worst / median / "
            "best | worst seed | compute idle, worst | over 1.10x, before -> after | goal | after from |")
    lines = [head + (" worst seed: per-pair / lockstep |" if lockstep else ""),
             "|" + "---|" * (12 + bool(lockstep))]
    for r in rows_:
        met = "**met**" if r["over after"] == 0 and "lower bound" not in r["how"] else "not met"
        line = (f"| {r['docs']} | {r['P']} | {r['mask']} | {r['seeds']} | {r['before']} | {r['lockstep before']} | "
                f"{r['after']} | {r['worst seed']} | {r['idle']:.1%} | {r['over before']} -> {r['over after']} | "
                f"{met} | {r['how']} |")
        if lockstep:
            pair, lock = lockstep[(r["docs"], r["P"], r["mask"])]
            line += f" {pair:.3f} / {lock:.3f} |"
        lines.append(line)
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--lockstep", action="store_true", help="solve each worst seed again: its lockstep figure")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    found = rows()
    lockstep = None
    if args.lockstep:
        from concurrent.futures import ProcessPoolExecutor

        keys = [(r["docs"], r["P"], r["mask"], r["worst seed"]) for r in found]
        with ProcessPoolExecutor(args.jobs) as ex:
            lockstep = {k[:3]: v for k, v in zip(keys, ex.map(lockstep_of, *zip(*keys)))}
    cmd = "python bench/placement_goal.py" + (" --lockstep" if args.lockstep else "")
    about = __doc__.split("\n\n")[2].replace("\n", " ").replace("``", "`").replace(":data:", "")  # markdown
    text = "\n".join(["# Where issue 39's goal stands: every setting, every seed (modelled)", "",
                       f"`{cmd}`: {about}", "", *table(found, lockstep), ""])
    print(text)
    if args.out:  # what is written below the table by hand (after MARK) is kept
        kept = args.out.read_text().partition(MARK)[2] if args.out.exists() else ""
        args.out.write_text(text + (f"\n{MARK}{kept}" if kept else ""))


if __name__ == "__main__":
    main()
