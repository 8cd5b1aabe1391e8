"""Every plot, rendered from a small in-memory table (matplotlib Agg), checked against the table it draws:
each line (or bar) is a method of the table in that method's fixed colour (``distattn._plotstyle``), each method
drawn has exactly one legend entry, the legend names nothing else but the reference marks, and the title names
the numbers' source. Issue 24: colours from the cycle put "ulysses" on ring's times where Ulysses had no rows."""

from __future__ import annotations

import math
from argparse import Namespace
from collections import Counter

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402

from distattn import _plotstyle  # noqa: E402


@pytest.fixture
def figures(monkeypatch):
    """The figures the code under test closes, kept open for inspection (closed at the end of the test)."""
    kept, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: kept.append(fig))
    yield kept
    for fig in kept:
        close(fig)


def _drawn(fig) -> list[tuple[str, str, object]]:
    """``(name, colour, artist)`` of every labelled line and bar container of the figure's panels."""
    out = []
    for ax in fig.axes:
        for line in ax.get_lines():
            if not line.get_label().startswith("_"):
                out.append((line.get_gid() or line.get_label(), to_hex(line.get_color()), line))
        for bars in ax.containers:
            if not bars.get_label().startswith("_"):
                first = bars.patches[0]
                out.append((first.get_gid() or bars.get_label(), to_hex(first.get_facecolor()), bars))
    return out


def _legend_entries(fig) -> list[tuple[str, object]]:
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert len(legends) == 1, f"expected one legend, found {len(legends)}"
    return [(t.get_text(), h) for t, h in zip(legends[0].get_texts(), legends[0].legend_handles)]


def _handle_colour(handle) -> str:
    return to_hex(handle.get_color() if hasattr(handle, "get_color") else handle.get_facecolor())


def check_mapping(fig, table_methods: set, label_of=lambda name: name, references=()) -> set:
    """The checks every plot passes; returns the set of methods drawn."""
    drawn = _drawn(fig)
    for name, colour, _ in drawn:
        if name in references:
            continue
        assert name in table_methods, f"{name!r} is drawn but not in the table {sorted(table_methods)}"
        assert colour == to_hex(_plotstyle.color(name)), f"{name} drawn in {colour}, its colour is " \
                                                         f"{_plotstyle.color(name)}"
    names = {name for name, _, _ in drawn if name not in references}
    entries = _legend_entries(fig)
    counts = Counter(text for text, _ in entries)
    for name in names:
        assert counts[label_of(name)] == 1, f"{name} has {counts[label_of(name)]} legend entries: {dict(counts)}"
    by_label = {label_of(n): n for n in names}
    for text, handle in entries:
        if text in references:
            continue
        assert text in by_label, f"legend entry {text!r} names no drawn method ({sorted(by_label)})"
        assert _handle_colour(handle) == to_hex(_plotstyle.color(by_label[text])), text
    return names


# -- bench/scaling.py: time.png, bytes.png -------------------------------------------------------------------
def _scaling_rows():
    """Two models x two workloads x two sizes; Ulysses cannot run tiny-odd (no rows drawn there)."""
    rows = []
    for model in ("tiny-mha", "tiny-odd"):
        for workload in ("attn", "layer"):
            for n in (32, 64):
                for i, m in enumerate(("megatron", "ulysses", "ring", "balanced", "no_overlap")):
                    row = {"model": model, "workload": workload, "world": 2, "tokens_per_rank": n, "method": m}
                    if model == "tiny-odd" and m == "ulysses":
                        rows.append({**row, "status": "Ulysses cannot run heads_q=3 on 2 ranks"})
                        continue
                    rows.append({**row, "status": "ok", "time_ms": f"{10 + i + n / 32:.2f}",
                                 "bytes_sent_max": 1024 * {"megatron": 40, "ulysses": 36}.get(m, 32) * n // 32})
    return rows


def test_scaling_plots_fixed_colours_one_legend(tmp_path, figures):
    from bench import scaling

    rows = _scaling_rows()
    scaling.write_plots(rows, tmp_path, cpu=True)
    assert {p.name for p in tmp_path.iterdir()} == {"time.png", "bytes.png"}
    assert len(figures) == 2
    for fig in figures:
        drawn = check_mapping(fig, {r["method"] for r in rows})
        assert drawn == {"megatron", "ulysses", "ring", "balanced", "no_overlap"}
        assert "CPU smoke, not a performance number" in fig._suptitle.get_text()
        odd = [ax for ax in fig.axes if ax.get_title().startswith("tiny-odd")]
        assert len(odd) == 2
        for ax in odd:  # the panel without Ulysses: ring keeps ring's colour, and the title says who is missing
            assert "not run: Ulysses cannot run heads_q=3 on 2 ranks" in ax.get_title()
            assert {line.get_gid() for line in ax.get_lines()} == {"megatron", "ring", "balanced", "no_overlap"}
    # bytes: ring, balanced and no_overlap send the same bytes here, and the panel says their lines coincide
    assert all("same values: ring = balanced = no_overlap" in ax.get_title() for ax in figures[1].axes
               if ax.get_lines())


# -- bench/model.py plots: speedup-vs-P.png, paper-setups.png ------------------------------------------------
def test_speedup_plot_each_method_once_and_its_source(figures):
    from bench import model_report
    from bench.model import A100_ASSUMED

    rows = [{"model": model, "link": link, "world": p, "method": m,
             "speedup": math.nan if (m == "ulysses" and p > 16) else 1.0 + p / 8 + k}
            for model in ("llama-7b", "llama-33h") for link in ("InfiniBand 100 Gb/s", "InfiniBand 400 Gb/s")
            for p in (8, 16, 32) for k, m in enumerate(model_report.SPEEDUP_METHODS)]
    source = model_report.source_line(A100_ASSUMED)
    fig = model_report.plot_speedup(plt, rows, source)
    assert check_mapping(fig, set(model_report.SPEEDUP_METHODS)) == set(model_report.SPEEDUP_METHODS)
    for ax in fig.axes:  # one line per method per panel (the old plot drew each method twice in one colour)
        gids = [line.get_gid() for line in ax.get_lines() if line.get_gid()]
        assert len(gids) == len(set(gids))
    title = fig._suptitle.get_text()
    assert "bench/model.py" in title and A100_ASSUMED.name in title and "assumed" in title
    assert "not distattn.schedule.cost" in title  # the README's cost model (H100 rates) is another model


def test_paper_setups_plot(figures):
    from bench import model_report

    rows = [{"setup": setup, "model": m, "tokens": f"{k}K tokens", "speedup": 1.0 + i}
            for setup in ("P=8 (1 node, NVLink)", "P=16 (2 nodes, IB 100 Gb/s)") for m in ("llama-7b", "llama-2h")
            for i, k in enumerate(model_report.SETUP_SEQ_K)]
    fig = model_report.plot_setups(plt, rows, "SOURCE")
    sizes = {r["tokens"] for r in rows}
    assert check_mapping(fig, sizes, references=(model_report.PAPER_BAND,)) == sizes
    assert "SOURCE" in fig._suptitle.get_text()


# -- python -m distattn.memory plan --plot -------------------------------------------------------------------
def test_planner_plot_styles_ticks_and_title(tmp_path, figures, capsys):
    from distattn.memory import cli as plan

    path = tmp_path / "plan.png"
    assert plan.main(["plan", "--model", "llama-7b", "--gpus", "8", "--gpu-mem", "80", "--plot", str(path)]) == 0
    assert f"plot written to {path}" in capsys.readouterr().out and path.stat().st_size > 0
    (fig,) = figures
    labels = {s.name: s.label for s in plan.strategies_for(8, 8)}
    limit = "usable per GPU (78 GiB)"
    assert check_mapping(fig, set(labels), label_of=labels.get, references=(limit,)) == set(labels)
    (ax,) = fig.axes
    styles = {line.get_gid(): line.get_linestyle() for line in ax.get_lines()}
    # distattn's rows solid, Megatron's dashed: the pairs that predict nearly the same bytes stay visible
    assert {styles[n] for n in ("none", "full", "remat")} == {"-"}
    assert {styles[n] for n in ("megatron", "megatron-full")} == {"--"}
    ticks = [t for t in ax.get_yticks() if 15 <= t <= 80]
    assert len(ticks) >= 5, f"15-80 GiB needs readable ticks, got {list(ax.get_yticks())}"
    title = ax.get_title()
    assert "78 GiB usable after --reserve 2" in title and "predicted by distattn.memory" in title


# -- bench/kernel.py, bench/checkpoint.py, bench/gpu_check.py ------------------------------------------------
def test_kernel_plot_and_console_units(tmp_path, figures):
    from bench import kernel

    rows = [{"impl": impl, "head_dim": 16, "causal": causal, "seqlen": s, "batch": 1, "heads": 2, "fwd": 1.0,
             "bwd": 2.0, "fwd+bwd": 1.5 + i, "note": ""}
            for causal in (False, True) for s in (32, 64) for i, impl in enumerate(("distattn", "sdpa-flash"))
            if not (causal and impl == "distattn")]  # a panel without distattn: sdpa-flash keeps its colour
    kernel.plot(tmp_path / "kernel.png", rows, smoke=True)
    (fig,) = figures
    assert check_mapping(fig, {"distattn", "sdpa-flash"}) == {"distattn", "sdpa-flash"}
    assert "CPU smoke, not a performance number" in fig._suptitle.get_text()
    line = kernel.row_line({**rows[0], "fwd": 3.15e-07, "bwd": 120.5, "fwd+bwd": "n/a"})
    assert line.endswith("fwd 315 kFLOP/s, bwd 120 TFLOP/s, fwd+bwd n/a") and "seqlen=32 tokens" in line
    assert "{" not in line and "not run (OOM)" in kernel.row_line({**rows[0], "note": "OOM"})
    assert kernel.carry_line({"chunks": 2, "seqlen": 64, "heads": 2, "head_dim": 16, "fwd": 2.5e-4, "bwd": 0.5}) \
        == "carry: 64 causal tokens, 2 heads, d=16, keys folded as 2 chunk(s): fwd 250 MFLOP/s, bwd 500 GFLOP/s"


def test_checkpoint_plot(tmp_path, figures):
    from bench import checkpoint

    rows = [{"tokens_per_gpu": n, "variant": v, "step_ms": 10.0 + i + n / 1024} for n in (1024, 2048)
            for i, v in enumerate(("hf", "remat"))]
    args = Namespace(out=str(tmp_path), smoke=True, layers=2, steps=2, warmup=1, schedule="balanced")
    checkpoint.write(rows, args, "a CPU", 1)
    (fig,) = figures
    assert check_mapping(fig, {"hf", "remat"}) == {"hf", "remat"}
    assert fig.axes[0].get_title() == checkpoint.SMOKE_LABEL


def test_gpu_check_memory_plot(tmp_path, figures):
    from bench import gpu_check

    rows = [{"model": "tiny", "seq_len": 4096, "remat": r, "measured_GiB": 1.0 + r, "predicted_GiB": 1.1 + r,
             "error_pct": 10.0, "note": ""} for r in (False, True)]
    gpu_check.write_memory(tmp_path, rows, "gpu")
    (fig,) = figures
    assert check_mapping(fig, {"predicted", "measured"}) == {"predicted", "measured"}


def test_every_name_has_its_own_style_and_unknown_names_are_refused():
    styles = {(s.get("color"), s.get("ls"), s.get("marker")) for s in _plotstyle.STYLES.values()}
    assert len(styles) == len(_plotstyle.STYLES) - 2  # remat and balanced are distattn: distattn's look
    with pytest.raises(KeyError, match="no fixed plot style for 'mystery'; add it to distattn._plotstyle.STYLES"):
        _plotstyle.style("mystery")
    assert _plotstyle.log_ticks(14, 90) == [15, 20, 30, 40, 60, 80]
    assert _plotstyle.same_values_note({"a": ((1, 2.0),), "b": ((1, 2.0),), "c": ((1, 3.0),)}) == \
        ["same values: a = b"]


def test_peers_plot_fixed_styles_one_legend_and_equal_lines_named(tmp_path, figures):
    """bench/peers/tables.py's peers.png: a line per system that ran, its fixed style, one legend; refused rows
    draw nothing; lines drawn on top of each other are named in the panel's title."""
    from bench.peers.tables import plot

    rows = []
    for world in (2, 4, 8):
        for workload in ("llama3-gqa", "docs-longtail"):
            for i, system in enumerate(("distattn (balanced)", "distattn (2-D)", "DeepSpeed-Ulysses",
                                        "PyTorch CP (alltoall)")):
                refused = system == "PyTorch CP (alltoall)" and workload == "docs-longtail"
                rows.append({"system": system, "workload": workload, "world": str(world),
                             "status": "refused" if refused else "ok", "sent_max": str(1024 * world * (i + 1)),
                             "saved_max": "516" if system.startswith("distattn") else str(1284 + i),
                             "peak_max": str(4096 + 512 * i)})
    assert plot(rows, tmp_path / "peers.png") and (tmp_path / "peers.png").is_file()
    (fig,) = figures
    drawn = check_mapping(fig, {r["system"] for r in rows})
    assert drawn == {r["system"] for r in rows}
    docs_panels = [ax for ax in fig.axes if ax.get_title().startswith("docs-longtail")]
    assert all("PyTorch CP (alltoall)" not in {ln.get_gid() for ln in ax.get_lines()} for ax in docs_panels)
    saved = next(ax for ax in fig.axes if ax.get_title().startswith("llama3-gqa: saved"))
    assert "equal: (balanced) = (2-D)" in saved.get_title()
