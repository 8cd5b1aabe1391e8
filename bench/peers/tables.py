"""The peers run as one table per measure, systems as columns: ``python -m bench.peers.tables bench/results/peers``.

Reads ``peers.csv`` (written by ``python -m bench.peers``) and writes beside it ``tables.md``: bytes sent / peak
together, then exactness, bytes sent, saved activations, peak rise of live bytes and work balance, one row per
(P, workload), every cell as measured ("refused" where the system refused the workload, "error"/"timeout" where it
failed, "–" where it does not apply); and, with matplotlib, ``peers.png``: bytes, saved activations and peak against
P for three workloads. The README of a results folder quotes these tables; nothing in them is typed by hand.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

__all__ = ["tables", "plot", "main"]

# column headers (the columns keep the order in which the run's rows name the systems)
_SHORT = {"distattn (balanced)": "distattn bal.", "distattn (zigzag)": "distattn zigzag",
          "distattn (placed)": "distattn placed", "distattn (2-D)": "distattn 2-D",
          "PyTorch CP (alltoall)": "CP a2a", "PyTorch CP (allgather)": "CP allgather", "USP (yunchang)": "USP (fwd only)",
          "megatron-core (TP+SP)": "megatron TP+SP", "megatron-core (CP)": "megatron CP"}

_MEASURES = [
    ("Exactness (max error of out/dq/dk/dv against fp64)", "exact"),
    ("Bytes sent per rank, KiB (forward + backward; USP forward only)", "sent_max"),
    ("Saved activations per rank, KiB", "saved_max"),
    ("Peak rise of live bytes per rank, KiB (forward + backward)", "peak_max"),
    ("Work balance (busiest rank's visible (q, k) pairs x heads / mean; 1.00 = perfect)", "balance"),
]


def _cell(row: dict, field: str) -> str:
    if row["status"] == "n/a":
        return "–"
    if row["status"] != "ok":
        return row["status"]
    if field == "exact":
        errs = [float(row[k]) for k in ("err_out", "err_dq", "err_dk", "err_dv") if row[k] not in ("", "None")]
        verdict = "yes" if row["exact"] == "True" else "**NO**"
        return f"{verdict} {max(errs):.1e}" if errs else verdict
    if row[field] in ("", "None"):
        return ""
    if field == "balance":
        return f"{float(row[field]):.2f}"
    return f"{int(row[field]) / 1024:.1f}"


def _pair(row: dict) -> str:
    """``bytes sent / peak rise`` in whole KiB (the README's combined cell)."""
    if row["status"] != "ok":
        return _cell(row, "sent_max")
    return f"{int(row['sent_max']) / 1024:.0f} / {int(row['peak_max']) / 1024:.0f}"


def tables(rows: list[dict]) -> str:
    """Markdown: bytes / peak together, then one table per measure; a column per system in the order of first
    appearance."""
    systems = list(dict.fromkeys(r["system"] for r in rows))
    keys = list(dict.fromkeys((int(r["world"]), r["workload"]) for r in rows))
    at = {(int(r["world"]), r["workload"], r["system"]): r for r in rows}
    out = ["## Bytes sent / peak rise of live bytes, KiB per rank (the largest rank), forward + backward", "",
           "| P | workload | " + " | ".join(_SHORT.get(s, s) for s in systems) + " |",
           "|---|---|" + "---|" * len(systems)]
    for world, workload in keys:
        cells = [_pair(at[world, workload, s]) if (world, workload, s) in at else "" for s in systems]
        out.append(f"| {world} | {workload} | " + " | ".join(cells) + " |")
    out.append("")
    for title, field in _MEASURES:
        out += [f"## {title}", "", "| P | workload | " + " | ".join(_SHORT.get(s, s) for s in systems) + " |",
                "|---|---|" + "---|" * len(systems)]
        for world, workload in keys:
            cells = [_cell(at[world, workload, s], field) if (world, workload, s) in at else "" for s in systems]
            out.append(f"| {world} | {workload} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


PLOT_WORKLOADS = ("llama3-gqa", "mha", "docs-longtail")
PLOT_MEASURES = (("sent_max", "bytes sent, KiB"), ("saved_max", "saved for backward, KiB"),
                 ("peak_max", "peak rise of live bytes, KiB"))


def plot(rows: list[dict], path: Path) -> bool:
    """``path`` (png): bytes sent, saved activations and peak per rank against P, a panel per (workload, measure),
    a line per system that ran (its fixed style, ``distattn._plotstyle``); ``False`` without matplotlib."""
    from bench._util import pyplot_or_note
    from distattn import _plotstyle

    plt = pyplot_or_note("the peers plot")
    if plt is None:
        return False
    workloads = [w for w in PLOT_WORKLOADS if any(r["workload"] == w for r in rows)]
    fig, axes = plt.subplots(len(workloads), len(PLOT_MEASURES), figsize=(4.4 * len(PLOT_MEASURES),
                                                                          3.4 * len(workloads) + 0.8),
                             squeeze=False)
    for i, workload in enumerate(workloads):
        for j, (field, label) in enumerate(PLOT_MEASURES):
            ax, series = axes[i][j], {}
            for system in dict.fromkeys(r["system"] for r in rows):
                pts = sorted((int(r["world"]), int(r[field]) / 1024) for r in rows
                             if r["system"] == system and r["workload"] == workload and r["status"] == "ok"
                             and r[field] not in ("", "None"))
                if pts:
                    series[system] = tuple(pts)
                    ax.plot(*zip(*pts), label=system, gid=system, **_plotstyle.style(system))
            notes = _plotstyle.same_values_note(series, rel=1e-3)  # lines drawn on top of each other: say so
            short = [n.replace("same values: ", "equal: ").replace("distattn ", "").replace("PyTorch ", "")
                     for n in notes]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(sorted({int(r["world"]) for r in rows}))
            ax.set_xticklabels([str(t) for t in ax.get_xticks()])
            ax.set_title("\n".join([f"{workload}: {label}", *short]), fontsize=8)
            ax.set_xlabel("P (ranks)")
    _plotstyle.figure_legend(fig, [ax for row in axes for ax in row], ncol=5, fontsize=8)
    _plotstyle.tight_with_legend(fig, 0.8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    folder = Path((argv if argv is not None else sys.argv[1:])[0])
    with open(folder / "peers.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    (folder / "tables.md").write_text(tables(rows))
    print(f"wrote {folder / 'tables.md'}")
    if plot(rows, folder / "peers.png"):
        print(f"wrote {folder / 'peers.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
