"""Render the plots of issue 24 item 5 from committed tables, for the before/after images.

    python bench/plots_fixed.py --out bench/results/plots-fixed/after

* ``time.png``, ``bytes.png``: ``bench/scaling.py``'s plots of ``bench/results/scaling-cpu-tiny/results.csv``;
* ``speedup-vs-P.png``, ``paper-setups.png``: ``bench/model.py plots`` (the cost model, assumed A100 rates);
* ``plan.png``: ``python -m distattn.memory plan --model llama-7b --gpus 8 --gpu-mem 80 --plot``.

Only the plotting functions' public signatures are used, so the same file renders the "before" images from an
older checkout (``bench/results/plots-fixed/README.md``).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCALING_CSV = ROOT / "bench" / "results" / "scaling-cpu-tiny" / "results.csv"
PLAN_ARGS = ["plan", "--model", "llama-7b", "--gpus", "8", "--gpu-mem", "80"]


def scaling_rows(path: Path = SCALING_CSV) -> list[dict]:
    """``results.csv`` as ``bench/scaling.py`` holds its rows in memory (numbers as numbers)."""
    rows = []
    for r in csv.DictReader(path.open()):
        rows.append({**r, "world": int(r["world"]), "tokens_per_rank": int(r["tokens_per_rank"])})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for the PNGs")
    out = Path(ap.parse_args(argv).out)
    out.mkdir(parents=True, exist_ok=True)
    from bench import model_report, scaling
    from bench.model import A100_ASSUMED
    from distattn.memory import cli as plan

    scaling.write_plots(scaling_rows(), out, cpu=True)
    model_report.write_plots(out, A100_ASSUMED)
    plan.main(PLAN_ARGS + ["--plot", str(out / "plan.png")])


if __name__ == "__main__":
    main()
