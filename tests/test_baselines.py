"""Every baseline (and distattn as a layer method) against the single-process reference layer.

For world sizes 2, 3 and 4 (gloo, CPU), one spawn per world size runs every case: each method x
{attention layer, full LLaMA layer} x {MHA, GQA, odd head count}, causal, plus non-causal attention layers.
The accuracy rule is tests/attn_ref.py's, applied to whole layers: the error of a method's fp32 output and
input/weight gradients against the same layer in fp64 (plain PyTorch attention) is at most twice that of
the plain fp32 layer, plus a floor. Each case's bytes sent per rank, from the methods' own counters, must
equal the cost model's formula (``bench/model.py``) within 1%, and distattn's executor must run the model's
plan: as many fetch rounds as the plan has steps, as many kernel calls per rank as its tasks. Ulysses (the
library's 2-D path with ``U = P``, ``R = 1``) must refuse exactly the head counts the library cannot split
(``distattn.schedule.ulysses_heads``; GQA with ``h_kv | P`` replicates kv heads) with a clear ValueError on every
rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` lives at the repository root

from attn_ref import assert_close_by_rule, magnitude_of, naive_attention  # noqa: E402
from dist_utils import run_distributed  # noqa: E402

from bench.baselines import METHODS, LayerShape, assemble_grads, init_weights  # noqa: E402
from bench.model import DISTATTN_METHODS, method_bytes  # noqa: E402
from distattn.schedule import make_plan  # noqa: E402

SHAPES = {
    "mha": LayerShape(heads_q=4, heads_kv=4, head_dim=8, ffn=24),
    "gqa": LayerShape(heads_q=4, heads_kv=2, head_dim=8, ffn=24),
    "odd": LayerShape(heads_q=3, heads_kv=3, head_dim=8, ffn=20),  # Megatron pads; Ulysses refuses (P=2, 4)
}
BATCH, N_PER_RANK = 2, 5  # odd n: no accidental alignment with head or block sizes
BYTES_REL_TOL = 0.01  # the acceptance criterion: counters match the model within 1%
SPAWN_TIMEOUT = 150  # seconds per world size; the whole file takes well under a minute on 2 cores


def _cases():
    cases = []
    for method in METHODS:
        for shape_name in SHAPES:
            for full in (False, True):
                cases.append((method, shape_name, full, True))
        cases.append((method, "mha", False, False))  # non-causal attention layer
    return cases


def _inputs(shape: LayerShape, world: int, case_seed: int):
    g = torch.Generator().manual_seed(1000 + case_seed)
    big_n = world * N_PER_RANK
    x = torch.randn(BATCH, big_n, shape.hidden, generator=g)
    dy = torch.randn(BATCH, big_n, shape.hidden, generator=g)
    return x, dy


def _worker(rank, world, cases):
    import distattn.comm as dcomm
    import distattn.kernels as kernels
    from bench.baselines import collectives
    from bench.model_report import instrument_executor

    counts = instrument_executor(kernels, dcomm)  # kernel calls (tasks) and fetch rounds (steps)
    results = []
    for i, (method_name, shape_name, full, causal) in enumerate(cases):
        shape, method = SHAPES[shape_name], METHODS[method_name]
        x_full, dy_full = _inputs(shape, world, i)
        sl = slice(rank * N_PER_RANK, (rank + 1) * N_PER_RANK)
        params, placement = method.shard(init_weights(shape, seed=i), shape, rank, world)
        params = {k: v.clone().requires_grad_() for k, v in params.items()}
        x = x_full[:, sl].clone().requires_grad_()
        collectives.reset_counters()
        dcomm.reset_counters()
        counts.clear()
        try:
            fn = method.layer if full else method.attention
            y = fn(x, params, shape, causal=causal, backend="torch")
        except ValueError as exc:
            results.append({"error": str(exc)})
            continue
        y.backward(dy_full[:, sl])
        used = {k for k in params if params[k].grad is not None}
        results.append({"out": y.detach(), "dx": x.grad, "grads": {k: params[k].grad for k in used},
                        "placement": {k: placement[k] for k in used},
                        "bytes": collectives.COUNTERS.bytes_sent + dcomm.COUNTERS.bytes_sent,
                        "steps": (counts.get("fwd_rounds", 0), counts.get("bwd_rounds", 0)),
                        "tasks": (counts.get("fold", 0), counts.get("bwd_chunk", 0))})
    return results


def _reference(shape: LayerShape, world: int, case_seed: int, full: bool, causal: bool, dtype):
    """out, dx and weight grads of the full-sequence layer with plain PyTorch attention in ``dtype``."""
    from bench.baselines.layers import reference_attention_layer, reference_llama_layer

    x, dy = _inputs(shape, world, case_seed)
    w = {k: v.to(dtype).requires_grad_() for k, v in init_weights(shape, seed=case_seed).items()}
    x = x.to(dtype).requires_grad_()

    def plain(q, k, v, causal):
        return naive_attention(q, k, v, causal=causal, dtype=dtype)[0]

    layer = reference_llama_layer if full else reference_attention_layer
    y = layer(x, w, shape, plain, causal)
    y.backward(dy.to(dtype))
    grads = {k: t.grad for k, t in w.items() if t.grad is not None}
    return y.detach(), x.grad, grads


def _ulysses_splits(shape: LayerShape, world: int) -> bool:
    """What the library accepts with ``U = P``: ``P | h_q``, and ``P | h_kv`` or ``h_kv | P`` (kv replicated)."""
    return shape.heads_q % world == 0 and (shape.heads_kv % world == 0 or world % shape.heads_kv == 0)


def _check_case(world, case, case_seed, per_rank):
    method_name, shape_name, full, causal = case
    shape = SHAPES[shape_name]
    label = f"P={world} {method_name} {shape_name} {'layer' if full else 'attn'} causal={causal}"
    if method_name == "ulysses" and not _ulysses_splits(shape, world):
        for r in per_rank:  # every rank refuses, before any communication, with the same message
            assert "error" in r, f"{label}: Ulysses should refuse"
            assert r["error"] == per_rank[0]["error"]
        assert "cannot be split over ulysses=" in per_rank[0]["error"], per_rank[0]["error"]
        return
    errors = [r["error"] for r in per_rank if "error" in r]
    assert not errors, f"{label}: {errors[0]}"

    out = torch.cat([r["out"] for r in per_rank], dim=1)
    dx = torch.cat([r["dx"] for r in per_rank], dim=1)
    ref = _reference(shape, world, case_seed, full, causal, torch.float64)
    base = _reference(shape, world, case_seed, full, causal, torch.float32)
    shapes = {k: g.shape for k, g in ref[2].items()}
    grads = assemble_grads([(r["grads"], r["placement"]) for r in per_rank], shapes)
    assert set(per_rank[0]["grads"]) == set(ref[2]), f"{label}: parameters with gradients differ"

    assert_close_by_rule(f"{label} out", out, base[0], ref[0], torch.float32)
    mag = magnitude_of(ref[1], *ref[2].values())
    assert_close_by_rule(f"{label} dx", dx, base[1], ref[1], torch.float32, magnitude=mag)
    for name in ref[2]:
        assert_close_by_rule(f"{label} d{name}", grads[name], base[2][name], ref[2][name], torch.float32,
                             magnitude=mag)

    for rank, r in enumerate(per_rank):
        want = method_bytes(method_name, world, rank, BATCH, N_PER_RANK, shape, 4, causal=causal, full_layer=full)
        assert abs(r["bytes"] - want) <= BYTES_REL_TOL * want, (
            f"{label} rank {rank}: counters say {r['bytes']} bytes sent, the model {want}")
    if method_name in DISTATTN_METHODS:  # the executor ran the model's plan: its steps, its tasks per rank
        plan = make_plan(world, causal, DISTATTN_METHODS[method_name][0])
        for rank, r in enumerate(per_rank):
            tasks = sum(1 for step in plan.steps for t in step if t.rank == rank)
            head = plan.run_order("backward").head_task(rank) is not None  # the local pair in two calls
            assert r["steps"] == (plan.num_steps(),) * 2, f"{label} rank {rank}: fetch rounds {r['steps']}"
            assert r["tasks"] == (tasks, tasks + head), f"{label} rank {rank}: kernel calls {r['tasks']} != plan " \
                                                        f"{tasks} (+ {int(head)} head)"


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.timeout(SPAWN_TIMEOUT + 60)
def test_baselines_match_reference(world):
    cases = _cases()
    per_rank = run_distributed(_worker, world, cases, timeout=SPAWN_TIMEOUT)
    for i, case in enumerate(cases):
        _check_case(world, case, i, [per_rank[r][i] for r in range(world)])


def test_megatron_partition_pads_heads():
    from bench.baselines.megatron import megatron_partition

    odd = SHAPES["odd"]  # 3 heads on 4 ranks: padded to 4, rank 3 computes one dummy head
    parts = [megatron_partition(odd, r, 4) for r in range(4)]
    assert [p.heads_padded for p in parts] == [4] * 4
    assert [p.q_heads for p in parts] == [(0,), (1,), (2,), ()]
    gqa = SHAPES["gqa"]  # 4 q heads, 2 kv heads on 4 ranks: kv heads replicated on pairs of ranks
    assert [megatron_partition(gqa, r, 4).kv_heads for r in range(4)] == [(0,), (0,), (1,), (1,)]
    mixed = megatron_partition(gqa, 1, 3)  # 6 padded heads, 2 per rank: rank 1 holds heads 2, 3 -> kv 1
    assert mixed.q_heads == (2, 3) and mixed.kv_heads == (1,) and mixed.native_gqa


def test_ulysses_refuses_what_the_library_refuses():
    from bench.baselines.ulysses import Ulysses

    with pytest.raises(ValueError, match=r"heads_q=4 on 3 ranks.*4 query heads cannot be split over ulysses=3"):
        Ulysses().check(SHAPES["mha"], 3)
    with pytest.raises(ValueError, match=r"heads_q=3 on 2 ranks"):
        Ulysses().check(SHAPES["odd"], 2)
    wide = LayerShape(heads_q=12, heads_kv=3, head_dim=8, ffn=24)
    with pytest.raises(ValueError, match=r"heads_kv=3 on 4 ranks.*3 kv heads cannot be split over ulysses=4"):
        Ulysses().check(wide, 4)  # 3 kv heads neither split over 4 ranks nor divide 4
    Ulysses().check(SHAPES["gqa"], 2)
    Ulysses().check(SHAPES["gqa"], 4)  # 2 kv heads on 4 ranks: each replicated on 2 (the library's GQA path)
    for world in (2, 3, 4, 6, 8):  # exactly the library's rule
        for shape in (*SHAPES.values(), wide):
            accepted = _ulysses_splits(shape, world)
            try:
                Ulysses().check(shape, world)
            except ValueError:
                assert not accepted, (shape, world)
            else:
                assert accepted, (shape, world)
