"""The simulator and the cost model read plans as runs (arrays), so that P = 16384 ranks simulate in seconds.

Against a straightforward reference on small P: every task of the plan walked one by one (``plan.task``), its
transfers derived from the task (not from the plan's own ``fetches``/``returns``), bytes and times summed per rank
in Python; then the scale itself, with the numbers a dense plan must give in closed form.
"""

import time

import pytest

from distattn.schedule import (
    HEAD,
    SCHEDULES,
    Layout,
    MaskSpec,
    Shapes,
    Task,
    make_plan,
    pair_work,
    payload_bytes,
    ring_plan,
    simulate,
)
from distattn.schedule.cost import BWD_FLOP_FACTOR, Cluster, Link, _phase, choose, predict
from distattn.schedule.timeline import phase_timeline

SHAPES = Shapes(batch=1, seq_per_rank=8, heads_q=6, heads_kv=2, head_dim=4, dtype_bytes=2)  # distinct payload sizes
GQA = Shapes(seq_per_rank=4096, heads_q=32, heads_kv=8, head_dim=128)
REL = 1e-12  # float sums may associate differently from the reference; bytes and counts must be exact
SCALE_P, SCALE_N = 16384, 1 << 20  # the scale: 16384 ranks of 1M tokens
SCALE_BOUND_S = 60.0  # generous "does not take minutes" bound (it takes about a second); the old path: > 300 s at 4096


# -- the reference: task by task ------------------------------------------------------------------------------


def _reference_steps(p, causal, schedule):
    """The dense plans written out task by task, as the package docstring draws them (a dense "placed" plan is the
    balanced one: its placement falls back to contiguous shards)."""
    if schedule in ("balanced", "placed") and causal:
        steps = [[Task(r, r, r) for r in range(p)]]
        for d in range(1, (p + 1) // 2):
            steps.append([Task(r, r + p - d, r) for r in range(d)] + [Task(i, i, i - d) for i in range(d, p)])
        if p > 1 and p % 2 == 0:
            steps.append([Task(i, i, i - p // 2) for i in range(p // 2, p)])
        return steps
    if causal and schedule == "ring":
        return [[Task(r, r, r - t) for r in range(t, p)] for t in range(p)]
    return [[Task(r, r, (r - t) % p) for r in range(p)] for t in range(p)]  # non-causal, and zigzag's ring order


def _tasks(plan):
    return [[t for t in (plan.task(s, r) for r in range(plan.world_size)) if t is not None]
            for s in range(plan.num_steps())]


def _cost(plan, task):
    if plan.work is not None:
        return plan.work[task.q_chunk][task.kv_chunk] / plan.chunk ** 2
    return 0.5 if plan.causal and task.is_diagonal else 1.0


def _transfers(task, phase, which):
    """``(src, dst, kind)`` of a task's fetch or return, or None."""
    if task.is_local:
        return None
    if which == "fetch":
        return (task.q_chunk, task.rank, "q") if task.is_helper else (task.kv_chunk, task.rank, "kv")
    if task.is_helper:
        return task.rank, task.q_chunk, "out" if phase == "forward" else "dq"
    return None if phase == "forward" else (task.rank, task.kv_chunk, "dkv")


def _size(plan, sizes, task, kind):
    """Bytes of a task's transfer of ``kind``: an owner task's k/v in and dk/dv back carry only the rows of the kv
    shard that its queries see (``Plan.key_ranges``, inside ``Plan.key_span``)."""
    ranges = plan.key_ranges(task.q_chunk, task.kv_chunk)
    if kind not in ("kv", "dkv") or ranges is None:
        return sizes[kind]
    a, b = plan.key_span(task.q_chunk, task.kv_chunk)
    assert ranges[0][0] == a and ranges[-1][1] == b  # the ranges lie in the span, its ends included
    return sizes[kind] // plan.chunk * sum(y - x for x, y in ranges)


def _sizes(phase, shapes, partials):
    kinds = ("kv", "q", "out") if phase == "forward" else ("kv", "q", "dkv", "dq")
    return {k: payload_bytes(k, phase, shapes, partials) for k in kinds}


def _reference_bytes(plan, phase, shapes, partials):
    sizes = _sizes(phase, shapes, partials)
    sent, recv = [0] * plan.world_size, [0] * plan.world_size
    for tasks in _tasks(plan):
        for task in tasks:
            for which in ("fetch", "return"):
                tr = _transfers(task, phase, which)
                if tr is not None:
                    sent[tr[0]] += _size(plan, sizes, task, tr[2])
                    recv[tr[1]] += _size(plan, sizes, task, tr[2])
    return sent, recv


def _comm(transfers, link):
    sent, recv, msgs = {}, {}, {}
    for src, dst, size in transfers:
        sent[src] = sent.get(src, 0) + size
        recv[dst] = recv.get(dst, 0) + size
        for rank in (src, dst):
            msgs[rank] = msgs.get(rank, 0) + 1
    return max((max(sent.get(r, 0), recv.get(r, 0)) / link.bandwidth + msgs[r] * link.latency for r in msgs),
               default=0.0)


def _reference_phase(plan, phase, shapes, link, flops, partials):
    """(compute, ring time): fetches of step t+1 and returns of step t-1 overlap step t's compute; the backward runs
    the plan's steps last first (``Plan.run_order``), its first fetch beside the head of the local pairs (``HEAD`` of
    its last step, ``Plan.head_task``), which that step no longer computes."""
    m = shapes.seq_per_rank
    pair_flops = 4 * shapes.batch * m * m * shapes.heads_q * shapes.head_dim * (
        BWD_FLOP_FACTOR if phase == "backward" else 1.0)
    sizes = _sizes(phase, shapes, partials)
    steps = _tasks(plan)[::-1] if phase == "backward" else _tasks(plan)
    of = lambda tasks, which: [(x[0], x[1], _size(plan, sizes, t, x[2])) for t in tasks  # noqa: E731
                               for x in [_transfers(t, phase, which)] if x is not None]
    fetches = [of(tasks, "fetch") for tasks in steps] + [[]]
    returns = [[]] + [of(tasks, "return") for tasks in steps]
    compute = [max(_cost(plan, t) for t in tasks) * pair_flops / flops for tasks in steps]
    head = HEAD * compute[-1] if phase == "backward" and len(steps) > 1 and plan.run_order(phase).head else 0.0
    if steps:
        compute[-1] -= head
    total = max(_comm(fetches[0], link), head) + _comm(returns[len(steps)], link)
    for t in range(len(steps)):
        total += max(compute[t], _comm(fetches[t + 1] + returns[t], link))
    return sum(compute) + head, total


# -- small P: the same numbers as the reference -------------------------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("causal", [True, False])
def test_dense_plans_equal_the_task_by_task_construction(schedule, causal):
    for p in list(range(1, 41)) + [64, 97]:
        plan = make_plan(p, causal, schedule, chunk=8 if schedule == "zigzag" else None)
        want = _reference_steps(p, causal, schedule)
        assert plan.steps == tuple(map(tuple, want)), f"P={p}"
        assert _tasks(plan) == want and plan.num_tasks() == sum(map(len, want))


@pytest.mark.parametrize("p", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("n", [2, 6, 8])
def test_zigzag_closed_form_work_equals_the_mask_computation(p, n):
    for causal in (True, False):
        plan = make_plan(p, causal, "zigzag", chunk=n)
        assert tuple(plan.work) == pair_work(MaskSpec(causal=causal), p, n, Layout("zigzag", p)), (p, n, causal)


def _cases():
    docs = MaskSpec(causal=True, cu_seqlens=(0, 3, 11, 12, 30, 41, 64))
    window = MaskSpec(causal=False, window=(5, 2))
    for p in range(1, 25):
        for schedule in SCHEDULES:
            for causal in (True, False):
                yield p, causal, schedule, None, 1
            if p in (4, 8, 16, 24):
                yield p, True, schedule, None, 2  # Ulysses x ring
        if p == 8:
            yield from ((p, True, s, m, 1) for s in SCHEDULES for m in (docs, window))


def test_simulator_and_cost_model_equal_the_reference_on_small_plans():
    cluster = Cluster(intra=Link(name="a", bandwidth=3e9, latency=2e-6), inter=Link(name="b", bandwidth=1e9,
                                                                                    latency=5e-6), flops=1e9)
    for p, causal, schedule, mask, ulysses in _cases():
        for partials in ("fp32", "input"):
            shapes = SHAPES
            label = (p, causal, schedule, mask, ulysses, partials)
            report = simulate(p, causal, schedule, shapes, mask=mask, ulysses=ulysses, partials=partials)
            plan, ring_shapes = ring_plan(p, causal, schedule, shapes, mask=mask, ulysses=ulysses)
            tasks = [t for step in _tasks(plan) for t in step]
            assert report.pairs == len(tasks) and report.steps == plan.num_steps(), label
            work = sum(_cost(plan, t) for t in tasks)
            makespan = sum(max(_cost(plan, t) for t in step) for step in _tasks(plan))
            assert report.work_makespan == pytest.approx(makespan, rel=REL), label
            assert report.work_fraction * (plan.world_size ** 2 / 2) == pytest.approx(work, rel=REL), label
            for phase, sent, recv in (("forward", report.bytes_sent_fwd, report.bytes_recv_fwd),
                                      ("backward", report.bytes_sent_bwd, report.bytes_recv_bwd)):
                ring_sent, ring_recv = _reference_bytes(plan, phase, ring_shapes, partials)
                a2a = report.a2a_fwd if phase == "forward" else report.a2a_bwd
                assert sent == tuple(ring_sent[g // ulysses] + a2a for g in range(p)), (label, phase)
                assert recv == tuple(ring_recv[g // ulysses] + a2a for g in range(p)), (label, phase)
            cand = predict(p, shapes, schedule, ulysses, causal=causal, mask=mask, cluster=cluster, partials=partials)
            for phase in ("forward", "backward"):
                compute, ring_time = _reference_phase(plan, phase, ring_shapes, cluster.ring_link(p), cluster.flops,
                                                      partials)
                lock = _phase(plan, phase, ring_shapes, cluster.ring_link(p), cluster.flops, partials)  # lockstep walk
                assert lock == pytest.approx((compute, ring_time), rel=REL, abs=1e-15), (label, phase)
                # the cost model reads the per-pair timeline: the busiest rank's compute, no more than lockstep's
                tl = phase_timeline(plan, phase, ring_shapes, cluster, partials, ulysses)
                got_compute = cand.compute_fwd if phase == "forward" else cand.compute_bwd
                got_exposed = cand.exposed_fwd if phase == "forward" else cand.exposed_bwd
                assert got_compute == pytest.approx(tl.busy.max(initial=0.0), rel=REL), (label, phase)
                assert got_compute <= compute * (1 + REL), (label, phase)
                assert got_exposed == pytest.approx(tl.makespan - got_compute, rel=REL, abs=1e-15), (label, phase)
            assert cand.helper_tasks == sum(t.is_helper for t in tasks), label


# -- the scale ----------------------------------------------------------------------------------------------------


def test_16384_ranks_of_1m_tokens_simulate_in_seconds():
    p, shapes = SCALE_P, Shapes(seq_per_rank=SCALE_N, heads_q=32, heads_kv=8, head_dim=128)
    kv = payload_bytes("kv", "forward", shapes)
    start = time.perf_counter()
    reports = {s: simulate(p, True, s, shapes) for s in SCHEDULES}
    best = choose(p, shapes, cluster=Cluster.preset("ib")).best
    elapsed = time.perf_counter() - start
    assert elapsed < SCALE_BOUND_S, f"simulating P={p} took {elapsed:.1f} s"
    ring, bal, zig = reports["ring"], reports["balanced"], reports["zigzag"]
    # ring: rank r receives the kv of every rank before it and sends its own to every rank after it
    assert ring.steps == p and ring.pairs == p * (p + 1) // 2
    assert ring.bytes_recv_fwd[:3] == (0, kv, 2 * kv) and ring.bytes_sent_fwd[-1] == 0
    assert ring.bytes_sent_fwd[0] == ring.bytes_recv_fwd[-1] == (p - 1) * kv
    assert ring.work_makespan == p - 0.5  # the last rank computes every step: half a diagonal + P - 1 pairs
    # balanced: 1 + P/2 steps of at most one full pair; zigzag: P steps of exactly half a pair (plus the diagonal)
    assert bal.steps == 1 + p // 2 and bal.work_makespan == 0.5 + p // 2
    # zigzag: rank r sends its whole shard to the r ranks before it, its first chunk (half) to the ranks after it
    assert zig.steps == p and all(zig.bytes_sent_fwd[r] == r * kv + (p - 1 - r) * kv // 2 for r in (0, 1, p - 1))
    assert all(zig.bytes_recv_fwd[r] == r * kv // 2 + (p - 1 - r) * kv for r in (0, 1, p - 1))
    assert zig.work_makespan == pytest.approx(p / 2 + 0.5 / SCALE_N, rel=REL)
    assert best.runnable and best.steps > 0
