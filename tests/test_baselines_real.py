"""The home-made Ulysses baseline (``bench/baselines/ulysses.py``: the library's 2-D path, ``U = P``, ``R = 1``) held
to DeepSpeed-Ulysses itself (``bench/baselines/deepspeed_ulysses.py``), issue 37 part 3.

At P = 2 and 4 (gloo, CPU, fp32), the attention layer of ``tests/test_baselines.py`` (MHA and GQA shapes, causal):
both against the fp64 one-process layer by the accuracy rule (out, dx, every weight gradient), and their bytes from
one counter (``bench.peers.measure.count_bytes``, the peers harness's): DeepSpeed's are its four all-to-alls each
way, ``2 (2 h_q + 2 h_kv) b n d 4 (P - 1) / P`` per rank; the home-made one's equal its cost model
(``bench.model.method_bytes``) and the library's own counters. The two are not byte-equal, and the test says by how
much: the library sends q, k, v, dout, lse and delta again in the backward instead of keeping head-sharded copies.

The home-made Megatron TP+SP baseline (``bench/baselines/megatron.py``) held to megatron-core's own ``SelfAttention``
and ``MLP`` (``bench/baselines/megatron_core.py``) the same way, the attention layer and the full layer: same outputs
and gradients on the same weights and inputs, and
the bytes of both from the one counter, equal except where megatron-core gathers its fused QKV for kv groups shared
by several ranks.

Needs the ``[peers]`` extra (DeepSpeed, megatron-core); CI runs this file in its peers phase.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` lives at the repository root

from dist_utils import run_distributed  # noqa: E402
from test_baselines import BATCH, N_PER_RANK, SHAPES, _inputs, _reference  # noqa: E402

from attn_ref import assert_close_by_rule, magnitude_of  # noqa: E402
from bench.baselines import METHODS, assemble_grads, init_weights  # noqa: E402
from bench.model import method_bytes  # noqa: E402

TIMEOUT_S = 240


def _worker(rank, world, shapes):
    import os
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import distattn.comm as dcomm
    from bench.baselines.deepspeed_ulysses import PEER_METHODS
    from bench.peers.measure import count_bytes

    methods = {"ulysses": METHODS["ulysses"], "deepspeed-ulysses": PEER_METHODS["deepspeed-ulysses"]}
    out = {}
    for i, shape_name in enumerate(shapes):
        shape = SHAPES[shape_name]
        x_full, dy_full = _inputs(shape, world, i)
        sl = slice(rank * N_PER_RANK, (rank + 1) * N_PER_RANK)
        for name, method in methods.items():
            params, placement = method.shard(init_weights(shape, seed=i), shape, rank, world)
            params = {k: v.clone().requires_grad_() for k, v in params.items()}
            x = x_full[:, sl].clone().requires_grad_()
            dcomm.reset_counters()
            with count_bytes() as c:
                y = method.attention(x, params, shape, causal=True, backend="torch")
                y.backward(dy_full[:, sl])
            out[(shape_name, name)] = {"out": y.detach(), "dx": x.grad, "placement": placement,
                                       "grads": {k: p.grad for k, p in params.items() if p.grad is not None},
                                       "sent": c.sent, "own": dcomm.COUNTERS.bytes_sent, "calls": dict(c.calls)}
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_home_made_ulysses_against_deepspeed_ulysses(world):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install -e '.[peers]')")
    shapes = ("mha", "gqa") if world == 2 else ("mha",)  # gqa's 2 kv heads do not split over 4 for DeepSpeed
    per_rank = run_distributed(_worker, world, shapes, timeout=TIMEOUT_S)
    report = {}
    for i, shape_name in enumerate(shapes):
        shape = SHAPES[shape_name]
        ref = _reference(shape, world, i, False, True, torch.float64)
        base = _reference(shape, world, i, False, True, torch.float32)
        mag = magnitude_of(ref[1], *ref[2].values())
        for name in ("ulysses", "deepspeed-ulysses"):
            runs = [r[(shape_name, name)] for r in per_rank]
            label = f"P={world} {shape_name} {name}"
            assert_close_by_rule(f"{label} out", torch.cat([r["out"] for r in runs], 1), base[0], ref[0],
                                 torch.float32)
            assert_close_by_rule(f"{label} dx", torch.cat([r["dx"] for r in runs], 1), base[1], ref[1],
                                 torch.float32, magnitude=mag)
            grads = assemble_grads([(r["grads"], r["placement"]) for r in runs], {k: g.shape for k, g in ref[2].items()})
            for w in ref[2]:
                assert_close_by_rule(f"{label} d{w}", grads[w], base[2][w], ref[2][w], torch.float32, magnitude=mag)
        for rank, r in enumerate(per_rank):
            ds, ours = r[(shape_name, "deepspeed-ulysses")], r[(shape_name, "ulysses")]
            want_ds = method_bytes("deepspeed-ulysses", world, rank, BATCH, N_PER_RANK, shape, 4)
            assert ds["sent"] == want_ds, (rank, ds["sent"], want_ds, ds["calls"])
            want = method_bytes("ulysses", world, rank, BATCH, N_PER_RANK, shape, 4, causal=True, full_layer=False)
            # the one counter also sees the library's agreement (a few-integer all_reduce per call), which its own
            # counters and the cost model leave out: within 1% of the model either way
            assert abs(ours["own"] - want) <= 0.01 * want and abs(ours["sent"] - want) <= 0.01 * want, \
                (rank, ours["sent"], ours["own"], want, ours["calls"])
            assert ours["sent"] > ds["sent"]  # the library re-sends in the backward what DeepSpeed keeps
            report[(shape_name, rank)] = (ours["sent"], ds["sent"])
    print({k: f"home-made {a} B vs DeepSpeed {b} B ({a / b:.2f}x)" for k, (a, b) in report.items()})


def test_scaling_benchmark_runs_deepspeed_ulysses_beside_the_home_made_one(tmp_path):
    """``bench/scaling.py --methods ulysses deepspeed-ulysses`` (2 ranks, smoke shapes): every row measured, the real
    one's bytes (the one counter) equal to its formula, the same refusal of 3 heads on 2 ranks."""
    import csv
    import os
    import subprocess

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install -e '.[peers]')")
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "scaling"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                           str(root / "bench" / "scaling.py"), "--smoke", "--methods", "ulysses", "deepspeed-ulysses",
                           "--out", str(out)], cwd=root, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert {r["method"] for r in rows} == {"ulysses", "deepspeed-ulysses"} and len(rows) == 24
    for r in rows:
        if r["model"] == "tiny-odd":
            assert "cannot run heads" in r["status"], r
            continue
        assert r["status"] == "ok" and r["bytes_match"] == "True" and int(r["bytes_sent_max"]) > 0, r


# -- the home-made Megatron TP+SP baseline held to megatron-core's SelfAttention and MLP -----------------------------
_MEGATRON_CASES = (("mha", False), ("gqa", False), ("odd", False), ("mha", True), ("gqa", True))


def _megatron_worker(rank, world, cases):
    from bench.baselines.megatron_core import PEER_METHODS as MCORE
    from bench.peers.measure import count_bytes

    methods = {"megatron": METHODS["megatron"], "megatron-core": MCORE["megatron-core"]}
    out = {}
    try:
        for i, (shape_name, full) in enumerate(cases):
            shape = SHAPES[shape_name]
            x_full, dy_full = _inputs(shape, world, i)
            sl = slice(rank * N_PER_RANK, (rank + 1) * N_PER_RANK)
            for name, method in methods.items():
                try:
                    method.check(shape, world)
                except ValueError as exc:  # megatron-core refuses what the home-made one pads (odd heads)
                    out[(shape_name, full, name)] = {"refused": str(exc)}
                    continue
                params, placement = method.shard(init_weights(shape, seed=i), shape, rank, world)
                params = {k: v.clone().requires_grad_() for k, v in params.items()}
                x = x_full[:, sl].clone().requires_grad_()
                fn = method.layer if full else method.attention
                with count_bytes() as c:
                    y = fn(x, params, shape, causal=True, backend="torch")
                    y.backward(dy_full[:, sl])
                out[(shape_name, full, name)] = {
                    "out": y.detach(), "dx": x.grad, "placement": placement, "sent": c.sent, "calls": dict(c.calls),
                    "grads": {k: p.grad for k, p in params.items() if p.grad is not None}}
    finally:
        MCORE["megatron-core"].close()
    return out


def _full_grads(name, runs, shape):
    """Full-weight gradients from every rank's shards (megatron-core's fused QKV and fc1 split back)."""
    full = {k: tuple(w.shape) for k, w in init_weights(shape).items()}
    per_rank = [(r["grads"], r["placement"]) for r in runs]
    if name == "megatron":
        return assemble_grads(per_rank, full)
    qd, kvd, f = shape.heads_q * shape.head_dim, shape.heads_kv * shape.head_dim, shape.ffn
    fused = {"wqkv": (qd + 2 * kvd, shape.hidden), "wo": full["wo"], "w_gate_up": (2 * f, shape.hidden),
             "w_down": full["w_down"], "norm1": full["norm1"], "norm2": full["norm2"]}
    g = assemble_grads(per_rank, fused)
    wq, wk, wv = g.pop("wqkv").split([qd, kvd, kvd])
    w_gate, w_up = g.pop("w_gate_up").split([f, f])
    return {**g, "wq": wq, "wk": wk, "wv": wv, "w_gate": w_gate, "w_up": w_up}


@pytest.mark.parametrize("world", [2, 4])
def test_home_made_megatron_against_megatron_core(world):
    """P = 2 and 4, gloo: megatron-core's ``SelfAttention`` and ``MLP`` (TP = P + sequence parallel, its local GPT
    layer spec, its RoPE) and the home-made ``MegatronTPSP`` on the same weights and inputs, the attention layer (MHA,
    GQA) and the full pre-norm layer: both within the accuracy rule of the fp64 layer (out, dx, every weight
    gradient). Bytes per rank: the home-made one's are the cost model's count, 5 collectives of ``(b, n, H)`` fp32 per
    block (2 forward, 3 backward), and so are megatron-core's (1.00x) except where the kv heads are fewer than the
    ranks (GQA at P = 4: 2 kv heads), where megatron-core moves its fused QKV output once more each way (1.80x for the
    attention layer here). 3 heads: megatron-core refuses (its TransformerConfig), the home-made one pads."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        pytest.skip("megatron-core is not installed (pip install -e '.[peers]')")
    per_rank = run_distributed(_megatron_worker, world, _MEGATRON_CASES, timeout=TIMEOUT_S)
    report = {}
    for i, (shape_name, full) in enumerate(_MEGATRON_CASES):
        shape = SHAPES[shape_name]
        if shape_name == "odd":
            for r in per_rank:
                assert "must be a multiple of tensor_model_parallel_size" in r[(shape_name, full, "megatron-core")][
                    "refused"]
                assert "refused" not in r[(shape_name, full, "megatron")]
        ref = _reference(shape, world, i, full, True, torch.float64)
        base = _reference(shape, world, i, full, True, torch.float32)
        mag = magnitude_of(ref[1], *ref[2].values())
        for name in ("megatron", "megatron-core"):
            runs = [r[(shape_name, full, name)] for r in per_rank]
            if "refused" in runs[0]:
                continue
            label = f"P={world} {shape_name} {'layer' if full else 'attn'} {name}"
            assert_close_by_rule(f"{label} out", torch.cat([r["out"] for r in runs], 1), base[0], ref[0],
                                 torch.float32)
            assert_close_by_rule(f"{label} dx", torch.cat([r["dx"] for r in runs], 1), base[1], ref[1],
                                 torch.float32, magnitude=mag)
            grads = _full_grads(name, runs, shape)
            for w in ref[2]:
                assert_close_by_rule(f"{label} d{w}", grads[w], base[2][w], ref[2][w], torch.float32, magnitude=mag)
        if shape_name == "odd":
            continue
        blocks = 2 if full else 1  # 5 all-gathers / reduce-scatters of (b, n, H) fp32 per block
        want = 5 * blocks * (world - 1) * BATCH * N_PER_RANK * shape.hidden * 4
        assert method_bytes("megatron", world, 0, BATCH, N_PER_RANK, shape, 4, full_layer=full) == want
        # kv heads fewer than ranks: megatron-core all-gathers the fused QKV output along its last dim to hand each
        # rank its whole kv group (backward: a reduce-scatter); the home-made one projects the group's kv heads on
        # every rank that reads them (replicated weights, summed gradients) and sends nothing more
        extra = 0 if shape.heads_kv % world == 0 else \
            2 * (world - 1) * BATCH * N_PER_RANK * (shape.heads_q + 2 * shape.heads_kv) * shape.head_dim * 4
        for rank, r in enumerate(per_rank):
            mc, ours = r[(shape_name, full, "megatron-core")], r[(shape_name, full, "megatron")]
            assert ours["sent"] == want and mc["sent"] == want + extra, (rank, ours["sent"], mc["sent"], want, extra,
                                                                         mc["calls"])
            report[(shape_name, "layer" if full else "attn", rank)] = (ours["sent"], mc["sent"])
    print({k: f"megatron-core {b} B vs home-made {a} B ({b / a:.2f}x)" for k, (a, b) in report.items()})


def test_scaling_benchmark_runs_megatron_core_beside_the_home_made_megatron(tmp_path):
    """``bench/scaling.py --methods megatron megatron-core`` (2 ranks, smoke shapes): every row measured, both bytes
    (megatron-core's from the one counter) equal to their formulas, 3 heads on 2 ranks refused by megatron-core only."""
    import csv
    import os
    import subprocess

    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        pytest.skip("megatron-core is not installed (pip install -e '.[peers]')")
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "scaling"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                           str(root / "bench" / "scaling.py"), "--smoke", "--methods", "megatron", "megatron-core",
                           "--out", str(out)], cwd=root, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert {r["method"] for r in rows} == {"megatron", "megatron-core"} and len(rows) == 24
    for r in rows:
        if r["model"] == "tiny-odd" and r["method"] == "megatron-core":
            assert "must be a multiple of tensor_model_parallel_size" in r["status"], r
            continue
        assert r["status"] == "ok" and r["bytes_match"] == "True" and int(r["bytes_sent_max"]) > 0, r
