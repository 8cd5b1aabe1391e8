"""What every bench script shares: optional plots, the machine's CPU name, where smoke runs write.

* Plots are optional (matplotlib comes with ``pip install -e ".[bench]"``, and with ``[test]`` for
  tests/test_plots.py): without it a script still writes its table and CSV and prints one line saying the plot
  was skipped. Colours, legends and ticks: ``distattn._plotstyle`` (one fixed style per method).
* Smoke runs (tiny shapes on CPU: they prove a script works, they are not numbers) never write into the
  committed ``bench/results/``: by default they write under ``runs/bench-smoke/`` (ignored by git).
"""

from __future__ import annotations

import platform
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SMOKE_ROOT = ROOT / "runs" / "bench-smoke"
PLOT_HINT = 'pip install -e ".[bench]"'


def pyplot_or_note(what: str):
    """``matplotlib.pyplot`` on the Agg backend, or ``None`` after printing that ``what`` was skipped."""
    try:
        import matplotlib
    except ImportError:
        print(f"note: matplotlib is not installed, so {what} was skipped (the tables are written); "
              f"for plots: {PLOT_HINT}", flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def cpu_name() -> str:
    """The CPU model (``/proc/cpuinfo``'s "model name" on Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def smoke_out(script: str, out: str | None) -> Path:
    """Output folder of a smoke run: ``out`` if given (never inside bench/results), else runs/bench-smoke/."""
    if out is None:
        return SMOKE_ROOT / script
    path = Path(out)
    if _inside(path, RESULTS):
        raise ValueError(f"--out {out} is inside bench/results/, which holds committed results; a --smoke run "
                         f"must not overwrite them: leave --out out (default {SMOKE_ROOT / script}) or "
                         "give a folder outside bench/results/")
    return path


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
    except ValueError:
        return False
    return True
