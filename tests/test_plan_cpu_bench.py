"""``bench/plan_cpu.py`` runs end to end, alone and side by side with a tree (here: this one)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rows(out: str) -> list[list[str]]:
    lines = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| docs")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines]


def test_the_table_has_a_row_per_schedule_and_size(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "plan_cpu.py"), "--world", "3", "5", "--docs", "uniform:256",
           "--seq-per-rank", "128", "--repeat", "1", "--out", str(tmp_path)]
    rows = _rows(subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300).stdout)
    assert [(r[1], r[2]) for r in rows] == [(p, s) for p in ("3", "5") for s in ("ring", "balanced", "zigzag", "placed")]
    assert all(float(r[4]) > 0 and float(r[5]) >= 0 for r in rows)
    assert (tmp_path / "results.csv").read_text().count("\n") == 1 + len(rows)


def test_side_by_side_fills_both_columns(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "plan_cpu.py"), "--before", str(ROOT), "--rounds", "1", "--world",
           "4", "--docs", "longtail:64", "--seq-per-rank", "64", "--repeat", "1", "--schedules", "ring", "placed"]
    rows = _rows(subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300).stdout)
    assert [r[2] for r in rows] == ["ring", "placed"] and all(len(r) == 8 for r in rows)
    assert all(float(x) >= 0 for r in rows for x in r[4:])
