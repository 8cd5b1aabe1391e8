"""dist_flash_attn_varlen_func on spawned gloo ranks: packed documents across ranks against an fp64 reference.

The reference is naive attention over the WHOLE stream with an explicit boolean mask (same document, causal,
window), in fp64 and in the test dtype (the accuracy rule's baseline). Each rank checks its shard of out, dq,
dk, dv; that its byte counters equal the simulator's for the same masked plan (so pairs the plan skips are
never communicated); and the plan itself: every pair with a visible (query, key) pair is computed exactly once,
and no other.
"""

import pytest
import torch

import distattn
from attn_ref import assert_all_close_by_rule
from dist_utils import run_distributed
from distattn import comm
from distattn.schedule import MaskSpec, Shapes, make_plan, pair_work, simulate

TIMEOUT_S = 240


def _stream_mask(cu, total, causal, window):
    """(total, total) bool: query p sees key j (padding tail = one more document)."""
    lo, hi = MaskSpec(causal=causal, window=window, cu_seqlens=tuple(cu)).bounds(total, 0, total)
    j = torch.arange(total)[None, :]
    return (j >= torch.from_numpy(lo)[:, None]) & (j <= torch.from_numpy(hi)[:, None])


def _explicit_keep(cu, total, causal, window):
    """The same mask built independently of MaskSpec: for the test of MaskSpec itself."""
    docs = list(cu) + ([total] if cu[-1] < total else [])
    keep = torch.zeros(total, total, dtype=torch.bool)
    for a, b in zip(docs, docs[1:]):
        for p in range(a, b):
            for j in range(a, b):
                ok = (not causal or j <= p) and (window[0] < 0 or j >= p - window[0])
                ok = ok and (causal or window[1] < 0 or j <= p + window[1])
                keep[p, j] = ok
    return keep


def _reference(q, k, v, dout, keep, dtype):
    """out, dq, dk, dv of softmax(q k^T scale + mask) v in ``dtype``; rows with no visible key -> 0."""
    qd, kd, vd = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", qd, kd.repeat_interleave(g, 1)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    out = torch.einsum("hqk,khd->qhd", p, vd.repeat_interleave(g, 1))
    out.backward(dout.to(dtype))
    return out.detach(), qd.grad, kd.grad, vd.grad


# (documents' lengths, padding at the tail) per world size: straddling 0, 1 and several rank boundaries,
# documents of length 1, a document covering (almost) the whole stream
def _layouts(world, n):
    total = world * n
    yield [n // 2, 1, 1, total]                    # tiny documents, then a long one straddling every boundary
    yield [1, 1, 1, 2 * n + 1, total]              # a document over several boundaries (cut at the end)
    yield [max(total - 3, 1)]                      # one document, stream not a multiple of P (tail padding)
    yield [3, 5, 2, 7] * total                     # many small documents (cut at the end)


CASES = [  # (causal, window, schedule, h_q, h_kv, d, dtype, backend)
    (True, (-1, -1), "balanced", 4, 2, 16, torch.float32, "torch"),
    (True, (-1, -1), "ring", 3, 3, 16, torch.float16, "torch"),
    (False, (-1, -1), "balanced", 2, 1, 16, torch.float32, "torch"),
    (True, (5, 0), "balanced", 2, 2, 16, torch.float32, "torch"),
    (False, (3, 4), "ring", 2, 1, 16, torch.float32, "torch"),
    (True, (-1, -1), "balanced", 4, 2, 16, torch.float16, "triton"),
]


def _cu(lengths, total):
    """Cumulative lengths of the positive ``lengths``, the last document cut at ``total`` tokens."""
    cu = [0]
    for length in lengths:
        if length > 0 and cu[-1] < total:
            cu.append(min(total, cu[-1] + length))
    return cu


def _check(rank, world, case, lengths, n, seed):
    causal, window, schedule, h_q, h_kv, d, dtype, backend = case
    total = world * n
    cu = _cu(lengths, total)
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(total, h, d, generator=g).to(dtype) for h in (h_q, h_kv, h_kv, h_q))
    mine = slice(rank * n, (rank + 1) * n)
    qs, ks, vs = (t[mine].clone().requires_grad_() for t in (q, k, v))
    comm.reset_counters()
    out = distattn.dist_flash_attn_varlen_func(qs, ks, vs, torch.tensor(cu, dtype=torch.int32), total,
                                               causal=causal, window_size=window, schedule=schedule,
                                               backend=backend)
    out.backward(dout[mine])

    spec = MaskSpec(causal=causal, window=window, cu_seqlens=tuple(cu))
    rep = simulate(world, causal, schedule, Shapes(batch=1, seq_per_rank=n, heads_q=h_q, heads_kv=h_kv,
                                                   head_dim=d, dtype_bytes=q.element_size()), mask=spec)
    assert comm.COUNTERS.bytes_sent == rep.bytes_sent[rank], (comm.COUNTERS, rep.bytes_sent[rank])
    assert comm.COUNTERS.bytes_recv == rep.bytes_recv[rank], (comm.COUNTERS, rep.bytes_recv[rank])

    keep = _stream_mask(cu, total, causal, window)
    ref = [t[mine] for t in _reference(q, k, v, dout, keep, torch.float64)]
    base = [t[mine] for t in _reference(q, k, v, dout, keep, dtype)]
    assert_all_close_by_rule(("out", "dq", "dk", "dv"), [out, qs.grad, ks.grad, vs.grad], base, ref, dtype)


def _worker(rank, world, n):
    done = 0
    for i, case in enumerate(CASES):
        if world > 5 and case[6] == torch.float16:
            continue
        for j, lengths in enumerate(_layouts(world, n)):
            if case[7] == "triton" and j > 1:
                continue  # the interpreter is slow: two layouts are enough for the Triton kernels
            try:
                _check(rank, world, case, lengths, n, seed=10 * i + j)
            except AssertionError as exc:
                raise AssertionError(f"world={world} case={case} lengths={lengths}: {exc}") from exc
            done += 1
    return done


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_packed_documents_against_reference(world):
    n = 9 if world <= 4 else 7  # odd, not a multiple of any block
    counts = run_distributed(_worker, world, n, timeout=TIMEOUT_S)
    assert len(set(counts)) == 1 and counts[0] > 0


# -- the plan, without ranks ----------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (4, 0)), (False, (2, 3))])
def test_masked_plan_computes_every_visible_pair_once(world, causal, window):
    n = 6
    for lengths in _layouts(world, n):
        cu = _cu(lengths, world * n)
        spec = MaskSpec(causal=causal, window=window, cu_seqlens=tuple(cu))
        keep = _explicit_keep(cu, world * n, causal, window)
        assert torch.equal(keep, _stream_mask(cu, world * n, causal, window))  # MaskSpec.bounds == explicit mask
        work = pair_work(spec, world, n)
        for i in range(world):
            for j in range(world):
                assert work[i][j] == int(keep[i * n:(i + 1) * n, j * n:(j + 1) * n].sum())
        for schedule in ("ring", "balanced"):
            plan = make_plan(world, causal, schedule, mask=spec, chunk=n)
            pairs = plan.pairs()
            assert len(pairs) == len(set(pairs))
            assert set(pairs) == {(i, j) for i in range(world) for j in range(world) if work[i][j] > 0}
            for tasks in plan.steps:
                assert len({t.rank for t in tasks}) == len(tasks)


def test_masked_balanced_never_longer_than_ring():
    for world in (4, 8, 16):
        for docs in ([5] * 100, [1, 2, 3, 60, 7, 200, 1, 1, 40] * 4):
            total = world * 32
            cu = _cu(docs, total)
            spec = MaskSpec(causal=True, cu_seqlens=tuple(cu))
            shapes = Shapes(seq_per_rank=32)
            ring = simulate(world, True, "ring", shapes, mask=spec)
            bal = simulate(world, True, "balanced", shapes, mask=spec)
            assert bal.work_makespan <= ring.work_makespan + 1e-12
            assert ring.pairs == bal.pairs and ring.pairs_skipped > 0


def _bad_cu_worker(rank, world):
    x = torch.zeros(4, 2, 8)
    msgs = []
    for cu in ([1, 8], [0, 5, 3, 8], [0, 9], [0.0, 8.0]):
        try:
            t = torch.tensor(cu) if isinstance(cu[0], float) else torch.tensor(cu, dtype=torch.int32)
            distattn.dist_flash_attn_varlen_func(x, x, x, t, 8, causal=True)
            msgs.append(None)
        except (ValueError, TypeError) as exc:
            msgs.append(str(exc))
    return msgs


def test_bad_cu_seqlens_same_error_on_every_rank():
    msgs = run_distributed(_bad_cu_worker, 2, timeout=60)
    assert msgs[0] == msgs[1] and None not in msgs[0]
    assert "cu_seqlens must start at 0" in msgs[0][0]
    assert "must be non-decreasing" in msgs[0][1]
    assert "is more than the stream holds (8 = 2 ranks x 4 tokens)" in msgs[0][2]
    assert "must be int32 or int64" in msgs[0][3]


# -- short streams and the local-cu_seqlens guard -------------------------------------------------------------
# cu_seqlens ending exactly at n with P > 1 is what per-rank LOCAL cu_seqlens look like (they end at the rank's own
# tokens, and ranks passing different ones are refused by the agreement); any other end short of P*n is a short
# stream padded at its tail, inside rank 0's shard included. (end, n, P) -> refused?
GUARD_TABLE = [
    (5, 9, 2, False),  # one short document inside rank 0's shard: padded
    (8, 9, 2, False),
    (9, 9, 2, True),  # exactly n: local cu_seqlens
    (9, 9, 3, True),
    (10, 9, 2, False),  # past rank 0's shard
    (9, 9, 1, False),  # one rank: local and global are the same
    (1, 1, 2, False),  # shard_batch's padding of a 1-token stream to a multiple of 2P explains it
    (2, 2, 2, False),  # 2 tokens padded to 2P = 4 = P*n
    (4, 4, 2, True),  # 4 tokens would be padded to 4, not 8
]


@pytest.mark.parametrize("end,n,world,refused", GUARD_TABLE)
def test_local_cu_seqlens_rule(end, n, world, refused):
    from distattn._validate import check_global_documents

    if not refused:
        check_global_documents([0, end], n, world)
        return
    with pytest.raises(ValueError, match=rf"cu_seqlens ends at {end}, exactly at the end of rank 0's shard .*LOCAL "
                                         rf"cu_seqlens.*append {world * n} to cu_seqlens"):
        check_global_documents([0, end], n, world)


def _short_worker(rank, world, n):
    for i, lengths in enumerate(([5], [n - 1], [2, 3])):  # every stream ends inside rank 0's shard
        _check(rank, world, CASES[0], lengths, n, seed=100 + i)
    _check(rank, world, CASES[3], [5], n, seed=110)  # with a window
    x = torch.zeros(n, 2, 8)
    try:  # what each rank's own shard looks like, on every rank: refused everywhere
        distattn.dist_flash_attn_varlen_func(x, x, x, torch.tensor([0, 3, n], dtype=torch.int32), world * n,
                                             causal=True)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("world", [2, 3])
def test_short_document_with_tail_padding_matches_reference_and_local_cu_seqlens_raise(world):
    """One short document (then padding) inside rank 0's shard trains like any short stream: out and grads equal
    the reference of the whole padded stream (the tail a document of its own); local cu_seqlens still raise."""
    n = 9
    msgs = run_distributed(_short_worker, world, n, timeout=TIMEOUT_S)
    assert len(set(msgs)) == 1 and msgs[0] is not None, msgs
    assert msgs[0].startswith(f"cu_seqlens ends at {n}, exactly at the end of rank 0's shard ({n} tokens per rank)")
    assert "LOCAL cu_seqlens" in msgs[0] and f"append {world * n} to cu_seqlens" in msgs[0]
