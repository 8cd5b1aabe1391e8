"""GPU tier, distributed: the distattn op on CUDA tensors, several gloo ranks sharing one GPU (NCCL refuses two
ranks on one device), and the side stream of ``comm.PeerExchange``.

``pytest -m gpu``; skipped without CUDA. Every rank uses ``cuda:0``. The Triton backend's kernels are slowed down
on purpose (``torch.cuda._sleep`` before each launch): a transfer that read a send buffer before the compute that
wrote it finished, a received buffer read before its copy landed, or a buffer freed while a copy still read it would
show as a wrong result against the fp64 reference, instead of passing by luck of timing.

gloo moves CUDA tensors through host memory (``PeerExchange._stage``), so the side stream (NCCL's path) cannot run
between processes on one GPU; ``test_side_stream_orders_transfers_and_keeps_buffers`` drives it with a loopback
transport instead, and checks each of its three orderings (send buffer ready, receive before read, no reuse).
"""
import functools

import pytest
import torch

import distattn
from attn_ref import assert_all_close_by_rule, reference_grads
from dist_utils import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TIMEOUT_S = 120  # ranks sharing one GPU, each compiling the Triton kernels on first use (seconds of work)
SLEEP_CYCLES = 20_000_000  # ~10 ms at ~2 GHz: far longer than a kernel or a copy of these small chunks
NAMES = ("out", "dq", "dk", "dv")
N_PER_RANK, H_Q, H_KV, D, DTYPE = 256, 4, 2, 64, torch.bfloat16


def _slow_kernels():
    """Every Triton launch of this process starts after a ~10 ms device-side sleep on the current stream."""
    from distattn.kernels import _triton

    for name in ("fold_", "merge_", "delta", "backward_chunk_"):
        real = getattr(_triton.TritonBackend, name)

        def slow(self, *args, _real=real, **kwargs):
            torch.cuda._sleep(SLEEP_CYCLES)
            return _real(self, *args, **kwargs)
        setattr(_triton.TritonBackend, name, slow)


def _inputs(total, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, total, h, D, generator=g).to(DTYPE) for h in (H_Q, H_KV, H_KV, H_Q)]


def _dense(rank, world, schedule, causal, group, seed):
    q, k, v, dout = _inputs(world * N_PER_RANK, seed)
    shard = functools.partial(distattn.shard_sequence, group=group, schedule=schedule)
    qs, ks, vs = (shard(t).cuda().requires_grad_() for t in (q, k, v))
    out = distattn.dist_flash_attn_func(qs, ks, vs, causal=causal, group=group, schedule=schedule, backend="triton")
    out.backward(shard(dout).cuda())
    ours = [t.detach().cpu() for t in (out, qs.grad, ks.grad, vs.grad)]
    ref = [shard(t) for i, t in enumerate(reference_grads(q, k, v, dout, torch.float64, causal=causal)) if i != 1]
    base = [shard(t) for i, t in enumerate(reference_grads(q, k, v, dout, DTYPE, causal=causal)) if i != 1]
    return lambda: assert_all_close_by_rule(NAMES, ours, base, ref, DTYPE)


def _varlen(rank, world, seed, schedule="zigzag"):
    from attn_ref import varlen_mask, masked_reference_grads
    from distattn.sharding import placement, positions

    total, lens = world * N_PER_RANK, [1, 200, world * N_PER_RANK - 301, 100]
    cu = torch.tensor([0, 1, 201, total - 100, total], dtype=torch.int32)
    q, k, v, dout = (t[0] for t in _inputs(total, seed))  # packed: (total, h, d)
    if schedule == "placed":  # the work-balanced placement: shards of many segments, k/v slices on the wire
        mine = positions(N_PER_RANK, None, layout=placement(cu.tolist(), N_PER_RANK))
    else:
        mine = positions(N_PER_RANK, None, schedule)
    qs, ks, vs = (t[mine].cuda().requires_grad_() for t in (q, k, v))
    out = distattn.dist_flash_attn_varlen_func(qs, ks, vs, cu.cuda(), total, causal=True, window_size=(128, 0),
                                               schedule=schedule, backend="triton")
    out.backward(dout[mine].cuda())
    ours = [t.detach().cpu() for t in (out, qs.grad, ks.grad, vs.grad)]
    mask = varlen_mask(lens, lens, causal=True, window=(128, 0))
    full = lambda dt: [t[0] if t.dim() == 4 else t for t in  # noqa: E731
                       masked_reference_grads(q[None], k[None], v[None], dout[None], mask, dt)]
    ref = [t[mine] for i, t in enumerate(full(torch.float64)) if i != 1]
    base = [t[mine] for i, t in enumerate(full(DTYPE)) if i != 1]
    return lambda: assert_all_close_by_rule(NAMES, ours, base, ref, DTYPE)


def _op_ranks(rank, world):
    from distattn.schedule import SCHEDULES
    from distattn.topology import make_2d_groups

    torch.cuda.set_device(0)  # every rank on the one GPU
    _slow_kernels()
    dense = [s for s in SCHEDULES if s != "placed"]  # placed shards by documents: the varlen checks below run it
    checks = [(f"{schedule} causal={causal}", _dense(rank, world, schedule, causal, None, 10 * i + causal))
              for i, schedule in enumerate(dense) for causal in (True, False)]
    checks.append(("varlen zigzag window", _varlen(rank, world, 99)))
    checks.append(("varlen placed window", _varlen(rank, world, 98, "placed")))
    if world % 2 == 0:  # Ulysses x ring: all-to-all of CUDA tensors staged through host memory (ulysses.py)
        group = make_2d_groups(2)
        checks += [(f"2-D U=2 {schedule}", _dense(rank, world, schedule, True, group, 50 + i))
                   for i, schedule in enumerate(("balanced", "zigzag"))]
    torch.cuda.synchronize()
    failures = []
    for label, check in checks:  # after every collective: a failing rank must not leave its peers waiting
        try:
            check()
        except AssertionError as exc:
            failures.append(f"rank {rank} of {world}, {label}: {exc}")
    return failures


# CUDA-only: distattn/comm.py PeerExchange staging of CUDA tensors over gloo (_stage: .cpu() sends, pinned
# receives copied back non_blocking), api.make_config's q.is_cuda device check, ulysses.py's staged all-to-all
# (stage = like.is_cuda and not nccl), every schedule (ring, balanced, zigzag, placed) and layout (contiguous, zigzag,
# packed documents on zigzag and on a placement, 2-D) with slowed kernels.
@pytest.mark.parametrize("world", [2, 3])
def test_dist_op_on_cuda_over_gloo_every_schedule_and_layout(world):
    results = run_distributed(_op_ranks, world, timeout=TIMEOUT_S)
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures)


class _Done:
    """A request that has completed (the loopback transport finished on the side stream when it was queued)."""

    def is_completed(self):
        return True

    def wait(self, timeout=None):
        return True


def _side_stream_ranks(rank, world):
    import torch.distributed as dist

    from distattn import comm

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    ex = comm.PeerExchange(None, dev, timeout=30)
    ex._stage = False  # what an NCCL group gets: the side-stream branch, a stream per kind of round
    ex._streams = {kind: torch.cuda.Stream(dev) for kind in ("fetch", "return")}

    def loopback(ops, slot, peers):
        """Runs on the side stream (post's ``torch.cuda.stream``): starts late, copies each send into a receive."""
        sends = [op.tensor for op in ops if op.op is dist.isend]
        recvs = [op.tensor for op in ops if op.op is dist.irecv]
        torch.cuda._sleep(SLEEP_CYCLES)
        for s, r in zip(sends, recvs):
            r.copy_(s)
        return [_Done()]
    ex._launch = loopback
    n, peer, failures = 1 << 20, 1 - rank, []
    for i in range(3):
        send = torch.empty(n, device=dev)
        torch.cuda._sleep(2 * SLEEP_CYCLES)  # the compute stream writes the send buffer late ...
        send.fill_(rank + i + 1.0)  # ... so a transfer that did not wait for it reads garbage
        recv = torch.zeros(n, device=dev)
        ex.post(("fetch", 0, i), [(peer, [send])], [(peer, [recv])])
        del send  # freed at once: only record_stream keeps its block from the next allocation
        junk = torch.full((n,), -7.0, device=dev)  # likely the same block, written before the copy ran
        ex.wait(("fetch", 0, i))
        got = recv.clone()  # read on the compute stream: must see the copy
        torch.cuda.synchronize()
        if not torch.all(got == rank + i + 1.0):
            failures.append(f"round {i}: received values {got.unique()[:4].tolist()}, want {rank + i + 1.0}")
        del junk
    # a return round posted after a slow fetch round does not wait for it: it runs on the other side stream
    def late_fetch(ops, slot, peers):
        if slot[0] == "fetch":
            torch.cuda._sleep(20 * SLEEP_CYCLES)  # the fetch's peer is late
        return loopback(ops, slot, peers)
    ex._launch = late_fetch
    send_f, recv_f = torch.full((n,), 5.0, device=dev), torch.zeros(n, device=dev)
    send_r, recv_r = torch.full((n,), 6.0, device=dev), torch.zeros(n, device=dev)
    ex.post(("fetch", 0, 9), [(peer, [send_f])], [(peer, [recv_f])])
    ex.post(("return", 0, 9), [(peer, [send_r])], [(peer, [recv_r])])
    ex.wait(("return", 0, 9))
    got = recv_r.clone()
    torch.cuda.current_stream(dev).synchronize()  # the compute stream waited for the return round only
    if ex._streams["fetch"].query():
        failures.append("the return round waited for the slow fetch round posted before it (one stream?)")
    if not torch.all(got == 6.0):
        failures.append(f"return round: received {got.unique()[:4].tolist()}, want 6.0")
    ex.wait(("fetch", 0, 9))
    torch.cuda.synchronize()
    if not torch.all(recv_f == 5.0):
        failures.append(f"fetch round: received {recv_f.unique()[:4].tolist()}, want 5.0")
    ex.close()
    return failures


# CUDA-only: distattn/comm.py PeerExchange's side streams (_streams: one per kind of round when CUDA and not staged):
# post() orders the round's side stream after the compute stream and record_stream()s its buffers, wait() orders the
# compute stream after that stream's done event, and a return round never waits behind a fetch round.
def test_side_stream_orders_transfers_and_keeps_buffers():
    results = run_distributed(_side_stream_ranks, 2, timeout=120)
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures)


def _nccl_gather_ranks(rank, world):
    import torch.distributed as dist

    from distattn import topology, tune

    torch.cuda.set_device(0)
    real = dist.get_backend
    dist.get_backend = lambda group=None: "nccl"  # what these helpers read to put their tensors on the GPU
    try:
        ints = topology._gather_int(10 + rank, None)
        texts = tune._all_gather_json(None, {"rank": rank, "text": "é" * rank}, 30.0, "a test gather")
    finally:
        dist.get_backend = real
    return ints, texts


# CUDA-only (NCCL groups, which need a GPU per rank): distattn/topology.py _gather_int's and distattn/tune.py
# _all_gather_json's CUDA tensors, gathered here over gloo (whose all_gather takes CUDA tensors) on one GPU.
def test_nccl_branches_gather_cuda_tensors():
    results = run_distributed(_nccl_gather_ranks, 3, timeout=120)
    for ints, texts in results:
        assert ints == [10, 11, 12]
        assert texts == [{"rank": r, "text": "é" * r} for r in range(3)]


def _faults_ranks(rank, world):
    """CUDA tensors: one rank's bad input fails every rank alike; NaN in a query row stays NaN (Triton)."""
    torch.cuda.set_device(0)
    q, k, v, _ = _inputs(world * N_PER_RANK, 5)
    q, k, v = (t.float().cuda() for t in (q, k, v))
    shard = distattn.shard_sequence
    causal = "yes" if rank == world - 1 else True
    try:
        distattn.dist_flash_attn_func(shard(q), shard(k), shard(v), causal=causal, backend="triton")
        raised = None
    except TypeError as exc:
        raised = str(exc)
    out = distattn.dist_flash_attn_func(shard(q), shard(k), shard(v), causal=True, backend="triton")
    ref = shard(distattn.flash_attn_func(q, k, v, causal=True, backend="triton"))
    q = q.clone()
    q[0, world * N_PER_RANK - 5, 1, 3] = float("nan")
    nan_out = distattn.gather_sequence(
        distattn.dist_flash_attn_func(shard(q), shard(k), shard(v), causal=True, backend="triton").contiguous())
    one = distattn.flash_attn_func(q, k, v, causal=True, backend="triton")
    return raised, (out - ref).abs().max().item(), torch.equal(nan_out.isnan().cpu(), one.isnan().cpu()), \
        bool(one[0, world * N_PER_RANK - 5, 1].isnan().all())


# CUDA-only: distattn/api.py validated_everywhere's collective device for CUDA inputs (here gloo with CUDA
# tensors) and the compiled Triton kernels' NaN propagation (merge weights, the epilogue's empty-row test)
def test_bad_input_on_one_rank_and_nan_rows_on_cuda():
    results = run_distributed(_faults_ranks, 2, timeout=TIMEOUT_S)
    messages = {r[0] for r in results}
    assert len(messages) == 1 and None not in messages and "rank(s) [1]" in messages.pop()
    for _, err, same_nan, row_nan in results:
        assert err < 1e-5 and same_nan and row_nan
