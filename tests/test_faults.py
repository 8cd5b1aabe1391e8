"""Faults an operator of a long training job meets (issue 21): one rank's bad input, message tags after
2^19 calls (a stalled rank and a dead one: tests/test_recovery.py). Every fault leaves every rank with a clear error
within seconds, and the next good call on every rank returns the exact result.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import distattn
from dist_utils import run_distributed
from distattn import comm

SPAWN_TIMEOUT_S = 240  # harness bound: spawn + a few dozen tiny calls on 2 shared cores
CALL_TIMEOUT_S = 20.0  # the library's bound per wait in these tests; every fault must be seen well before
FAST_S = 8.0  # "within seconds": an agreement-level error (no wait on a timeout) on a loaded 2-core machine
EXACT = 1e-5  # fp32 results of the same plan run twice: identical up to nothing; a stale pairing is O(1)


def _data(world, n, seed, h_q=2, h_kv=1, d=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, world * n, h, d, generator=g) for h in (h_q, h_kv, h_kv)]


def _reference(q, k, v, causal=True, cu=None):
    """One device over the whole stream (documents: one call per document)."""
    if cu is None:
        return distattn.flash_attn_func(q, k, v, causal=causal)
    outs = [distattn.flash_attn_func(q[:, a:b], k[:, a:b], v[:, a:b], causal=causal) for a, b in zip(cu, cu[1:])]
    return torch.cat(outs, dim=1)


def _good_dense(rank, world, seed):
    """A correct dense call on every rank: the largest error vs the one-device result."""
    q, k, v = _data(world, 8, seed)
    shard = distattn.shard_sequence
    out = distattn.dist_flash_attn_func(shard(q), shard(k), shard(v), causal=True, timeout=CALL_TIMEOUT_S)
    return (out - shard(_reference(q, k, v))).abs().max().item()


def _good_varlen(rank, world, seed, cu):
    q, k, v = _data(world, 8, seed)
    shard = distattn.shard_sequence
    cu_t = torch.tensor(cu, dtype=torch.int32)
    out = distattn.dist_flash_attn_varlen_func(shard(q)[0], shard(k)[0], shard(v)[0], cu_t, world * 8, causal=True,
                                               timeout=CALL_TIMEOUT_S)
    full = _reference(q, k, v, cu=list(cu) + ([world * 8] if cu[-1] < world * 8 else []))
    return (out - shard(full)[0]).abs().max().item()


def _outcome(fn):
    start = time.monotonic()
    try:
        fn()
        kind, msg = "ok", ""
    except Exception as exc:  # noqa: BLE001 - the test compares kinds and messages across ranks
        kind, msg = type(exc).__name__, str(exc)
    return kind, msg, time.monotonic() - start


# -- 1. one rank's input fails validation ---------------------------------------------------------------
def _bad_cu(world):
    """Kinds of bad cu_seqlens one rank may pass alone (the others pass a valid one)."""
    total = world * 8
    return [("decreasing", [0, 9, 5, total]), ("not from 0", [1, 5, total]), ("past the end", [0, 5, total + 3]),
            ("2-D", [[0, 5, total]])]


def _validation_worker(rank, world):
    bad_rank = world - 1
    good_cu = [0, 5, 13, world * 8]
    _good_dense(rank, world, 999)  # the first call builds the library's communicators: not part of what is timed
    found = []
    for i, (name, bad) in enumerate(_bad_cu(world)):
        q, k, v = _data(world, 8, i)
        cu = torch.tensor(bad if rank == bad_rank else good_cu, dtype=torch.int32)
        shard = distattn.shard_sequence
        call = lambda: distattn.dist_flash_attn_varlen_func(  # noqa: E731
            shard(q)[0], shard(k)[0], shard(v)[0], cu, world * 8, causal=True, timeout=CALL_TIMEOUT_S)
        kind, msg, took = _outcome(call)
        # the next good calls (two of them: a drift would pair batch k with batch k+1 and show in the second)
        errs = [_good_varlen(rank, world, 100 + i, good_cu), _good_dense(rank, world, 200 + i)]
        found.append((name, kind, msg, took, errs))
    # a TypeError on one rank (causal not a bool), dense call
    q, k, v = _data(world, 8, 7)
    shard = distattn.shard_sequence
    causal = "yes" if rank == 0 else True
    kind, msg, took = _outcome(lambda: distattn.dist_flash_attn_func(shard(q), shard(k), shard(v), causal=causal,
                                                                      timeout=CALL_TIMEOUT_S))
    found.append(("causal type", kind, msg, took, [_good_dense(rank, world, 300), _good_dense(rank, world, 301)]))
    return found


@pytest.mark.parametrize("world", [2, 3])
def test_one_rank_failing_validation_fails_every_rank_alike_and_the_next_call_is_exact(world):
    per_rank = run_distributed(_validation_worker, world, timeout=SPAWN_TIMEOUT_S)
    for case in range(len(per_rank[0])):
        rows = [r[case] for r in per_rank]
        name, kind, msg = rows[0][:3]
        expected_kind = "TypeError" if name == "causal type" else "ValueError"
        failing = 0 if name == "causal type" else world - 1
        for rank, (_, k_, m_, took, errs) in enumerate(rows):
            assert k_ == expected_kind, (name, rank, k_, m_)
            assert m_ == msg, f"{name}: rank {rank} raised a different message:\n{m_}\nvs\n{msg}"
            assert took < FAST_S, (name, rank, took)
            assert max(errs) < EXACT, (name, rank, errs)
        assert f"rank(s) [{failing}]" in msg and "failed validation" in msg, msg


# -- 3. message tags stay below 2^31 for any number of calls ---------------------------------------------
def test_message_tags_are_bounded_and_unique_in_flight():
    top = 2 ** 31 - 1
    for seq in (0, 1, 2 ** 19 - 1, 2 ** 19, 2 ** 31, 2 ** 40 + 3):
        tags = {comm.message_tag(seq, r) for r in range(comm.ROUNDS_PER_CALL)}
        assert len(tags) == comm.ROUNDS_PER_CALL and all(0 <= t <= top for t in tags), seq
    # consecutive calls never share a tag (what a late message of the previous call could match)
    a = {comm.message_tag(2 ** 19 - 1, r) for r in range(comm.ROUNDS_PER_CALL)}
    b = {comm.message_tag(2 ** 19, r) for r in range(comm.ROUNDS_PER_CALL)}
    assert not a & b


def _tags_worker(rank, world):
    lib = comm.communicator(None, CALL_TIMEOUT_S)
    lib.seq = 2 ** 31 - 3  # as after ~2^31 calls: the next calls cross 2^31 (and the 2^19-call tag wrap)
    errs = [_good_dense(rank, world, s) for s in range(5)]
    sub = torch.distributed.new_group(list(range(world)))  # a subgroup object (not the default group)
    comm.communicator(sub, CALL_TIMEOUT_S).seq = 2 ** 31 - 2
    q, k, v = _data(world, 8, 9)
    shard = distattn.shard_sequence
    for _ in range(3):
        out = distattn.dist_flash_attn_func(shard(q), shard(k), shard(v), causal=True, group=sub,
                                            timeout=CALL_TIMEOUT_S)
        errs.append((out - shard(_reference(q, k, v))).abs().max().item())
    return errs, lib.seq


@pytest.mark.parametrize("world", [2, 3])
def test_calls_past_two_to_the_31_stay_exact(world):
    for errs, seq in run_distributed(_tags_worker, world, timeout=SPAWN_TIMEOUT_S):
        assert max(errs) < EXACT, errs
        assert seq > 2 ** 31


# -- 4. recovery after a stall or a dead peer: tests/test_recovery.py (the README's loop, P = 2, 3, 4)
STALL_TIMEOUT_S = 3.0  # timeout= of the calls below


def _call(world, seed, timeout=STALL_TIMEOUT_S):
    q, k, v = _data(world, 8, seed)
    shard = distattn.shard_sequence
    out = distattn.dist_flash_attn_func(shard(q), shard(k), shard(v), causal=True, timeout=timeout)
    return (out - shard(_reference(q, k, v))).abs().max().item()


# -- 6. a new group per call leaves nothing behind ------------------------------------------------------------
def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _group_churn_worker(rank, world):
    _call(world, 0)
    counts = []
    for i in range(40):
        group = torch.distributed.new_group(list(range(world)))  # a new whole-world group each time (owned)
        q, k, v = _data(world, 8, i)
        shard = distattn.shard_sequence
        out = distattn.dist_flash_attn_func(shard(q), shard(k), shard(v), causal=True, group=group,
                                            timeout=CALL_TIMEOUT_S)
        assert (out - shard(_reference(q, k, v))).abs().max().item() < EXACT
        torch.distributed.destroy_process_group(group)
        del group, out
        if i in (9, 39):
            import gc
            gc.collect()
            counts.append(_fds())
    return counts


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts file descriptors through /proc")
def test_communicators_are_freed_with_their_group():
    for ten, forty in run_distributed(_group_churn_worker, 2, timeout=SPAWN_TIMEOUT_S):
        # 30 more groups, each with a library group of its own: without freeing, ~10 descriptors each
        assert forty - ten < 30, (ten, forty)


# -- 6. agreement before anything sized by the inputs -----------------------------------------------------------
def _huge_worker(rank, world):
    import resource

    _call(world, 0)
    n = 2 ** 28 if rank == world - 1 else 8  # a stride-0 view: 2^28 tokens that cost no memory to hold
    x = torch.zeros(1, 1, 2, 8).expand(1, n, 2, 8)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kind, msg, took = _outcome(lambda: distattn.dist_flash_attn_func(x, x, x, causal=True, window_size=(64, 0),
                                                                      timeout=CALL_TIMEOUT_S))
    grew_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    return kind, msg, took, grew_mb, _call(world, 1)


def test_a_huge_declared_shard_fails_the_agreement_before_any_allocation():
    for kind, msg, took, grew_mb, after in run_distributed(_huge_worker, 2, timeout=SPAWN_TIMEOUT_S):
        assert kind == "ValueError" and "q.shape" in msg and "268435456" in msg, (kind, msg)
        assert took < FAST_S, took
        assert grew_mb < 256, grew_mb  # the plan's per-row bounds for 2^28 rows alone would be 4 GiB
        assert after < EXACT


# -- 7. a peer's failure reaches a waiting rank through the job's store ---------------------------------------
def _unheard_fault_worker(rank, world):
    """The last rank raises in its first backward kernel call and aborts, but keeps its groups' connections open (its
    ``Communicator.free`` does nothing here), as when a closed connection does not reach a waiting peer (seen on gloo:
    a receive posted after the connection closed waits out its bound). Its peers learn of the failure from the
    given-up mark in the job's store only. Every rank then skips the batch, as a training loop would, and the next
    call must be exact."""
    import torch.distributed as dist

    from distattn import communicators

    q, k, v = _data(world, 8, 5)
    shard = distattn.shard_sequence

    def call():
        qs, ks, vs = (shard(t).clone().requires_grad_() for t in (q, k, v))
        out = distattn.dist_flash_attn_func(qs, ks, vs, causal=True, timeout=CALL_TIMEOUT_S)
        out.sum().backward()
        return out

    call()  # builds the library's communicators: not part of what is timed
    real, raised_at = distattn.kernels.backward_chunk_, [0.0]

    def fault(*args, **kw):
        raised_at[0] = time.monotonic()
        raise RuntimeError("injected fault")
    if rank == world - 1:
        distattn.kernels.backward_chunk_ = fault
        communicators.Communicator.free = lambda self: None
    try:
        kind, msg, _ = _outcome(call)
    finally:
        distattn.kernels.backward_chunk_ = real
    failed_at = time.monotonic()
    at = torch.tensor([raised_at[0]], dtype=torch.float64)
    dist.all_reduce(at, op=dist.ReduceOp.MAX)  # one clock for the processes of this machine
    after = (call() - shard(distattn.flash_attn_func(q, k, v, causal=True))).abs().max().item()
    return kind, msg, failed_at - at.item(), after


@pytest.mark.parametrize("world", [2, 3])
def test_a_failure_that_closes_no_connection_fails_the_peers_within_seconds_through_the_store(world):
    per_rank = run_distributed(_unheard_fault_worker, world, timeout=SPAWN_TIMEOUT_S)
    kind, msg, _, _ = per_rank[-1]
    assert kind == "RuntimeError" and "injected fault" in msg, msg
    for rank, (kind, msg, took, after) in enumerate(per_rank):
        assert after < EXACT, (rank, after)
        if rank < world - 1:
            assert kind == "DistAttnError", (rank, kind, msg)
            assert "a peer failed and aborted" in msg and f"group rank {world - 1} failed it and aborted" in msg, msg
            assert took < FAST_S, (rank, took, msg)  # not CALL_TIMEOUT_S: no closed connection woke it


class _Pending:
    """A request that never completes (a receive whose peer died without closing the connection)."""

    def is_completed(self):
        return False

    def wait(self, timeout=None):
        time.sleep(timeout.total_seconds())
        raise RuntimeError(f"timed out after {timeout.total_seconds():g} s")


@pytest.mark.parametrize("poll", [False, True], ids=["blocking wait (gloo)", "polled (NCCL)"])
def test_a_watched_wait_ends_when_the_store_says_a_peer_gave_the_call_up(poll):
    from distattn._bounded import WATCH_S, DistAttnError, bounded_wait

    start, marked_after = time.monotonic(), 3 * WATCH_S
    mark = lambda: "call 4 was given up: group rank 2 failed it and aborted" if (  # noqa: E731
        time.monotonic() - start > marked_after) else None
    works = [_Pending()]
    with pytest.raises(DistAttnError) as err:
        bounded_wait(works, 30.0, "waiting for the fetch round", poll=poll, gave_up=mark)
    took = time.monotonic() - start
    assert marked_after < took < marked_after + 2 * WATCH_S + 2.0, took  # slack for a loaded machine
    assert str(err.value) == ("waiting for the fetch round: a peer failed and aborted the library's communicators "
                              "(the job's store: call 4 was given up: group rank 2 failed it and aborted)")
    assert not err.value.timed_out and works == []
    # unwatched, the same wait ends at its bound only, as a timeout
    with pytest.raises(DistAttnError, match="no message within the timeout") as err:
        bounded_wait([_Pending()], 0.3, "waiting", poll=poll)
    assert err.value.timed_out
