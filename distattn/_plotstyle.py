"""One look for every plot distattn and its benchmarks draw: a fixed colour (and line) per method.

Colours used to come from matplotlib's cycle, in drawing order: a panel where one method had no rows drew every
later method in the next one's colour (issue 24). Here each name has its colour whatever else is on the axes,
the same system has the same colour in every figure (``megatron`` in the scaling benchmark, the cost model and the
planner), and curves that can coincide (the planner's distattn and Megatron rows) differ in line style and
marker too, so one never hides the other.

No matplotlib import here: the planner (``python -m distattn.memory plan --plot``) and ``bench/`` import this
module, and matplotlib stays optional for both.
"""

from __future__ import annotations

import math

__all__ = ["STYLES", "style", "color", "figure_legend", "tight_with_legend", "same_values_note", "log_ticks",
           "tokens_label"]

# Tableau 10 colours (matplotlib's default cycle), each fixed to one system.
_BLUE, _ORANGE, _GREEN, _RED, _PURPLE = "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"
_BROWN, _PINK, _GREY, _OLIVE, _CYAN = "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"

STYLES: dict[str, dict] = {
    # bench/scaling.py and bench/model.py (bench/baselines.METHODS)
    "megatron": dict(color=_RED, ls="-", marker="s"),
    "ulysses": dict(color=_PURPLE, ls="-", marker="^"),
    "ring": dict(color=_ORANGE, ls="-", marker="v"),
    "balanced": dict(color=_BLUE, ls="-", marker="o"),
    "no_overlap": dict(color=_CYAN, ls="-", marker="D"),
    "deepspeed-ulysses": dict(color=_PURPLE, ls="--", marker="^", mfc="none"),  # the real one beside "ulysses"
    "megatron-core": dict(color=_RED, ls="--", marker="s", mfc="none"),  # the real one beside "megatron"
    # distattn.memory plan --plot (strategy names): distattn solid, Megatron dashed with hollow markers
    "none": dict(color=_GREY, ls="-", marker="o"),
    "full": dict(color=_GREEN, ls="-", marker="o"),
    "remat": dict(color=_BLUE, ls="-", marker="o"),
    "megatron-full": dict(color=_PINK, ls="--", marker="s", mfc="none"),
    "single": dict(color=_BROWN, ls=":", marker="x"),
    # bench/kernel.py implementations
    "distattn": dict(color=_BLUE, ls="-", marker="o"),
    "sdpa-flash": dict(color=_ORANGE, ls="-", marker="s"),
    "sdpa-cudnn": dict(color=_GREEN, ls="-", marker="^"),
    "sdpa-efficient": dict(color=_PURPLE, ls="-", marker="v"),
    "flash-attn": dict(color=_RED, ls="-", marker="D"),
    # bench/checkpoint.py variants (remat is distattn's, above)
    "hf": dict(color=_OLIVE, ls="-", marker="s"),
    # bench/model.py plots: paper-setups.png's bars (total sequence length)
    "32K tokens": dict(color=_CYAN),
    "128K tokens": dict(color=_OLIVE),
    "512K tokens": dict(color=_PURPLE),
    # bench/gpu_check.py memory bars
    "predicted": dict(color=_GREY),
    "measured": dict(color=_BLUE),
    # bench/peers (python -m bench.peers.tables: peers.png), the systems by their row names
    "distattn (balanced)": dict(color=_BLUE, ls="-", marker="h"),
    "distattn (zigzag)": dict(color=_BLUE, ls="-.", marker="d"),
    "distattn (placed)": dict(color=_GREEN, ls="-", marker="P"),
    "distattn (2-D)": dict(color=_BLUE, ls=":", marker="*"),
    "DeepSpeed-Ulysses": dict(color=_PURPLE, ls="-.", marker="^"),
    "PyTorch CP (alltoall)": dict(color=_BROWN, ls="-", marker="<"),
    "PyTorch CP (allgather)": dict(color=_BROWN, ls="--", marker=">"),
    "USP (yunchang)": dict(color=_PINK, ls="-", marker="X"),
    "megatron-core (TP+SP)": dict(color=_RED, ls="-.", marker="s"),
}
# The planner's Megatron row with selective recompute is "megatron": on its own plot it can lie on top of
# distattn's "none" row, so there it is drawn dashed with hollow markers (style(name, dashed=True)).


def style(name: str, *, dashed: bool = False) -> dict:
    """Line keyword arguments (``color``, ``ls``, ``marker``, ...) of ``name``; ``KeyError`` for a name without a
    fixed style (add it to ``STYLES``: a colour from the cycle is what this module exists to prevent)."""
    if name not in STYLES:
        raise KeyError(f"no fixed plot style for {name!r}; add it to distattn._plotstyle.STYLES "
                       f"(known: {', '.join(STYLES)})")
    out = dict(STYLES[name])
    if dashed:
        out.update(ls="--", mfc="none")
    return out


def color(name: str) -> str:
    return style(name)["color"]


def figure_legend(fig, axes, **kwargs):
    """One legend for the whole figure naming every labelled artist of ``axes`` once (first one wins), below
    the panels; returns it (``None`` when nothing is labelled)."""
    handles, seen = [], {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in seen:
                seen[label] = h
    if not seen:
        return None
    handles = list(seen.values())
    ncol = kwargs.pop("ncol", min(len(handles), 5))
    return fig.legend(handles, list(seen), loc="lower center", ncol=ncol, frameon=False,
                      bbox_to_anchor=(0.5, 0.0), **kwargs)


def tight_with_legend(fig, legend_inches: float = 0.6) -> None:
    """``tight_layout`` leaving ``legend_inches`` at the bottom for :func:`figure_legend`."""
    fig.tight_layout(rect=(0, min(0.4, legend_inches / fig.get_figheight()), 1, 1))


def same_values_note(series: dict, rel: float = 1e-9) -> list[str]:
    """``["same values: ring = balanced"]`` for each group of names in ``series`` (name -> ``((x, y), ...)``)
    whose points are equal: their lines are drawn on top of each other, and the note says who is hidden."""
    groups: list[list[str]] = []
    for name, pts in series.items():
        for g in groups:
            ref = series[g[0]]
            if len(ref) == len(pts) and all(a[0] == b[0] and math.isclose(a[1], b[1], rel_tol=rel)
                                            for a, b in zip(ref, pts)):
                g.append(name)
                break
        else:
            groups.append([name])
    return [f"same values: {' = '.join(g)}" for g in groups if len(g) > 1]


def log_ticks(lo: float, hi: float, steps=(1, 1.5, 2, 3, 4, 6, 8)) -> list[float]:
    """Readable ticks for a log axis from ``lo`` to ``hi``: ``steps x 10^k`` (e.g. 15, 20, 30, 40, 60, 80 GiB),
    thinned to at most ~12 ticks."""
    if not (0 < lo < hi and math.isfinite(hi)):
        raise ValueError(f"log_ticks needs 0 < lo < hi, got lo={lo!r}, hi={hi!r}")
    ticks = [s * 10 ** k for k in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
             for s in steps]
    ticks = [t for t in ticks if lo <= t <= hi]
    while len(ticks) > 12:
        ticks = ticks[::2]
    return ticks


def tokens_label(n: float) -> str:
    """1024 -> '1K', 1048576 -> '1M' (binary, as the planner's table); small counts as they are."""
    n = int(n)
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    if n >= 1024 and n % 1024 == 0:
        return f"{n >> 10}K"
    return str(n)
