"""bench/placement_goal.py: issue 39's goal table from the per-seed logs (no solve), on a synthetic sweep and logs."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import placement_goal as pg  # noqa: E402
from test_placement_worst import _sweep  # noqa: E402  (the sweep CSV's writer)

DOCS, P = "uniform:8192", 8


def _log(path, ratios, mask="causal"):
    path.write_text("".join(f"{DOCS} P={P} {mask} seed {s}: 9.999 -> {r:.3f} (a note)\n" for s, r in ratios.items()))


def test_every_seed_today_gives_exact_figures_and_the_goal(tmp_path):
    _sweep(tmp_path / "s.csv", {s: 1.2 + s / 100 for s in range(5)})
    _log(tmp_path / pg.TODAY[0], {0: 1.05, 1: 1.02, 2: 1.09, 3: 1.01, 4: 1.03})
    (row,) = pg.rows(tmp_path, tmp_path / "s.csv")
    assert row["before"] == "1.240 / 1.220 / 1.200" and row["after"] == "1.090 / 1.030 / 1.010"
    assert row["worst seed"] == 2 and row["how"] == "every seed, today's solver"
    assert (row["over before"], row["over after"]) == (5, 0) and abs(row["idle"] - (1 - 1 / 1.09)) < 1e-12
    assert "| **met** |" in pg.table([row])[2]


def test_seeds_of_an_earlier_solver_fill_in_and_are_said(tmp_path):
    _sweep(tmp_path / "s.csv", {s: 1.3 for s in range(4)})
    _log(tmp_path / pg.EARLIER[0], {0: 1.20, 1: 1.15, 2: 1.12, 3: 1.05})
    _log(tmp_path / pg.TODAY[-1], {0: 1.18})  # the worst re-solved today passes every earlier figure left: exact
    (row,) = pg.rows(tmp_path, tmp_path / "s.csv")
    assert row["after"].startswith("1.180 /") and row["over after"] == 3
    assert row["how"].startswith("1 worst re-solved today, 3 at an earlier solver: worst exact")
    _log(tmp_path / pg.TODAY[-1], {0: 1.10})  # now an earlier figure (1.15) is above it: a lower bound
    (row,) = pg.rows(tmp_path, tmp_path / "s.csv")
    assert row["worst seed"] == 1 and "worst a lower bound" in row["how"] and "seeds over upper bounds" in row["how"]
    assert "| not met |" in pg.table([row])[2]


def test_the_committed_logs_cover_every_setting_of_the_sweep():
    """The table of GOAL.md: every setting of the 200-seed sweep has today's figures for every seed, or says so."""
    rows = pg.rows()
    assert len(rows) == 24 and all(r["seeds"] == 200 for r in rows)
    assert all(r["how"] == "every seed, today's solver" or "re-solved today" in r["how"] for r in rows)


def test_the_reading_below_the_table_is_kept(tmp_path, monkeypatch):
    out = tmp_path / "GOAL.md"
    out.write_text(f"old table\n\n{pg.MARK}\n\n**Reading it.** by hand\n")
    monkeypatch.setattr(pg, "rows", lambda: [])
    pg.main(["--out", str(out)])
    text = out.read_text()
    assert "old table" not in text and text.endswith(f"{pg.MARK}\n\n**Reading it.** by hand\n")
