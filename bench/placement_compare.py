"""Two runs of the placement sweep side by side (issue 39): the library's placed step over perfect balance, before and
after, seed by seed.

    python bench/placement_compare.py BEFORE.csv AFTER.csv --out COMPARE.md

Both files are ``bench/placement_sweep.py``'s rows (``sweep.csv``). Per setting (documents, P, mask) on NVLink: the
step over perfect balance of what the library runs (``placed`` for causal rows, ``placed, window weighed`` for windowed
ones, the solver given the call's window), worst / median / best over the seeds both runs hold; how many seeds got
faster and slower; how many are above the issue's 1.10x; the worst compute idle. Modelled figures, as the rows are.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np

GOAL = 1.10
WEIGHED = "placed, window weighed"


def load(path: Path) -> dict:
    """``(docs, P, mask, seed) -> (step over perfect, compute idle)`` of the library's plan, NVLink, from a sweep's CSV
    (``bench/placement_sweep.py``; also read by ``placement_worst.py`` and ``placement_diagnose.py --whatif``)."""
    out = {}
    for r in csv.DictReader(path.open()):
        want = "placed" if r["mask"] == "causal" else WEIGHED
        if r["link"] == "nvlink" and r["schedule"] == want:
            out[(r["docs"], int(r["P"]), r["mask"], int(r["seed"]))] = (float(r["per-pair / perfect"]),
                                                                         float(r["compute idle"]))
    return out


def _stats(v) -> str:
    v = np.asarray(v)
    return f"{v.max():.3f} / {np.median(v):.3f} / {v.min():.3f}"


def compare(before: dict, after: dict) -> list[str]:
    settings = sorted({k[:3] for k in before} & {k[:3] for k in after})
    lines = ["| docs | P | mask | seeds | before: worst / median / best | after: worst / median / best | faster | "
             f"slower | above {GOAL:.2f}x, before | after | compute idle, worst before | after |", "|" + "---|" * 12]
    for s in settings:
        seeds = sorted(k[3] for k in before if k[:3] == s and (*s, k[3]) in after)
        b = np.array([before[(*s, x)][0] for x in seeds])
        a = np.array([after[(*s, x)][0] for x in seeds])
        ib = max(before[(*s, x)][1] for x in seeds)
        ia = max(after[(*s, x)][1] for x in seeds)
        lines.append(f"| {s[0]} | {s[1]} | {s[2]} | {len(seeds)} | {_stats(b)} | {_stats(a)} | "
                     f"{int((a < b - 5e-4).sum())} | {int((a > b + 5e-4).sum())} | {int((b > GOAL).sum())} | "
                     f"{int((a > GOAL).sum())} | {ib:.1%} | {ia:.1%} |")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    text = "\n".join(compare(load(args.before), load(args.after))) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
