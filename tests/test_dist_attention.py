"""dist_flash_attn_func on spawned gloo ranks against an fp64 single-device reference.

One spawn per world size runs the whole case grid (spawning costs seconds per rank on a small machine).
Each rank checks its own shard of out, dq, dk, dv with the accuracy rule, that its error is no worse than a
constant factor of the single-device kernel's error on the same inputs (the error must not grow with the
world size), and that the bytes its comm counters saw equal the simulator's prediction for the same plan.
"""

import pytest
import torch

import distattn
from attn_ref import assert_all_close_by_rule, magnitude_of, max_err, reference_grads
from dist_utils import run_distributed
from distattn import comm
from distattn.schedule import Shapes, simulate

TIMEOUT_S = 240  # the whole grid of one world size, 8 ranks sharing two cores
# Error growth allowed over the single-device kernel on the same inputs, plus a few-ulp floor: merging
# partials adds one rounding per merge, nothing that scales with P.
GROWTH_FACTOR = 2.0
GROWTH_FLOOR_REL = {torch.float32: 4e-6, torch.float16: 2e-3}

CASES = [  # (causal, schedule, h_q, h_kv, d, dtype, backend)
    (causal, schedule, h_q, h_kv, d, dtype, "torch")
    for causal in (True, False)
    for schedule in ("balanced", "ring")
    for (h_q, h_kv, d) in ((4, 2, 16), (3, 3, 80))
    for dtype in (torch.float32, torch.float16)
] + [  # the Triton kernels (interpreter on CPU; fp16/fp32 only there: bf16 tl.dot is broken in the interpreter)
    (True, "balanced", 4, 2, 16, torch.float16, "triton"),
    (False, "ring", 4, 1, 32, torch.float32, "triton"),
]


def _full_inputs(world, n, h_q, h_kv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(2, world * n, h, d, generator=g).to(dtype)  # noqa: E731
    return mk(h_q), mk(h_kv), mk(h_kv), mk(h_q)


def _check_case(rank, world, case, n, seed):
    causal, schedule, h_q, h_kv, d, dtype, backend = case
    q, k, v, dout = _full_inputs(world, n, h_q, h_kv, d, dtype, seed)
    shard = distattn.shard_sequence
    qs, ks, vs = (shard(t).clone().requires_grad_() for t in (q, k, v))
    comm.reset_counters()
    out = distattn.dist_flash_attn_func(qs, ks, vs, causal=causal, schedule=schedule, backend=backend)
    out.backward(shard(dout))
    ours = [out, qs.grad, ks.grad, vs.grad]
    assert all(t.dtype == dtype for t in ours)

    # bytes: what the counters saw == what the simulator predicts from the same plan
    rep = simulate(world, causal, schedule, Shapes(batch=2, seq_per_rank=n, heads_q=h_q, heads_kv=h_kv,
                                                   head_dim=d, dtype_bytes=q.element_size()))
    assert comm.COUNTERS.bytes_sent == rep.bytes_sent[rank], (comm.COUNTERS, rep.bytes_sent[rank])
    assert comm.COUNTERS.bytes_recv == rep.bytes_recv[rank], (comm.COUNTERS, rep.bytes_recv[rank])

    # accuracy rule against fp64, on this rank's shard
    ref = [shard(t) for i, t in enumerate(reference_grads(q, k, v, dout, torch.float64, causal=causal)) if i != 1]
    base = [shard(t) for i, t in enumerate(reference_grads(q, k, v, dout, dtype, causal=causal)) if i != 1]
    assert_all_close_by_rule(("out", "dq", "dk", "dv"), ours, base, ref, dtype)

    # the error does not grow with the world size: compare with the single-device kernel on the full inputs
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    single = distattn.flash_attn_func(qf, kf, vf, causal=causal, backend=backend)
    single.backward(dout)
    singles = [shard(t) for t in (single, qf.grad, kf.grad, vf.grad)]
    floor = GROWTH_FLOOR_REL[dtype] * max(magnitude_of(*ref), 1.0)
    for name, o, s, r in zip(("out", "dq", "dk", "dv"), ours, singles, ref):
        assert max_err(o, r) <= GROWTH_FACTOR * max_err(s, r) + floor, (name, max_err(o, r), max_err(s, r))


def _grid_worker(rank, world, cases, n):
    for i, case in enumerate(cases):
        try:
            _check_case(rank, world, case, n, seed=100 + i)
        except AssertionError as exc:
            raise AssertionError(f"world={world} case={case}: {exc}") from exc
    return len(cases)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_grid_against_reference(world):
    n = 7 if world <= 4 else 5  # tokens per rank: odd, not a multiple of any block size
    cases = CASES if world <= 5 else [c for c in CASES if c[5] == torch.float32]
    assert run_distributed(_grid_worker, world, cases, n, timeout=TIMEOUT_S) == [len(cases)] * world


def test_one_and_two_tokens_per_rank_against_reference():
    """The backward splits each rank's local pair into a head, computed before its first step, and the rest
    (``Plan.head_task``, ``Executor.head_rows``): with one token per rank there is no row to split off (the head
    computes nothing), with two each part holds one row."""
    cases = [c for c in CASES if c[5] == torch.float32 and c[6] == "torch" and c[2] == 4]
    for n in (1, 2):
        assert run_distributed(_grid_worker, 3, cases, n, timeout=TIMEOUT_S) == [len(cases)] * 3


def _bad_input_worker(rank, world):
    errors = []
    q = torch.zeros(1, 4, 6, 16)
    for args, kwargs in [
        ((q, torch.zeros(1, 4, 4, 16), torch.zeros(1, 4, 4, 16)), {}),          # 6 heads vs 4
        ((q, torch.zeros(1, 5, 6, 16), torch.zeros(1, 5, 6, 16)), {}),          # q and kv shards differ
        ((q, q, q), {"schedule": "zigzagx"}),
        ((q, q, q), {"backend": "nope"}),
        ((q.half(), q, q), {}),
    ]:
        try:
            distattn.dist_flash_attn_func(*args, **kwargs)
            errors.append(None)
        except (ValueError, TypeError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    try:
        distattn.shard_sequence(torch.zeros(1, 5))
    except ValueError as exc:
        errors.append(str(exc))
    return errors


def test_bad_input_raises_same_error_on_every_rank_without_hanging():
    per_rank = run_distributed(_bad_input_worker, 3, timeout=60)
    assert all(r == per_rank[0] for r in per_rank)
    msgs = per_rank[0]
    assert None not in msgs
    assert "heads_q (6) must be a multiple of heads_kv (4)" in msgs[0]
    assert "q holds 4 tokens of this rank's shard but k/v hold 5" in msgs[1]
    assert "schedule='zigzagx' is not one of ('ring', 'balanced', 'zigzag', 'placed', 'auto')" in msgs[2]
    assert "backend='nope' is unknown" in msgs[3]
    assert msgs[4].startswith("TypeError: q, k, v must share one dtype")
    assert msgs[5].startswith("sequence length 5 (dim 1) must be divisible by the group size 3")


def _rank_mismatch_worker(rank, world):
    n = 4 if rank == 0 else 6  # a mismatch that no single rank can see from its own shapes
    x = torch.zeros(1, n, 2, 8)
    try:
        distattn.dist_flash_attn_func(x, x, x)
    except ValueError as exc:
        return str(exc)
    return None


def test_rank_mismatch_caught_without_any_flag():
    msgs = run_distributed(_rank_mismatch_worker, 2, timeout=60)
    assert msgs[0] is not None and msgs[0] == msgs[1]
    assert msgs[0].startswith("distattn: the ranks of the group disagree on the attention call")
    assert "q.shape: rank 0: (1, 4, 2, 8), rank 1: (1, 6, 2, 8)" in msgs[0]


def _exchange_misuse_worker(rank, world):
    ex = comm.PeerExchange(None, torch.device("cpu"))
    peer = 1 - rank
    buf = torch.empty(3)
    ex.post("a", [(peer, [torch.full((3,), float(rank))])], [(peer, [buf])])
    found = []
    try:
        ex.post("a", [], [])
    except RuntimeError as exc:
        found.append(str(exc))
    try:
        ex.close()
    except RuntimeError as exc:
        found.append(str(exc))
    ex.wait("a")
    try:
        ex.wait("a")
    except RuntimeError as exc:
        found.append(str(exc))
    ex.close()
    return found, buf.tolist()


def test_exchange_raises_on_misuse_and_delivers():
    results = run_distributed(_exchange_misuse_worker, 2, timeout=60)
    for rank, (found, buf) in enumerate(results):
        assert buf == [float(1 - rank)] * 3
        assert "slot 'a' was posted twice without wait()" in found[0]
        assert "closed with rounds still in flight" in found[1]
        assert "wait() on slot 'a' with nothing posted (waited twice?)" in found[2]


def _no_overlap_and_gather_worker(rank, world):
    q, k, v, dout = _full_inputs(world, 4, 4, 1, 16, torch.float32, seed=5)
    shards = [distattn.shard_sequence(t) for t in (q, k, v)]
    a = distattn.dist_flash_attn_func(*shards, causal=True, overlap=True)
    b = distattn.dist_flash_attn_func(*shards, causal=True, overlap=False)
    x = distattn.shard_sequence(q).clone().requires_grad_()
    full = distattn.gather_sequence(x)
    (full * (rank + 1)).sum().backward()  # every rank uses the whole gathered tensor
    return torch.equal(a, b), torch.equal(full, q), x.grad.unique().tolist()


def test_overlap_changes_nothing_and_gather_sequence_gradient():
    world = 3
    for same, gathered, grad in run_distributed(_no_overlap_and_gather_worker, world, timeout=60):
        assert same and gathered
        assert grad == [float(sum(r + 1 for r in range(world)))]  # sum over ranks of their d(loss)/d(shard)


def test_without_process_group_is_a_clear_error():
    x = torch.zeros(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="needs an initialized process group"):
        distattn.dist_flash_attn_func(x, x, x)


def test_shard_and_gather_without_process_group_are_identity():
    x = torch.zeros(1, 5)
    assert distattn.shard_sequence(x) is not None and distattn.shard_sequence(x).shape == (1, 5)
    assert distattn.gather_sequence(x) is x


def _strided_worker(rank, world):
    """HF hands attention (b, h, n, d) tensors transposed to (b, n, h, d): unit stride in d only."""
    q, k, v, dout = _full_inputs(world, 6, 4, 2, 16, torch.float32, seed=9)
    results = []
    for backend in ("torch", None):  # the reference and the CPU default
        outs = []
        for strided in (False, True):
            shards = [distattn.shard_sequence(t) for t in (q, k, v)]
            if strided:  # same values, memory laid out (b, h, n, d)
                shards = [s.transpose(1, 2).contiguous().transpose(1, 2) for s in shards]
                assert not shards[0].is_contiguous() and shards[0].stride(-1) == 1
            shards = [s.detach().requires_grad_() for s in shards]
            out = distattn.dist_flash_attn_func(*shards, causal=True, backend=backend)
            out.backward(distattn.shard_sequence(dout))
            outs.append([out.detach(), *(s.grad for s in shards)])
        # the reference's einsums may sum in another order for another layout: equal to round-off
        results.append(all(torch.equal(a, b) if backend is None else torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                           for a, b in zip(*outs)))
    return results


def test_strided_inputs_need_no_copy_and_give_the_same_results():
    for per_rank in run_distributed(_strided_worker, 3, timeout=60):
        assert per_rank == [True, True]  # the CPU default: the same bits; the reference: to round-off
