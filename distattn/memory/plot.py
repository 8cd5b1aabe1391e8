"""``python -m distattn.memory plan --plot FILE``: predicted peak memory per GPU against sequence length.

One line per strategy in its fixed style (``distattn._plotstyle``): distattn's rows solid, Megatron's dashed with
hollow markers, because a distattn row and a Megatron row can predict the same bytes (no checkpointing vs selective
recompute; full checkpointing vs full recompute) and would otherwise hide each other. The y axis spans the device
limit with readable ticks (e.g. 15, 20, 30, 40, 60, 80 GiB); curves far above the limit are cut at the top.
"""

from __future__ import annotations

from distattn._plotstyle import log_ticks, same_values_note, style, tokens_label

GIB = 2 ** 30
HEADROOM = 4.0
"""The y axis ends at this multiple of the device limit: above it a strategy does not fit by far, and showing
its terabytes would squeeze the range that decides (tens of GiB) into a sliver."""


def curves(strategies, model, *, batch: int, precision: str, chunked_loss: bool, top: int) -> dict:
    """``name -> (label, [(seq, GiB), ...])``: each strategy's predicted peak at doubling sequence lengths."""
    out = {}
    for strat in strategies:
        pts, seq = [], strat.seq_unit
        while seq <= top:
            pts.append((seq, strat.peak(model, seq, batch, precision, chunked_loss).total / GIB))
            seq *= 2
        out[strat.name] = (strat.label, pts)
    return out


def draw(plt, lines: dict, limit_gib: float, title: str):
    """The figure: a line per strategy, the device limit, one legend naming every line; returns the figure."""
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for name, (label, pts) in lines.items():
        ax.plot(*zip(*pts), ms=4, lw=1.5, label=label, gid=name,
                **style(name, dashed=name.startswith("megatron")))
    ax.axhline(limit_gib, color="k", ls="-.", lw=1, label=f"usable per GPU ({limit_gib:g} GiB)")
    lo = min(y for _, pts in lines.values() for _, y in pts)
    hi = min(max(y for _, pts in lines.values() for _, y in pts), limit_gib * HEADROOM)
    ticks = log_ticks(lo * 0.9, max(hi, limit_gib) * 1.1)
    ax.set(xscale="log", yscale="log", xlabel="sequence length (tokens, total over the GPUs)",
           ylabel="predicted peak GiB per GPU", ylim=(lo * 0.9, max(hi, limit_gib) * 1.1))
    ax.minorticks_off()
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    seqs = sorted({s for _, pts in lines.values() for s, _ in pts})
    xt = [s for s in seqs if (s.bit_length() - seqs[0].bit_length()) % 2 == 0]  # every other doubling
    ax.set_xticks(xt, [tokens_label(s) for s in xt])
    ax.grid(True, which="major", alpha=0.3)
    same = same_values_note({lines[n][0]: tuple(lines[n][1]) for n in lines}, rel=1e-3)
    ax.set_title(title + ("\n" + "; ".join(same) if same else ""), fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def write(path: str, lines: dict, limit_gib: float, title: str) -> str:
    """Draw and save to ``path``; the line the planner prints (or why the plot was skipped)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    fig = draw(plt, lines, limit_gib, title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot written to {path}"
