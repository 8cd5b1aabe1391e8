"""Tests for distattn.schedule: plan invariants, transfers, simulator bytes, input validation."""

import dataclasses

import numpy as np

import pytest

from distattn import schedule as sched
from distattn.schedule import (
    SCHEDULES,
    MaskSpec,
    Plan,
    Shapes,
    Task,
    Transfer,
    format_table,
    make_plan,
    payload_bytes,
    simulate,
)

WORLD_SIZES = range(1, 65)
ALL_PLANS = [(p, c, s) for p in WORLD_SIZES for c in (True, False) for s in SCHEDULES]


def _required_pairs(p, causal, schedule="balanced"):
    # zigzag: every shard holds an early and a late chunk, so every (q shard, kv shard) pair has causal work
    return {(i, j) for i in range(p) for j in range(p) if j <= i or not causal or schedule == "zigzag"}


# -- plan invariants ----------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_pair_once_one_task_per_rank_per_step(schedule, causal):
    for p in WORLD_SIZES:
        plan = make_plan(p, causal, schedule)
        pairs = plan.pairs()
        assert len(pairs) == len(set(pairs)), f"P={p}: a pair is computed twice"
        assert set(pairs) == _required_pairs(p, causal, schedule)
        for tasks in plan.steps:
            ranks = [t.rank for t in tasks]
            assert ranks == sorted(set(ranks)), f"P={p}: ranks not unique and sorted: {ranks}"
            for t in tasks:
                assert t.rank in (t.q_chunk, t.kv_chunk)
                assert 0 <= t.rank < p


@pytest.mark.parametrize("p", WORLD_SIZES)
def test_step_counts(p):
    assert make_plan(p, True, "balanced").num_steps() == 1 + p // 2
    # lower bound: ceil(P(P+1)/2 / P) steps of at most P tasks each
    assert make_plan(p, True, "balanced").num_steps() == -(-(p * (p + 1) // 2) // p)
    assert make_plan(p, True, "ring").num_steps() == p
    assert make_plan(p, False, "ring").num_steps() == p
    assert make_plan(p, False, "balanced").num_steps() == p
    if p >= 3:
        assert make_plan(p, True, "balanced").num_steps() < make_plan(p, True, "ring").num_steps()


@pytest.mark.parametrize("p", WORLD_SIZES)
def test_step_zero_is_all_diagonals(p):
    for causal in (True, False):
        for schedule in SCHEDULES:
            plan = make_plan(p, causal, schedule)
            assert plan.steps[0] == tuple(Task(r, r, r) for r in range(p))


def test_ring_only_owners_compute():
    for p in WORLD_SIZES:
        for causal in (True, False):
            plan = make_plan(p, causal, "ring")
            assert all(t.rank == t.q_chunk for tasks in plan.steps for t in tasks)


def test_noncausal_balanced_equals_ring():
    for p in WORLD_SIZES:
        assert make_plan(p, False, "balanced").steps == make_plan(p, False, "ring").steps


def test_balanced_causal_p4_layout():
    plan = make_plan(4)
    assert plan.task(1, 0) == Task(0, 3, 0) and plan.task(1, 0).is_helper
    assert [plan.task(1, r) for r in (1, 2, 3)] == [Task(1, 1, 0), Task(2, 2, 1), Task(3, 3, 2)]
    assert plan.task(2, 0) is None and plan.task(2, 1) is None
    assert [plan.task(2, r) for r in (2, 3)] == [Task(2, 2, 0), Task(3, 3, 1)]


def test_docstring_pictures_match_render():
    doc = sched.__doc__
    for p in (4, 5):
        picture = "\n".join("    " + line for line in make_plan(p).render().splitlines())
        assert picture in doc, f"module docstring picture for P={p} is stale:\n{picture}"


def test_task_properties():
    assert Task(2, 2, 2).is_local and Task(2, 2, 2).is_diagonal and not Task(2, 2, 2).is_helper
    assert Task(0, 3, 0).is_helper and not Task(0, 3, 0).is_local
    assert not Task(3, 3, 0).is_helper and not Task(3, 3, 0).is_diagonal
    with pytest.raises(AssertionError):
        Task(1, 2, 0)  # neither owner


def test_plan_is_cached_and_immutable():
    assert make_plan(8) is make_plan(8, True, "balanced")
    with pytest.raises(AttributeError):
        make_plan(8).world_size = 3


# -- transfers ----------------------------------------------------------------------------------------


def _expected_fetch(t, s):
    if t.is_local:
        return None
    if t.is_helper:
        return Transfer(t.q_chunk, t.rank, "q", t.q_chunk, s)
    return Transfer(t.kv_chunk, t.rank, "kv", t.kv_chunk, s)


def _expected_return(t, s, phase):
    if t.is_local:
        return None
    if t.is_helper:
        return Transfer(t.rank, t.q_chunk, "out" if phase == "forward" else "dq", t.q_chunk, s)
    return None if phase == "forward" else Transfer(t.rank, t.kv_chunk, "dkv", t.kv_chunk, s)


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_fetches_and_returns_match_tasks(phase):
    for p, causal, schedule in ALL_PLANS:
        plan = make_plan(p, causal, schedule)
        for s, tasks in enumerate(plan.steps):
            fetches, returns = plan.fetches(s, phase), plan.returns(s, phase)
            want_f = {x for x in (_expected_fetch(t, s) for t in tasks) if x is not None}
            want_r = {x for x in (_expected_return(t, s, phase) for t in tasks) if x is not None}
            assert set(fetches) == want_f and len(fetches) == len(want_f)
            assert set(returns) == want_r and len(returns) == len(want_r)
            for group in (fetches, returns):
                keys = [(tr.src, tr.dst, tr.kind) for tr in group]
                assert keys == sorted(keys), "transfers must be posted in (src, dst, kind) order"
                assert len(set(keys)) == len(keys)
                assert all(tr.src != tr.dst and tr.step == s for tr in group)
            for t in tasks:  # every helper task sends a partial back
                if t.is_helper:
                    assert any(tr.src == t.rank and tr.dst == t.q_chunk for tr in returns)


def test_transfers_deterministic_across_calls():
    plan = make_plan(7)
    again = sched._make_plan_cached.__wrapped__(7, True, "balanced")  # rebuilt, not the cached object
    for s in range(plan.num_steps()):
        for phase in ("forward", "backward"):
            assert plan.fetches(s, phase) == again.fetches(s, phase)
            assert plan.returns(s, phase) == again.returns(s, phase)


def _rank_ops_plans():
    docs = MaskSpec(causal=True, cu_seqlens=(0, 5, 6, 30, 31, 47, 48))
    yield make_plan(6)
    for p in (1, 2, 3, 5, 8):
        for causal in (True, False):
            for schedule in ("ring", "balanced"):
                yield make_plan(p, causal, schedule)
        yield make_plan(p, True, "zigzag", chunk=6)
    for p in (3, 4):  # masked: helpers (balanced), owners in ring order, the placement, a window
        for schedule in ("ring", "balanced", "placed"):
            yield make_plan(p, True, schedule, mask=docs, chunk=48 // p)
        yield make_plan(p, False, "balanced", mask=MaskSpec(causal=False, cu_seqlens=(0, 20, 48)), chunk=48 // p)
        yield make_plan(p, True, "balanced", mask=MaskSpec(causal=True, window=(7, 0)), chunk=48 // p)


@pytest.mark.parametrize("plan", list(_rank_ops_plans()), ids=lambda plan: f"P{plan.world_size}-{plan.schedule}")
def test_rank_ops_are_the_ranks_share_of_the_step_in_posting_order(plan):
    """What the executor reads per step (computed from the step's runs) is exactly its part of fetches/returns, in
    their order, and the ranks' parts partition the step."""
    p = plan.world_size
    for s in range(plan.num_steps()):
        for phase in ("forward", "backward"):
            for which, full in (("fetch", plan.fetches(s, phase)), ("return", plan.returns(s, phase))):
                for r in range(p):
                    sends = tuple(tr for tr in full if tr.src == r)
                    recvs = tuple(tr for tr in full if tr.dst == r)
                    assert plan.rank_ops(s, r, phase, which) == (sends, recvs), (s, r, phase, which)
                got = [tr for r in range(p) for tr in plan.rank_ops(s, r, phase, which)[0]]
                assert sorted(got, key=repr) == sorted(full, key=repr)


@pytest.mark.parametrize("plan", list(_rank_ops_plans()), ids=lambda plan: f"P{plan.world_size}-{plan.schedule}")
def test_the_backward_runs_the_steps_in_reverse(plan):
    """``Plan.run_order``: the forward is the plan itself; the backward's step ``t`` is the plan's step ``S - 1 - t``
    (every task, fetch and return of it), one cached view whose forward is the plan again."""
    back, last = plan.run_order("backward"), plan.num_steps() - 1
    assert plan.run_order("forward") is plan and back.run_order("backward") is back
    assert back.run_order("forward") is plan and plan.run_order("backward") is back
    assert (back.runs, plan.runs) == ("backward", "forward") and back.num_steps() == plan.num_steps()
    assert back.layout == plan.layout and back.pair_table is plan.pair_table and back.work is plan.work
    for t in range(plan.num_steps()):
        assert back.steps[t] == plan.steps[last - t]
        for which in ("fetches", "returns"):
            assert getattr(back, which)(t, "backward") == tuple(Transfer(x.src, x.dst, x.kind, x.chunk, t)
                                                                for x in getattr(plan, which)(last - t, "backward"))
        for r in range(plan.world_size):
            assert back.task(t, r) == plan.task(last - t, r)
            for which in ("fetch", "return"):
                got, want = back.rank_ops(t, r, "backward", which), plan.rank_ops(last - t, r, "backward", which)
                assert got == tuple(tuple(Transfer(x.src, x.dst, x.kind, x.chunk, t) for x in side) for side in want)
    with pytest.raises(ValueError, match="phase='sideways'"):
        plan.run_order("sideways")
    if plan.layout is not None and plan.layout.kind == "placed":  # a placed layout may keep the plan's order
        kept = dataclasses.replace(plan, layout=dataclasses.replace(plan.layout, backward="forward"))
        assert kept.run_order("backward") is kept and kept.run_order("forward") is kept


@pytest.mark.parametrize("plan", list(_rank_ops_plans()), ids=lambda plan: f"P{plan.world_size}-{plan.schedule}")
def test_the_backward_computes_its_local_pairs_head_first(plan):
    """``Plan.head_task``: in the backward's reversed view every rank whose last step is its local pair computes that
    pair's head before step 0 (``sched.HEAD`` of its work); the forward, and a backward in the plan's order, have
    none (their local pair is first)."""
    back, last = plan.run_order("backward"), plan.num_steps() - 1
    assert back.head == sched.HEAD and plan.head == 0.0
    for r in range(plan.world_size):
        assert plan.head_task(r) is None
        local = back.task(last, r)
        has = local is not None and local.is_local and plan.num_steps() > 1
        assert back.head_task(r) == (local if has else None)
    assert any(back.head_task(r) is not None for r in range(plan.world_size)) == (plan.num_steps() > 1)
    one = make_plan(1, True, "ring").run_order("backward")  # one step: no fetch to hide
    assert one.head == sched.HEAD and one.head_task(0) is None
    if plan.layout is not None and plan.layout.kind == "placed":
        kept = dataclasses.replace(plan, layout=dataclasses.replace(plan.layout, backward="forward"))
        assert kept.run_order("backward").head == 0.0


def test_head_rows_split_a_pairs_work_by_its_rows():
    """``head_rows``: the fewest leading rows whose visible keys reach the share, within ``[1, rows - 1]``."""
    causal = np.arange(1, 4097)  # a causal diagonal: row i sees i + 1 keys; a quarter of the work is half the rows
    assert sched.head_rows(causal) == 2048 and sched.head_rows(causal, 0.5) == 2897  # ceil(sqrt(0.5) * 4096)
    assert sched.head_rows(np.full(100, 7)) == 25
    assert sched.head_rows([5]) == 0 and sched.head_rows([]) == 0  # one row: nothing to split
    assert sched.head_rows([0, 0, 9]) == 2 and sched.head_rows([9, 0, 0]) == 1  # both parts keep a row
    assert sched.head_rows([0, 0, 0, 0]) == 2  # no visible key: the middle


def test_only_a_placed_layout_keeps_the_plans_order_in_the_backward():
    from distattn.schedule.layouts import Layout

    with pytest.raises(ValueError, match="backward='sideways'"):
        Layout("contiguous", 4, backward="sideways")
    with pytest.raises(ValueError, match="backward='forward'"):
        Layout("zigzag", 4, backward="forward")
    assert Layout("placed", 1, placement=(((0, 4),),), backward="forward").backward == "forward"


@pytest.mark.parametrize("field,deepest", [("prefetch", 12), ("return_depth", 8)])
def test_only_a_placed_layout_fetches_ahead_or_absorbs_later(field, deepest):
    """``Layout.prefetch`` (``Plan.prefetch``) and ``Layout.return_depth`` (``Plan.return_depth``): 1 for every plan, up
    to 12 and 8 only for a placed layout (the solver's, as deep as its buffers admit: ``distattn.schedule.pool``)."""
    from distattn.schedule.layouts import PREFETCHES, RETURN_DEPTHS, Layout

    assert {"prefetch": PREFETCHES, "return_depth": RETURN_DEPTHS}[field] == tuple(range(1, deepest + 1))
    for bad in (0, deepest + 1, True, 2.0):
        with pytest.raises(ValueError, match=f"{field}={bad!r}"):
            Layout("placed", 1, placement=(((0, 4),),), **{field: bad})
    with pytest.raises(ValueError, match=f"{field}=2"):
        Layout("zigzag", 4, **{field: 2})
    assert getattr(Layout("placed", 1, placement=(((0, 4),),), **{field: deepest}), field) == deepest
    assert all(getattr(make_plan(4, True, kind), field) == 1 for kind in ("zigzag", "ring"))


def test_rank_ops_reject_bad_arguments():
    plan = make_plan(6)
    with pytest.raises(ValueError, match="which='both'"):
        plan.rank_ops(0, 0, "forward", "both")
    with pytest.raises(ValueError, match="phase='sideways'"):
        plan.rank_ops(0, 0, "sideways")
    with pytest.raises(ValueError, match="phase='sideways'"):
        plan.fetches(0, "sideways")


# -- simulator ----------------------------------------------------------------------------------------

# b=1, n=2, h_q=6, h_kv=2, d=4, bf16: sizes chosen so every payload kind has a distinct size.
SMALL = Shapes(batch=1, seq_per_rank=2, heads_q=6, heads_kv=2, head_dim=4, dtype_bytes=2)
KV = 2 * 1 * 2 * 2 * 4 * 2  # k and v, (1, 2, 2, 4) bf16 each = 64
Q = 1 * 2 * 6 * 4 * 2  # (1, 2, 6, 4) bf16 = 96
OUT = 1 * 2 * 6 * 4 * 4 + 1 * 6 * 2 * 4  # fp32 out (1, 2, 6, 4) + fp32 lse (1, 6, 2) = 240
Q_BWD = 2 * Q + 2 * (1 * 6 * 2 * 4)  # q, dout bf16 + lse, delta fp32 = 288
DKV = 2 * 1 * 2 * 2 * 4 * 4  # fp32 dk, dv = 128
DQ = 1 * 2 * 6 * 4 * 4  # fp32 dq = 192


def test_payload_bytes():
    assert (KV, Q, OUT, Q_BWD, DKV, DQ) == (64, 96, 240, 288, 128, 192)
    assert payload_bytes("kv", "forward", SMALL) == KV
    assert payload_bytes("q", "forward", SMALL) == Q
    assert payload_bytes("out", "forward", SMALL) == OUT
    assert payload_bytes("kv", "backward", SMALL) == KV
    assert payload_bytes("q", "backward", SMALL) == Q_BWD
    assert payload_bytes("dkv", "backward", SMALL) == DKV
    assert payload_bytes("dq", "backward", SMALL) == DQ
    with pytest.raises(ValueError, match="kind='dq' is not a forward transfer kind"):
        payload_bytes("dq", "forward", SMALL)


def _check_bytes(report, sent_f, recv_f, sent_b, recv_b):
    assert report.bytes_sent_fwd == sent_f and report.bytes_recv_fwd == recv_f
    assert report.bytes_sent_bwd == sent_b and report.bytes_recv_bwd == recv_b
    assert report.bytes_sent == tuple(a + b for a, b in zip(sent_f, sent_b))
    assert report.bytes_recv == tuple(a + b for a, b in zip(recv_f, recv_b))


@pytest.mark.parametrize("schedule", ["ring", "balanced"])
def test_simulate_p2_causal(schedule):
    # step 1: rank 1 computes (1, 0) with kv from rank 0; backward returns dk, dv to rank 0
    r = simulate(2, True, schedule, SMALL)
    _check_bytes(r, (KV, 0), (0, KV), (KV, DKV), (DKV, KV))
    assert r.steps == 2 and r.idle_fraction == pytest.approx(1 / 4)
    assert r.work_makespan == pytest.approx(1.5)
    assert r.compute_idle_fraction == pytest.approx(1 - 2 / 3)  # work 0.5 + 0.5 + 1


def test_simulate_p3_balanced_causal():
    # step 1: kv 0->1 for (1,0), kv 1->2 for (2,1); rank 0 helps with (2,0): q 2->0, out 0->2
    r = simulate(3, True, "balanced", SMALL)
    _check_bytes(
        r,
        sent_f=(KV + OUT, KV, Q),
        recv_f=(Q, KV, KV + OUT),
        sent_b=(KV + DQ, KV + DKV, Q_BWD + DKV),  # dkv 1->0 and 2->1, dq 0->2
        recv_b=(Q_BWD + DKV, KV + DKV, KV + DQ),
    )
    assert r.steps == 2 and r.idle_fraction == 0.0


def test_simulate_p3_noncausal():
    # every rank sends its kv to both others and, backward, gets two dk, dv partials back
    r = simulate(3, False, "balanced", SMALL)
    _check_bytes(r, (2 * KV,) * 3, (2 * KV,) * 3, (2 * KV + 2 * DKV,) * 3, (2 * KV + 2 * DKV,) * 3)
    assert r.idle_fraction == 0.0 and r.compute_idle_fraction == 0.0 and r.work_makespan == 3.0


def test_simulate_p4_balanced_causal():
    # step 1: kv 0->1, 1->2, 2->3; q 3->0, out 0->3 (rank 0 helps with (3,0)); step 2: kv 0->2, 1->3
    r = simulate(4, True, "balanced", SMALL)
    _check_bytes(
        r,
        sent_f=(2 * KV + OUT, 2 * KV, KV, Q),
        recv_f=(Q, KV, 2 * KV, 2 * KV + OUT),
        # backward adds dkv back along every kv edge and dq 0->3 instead of out
        sent_b=(2 * KV + DQ, 2 * KV + DKV, KV + 2 * DKV, Q_BWD + 2 * DKV),
        recv_b=(Q_BWD + 2 * DKV, KV + 2 * DKV, 2 * KV + DKV, 2 * KV + DQ),
    )
    assert r.bytes_sent_fwd == (368, 128, 64, 96) and r.bytes_sent_bwd == (320, 256, 320, 544)
    assert r.steps == 3 and r.idle_fraction == pytest.approx(2 / 12)
    assert r.work_makespan == pytest.approx(2.5)
    assert r.compute_idle_fraction == pytest.approx(1 - 8 / 10)


def test_simulate_p4_ring_causal():
    # rank p receives kv from every j < p; rank j sends to every p > j
    r = simulate(4, True, "ring", SMALL)
    _check_bytes(
        r,
        sent_f=(3 * KV, 2 * KV, KV, 0),
        recv_f=(0, KV, 2 * KV, 3 * KV),
        sent_b=(3 * KV, 2 * KV + DKV, KV + 2 * DKV, 3 * DKV),
        recv_b=(3 * DKV, KV + 2 * DKV, 2 * KV + DKV, 3 * KV),
    )
    assert r.idle_fraction == pytest.approx(6 / 16) and r.work_makespan == pytest.approx(3.5)


def test_simulate_conservation_and_balance():
    for p in range(1, 33):
        for causal in (True, False):
            for schedule in SCHEDULES:
                r = simulate(p, causal, schedule, SMALL)
                assert sum(r.bytes_sent) == sum(r.bytes_recv)
                assert len(r.bytes_sent) == p
        if p % 2 == 1:
            r = simulate(p, True, "balanced", SMALL)
            assert r.idle_fraction == 0.0
        if p >= 3:
            assert simulate(p, True, "balanced").work_makespan < simulate(p, True, "ring").work_makespan


def test_format_table_and_cli(capsys):
    table = format_table([simulate(4, True, s) for s in SCHEDULES])
    lines = table.splitlines()
    assert len(lines) == 2 + len(SCHEDULES) and lines[0].startswith("| P | schedule")
    assert "| 4 | balanced | True | 3 |" in table
    sched._main(["--world", "2", "5", "--seq-per-rank", "1024"])
    out = capsys.readouterr().out
    assert "| 5 | balanced | True | 3 |" in out and "| 5 | ring | True | 5 |" in out


# -- validation ---------------------------------------------------------------------------------------


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"world_size=0 must be >= 1"):
        make_plan(0)
    with pytest.raises(ValueError, match=r"schedule='zigzagx' is not one of \('ring', 'balanced', 'zigzag', 'placed'\); pass"):
        make_plan(3, schedule="zigzagx")
    with pytest.raises(TypeError, match=r"world_size=2.5 must be an int"):
        make_plan(2.5)
    with pytest.raises(TypeError, match=r"world_size=True must be an int"):
        make_plan(True)
    with pytest.raises(TypeError, match=r"causal='yes' must be a bool"):
        make_plan(2, causal="yes")
    with pytest.raises(ValueError, match=r"Shapes.heads_kv=0 must be a positive int"):
        Shapes(heads_kv=0)
    with pytest.raises(ValueError, match=r"schedule='zigzagx'"):
        simulate(3, schedule="zigzagx")


def test_plan_type_exported():
    assert isinstance(make_plan(1), Plan) and make_plan(1).num_steps() == 1


# -- zigzag layout, partials, two-dimensional (Ulysses x ring) -------------------------------------------


def test_zigzag_layout_segments():
    from distattn.schedule import Layout

    lay = Layout("zigzag", 4)
    assert [lay.segments(r, 6) for r in range(4)] == [((0, 3), (21, 24)), ((3, 6), (18, 21)), ((6, 9), (15, 18)),
                                                      ((9, 12), (12, 15))]
    every = sorted(int(x) for r in range(4) for x in lay.positions(r, 6))
    assert every == list(range(24))
    with pytest.raises(ValueError, match=r"tokens per rank \(5\) must be even: pad the sequence to a multiple of 8"):
        lay.segments(0, 5)
    # 2D: rank (r, u) holds the u-th piece of every segment of ring shard r (ring shards of U * n tokens)
    two = Layout("zigzag", 2, ulysses=2)
    assert [two.segments(g, 4) for g in range(4)] == [((0, 2), (12, 14)), ((2, 4), (14, 16)),
                                                      ((4, 6), (8, 10)), ((6, 8), (10, 12))]
    assert [Layout("contiguous", 3, 2).segments(g, 5) for g in range(6)] == [((5 * g, 5 * g + 5),) for g in range(6)]


@pytest.mark.parametrize("p", range(1, 17))
def test_zigzag_equal_work_every_step_owners_only(p):
    n = 8
    plan = make_plan(p, True, "zigzag", chunk=n)
    assert plan.num_steps() == p and plan.layout is not None and plan.layout.kind == "zigzag"
    assert all(t.rank == t.q_chunk for tasks in plan.steps for t in tasks), "zigzag: only owner tasks"
    for s, tasks in enumerate(plan.steps):
        assert len(tasks) == p, f"step {s}: a rank idles"
        work = {plan.work[t.q_chunk][t.kv_chunk] for t in tasks}
        # off-diagonal shard pairs hold exactly two fully visible (n/2 x n/2) chunk pairs: n^2/2;
        # the diagonal pair holds one full chunk pair and two causal diagonal chunks: n^2/2 + n/2
        assert work == ({n * n // 2 + n // 2} if s == 0 else {n * n // 2}), f"step {s}: unequal work {work}"
    # only kv travels forward, only dk/dv back; each step is a permutation (one send, one receive per rank)
    for s in range(1, p):
        fetched = plan.fetches(s, "forward")
        assert {tr.kind for tr in fetched} == {"kv"} and sorted(tr.src for tr in fetched) == list(range(p))
        assert {tr.kind for tr in plan.returns(s, "backward")} == {"dkv"} and not plan.returns(s, "forward")


@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_causal_zigzag_borrows_half_of_an_earlier_ranks_shard(p):
    """Query rank i's chunks (i and 2P-1-i) see only the first chunk of an earlier kv rank j < i: the pair borrows the
    first n/2 rows; a later kv rank's shard is needed whole. The generic key_spans agrees; the simulator counts it
    (a quarter fewer k/v bytes than whole shards, forward, every rank together)."""
    from distattn.schedule.layouts import Layout
    from distattn.schedule.masks import MaskSpec, key_spans

    n = 12
    plan = make_plan(p, True, "zigzag", chunk=n)
    a, b = key_spans(MaskSpec(causal=True), p, n, Layout("zigzag", p))
    for i in range(p):
        for j in range(p):
            assert plan.key_span(i, j) == ((0, n // 2) if j < i else (0, n)) == (a[i, j], b[i, j]), (i, j)
    assert make_plan(p, False, "zigzag", chunk=n).key_span(1, 0) is None  # non-causal: every key, whole shards
    shapes = Shapes(seq_per_rank=n, heads_q=4, heads_kv=2, head_dim=8)
    whole = simulate(p, False, "zigzag", shapes)  # the same transfers, every one a whole shard
    half = simulate(p, True, "zigzag", shapes)
    assert 4 * sum(half.bytes_sent_fwd) == 3 * sum(whole.bytes_sent_fwd)
    assert 2 * half.bytes_recv_fwd[p - 1] == whole.bytes_recv_fwd[p - 1]  # the last rank: only earlier kv ranks


def test_zigzag_beats_balanced_on_gqa_bytes_and_makespan():
    # the numbers: LLaMA-3-8B-shaped layer, P=8, 4k tokens per rank
    shapes = Shapes(seq_per_rank=4096, heads_q=32, heads_kv=8, head_dim=128)
    bal, zig = simulate(8, True, "balanced", shapes), simulate(8, True, "zigzag", shapes)
    mib = 1 << 20
    assert max(bal.bytes_sent_fwd) / mib == pytest.approx(258, abs=0.5)
    assert max(zig.bytes_sent_fwd) / mib == pytest.approx(112, abs=0.5)  # 7 kv steps of 16 MiB
    assert zig.work_makespan < bal.work_makespan and zig.compute_idle_fraction < 0.01


def test_partials_input_halves_fp32_returns():
    assert payload_bytes("out", "forward", SMALL, "input") == 1 * 2 * 6 * 4 * 2 + 1 * 6 * 2 * 4
    assert payload_bytes("dkv", "backward", SMALL, "input") == DKV // 2
    assert payload_bytes("dq", "backward", SMALL, "input") == DQ // 2
    assert payload_bytes("kv", "forward", SMALL, "input") == KV  # inputs are unchanged
    r32, r16 = simulate(4, True, "balanced", SMALL), simulate(4, True, "balanced", SMALL, partials="input")
    assert sum(r16.bytes_sent) < sum(r32.bytes_sent)
    with pytest.raises(ValueError, match="partials='bf16'"):
        payload_bytes("dq", "backward", SMALL, "bf16")


def test_two_dimensional_simulation():
    from distattn.schedule import a2a_bytes, ulysses_heads

    shapes = Shapes(batch=1, seq_per_rank=4, heads_q=8, heads_kv=2, head_dim=4, dtype_bytes=2)
    # h_kv = 2 < U = 4: each kv head is replicated on 2 ranks, each rank gets one
    assert ulysses_heads(8, 2, 4) == (2, 1, 2) and ulysses_heads(8, 8, 4) == (2, 2, 1)
    with pytest.raises(ValueError, match="6 kv heads cannot be split"):
        ulysses_heads(32, 6, 4)
    with pytest.raises(ValueError, match="query heads cannot be split"):
        ulysses_heads(33, 3, 2)
    q, kv, stat = 4 * 8 * 4, 4 * 4 * 4, 8 * 4  # elements a rank holds: q (n, 8, d), k' (n, 4, d), lse (8, n)
    assert a2a_bytes("forward", shapes, 4) == ((2 * q + 2 * kv) * 2 + stat * 4) * 3 // 4
    assert a2a_bytes("backward", shapes, 4) == ((3 * q + 4 * kv) * 2 + 2 * stat * 4) * 3 // 4
    assert a2a_bytes("forward", shapes, 1) == 0
    r = simulate(8, True, "zigzag", shapes, ulysses=4)  # ring of R = 2 over 16-token shards with 2 / 1 heads
    ring = simulate(2, True, "zigzag", Shapes(batch=1, seq_per_rank=16, heads_q=2, heads_kv=1, head_dim=4))
    assert r.steps == ring.steps == 2 and r.ulysses == 4 and len(r.bytes_sent) == 8
    for g in range(8):
        assert r.bytes_sent_fwd[g] == ring.bytes_sent_fwd[g // 4] + r.a2a_fwd
        assert r.ring_bytes("backward", g) == ring.bytes_sent_bwd[g // 4]
    # (P, 1): pure Ulysses, no ring transfer at all
    pure = simulate(4, True, "balanced", shapes, ulysses=4)
    assert pure.steps == 1 and pure.bytes_sent_fwd == (pure.a2a_fwd,) * 4
    assert "2d U=4 x zigzag R=2" in format_table([r])
    with pytest.raises(ValueError, match="ulysses=3 must be a positive int dividing world_size=8"):
        simulate(8, True, "zigzag", shapes, ulysses=3)


# -- the masked balanced plan's assignment ------------------------------------------------------------


def _balance_reference(p, work, needed):
    """``_balance_by_work`` as its docstring says, computed the plain way: for each off-diagonal pair (largest first,
    then by pair), the owner (query rank first, on a tie) whose task lists, each sorted largest first, give the
    shortest plan, the length summed over steps of the step's largest task, recomputed from every list."""
    lists = [[work[r][r]] if (r, r) in needed else [] for r in range(p)]
    chosen = [[] for _ in range(p)]

    def length(ls):
        cols = [sorted(x, reverse=True) for x in ls]
        return sum(max(c[t] for c in cols if t < len(c)) for t in range(max(map(len, cols))))

    for i, j in sorted((ij for ij in needed if ij[0] != ij[1]), key=lambda ij: (-work[ij[0]][ij[1]], ij)):
        trials = []
        for rank in (i, j):
            ls = [x + [work[i][j]] if r == rank else x for r, x in enumerate(lists)]
            trials.append((length(ls), rank, ls))
        _, rank, lists = min(trials, key=lambda t: t[0])  # min keeps the first (the query rank) on a tie
        chosen[rank].append(Task(rank, i, j))
    out = [[Task(r, r, r)] if (r, r) in needed else [] for r in range(p)]
    for r in range(p):
        out[r] += sorted(chosen[r], key=lambda t: (-work[t.q_chunk][t.kv_chunk], t.q_chunk, t.kv_chunk))
    return out


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8, 13])
def test_balance_by_work_is_the_plain_greedy(p):
    """The masked balanced plan's helper assignment keeps the largest task of every step instead of recomputing
    every rank's lists: the same tasks as the plain computation, on random work with ties, missing diagonals and
    empty pairs."""
    import random

    from distattn.schedule.masked import _balance_by_work

    rng = random.Random(p)
    for _ in range(20):
        work = [[rng.choice([0, 0, 1, 2, 3, rng.randrange(1, 1000)]) for _ in range(p)] for _ in range(p)]
        needed = {(i, j) for i in range(p) for j in range(p) if work[i][j] > 0}
        assert _balance_by_work(p, work, needed) == _balance_reference(p, work, needed), work
