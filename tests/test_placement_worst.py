"""bench/placement_worst.py: the worst seed of a sweep under today's solver from a few solves (issue 39's report)."""

import csv
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import placement_worst as pw  # noqa: E402

FIELDS = ["docs", "P", "seed", "mask", "link", "schedule", "step ms", "per-pair / perfect", "compute idle",
          "lockstep / perfect", "group", "solver ms"]
DOCS, P, N = "uniform:8192", 8, 1024


def _sweep(path, ratios, mask="causal"):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for seed, ratio in ratios.items():
            for link in ("nvlink", "ib"):  # the IB rows are not read
                w.writerow({"docs": DOCS, "P": P, "seed": seed, "mask": mask, "link": link,
                            "schedule": "placed" if mask == "causal" else "placed, window weighed", "step ms": 1.0,
                            "per-pair / perfect": ratio if link == "nvlink" else 99.0, "compute idle": 0.1,
                            "lockstep / perfect": 1.0, "group": 8, "solver ms": 1.0})


def test_causal_worst_seed_stops_once_the_bound_closes(tmp_path):
    """Sweep figures equal to today's: the worst seed alone is re-solved (every other seed's sweep figure, a bound of
    its figure today, is no larger). One seed's sweep figure raised above the others: it is re-solved first, comes out
    lower, and the search goes on to the next seeds until the bound closes; the worst is today's exact figure."""
    today = {s: pw.solve(DOCS, P, "causal", s, N)[0] for s in range(6)}
    worst = max(today, key=today.get)
    path = tmp_path / "s.csv"
    _sweep(path, today)
    row = pw.one(((DOCS, P, "causal"), pw.sweep_rows(path, {P})[(DOCS, P, "causal")], N, 20))
    assert row["re-solved"] == 1 and row["exact"] == "yes"
    assert row["today worst"].startswith(f"{today[worst]:.3f} (seed {worst},")
    raised = dict(today)
    other = min(today, key=today.get)
    raised[other] = today[worst] + 0.5  # as if the sweep's solver had done worse on this seed
    _sweep(path, raised)
    row = pw.one(((DOCS, P, "causal"), pw.sweep_rows(path, {P})[(DOCS, P, "causal")], N, 20))
    assert row["re-solved"] == 2 and row["exact"] == "yes" and row["slower than the sweep"] == "none"
    assert row["today worst"].startswith(f"{today[worst]:.3f} (seed {worst},")
    assert row["sweep worst"] == f"{today[worst] + 0.5:.3f} (seed {other})"


def test_a_seed_slower_than_the_sweep_is_reported_and_windowed_masks_are_capped(tmp_path):
    """A sweep figure below today's breaks the premise: the row says so. Windowed masks have no bound: their worst
    ``--max-seeds`` are re-solved and the row says the figure is not exact, unless that is every seed of the sweep."""
    today = {s: pw.solve(DOCS, P, "causal", s, N)[0] for s in range(3)}
    low = {s: r - 0.01 for s, r in today.items()}
    path = tmp_path / "s.csv"
    _sweep(path, low)
    row = pw.one(((DOCS, P, "causal"), pw.sweep_rows(path, {P})[(DOCS, P, "causal")], N, 20))
    assert row["slower than the sweep"] != "none"
    _sweep(path, {s: 1.5 for s in range(4)}, mask=f"window {N}")
    row = pw.one(((DOCS, P, f"window {N}"), pw.sweep_rows(path, {P})[(DOCS, P, f"window {N}")], N, 3))
    assert row["re-solved"] == 3 and row["exact"].startswith("no")
    row = pw.one(((DOCS, P, f"window {N}"), pw.sweep_rows(path, {P})[(DOCS, P, f"window {N}")], N, 4))
    assert row["re-solved"] == 4 and row["exact"] == "yes: all 4 re-solved"  # every seed: the worst is exact


def test_without_the_bound_every_seed_up_to_the_cap_is_re_solved(tmp_path):
    """``--no-bound`` (the timeline changed since the sweep, so its figures bound nothing): a causal setting is
    re-solved seed by seed up to the cap, not stopped at the first; with every seed re-solved the row is exact and
    carries today's median."""
    today = {s: pw.solve(DOCS, P, "causal", s, N)[0] for s in range(3)}
    path = tmp_path / "s.csv"
    _sweep(path, today)
    seeds = pw.sweep_rows(path, {P})[(DOCS, P, "causal")]
    row = pw.one(((DOCS, P, "causal"), seeds, N, 2, False))
    assert row["re-solved"] == 2 and row["exact"] == "no: the 2 worst re-solved" and row["today median"] == "-"
    row = pw.one(((DOCS, P, "causal"), seeds, N, 20, False))
    assert row["re-solved"] == 3 and row["exact"] == "yes: all 3 re-solved"
    assert row["today median"] == f"{sorted(today.values())[1]:.3f}"
    assert pw.one(((DOCS, P, "causal"), seeds, N, 20))["re-solved"] == 1  # with the bound: the worst alone


def test_a_log_bounds_windowed_seeds_too(tmp_path):
    """``--log``: the seeds' figures from an earlier run's per-seed log (the figure after the arrow), for a solver this
    one only adds candidates to: a windowed setting then stops once the bound closes, as a causal one does, and a
    log's 3 decimals are the rounding."""
    mask = f"window {N}"
    today = {s: pw.solve(DOCS, P, mask, s, N)[0] for s in range(4)}
    worst = max(today, key=today.get)
    log = tmp_path / "run.log"
    log.write_text("".join(f"{DOCS} P={P} {mask} seed {s}: 9.999 -> {r:.3f} (a note)\n" for s, r in today.items())
                   + f"{DOCS} P=16 {mask} seed 0: 1.0 -> 1.500 (another world)\nnot a seed line\n")
    rows = pw.log_rows(log, {P})
    assert list(rows) == [(DOCS, P, mask)] and rows[(DOCS, P, mask)][0] == (round(today[worst], 3), worst)
    row = pw.one(((DOCS, P, mask), rows[(DOCS, P, mask)], N, 20, True, True))
    assert row["exact"] == "yes" and row["re-solved"] < 4 and row["slower than the sweep"] == "none"
    assert row["today worst"].startswith(f"{today[worst]:.3f} (seed {worst},")
    row = pw.one(((DOCS, P, mask), rows[(DOCS, P, mask)], N, 2, True, False))  # no log: the windowed cap
    assert row["exact"].startswith("no")


def test_the_ib_window_bench_picks_the_least_step_per_seed(tmp_path, capsys):
    """``bench/placement_ib_window.py``: auto's pick is the least of the four steps on every seed, so the best other
    over auto is at least 1; the placement is the one solved for the window on IB."""
    from bench import placement_ib_window as ib

    out = tmp_path / "ib.md"
    ib.main(["--docs", "longtail:2048", "--world", "8", "--seeds", "2", "--seq-per-rank", "512", "--window", "256",
             "--jobs", "1", "--out", str(out)])
    row = [line for line in out.read_text().splitlines() if line.startswith("| longtail:2048 | 8 | 2 |")]
    assert len(row) == 1
    cells = row[0].split("|")
    worst, median, best = (float(x) for x in cells[7].split("/"))
    assert 1.0 <= worst <= median <= best and float(cells[8]) >= 1.0  # best flat other / auto
    assert all(float(c) >= 1.0 for c in cells[9:12])  # the best other's step and busiest rank, auto's: >= perfect
    found = ib.one(("longtail:2048", 8, 0, 512, 256, 1))
    assert set(found["steps"]) == set(found["busiest"]) == {"ring", "balanced", "zigzag", "placed"}
    causal = ib.one(("longtail:2048", 8, 0, 512, -1, 1))  # --window -1: the causal mask, its own placement
    assert causal["steps"]["placed"] != found["steps"]["placed"]
    grid = ib.one(("longtail:2048", 8, 0, 512, -1, 2))  # --ulysses 2: every schedule on a 2 x 4 grid too
    assert {k: v for k, v in grid["steps"].items() if " x " not in k} == causal["steps"]
    assert {k for k in grid["steps"] if " x " in k} == {f"2d U=2 x {s}" for s in ("ring", "balanced", "zigzag",
                                                                                    "placed")}
    assert ib.others(grid["steps"], flat=True) in ib.OTHERS and ib.others(grid["steps"]) in grid["steps"]
    ib.main(["--docs", "longtail:2048", "--world", "8", "--seeds", "1", "--seq-per-rank", "512", "--window", "-1",
             "--jobs", "1", "--out", str(out)])
    assert "--window -1`: causal," in out.read_text()


def test_the_grid_bench_takes_the_least_of_the_flat_placement_and_the_grids(capsys):
    """``bench/placement_grid.py``: per seed the flat placement's figure (today's log where it holds the seed) and
    each grid's; the least is what choosing the degree runs, never above the flat figure."""
    from bench import placement_grid as grid
    from bench.placement_goal import TODAY, figures

    grid.main(["--docs", "uniform:8192", "--world", "8", "--mask", "causal", "--ulysses", "2", "--only", "3", "5",
               "--jobs", "1"])
    out = capsys.readouterr().out
    logged = figures(TODAY)[("uniform:8192", 8, "causal")]
    for seed in (3, 5):
        line = next(x for x in out.splitlines() if x.startswith(f"uniform:8192 P=8 causal seed {seed}: "))
        flat, u2 = (float(part.split()[-1]) for part in line.split(": ")[1].split(", "))
        assert flat == pytest.approx(logged[seed], abs=5e-4) and u2 >= 1.0
    summary = out.split("2 seeds, degrees [2]: flat ")[1]
    flat_worst, least_worst = float(summary.split()[0]), float(summary.split("-> the least ")[1].split()[0])
    assert least_worst <= flat_worst and "the least's degree: " in summary


def test_the_latency_what_if_solves_for_its_link_and_never_stops_early(tmp_path, monkeypatch):
    """``--latency-us``: every link of the NVLink preset with that per-message latency (the rest the preset's); the
    seeds are solved for it and timed on it, so the sweep's figures (at the preset's 3 us) bound nothing: a causal
    setting is re-solved up to the cap, each solve asked at that latency."""
    base, free = pw.nvlink(), pw.nvlink(0.0)
    assert base == pw.Cluster.preset("nvlink") and base.intra.latency == 3e-6
    assert free.intra.latency == free.inter.latency == 0.0
    assert (free.intra.bandwidth, free.gpus_per_node, free.flops) == (base.intra.bandwidth, base.gpus_per_node,
                                                                      base.flops)
    today = {s: pw.solve(DOCS, P, "causal", s, N)[0] for s in range(3)}
    path = tmp_path / "s.csv"
    _sweep(path, today)
    seeds = pw.sweep_rows(path, {P})[(DOCS, P, "causal")]
    asked, solve = [], pw.solve

    def spy(*args):
        asked.append(args[5:])
        return solve(*args)

    monkeypatch.setattr(pw, "solve", spy)
    row = pw.one(((DOCS, P, "causal"), seeds, N, 20, True, False, 0.0))
    assert row["re-solved"] == 3 and row["exact"] == "yes: all 3 re-solved" and asked == [(0.0,)] * 3
    assert pw.one(((DOCS, P, "causal"), seeds, N, 20, True, False))["re-solved"] == 1  # the bound, at 3 us
    assert asked[3:] == [(None,)]
    assert solve(DOCS, P, "causal", 0, N, 0.0)[0] < today[0]  # the latency reaches the timeline


def test_the_breakdown_orders_what_each_cost_adds():
    """``--breakdown``: the worst seed's step with its busiest rank's compute alone, on free links, with bandwidth and
    no latency, and as is: each a bound of the next (the timeline only grows with its costs); as is, the solve's."""
    ratio = pw.solve(DOCS, P, "causal", 1, N)[0]
    parts = [float(x) for x in pw.breakdown(DOCS, P, "causal", 1, N).split(" / ")]
    assert len(parts) == 4 and parts[-1] == float(f"{ratio:.3f}")
    assert all(a <= b + 1e-9 for a, b in zip(parts, parts[1:])) and parts[0] >= 1.0
    assert parts[-1] > parts[2]  # the preset's latency costs this seed something
