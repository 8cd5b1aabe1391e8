"""The cost model (bench/model.py): the paper's claims from our plan objects, byte formulas, time model.

Pure Python, no processes: what the counters measure is compared with these formulas in
tests/test_baselines.py (P = 2, 3, 4) and by ``bench/model.py validate`` (P = 2..8, bench/results/).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.baselines.layers import LayerShape  # noqa: E402
from bench.model import (MODELS, Cluster, Compute, IB_100G, Workload, balance_speedup, megatron_bytes,  # noqa: E402
                         paper_comm_ratio, paper_units, predict, ulysses_bytes, wire_comm_ratio)
from bench.model_report import CPU_DEFAULTS, claims_markdown, measure  # noqa: E402
from bench.model_report import main as model_report_main  # noqa: E402
from distattn.schedule import Shapes, a2a_bytes, make_plan  # noqa: E402

WORLDS = (2, 3, 4, 5, 8, 16, 33, 64)


@pytest.mark.parametrize("world", WORLDS)
def test_paper_communication_claim(world):
    """Megatron-LM with checkpointing moves 14 units per layer, DistFlashAttn 3: the paper's ~4.7x."""
    ring = paper_units(make_plan(world, True, "ring"))
    assert ring["forward"] == pytest.approx(1.0) and ring["backward"] == pytest.approx(2.0)
    assert paper_comm_ratio(world, "ring") == pytest.approx(14 / 3)
    assert round(paper_comm_ratio(world, "ring"), 1) == 4.7
    assert paper_comm_ratio(world, "ring", checkpoint=False) == pytest.approx(10 / 3)
    # helpers move q, dout and dq (3 tensors) instead of kv and dkv (4): the balanced plan moves a little less
    assert 14 / 3 <= paper_comm_ratio(world, "balanced") < 5.0
    # GQA 32/8: kv chunks are a quarter of the hidden size
    assert paper_units(make_plan(world, True, "ring"), 32, 8)["forward"] == pytest.approx(0.25)


def test_wire_ratio_counts_fp32_partials():
    """Our op sends fp32 partials and statistics: the byte ratio vs Megatron is below the paper's count."""
    for world in (2, 8):
        assert 3.4 < wire_comm_ratio(world, "balanced") < paper_comm_ratio(world, "balanced")


def test_balance_claim():
    """Paper: balanced causal 7.2x of 8 ranks vs 4.5x unbalanced (pairs / steps), from the plans."""
    assert balance_speedup(8, "balanced") == pytest.approx(7.2)
    assert balance_speedup(8, "ring") == pytest.approx(4.5)
    assert balance_speedup(8, "balanced", diagonal_half=True) == pytest.approx(32 / 4.5)
    assert balance_speedup(8, "ring", diagonal_half=True) == pytest.approx(32 / 7.5)
    for world in WORLDS:
        assert balance_speedup(world, "ring") == pytest.approx((world + 1) / 2)
        assert balance_speedup(world, "balanced") >= balance_speedup(world, "ring")


def test_baseline_byte_formulas():
    world, n, hidden = 8, 1024, 4096
    one = (world - 1) * n * hidden * 2  # one all-gather of bf16 activations, per rank
    assert megatron_bytes(world, 1, n, hidden, 2) == 10 * one  # 6 AG + 4 RS
    assert megatron_bytes(world, 1, n, hidden, 2, recompute=True) == 14 * one
    assert megatron_bytes(world, 1, n, hidden, 2, full_layer=False) == 5 * one
    shape = LayerShape(heads_q=32, heads_kv=8)
    q, kv, stat = n * 32 * 128 * 2, n * 8 * 128 * 2, n * 32 * 4  # bf16 tensors, fp32 lse / delta
    fwd = (2 * q + 2 * kv + stat) * (world - 1) // world  # q, k, v in; out, lse back
    bwd = (3 * q + 4 * kv + 2 * stat) * (world - 1) // world  # q, dout, k, v, lse, delta in; dq, dk, dv back
    assert ulysses_bytes(world, 1, n, shape, 2) == fwd + bwd
    assert ulysses_bytes(world, 1, n, shape, 2, recompute=True) == 2 * fwd + bwd
    shapes = Shapes(batch=1, seq_per_rank=n, heads_q=32, heads_kv=8, head_dim=128, dtype_bytes=2)
    assert ulysses_bytes(world, 1, n, shape, 2) == a2a_bytes("forward", shapes, world) + a2a_bytes(
        "backward", shapes, world)  # the library's all-to-alls with U = P, R = 1
    # 8 kv heads on 16 ranks: each replicated twice, so k, v (and dk, dv) travel with 16 heads
    wide = Shapes(batch=1, seq_per_rank=n, heads_q=32, heads_kv=16, head_dim=128, dtype_bytes=2)
    assert ulysses_bytes(16, 1, n, shape, 2) == a2a_bytes("forward", wide, 16) + a2a_bytes("backward", wide, 16)
    with pytest.raises(ValueError, match="cannot be split"):
        ulysses_bytes(3, 1, n, shape, 2)


def test_claims_table():
    text = claims_markdown(worlds=(2, 8))
    assert "| 8 | 3.000 | 2.893 | 4.67x | 4.84x |" in text
    assert "| 8 | 4.50x | 7.20x |" in text


def _times(model, world, tokens=8192, cluster=Cluster()):
    shape, layers = MODELS[model]
    w = Workload(shape=shape, layers=layers, tokens_per_rank=tokens)
    return {m: predict(m, world, w, cluster=cluster)["total"]
            for m in ("megatron", "ulysses", "ring", "balanced", "no_overlap")}


def test_time_model_orders_methods():
    t = _times("llama-7b", 8)
    assert t["balanced"] < t["ring"]  # load balance
    assert t["balanced"] <= t["no_overlap"]  # overlap never hurts in the model
    assert all(v > 0 for v in t.values())
    odd = _times("llama-33h", 8)
    assert math.isnan(odd["ulysses"])  # 33 heads on 8 ranks: Ulysses cannot run
    assert not math.isnan(_times("llama-gqa", 16)["ulysses"])  # 8 kv heads on 16 ranks: replicated, runs
    # Megatron pads 33 heads to 40: its attention costs more per head than for 32 heads
    assert odd["megatron"] / t["megatron"] > 33 / 32
    slow = _times("llama-7b", 16, cluster=Cluster(inter=IB_100G))
    assert slow["megatron"] > t["megatron"]  # its collectives cross the slow link


def test_time_model_parts_add_up():
    shape, layers = MODELS["llama-gqa"]
    w = Workload(shape=shape, layers=layers, tokens_per_rank=4096)
    for method in ("megatron", "balanced", "no_overlap"):
        r = predict(method, 16, w)
        assert r["total"] == pytest.approx(r["compute"] + r["comm_exposed"])
        assert r["comm_exposed"] >= -1e-9 * r["total"]
        assert r["total"] == pytest.approx(r["per_layer"] * layers)
    with pytest.raises(ValueError, match="method='bogus' is unknown"):
        predict("bogus", 8, w)


def test_measured_compute_file(tmp_path):
    path = tmp_path / "compute.json"
    path.write_text(json.dumps({"name": "X, measured", "attn_fwd": 1e14, "attn_bwd": 8e13, "matmul": 2e14,
                                "measured": True}))
    compute = Compute.from_json(path)
    assert compute.measured and compute.matmul == 2e14
    shape, layers = MODELS["llama-7b"]
    w = Workload(shape=shape, layers=layers, tokens_per_rank=4096)
    assert predict("balanced", 8, w, compute=compute)["total"] > 0


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 6.7e20, 0.0, -1e12, "1e14", None])
def test_compute_file_rejects_implausible_rates(tmp_path, bad):
    """A measured file with a non-finite or absurd rate (a clamped time difference once gave 6.7e20 FLOP/s)
    is refused with a message naming the field, the value, what is allowed and how to fix it."""
    path = tmp_path / "compute.json"
    path.write_text(json.dumps({"name": "X", "attn_fwd": 1e14, "attn_bwd": bad, "matmul": 2e14, "measured": True}))
    with pytest.raises(ValueError, match=r"attn_bwd=.* FLOP/s is not a plausible rate .*bench/model.py measure"):
        Compute.from_json(path)
    with pytest.raises(SystemExit) as exc:  # the CLI: one clear line, exit code 2, before any plotting
        model_report_main(["plots", "--out", str(tmp_path / "out"), "--compute", str(path)])
    assert exc.value.code == 2 and not (tmp_path / "out").exists()


def test_compute_file_missing_rate(tmp_path):
    path = tmp_path / "compute.json"
    path.write_text(json.dumps({"name": "X", "attn_fwd": 1e14, "matmul": 2e14}))
    with pytest.raises(ValueError, match=r"missing \['attn_bwd'\]"):
        Compute.from_json(path)


def test_measure_on_cpu_is_small_and_plausible(tmp_path, capsys):
    """`measure` on CPU uses small defaults, prints progress, times the backward on its own (finite, plausible
    rates that plots --compute accepts)."""
    out = tmp_path / "compute.json"
    data = measure(out, n=64, heads=2, head_dim=16, reps=1)
    assert Compute.from_json(out).measured
    assert all(0 < data[k] < 1e16 for k in ("attn_fwd", "attn_bwd", "matmul"))
    printed = capsys.readouterr().out
    assert "attention backward" in printed and "not a GPU number" in printed
    assert CPU_DEFAULTS["tokens"] <= 1024  # the GPU size (8192 x 32 heads x 128) took ~10 minutes on CPU
