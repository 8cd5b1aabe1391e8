"""The per-pair timeline (``distattn.schedule.timeline``): held to the executor's own event order on gloo, and to
hand-computed times on small plans."""

import dataclasses

import numpy as np
import pytest
import torch

import distattn
from dist_utils import placed_forced, run_distributed
from distattn.schedule import HEAD, MaskSpec, Shapes, make_plan, simulate
from distattn.schedule.cli import document_lengths
from distattn.schedule.cluster import Cluster, Link
from distattn.schedule.layouts import PREFETCHES
from distattn.schedule.timeline import phase_timeline, rank_events, step_timeline, timeline
from distattn.schedule.wire import payload_bytes

TIMEOUT_S = 180
SHAPES = Shapes(seq_per_rank=4096, heads_q=32, heads_kv=8, head_dim=128)
FAST = Link(name="free", bandwidth=1e30, latency=0.0)  # communication costs nothing


def _trace_worker(rank, world, n, cases):
    """Every case: the executor's events (``distattn.executor.TRACE``) of one forward and backward equal the
    timeline's replay of the plan on this rank."""
    from distattn import executor

    for schedule, causal, window, cu in cases:
        g = torch.Generator().manual_seed(world)
        q, k, v = (torch.randn(1, n, h, 8, generator=g).requires_grad_() for h in (4, 2, 2))
        executor.TRACE = []
        try:
            out = distattn.dist_flash_attn_varlen_func(q[0], k[0], v[0], torch.tensor(cu, dtype=torch.int32),
                                                       world * n, causal=causal, window_size=window,
                                                       schedule=schedule, backend="torch")
            out.sum().backward()
            seen = executor.TRACE
        finally:
            executor.TRACE = None
        plan = make_plan(world, causal, schedule, mask=MaskSpec(causal=causal, window=window, cu_seqlens=tuple(cu)),
                         chunk=n)
        for phase in ("forward", "backward"):
            mine = [event for ph, event in seen if ph == phase]
            want = rank_events(plan, rank, phase)
            assert mine == want, f"{schedule} {phase} rank {rank}:\nexecutor {mine}\ntimeline {want}"
            assert any(e[0] == "compute" for e in want)
        pairs = {ph: [e[2:] for p, e in seen if p == ph and e[0] == "compute"] for ph in ("forward", "backward")}
        flipped = plan.run_order("backward").runs == "backward"  # reversed unless a placed layout keeps the order
        want = pairs["forward"][::-1] if flipped else pairs["forward"]
        assert pairs["backward"] == want, f"{schedule} rank {rank}: the backward's order is not the plan's run order"
    return True


@pytest.mark.parametrize("world", [3, 4])
def test_the_executor_runs_the_timelines_event_order(world):
    """Posts (with their send and receive peers), waits and computes, in order, per rank and phase: placed (owner
    tasks only), balanced on documents (helper tasks: partials come back in the forward too) and ring."""
    n = 16
    cu = [0, 5, 5 + world * 6, world * n - 3, world * n]
    cases = [("placed", True, (-1, -1), cu), ("balanced", True, (-1, -1), cu), ("ring", False, (4, 3), cu)]
    assert all(run_distributed(_trace_worker, world, n, cases, timeout=TIMEOUT_S))


def _trace_ordered_worker(rank, world, n, cases, order):
    """:func:`_trace_worker` with the placement's plan forced into a matched ``order`` (``Layout.order``)."""
    with placed_forced(order):
        return _trace_worker(rank, world, n, cases)


def test_the_executor_runs_a_matched_orders_event_order():
    """A placed plan whose steps are matchings, with a rank idle between two of its pairs (the stream of
    ``tests/test_dist_placed.py``'s HOLES at P = 4): the executor's posts, waits and computes are the timeline's."""
    from distattn.schedule.masked import make_masked_plan
    from distattn.schedule.placement import place

    cu, n = [0, 8, 11, 22, 36, 47, 48], 12
    lay = dataclasses.replace(place(MaskSpec(causal=True, cu_seqlens=tuple(cu)), 4, n), order="ranks-work")
    plan = make_masked_plan(4, "placed", MaskSpec(causal=True, cu_seqlens=tuple(cu)), n, lay)
    idle = [(t, r) for r in range(4) for t in range(plan.num_steps()) if plan.task(t, r) is None
            and any(plan.task(u, r) is not None for u in range(t + 1, plan.num_steps()))]
    assert idle, "the stream no longer leaves a rank idle between its pairs"
    assert all(run_distributed(_trace_ordered_worker, 4, n, [("placed", True, (-1, -1), cu)], "ranks-work",
                               timeout=TIMEOUT_S))


def _trace_deeper_worker(rank, world, n, cases, depth, keep=1):
    """:func:`_trace_worker` with every placement fetching ``depth`` steps ahead (``Layout.prefetch``) and absorbing
    its partials ``keep`` steps after their round (``Layout.return_depth``)."""
    with placed_forced(prefetch=depth, return_depth=keep):
        return _trace_worker(rank, world, n, cases)


@pytest.mark.parametrize("world,depth,keep", [(4, 2, 1), (5, 3, 3), (4, 1, 2), (8, 6, 4)])
def test_the_executor_runs_a_deeper_prefetchs_event_order(world, depth, keep):
    """A placed plan fetching ``depth`` steps ahead (``Plan.prefetch``, ``depth + 1`` fetch slots) and absorbing its
    partials ``keep`` steps after their round (``Plan.return_depth``, ``keep + 1`` return slots): the executor posts
    the first ``depth`` steps' fetches, then step ``t + depth``'s before step ``t`` computes, and waits for step ``t``'s
    returns after step ``t + keep``'s compute; its posts, waits and computes are the timeline's replay
    (``rank_events`` reads the plan's depths), which differs from the same plan's at depth 1."""
    from distattn.schedule.masked import make_masked_plan

    n = 16
    cu = [0, 3, world * n - 2, world * n]  # a long document: a step per rank
    assert all(run_distributed(_trace_deeper_worker, world, n, [("placed", True, (-1, -1), cu)], depth, keep,
                               timeout=TIMEOUT_S))
    mask = MaskSpec(causal=True, cu_seqlens=tuple(cu))
    with placed_forced(prefetch=depth, return_depth=keep):
        deep = make_plan(world, True, "placed", mask=mask, chunk=n)
    shallow = make_masked_plan(world, "placed", mask, n, dataclasses.replace(deep.layout, prefetch=1, return_depth=1))
    assert (deep.prefetch, deep.return_depth) == (depth, keep) and shallow.prefetch == shallow.return_depth == 1
    assert deep.num_steps() >= max(depth, keep) + 2  # a slot is reused
    for phase in ("forward", "backward"):
        deep_events = [rank_events(deep, r, phase) for r in range(world)]
        assert deep_events != [rank_events(shallow, r, phase) for r in range(world)]
        for events in deep_events:  # the first depth fetches are posted before anything waits
            assert [e[:3] for e in events[:depth]] == [("post", "fetch", t) for t in range(depth)], events[:depth]
            waits = [e for e in events if e[:2] in (("wait", "fetch"), ("wait", "return"))]
            for t in range(deep.num_steps() - keep):  # step t's returns: waited for after step t + keep's fetch
                assert waits.index(("wait", "return", t)) == waits.index(("wait", "fetch", t + keep)) + 1, waits


def test_the_timeline_runs_the_plans_prefetch_depth():
    """``prefetch=None`` (the default) is the plan's depth (``Plan.prefetch``), with ``prefetch + 1`` receive slots:
    a placed plan of depth ``d`` times as its depth-1 twin does with ``prefetch=d``; fewer slots than the depth needs
    are refused. Uniform documents at P = 8, seed 187 (depth 2: 1.076x -> 1.044x of perfect balance; the solver goes
    deeper)."""
    from distattn.schedule.masked import make_masked_plan

    shapes, cluster = SHAPES, Cluster.preset("nvlink")
    mask = MaskSpec(causal=True, cu_seqlens=document_lengths("uniform:8192", 8 * 4096, seed=187))
    chosen = make_plan(8, True, "placed", mask=mask, chunk=4096).layout
    assert chosen.prefetch >= 2 and f"fetches {chosen.prefetch} steps ahead" in chosen.note
    plans = {d: make_masked_plan(8, "placed", mask, 4096, dataclasses.replace(chosen, prefetch=d)) for d in PREFETCHES}
    runs = {d: step_timeline(plans[d], shapes, cluster) for d in PREFETCHES}
    for d in PREFETCHES:
        assert runs[d] == step_timeline(plans[1], shapes, cluster, prefetch=d)
        assert runs[1] == step_timeline(plans[d], shapes, cluster, prefetch=1)
        assert step_timeline(plans[d], shapes, cluster, slots=d + 1) == runs[d]
        with pytest.raises(ValueError, match=f"slots={d}"):
            step_timeline(plans[d], shapes, cluster, slots=d)
    assert runs[2]["ratio"] < runs[1]["ratio"] - 0.02, (runs[1]["ratio"], runs[2]["ratio"])


def test_two_ranks_by_hand():
    """Causal ring on 2 ranks: step 0 the diagonals (half a pair each), step 1 rank 1 computes (1, 0) with rank 0's
    k/v, fetched while step 0 computes. On a slow link the fetch ends after the diagonal: rank 1 waits for it."""
    link = Link(name="slow", bandwidth=1e9, latency=1e-6)
    cluster = Cluster(intra=link, inter=link)
    plan = make_plan(2, True, "ring")
    pair = 4 * 4096 ** 2 * 32 * 128 / cluster.flops  # one full pair, forward
    kv = payload_bytes("kv", "forward", SHAPES) / link.bandwidth + link.latency
    fwd = phase_timeline(plan, "forward", SHAPES, cluster)
    assert kv > 0.5 * pair  # the fetch outlasts the diagonal
    assert fwd.makespan == pytest.approx(kv + pair)
    assert fwd.busy.tolist() == pytest.approx([0.5 * pair, 1.5 * pair])
    assert fwd.exposed.tolist() == pytest.approx([0.0, kv - 0.5 * pair])
    fast = phase_timeline(plan, "forward", SHAPES, Cluster(intra=FAST, inter=FAST))
    assert fast.makespan == pytest.approx(1.5 * pair) and fast.exposed.max() == 0.0


def test_the_backward_runs_the_steps_in_reverse_by_hand():
    """Causal ring on 2 ranks, backward (``Plan.run_order``): rank 1 computes the head of its diagonal
    (``Plan.head_task``: ``HEAD`` of its work) while rank 0's k/v arrive, computes (1, 0), then the rest of its
    diagonal while the (1, 0) dk/dv partial goes back; in the plan's order the diagonal came first (hiding the fetch)
    and the fp32 partial, twice the k/v's bytes, went back after everything. On NVLink both transfers are shorter
    than the diagonal's head and rest, so the reversed backward exposes nothing, where the plan's order ended a return
    after the compute. Without the head the fetch was exposed (the timeline before it: ``kv + 1.5 pair``)."""
    cluster = Cluster.preset("nvlink")
    plan = make_plan(2, True, "ring")
    pair = 2.5 * 4 * 4096 ** 2 * 32 * 128 / cluster.flops  # one full pair, backward
    kv, dkv = (payload_bytes(kind, "backward", SHAPES) / cluster.intra.bandwidth + cluster.intra.latency
               for kind in ("kv", "dkv"))
    head = HEAD * 0.5 * pair
    assert kv < head and kv < dkv < 0.5 * pair - head
    bwd = phase_timeline(plan, "backward", SHAPES, cluster)
    assert bwd.makespan == pytest.approx(1.5 * pair)
    assert bwd.finish.tolist() == pytest.approx([head + pair + dkv, 1.5 * pair])
    assert bwd.exposed.tolist() == pytest.approx([0.0, 0.0])
    assert bwd.busy.tolist() == pytest.approx([0.5 * pair, 1.5 * pair])
    as_planned = dataclasses.replace(plan, runs="backward")  # marked as the backward's order: run as it is
    old = phase_timeline(as_planned, "backward", SHAPES, cluster)
    assert old.makespan == pytest.approx(1.5 * pair + dkv) and old.makespan > bwd.makespan


@pytest.mark.parametrize("docs, p", [("uniform:8192", 8), ("longtail:2048", 16)])
def test_free_links_give_the_compute_bounds(docs, p):
    """With communication free, every schedule's per-pair makespan lies between the busiest rank's compute and the
    lockstep makespan (each step as long as its largest pair), and exposes no communication."""
    cluster = Cluster(intra=FAST, inter=FAST)
    mask = MaskSpec(causal=True, cu_seqlens=document_lengths(docs, p * 4096))
    pair = 4 * 4096 ** 2 * 32 * 128 / cluster.flops
    for schedule in ("ring", "balanced", "zigzag", "placed"):
        plan = make_plan(p, True, schedule, mask=mask, chunk=4096)
        fwd = phase_timeline(plan, "forward", SHAPES, cluster)
        lockstep = simulate(p, True, schedule, SHAPES, mask=mask).work_makespan * pair
        assert fwd.busy.max() * (1 - 1e-9) <= fwd.makespan <= lockstep * (1 + 1e-9), schedule
        assert fwd.exposed.max() < 1e-15  # float rounding of sums of 1e-30 s transfers


def test_messages_across_nodes_take_the_slow_link():
    """P = 16 on nodes of 8: a ring's messages across the node boundary go over InfiniBand; one NVLink domain is
    faster; with every link NVLink the answer does not depend on the node size."""
    plan = make_plan(16, True, "ring")
    ib = step_timeline(plan, SHAPES, Cluster.preset("ib"))["makespan"]
    nv = step_timeline(plan, SHAPES, Cluster.preset("nvlink"))["makespan"]
    nv4 = step_timeline(plan, SHAPES, Cluster.preset("nvlink", gpus_per_node=4))["makespan"]
    assert ib > 1.5 * nv and nv4 == pytest.approx(nv)


def test_a_ulysses_stride_moves_the_node_boundary():
    """Ring ranks U apart: with U = 4 on nodes of 8 every second ring rank is on another node."""
    plan = make_plan(4, True, "ring")
    flat = step_timeline(plan, SHAPES, Cluster.preset("ib"))["makespan"]
    spread = step_timeline(plan, SHAPES, Cluster.preset("ib"), stride=4)["makespan"]
    assert spread > 1.5 * flat


def test_per_pair_figure_beside_lockstep_for_the_ring():
    """The issue's example: ring on uniform:8192 at P = 8, whose lockstep figure (2.2x) overstates the per-pair one."""
    mask = MaskSpec(causal=True, cu_seqlens=document_lengths("uniform:8192", 8 * 4096))
    plan = make_plan(8, True, "ring", mask=mask, chunk=4096)
    per_pair = step_timeline(plan, SHAPES, Cluster.preset("nvlink"))["ratio"]
    rep = simulate(8, True, "ring", SHAPES, mask=mask)
    lockstep = 1 / (1 - rep.compute_idle_fraction)
    assert 1.0 < per_pair < lockstep - 0.3


def test_timeline_of_both_phases_and_the_partials():
    """Backward moves dk/dv partials: fp32 partials take longer than input-dtype ones on a slow link."""
    link = Link(name="slow", bandwidth=5e9, latency=0.0)
    cluster = Cluster(intra=link, inter=link)
    plan = make_plan(4, True, "ring", mask=MaskSpec(causal=True, cu_seqlens=(0, 16384)), chunk=4096)
    fwd32, bwd32 = timeline(plan, SHAPES, cluster)
    _, bwd16 = timeline(plan, SHAPES, cluster, partials="input")
    assert bwd32.makespan > bwd16.makespan and fwd32.phase == "forward"
    assert np.allclose(bwd32.busy, 2.5 * fwd32.busy)


def test_step_timeline_fields():
    plan = make_plan(2, True, "balanced")
    out = step_timeline(plan, dataclasses.replace(SHAPES, seq_per_rank=1024))
    assert set(out) == {"makespan", "perfect", "ratio", "compute_idle", "busiest", "exposed"}
    assert out["makespan"] >= out["busiest"] >= out["perfect"] > 0


def _longtail_case():
    shapes = Shapes(batch=1, seq_per_rank=1024, heads_q=8, heads_kv=2, head_dim=64, dtype_bytes=2)
    mask = MaskSpec(causal=True, cu_seqlens=document_lengths("longtail:512", 4 * 1024, seed=3))
    link = dataclasses.replace(Cluster(), intra=Link(name="10 GB/s", bandwidth=1e10, latency=5e-6))
    return shapes, mask, link


def test_prefetch_depth_is_a_what_if():
    """``prefetch`` (default: the plan's, 1 for these). Deeper starts a later step's fetch earlier. With every round on
    one side stream (``return_stream=False``, the executor before its second stream) it can be faster (ring over these
    packed documents: the backward's next fetch is posted before the return it queued behind) or change nothing
    (balanced: its rounds already wait on compute, not on the stream); with the returns on their own stream (the
    executor) these plans gain nothing from it; on free links every depth gives the same step; 0 is refused."""
    shapes, mask, link = _longtail_case()

    def steps(schedule, cluster, return_stream=False):
        plan = make_plan(4, True, schedule, mask=mask, chunk=1024)
        return [step_timeline(plan, shapes, cluster, prefetch=d, return_stream=return_stream)["makespan"]
                for d in (1, 2, 3)]

    balanced, ring = steps("balanced", link), steps("ring", link)
    assert ring[1] < ring[0] and ring[2] <= ring[1], ring
    assert len(set(balanced)) == 1, balanced
    for schedule in ("balanced", "ring"):
        two = steps(schedule, link, return_stream=True)
        assert two[0] == step_timeline(make_plan(4, True, schedule, mask=mask, chunk=1024), shapes,
                                       link)["makespan"]  # the plan's prefetch (1) and the return stream: defaults
        assert len(set(two)) == 1, two
    free_link = Link(name="free", bandwidth=1e30, latency=0.0)
    free = dataclasses.replace(Cluster(), intra=free_link, inter=free_link)
    assert len(set(steps("balanced", free))) == 1
    with pytest.raises(ValueError, match="prefetch=0"):
        step_timeline(make_plan(4, True, "ring", chunk=1024), shapes, link, prefetch=0)


def test_receive_slots_are_a_what_if():
    """``slots`` (default the executor's, ``prefetch + 1``: double-buffered receives at depth 1): a fetch round waits
    for the compute that last read the buffers it reuses, ``slots - prefetch`` steps before its posting step; a third
    set of buffers (3) or fresh ones (``None``, no wait) let a late sender's k/v leave earlier. Zigzag over uniform
    documents at P = 8 (every pair has work, steps of unequal work): each is faster than the one before, and none beats
    the busiest rank's compute (even on free links the wait couples a rank to its peers' progress: the round starts
    when both ends reach it); a wrong value is refused."""
    shapes = dataclasses.replace(SHAPES, seq_per_rank=4096)
    mask = MaskSpec(causal=True, cu_seqlens=document_lengths("uniform:8192", 8 * 4096, seed=42))
    plan = make_plan(8, True, "zigzag", mask=mask, chunk=4096)
    cluster = Cluster.preset("nvlink")
    two, three, fresh = (step_timeline(plan, shapes, cluster, slots=s)["makespan"] for s in (2, 3, None))
    assert two == step_timeline(plan, shapes, cluster)["makespan"]
    assert two > three * (1 + 1e-3) and three > fresh * (1 + 1e-3), (two, three, fresh)
    free = Cluster(intra=FAST, inter=FAST)
    for s in (2, 3, None):
        tl = step_timeline(plan, shapes, free, slots=s)
        assert tl["makespan"] >= tl["busiest"] * (1 - 1e-12) and tl["exposed"] < 1e-15
    for bad in (1, 0, True, 2.0):
        with pytest.raises(ValueError, match="slots="):
            step_timeline(plan, shapes, cluster, slots=bad)


@pytest.mark.parametrize("schedule", ["ring", "balanced", "zigzag", "placed"])
def test_returns_on_their_own_stream(schedule):
    """The executor's return rounds have a side stream (and on NCCL a communicator) of their own
    (``distattn.comm.PeerExchange``, ``distattn.communicators.Communicator``): a backward's dk/dv partial no longer
    waits behind the next step's k/v fetch. On a slow link that shortens the backward of every schedule of these
    packed documents; the forward (owner tasks return nothing there, helpers' partials are few) is never slower; on
    free links nothing changes; the stream's free time is per kind (``return_stream=False`` shares one)."""
    shapes, mask, link = _longtail_case()
    plan = make_plan(4, True, schedule, mask=mask, chunk=1024)
    fwd2, bwd2 = timeline(plan, shapes, link)
    fwd1, bwd1 = timeline(plan, shapes, link, return_stream=False)
    assert bwd2.makespan < bwd1.makespan, (bwd2.makespan, bwd1.makespan)
    assert fwd2.makespan <= fwd1.makespan
    assert np.array_equal(bwd2.busy, bwd1.busy)  # the same compute, only the waits differ
    free_link = Link(name="free", bandwidth=1e30, latency=0.0)
    free = dataclasses.replace(Cluster(), intra=free_link, inter=free_link)
    assert step_timeline(plan, shapes, free)["makespan"] == step_timeline(plan, shapes, free,
                                                                          return_stream=False)["makespan"]


@pytest.mark.parametrize("docs, p, window, link", [("pile:4", 8, (-1, -1), "nvlink"),
                                                   ("longtail:2048", 16, (4096, 0), "ib"),
                                                   ("uniform:8192", 16, (-1, -1), "ib")])
def test_owner_bounds_hold_for_every_order_depth_and_backward(docs, p, window, link):
    """``owner_bounds`` (what the solver drops a deal by before building its plans) is at most the makespan of every
    plan of the deal's pairs: each order, prefetch and return depth, backward way and head; and some plan comes within
    5% of it (the busiest rank's compute or its rounds), so it is not a loose constant either."""
    from distattn.schedule.layouts import ORDERS
    from distattn.schedule.masked import masked_plan_of
    from distattn.schedule.pairs import pair_table
    from distattn.schedule.placement import _place_cached
    from distattn.schedule.timeline import owner_bounds

    n = 4096
    cluster = Cluster.preset(link) if link == "nvlink" else Cluster.preset(link, gpus_per_node=4)
    spec = MaskSpec(causal=True, window=window, cu_seqlens=document_lengths(docs, p * n, seed=5))
    layouts = [_place_cached.__wrapped__(spec, p, n, k, cluster, share=share) for k in (2, p) for share in (None, .25)]
    tightest = []
    for lay in [x for x in layouts if x is not None and x.kind == "placed"]:
        table = pair_table(spec, p, n, lay, cache=False)
        low = owner_bounds(table, n, SHAPES, cluster)
        for order in ORDERS:
            for prefetch, keep, head, backward in ((1, 1, True, "reversed"), (6, 4, False, "forward"),
                                                   (3, 2, True, "forward"), (6, 4, True, "reversed")):
                cand = dataclasses.replace(lay, order=order, prefetch=prefetch, return_depth=keep, head=head,
                                           backward=backward)
                plan = masked_plan_of(p, "placed", spec, n, cand, table)
                spans = [phase_timeline(plan, phase, SHAPES, cluster).makespan for phase in ("forward", "backward")]
                assert all(s >= b * (1 - 1e-12) for s, b in zip(spans, low)), (lay.note, order, spans, low)
                tightest.append(min(s / b for s, b in zip(spans, low)))
    assert len(tightest) >= 40 and min(tightest) < 1.05, min(tightest)


def test_stop_at_stops_only_a_timeline_that_reaches_it():
    """``stop_at`` above the makespan changes nothing; at or below it the makespan is reported as ``inf``."""
    mask = MaskSpec(causal=True, cu_seqlens=document_lengths("longtail:2048", 8 * 4096, seed=2))
    plan = make_plan(8, True, "placed", mask=mask, chunk=4096)
    cluster = Cluster.preset("nvlink")
    for phase in ("forward", "backward"):
        full = phase_timeline(plan, phase, SHAPES, cluster)
        above = phase_timeline(plan, phase, SHAPES, cluster, stop_at=full.makespan * (1 + 1e-9))
        assert np.array_equal(above.finish, full.finish) and np.array_equal(above.exposed, full.exposed)
        for stop in (full.makespan, 0.5 * full.makespan):
            cut = phase_timeline(plan, phase, SHAPES, cluster, stop_at=stop)
            assert cut.makespan == float("inf") and np.allclose(cut.busy, full.busy)
