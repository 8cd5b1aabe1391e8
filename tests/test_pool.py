"""``distattn.schedule.pool``: the receive pool sized by what a plan's rounds carry, and the depths its budget admits.

``pool_rows`` (every rank at once, from the plan's runs: the placement solver's check) is held equal to a walk of each
rank's rounds through ``Plan.rank_ops``, the executor's own view (``slot_rows`` for the pool; the sends summed over
every ``slots`` consecutive rounds); that the executor allocates what ``slot_rows`` says is
``tests/test_executor_memory.py``'s (measured against the replay on gloo)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from distattn.schedule import MaskSpec
from distattn.schedule.layouts import BACKWARDS, ORDERS, PREFETCHES, RETURN_DEPTHS
from distattn.schedule.masked import make_masked_plan
from distattn.schedule.pool import FETCH_SHARDS, RETURN_SHARDS, _Rounds, deepest, pool_rows, slot_rows, transfer_rows
from distattn.schedule.solver import _place_cached

CU = (0, 286, 1181, 2042, 2555, 4189, 6181, 6739, 7769, 7780, 8192)


def _walked(plan, phase: str, which: str, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """``pool_rows`` by walking every rank's rounds (the executor's view)."""
    p, n = plan.world_size, plan.chunk
    pool = np.array([sum(n if r is None else r for r in slot_rows(plan, rank, phase, which, slots).values())
                     for rank in range(p)])
    sent = np.zeros((plan.num_steps(), p), dtype=np.int64)
    for t in range(plan.num_steps()):
        for rank in range(p):
            sent[t, rank] = sum(transfer_rows(plan, tr) or n for tr in plan.rank_ops(t, rank, phase, which)[0])
    windows = [sent[t:t + slots].sum(axis=0) for t in range(max(1, plan.num_steps() - slots + 1))]
    return pool, np.max(windows, axis=0)


def _plans():
    """Placed plans of packed documents at 16 ranks, causal and windowed, in every order and backward way."""
    for window, group in (((-1, -1), 16), ((512, 0), 16), ((-1, -1), None)):
        mask = MaskSpec(causal=True, cu_seqlens=CU, window=window)
        lay = _place_cached(mask, 16, 512, group)
        for order, backward in [(o, b) for o in ORDERS for b in BACKWARDS]:
            yield make_masked_plan(16, "placed", mask, 512, dataclasses.replace(lay, order=order, backward=backward))


@pytest.mark.parametrize("slots", [2, 5, 7, 13])
def test_pool_rows_equal_a_walk_of_every_rank(slots):
    """The pool (each buffer set as large as the most rows its slot receives, summed) and the most rows sent in any
    ``slots`` consecutive rounds, per rank, for both phases' fetches and returns: arrays equal the executor's walk.
    Among the plans, rotations where a rank's k/v is borrowed by two ranks at once (two dk/dv partials in one return
    round, two buffer sets) and plans of one message per round."""
    several = 0
    for plan in _plans():
        for phase in ("forward", "backward"):
            view = plan.run_order(phase)
            for which in ("fetch", "return"):
                fast, walked = pool_rows(view, phase, which, slots), _walked(view, phase, which, slots)
                assert all(np.array_equal(a, b) for a, b in zip(fast, walked)), (plan.layout.order, phase, which)
                several += any(len(view.rank_ops(t, r, phase, which)[1]) > 1 for t in range(view.num_steps())
                               for r in range(16))
                # the same rounds read from the plan's own order, the steps reversed where the phase reverses them
                flipped = view is not plan.run_order("forward")
                same = _Rounds(plan.run_order("forward"), phase, which).rows(slots, reverse=flipped)
                assert all(np.array_equal(a, b) for a, b in zip(same, fast)), (plan.layout.order, phase, which)
    assert several  # the case of several messages to a rank in a round was met


def test_deepest_admits_what_fits_the_budget_and_no_more():
    """``deepest`` admits 6 and 4 always (whole-shard buffers held that much) and a deeper depth only where every rank's
    pool and sends in flight fit ``FETCH_SHARDS`` / ``RETURN_SHARDS`` whole shards in every phase and backward way; the
    next deeper depth does not fit. A long document over 16 ranks borrows near-whole shards (6 and 4); packed
    documents in one group borrow slices (deeper)."""
    cases = [(MaskSpec(causal=True, cu_seqlens=(0, 7600, 8192)), None),
             (MaskSpec(causal=True, cu_seqlens=CU), 16), (MaskSpec(causal=True, cu_seqlens=CU, window=(512, 0)), 16)]
    got = []
    for mask, group in cases:
        plan = make_masked_plan(16, "placed", mask, 512, _place_cached(mask, 16, 512, group))
        fetch, keep = deepest(plan)
        got.append((fetch, keep))
        assert fetch >= FETCH_SHARDS - 1 and keep >= RETURN_SHARDS - 1
        views = [(plan.run_order("forward"), "forward")] + [
            (dataclasses.replace(plan, layout=dataclasses.replace(plan.layout, backward=b)).run_order("backward"),
             "backward") for b in BACKWARDS]

        def worst(which, depth):
            return max(int(x.max()) for v, ph in views for x in pool_rows(v, ph, which, depth + 1))

        for which, depth, shards, depths in (("fetch", fetch, FETCH_SHARDS, PREFETCHES),
                                             ("return", keep, RETURN_SHARDS, RETURN_DEPTHS)):
            if depth > shards - 1:
                assert worst(which, depth) <= shards * 512
            if depth < depths[-1]:
                assert worst(which, depth + 1) > shards * 512
    assert got[0] == (FETCH_SHARDS - 1, RETURN_SHARDS - 1)
    assert got[1][0] > FETCH_SHARDS - 1 and got[2][0] == PREFETCHES[-1] and got[2][1] > RETURN_SHARDS - 1, got


def test_the_solver_deepens_only_as_far_as_the_budget_admits():
    """The placement solver's layout fetches and absorbs no deeper than ``deepest`` admits for its plan (it times each
    candidate at those depths, then takes the shallowest no deeper one beats); with only the old depths (up to 6 and 4)
    it solves as before the deeper ones existed."""
    from tests.dist_utils import solver_depths

    for mask in (MaskSpec(causal=True, cu_seqlens=CU), MaskSpec(causal=True, cu_seqlens=CU, window=(512, 0))):
        _place_cached.cache_clear()
        lay = _place_cached(mask, 16, 512)
        plan = make_masked_plan(16, "placed", mask, 512, lay)
        fetch, keep = deepest(plan)
        assert lay.prefetch <= fetch and lay.return_depth <= keep
        with solver_depths(prefetch=6, return_depth=4):
            old = _place_cached(mask, 16, 512)
        assert old.prefetch <= 6 and old.return_depth <= 4


def test_the_pool_bytes_bench_counts_within_the_planners_bound():
    """``bench/pool_bytes.py``'s row: a solved placement's depths within those admitted, its pools and sends in flight
    within the budget (7 / 5 whole shards), and the executor's backward peak on its worst rank within what the memory
    planner counts for a placed call."""
    from bench.pool_bytes import row

    cells = [c.strip() for c in row("longtail:2048", 8, "window 1024", 3, 1024).strip("|").split("|")]
    (depth, admitted), pools = ([tuple(map(int, cells[i].split(" / "))) for i in (3, 4)],
                                [tuple(map(float, cells[i].split(" / "))) for i in (5, 6)])
    assert all(d <= a for d, a in zip(depth, admitted))
    assert max(pools[0]) <= FETCH_SHARDS and max(pools[1]) <= RETURN_SHARDS
    assert int(cells[9]) <= int(cells[10])
