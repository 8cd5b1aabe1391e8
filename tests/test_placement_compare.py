"""bench/placement_compare.py: two sweeps' rows side by side (issue 39's before/after report)."""

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ["docs", "P", "seed", "mask", "link", "schedule", "step ms", "per-pair / perfect", "compute idle",
          "lockstep / perfect", "group", "solver ms"]


def _write(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for docs, p, seed, mask, link, schedule, ratio, idle in rows:
            w.writerow({"docs": docs, "P": p, "seed": seed, "mask": mask, "link": link, "schedule": schedule,
                        "step ms": 1.0, "per-pair / perfect": ratio, "compute idle": idle, "lockstep / perfect": 1.0,
                        "group": "", "solver ms": ""})


def test_before_and_after_per_setting(tmp_path):
    before, after = tmp_path / "b.csv", tmp_path / "a.csv"
    _write(before, [("u", 8, 0, "causal", "nvlink", "placed", 1.30, 0.2),
                    ("u", 8, 1, "causal", "nvlink", "placed", 1.05, 0.05),
                    ("u", 8, 0, "causal", "ib", "placed", 9.0, 0.9),  # another link: not read
                    ("u", 8, 0, "causal", "nvlink", "ring", 3.0, 0.6),  # another schedule: not read
                    ("u", 8, 0, "window 4", "nvlink", "placed, window weighed", 1.2, 0.1),
                    ("u", 8, 0, "window 4", "nvlink", "placed", 5.0, 0.1)])  # windowed: the weighed row is read
    _write(after, [("u", 8, 0, "causal", "nvlink", "placed", 1.08, 0.07),
                   ("u", 8, 1, "causal", "nvlink", "placed", 1.06, 0.06),
                   ("u", 8, 2, "causal", "nvlink", "placed", 4.0, 0.7),  # a seed only one run holds: left out
                   ("u", 8, 0, "window 4", "nvlink", "placed, window weighed", 1.15, 0.09)])
    out = tmp_path / "c.md"
    subprocess.run([sys.executable, str(ROOT / "bench" / "placement_compare.py"), str(before), str(after), "--out",
                    str(out)], check=True, capture_output=True, cwd=ROOT)
    lines = out.read_text().splitlines()
    assert lines[2] == ("| u | 8 | causal | 2 | 1.300 / 1.175 / 1.050 | 1.080 / 1.070 / 1.060 | 1 | 1 | 1 | 0 | 20.0% "
                        "| 7.0% |")
    assert lines[3] == ("| u | 8 | window 4 | 1 | 1.200 / 1.200 / 1.200 | 1.150 / 1.150 / 1.150 | 1 | 0 | 1 | 1 "
                        "| 10.0% | 9.0% |")
    assert len(lines) == 4
