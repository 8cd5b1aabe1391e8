"""The executor's own buffers (``distattn.memory.executor``) against the bytes the real executor allocates.

Each rank runs ``dist_attn_forward`` and ``dist_attn_backward`` on gloo under ``distattn.memory.measure.live_bytes``:
the peak of the live bytes the call allocates, without its outputs and without the kernels' transients (the CPU
backends' per-tile scratch, not what a GPU kernel holds), must equal the replay of the same plan within
``REL_TOL``, for P = 1, 2, 4, the balanced, zigzag and ring schedules, two shard lengths, both partial dtypes and
contiguous or transposed (HF-like) inputs.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

REL_TOL = 0.03  # the bar for the byte model (issue 36)
ABS_SLACK = 64  # bytes: the call's scalars (the NaN check's flag, the agreement's), the same at every length
B, HQ, HKV, D = 1, 4, 2, 32
KERNEL_FNS = ("fold_", "merge_", "attn_delta", "backward_chunk_")


def _measure(rank, world, cases):
    import distattn.attention as att
    from distattn import kernels
    from distattn.memory.executor import executor_peak
    from distattn.memory.measure import live_bytes

    out = []
    for schedule, n, partials, transposed, *cu in cases:
        torch.manual_seed(rank)
        cfg = att.DistAttnConfig(causal=True, scale=D ** -0.5, schedule=schedule, partials=partials,
                                 cu_seqlens=tuple(cu[0]) if cu else None)

        def make(h):
            if transposed:  # HF passes (b, h, n, d) tensors viewed as (b, n, h, d)
                return torch.randn(B, h, n, D, dtype=torch.bfloat16).transpose(1, 2)
            return torch.randn(B, n, h, D, dtype=torch.bfloat16)

        q, k, v = make(HQ), make(HKV), make(HKV)
        dout = torch.randn(B, n, HQ, D, dtype=torch.bfloat16)
        res = {}
        for phase in ("forward", "backward"):
            saved = {name: getattr(kernels, name) for name in KERNEL_FNS}
            with live_bytes() as mem:
                for name in KERNEL_FNS:
                    setattr(kernels, name, mem.opaque(saved[name]))
                try:
                    if phase == "forward":
                        outs = att.dist_attn_forward(q, k, v, cfg)
                    else:
                        outs = att.dist_attn_backward(dout, q, k, v, o, lse, cfg)
                finally:
                    for name, fn in saved.items():
                        setattr(kernels, name, fn)
            if phase == "forward":
                o, lse = outs
            plan = cfg.plan(n)
            model = executor_peak(plan, batch=B, n=n, heads=HQ, kv_heads=HKV, head_dim=D, dtype=torch.bfloat16,
                                  partials=partials, phase=phase, copied=("q", "k", "v") if transposed else (),
                                  rank=rank)
            res[phase] = (mem.peak_excluding(outs), model.total, model.moment)
        out.append(((schedule, n, partials, transposed), res))
    return out


def _cases(world):
    cases = [(s, n, "fp32", False) for s in ("balanced", "zigzag", "ring") for n in (128, 384)]
    cases += [("balanced", 256, "input", False), ("zigzag", 256, "input", True), ("balanced", 256, "fp32", True)]
    return cases


@pytest.mark.parametrize("world", [1, 2, 4])
def test_executor_buffers_equal_the_replay(world):
    results = run_distributed(_measure, world, _cases(world), timeout=300)
    for rank, cases in enumerate(results):
        for case, res in cases:
            for phase, (measured, model, moment) in res.items():
                assert abs(measured - model) <= min(ABS_SLACK, REL_TOL * model), (
                    f"P={world} rank {rank} {case} {phase}: measured {measured} B, replay {model} B ({moment})")


def test_executor_buffers_equal_the_replay_on_packed_rows():
    """Packed documents on their placement, where pairs borrow only the runs of kv rows their queries see (one packed
    copy of k and of v is sent, the partials come back for those rows): the replay holds the bytes too."""
    from tests.test_dist_placed import PACKED_CU, PACKED_N, PACKED_WORLD

    cases = [("placed", PACKED_N, partials, False, PACKED_CU) for partials in ("fp32", "input")]
    results = run_distributed(_measure, PACKED_WORLD, cases, timeout=300)
    for rank, per_case in enumerate(results):
        for case, res in per_case:
            for phase, (measured, model, moment) in res.items():
                assert abs(measured - model) <= min(ABS_SLACK, REL_TOL * model), (
                    f"P={PACKED_WORLD} rank {rank} {case} {phase}: measured {measured} B, replay {model} B ({moment})")


def _measure_deeper(rank, world, cases, depth, keep=1):
    """:func:`_measure` with every placement fetching ``depth`` steps ahead (``Layout.prefetch``) and absorbing its
    partials ``keep`` steps after their round (``Layout.return_depth``)."""
    from tests.dist_utils import placed_forced

    with placed_forced(prefetch=depth, return_depth=keep):
        return _measure(rank, world, cases)


@pytest.mark.parametrize("depth,keep,world,cu", [(2, 1, 4, [0, 500, 512]), (3, 3, 5, [0, 620, 640]),
                                                 (1, 2, 4, [0, 500, 512]), (8, 6, 10, [0, 1200, 1280])])
def test_executor_buffers_equal_the_replay_fetching_steps_ahead(depth, keep, world, cu):
    """A placed plan fetching ``depth`` steps ahead (``Layout.prefetch``, as deep as the placement solver finds it
    faster) holds ``depth + 1`` fetch slots of receive buffers, and absorbing its partials ``keep`` steps after their
    round (``Layout.return_depth``) ``keep + 1`` return slots and ``keep`` steps' sent partials, each buffer set as
    large as the most rows its slot receives (``distattn.schedule.pool.slot_rows``; at 10 ranks, 8 and 6 deep, as the
    solver deepens plans whose pairs borrow few rows): the replay counts them as the executor allocates them, and its
    peak lies above the same plan's at depth 1 on some rank (a third slot is live beside the other two). A long
    document over the ranks: a step per rank, every slot used and one reused."""
    import dataclasses

    from distattn.memory.executor import executor_peak
    from distattn.schedule import MaskSpec, make_plan
    from tests.dist_utils import placed_forced

    PACKED_CU, PACKED_N, PACKED_WORLD = cu, 128, world
    cases = [("placed", PACKED_N, partials, False, PACKED_CU) for partials in ("fp32", "input")]
    results = run_distributed(_measure_deeper, PACKED_WORLD, cases, depth, keep, timeout=300)
    for rank, per_case in enumerate(results):
        for case, res in per_case:
            for phase, (measured, model, moment) in res.items():
                assert abs(measured - model) <= min(ABS_SLACK, REL_TOL * model), (
                    f"P={PACKED_WORLD} rank {rank} {case} {phase}: measured {measured} B, replay {model} B ({moment})")
    with placed_forced(prefetch=depth, return_depth=keep):
        deep = make_plan(PACKED_WORLD, True, "placed", mask=MaskSpec(causal=True, cu_seqlens=tuple(PACKED_CU)),
                         chunk=PACKED_N)
    assert (deep.prefetch, deep.return_depth) == (depth, keep) and deep.num_steps() >= max(depth, keep) + 2
    shallow = dataclasses.replace(deep, layout=dataclasses.replace(deep.layout, prefetch=1, return_depth=1))
    peaks = [[executor_peak(plan, batch=B, n=PACKED_N, heads=HQ, kv_heads=HKV, head_dim=D, phase=phase,
                            rank=r).total for plan in (shallow, deep)] for r in range(PACKED_WORLD)
             for phase in ("forward", "backward")]
    assert all(a <= b for a, b in peaks) and any(a < b for a, b in peaks), peaks


def test_the_planner_counts_the_deepest_prefetch_and_returns_of_a_placed_plan():
    """``attention_buffers("placed", ...)`` (what ``--memory auto`` weighs for packed documents) adds what a placed plan
    may hold beyond the balanced plan's: its fetch rounds up to ``FETCH_SHARDS`` whole k/v shards of receive buffers and
    as many of sends in flight (5 more rounds than a plan one step ahead, each with whole-shard k/v receive buffers and
    k/v send copies), and in the backward its return rounds up to ``RETURN_SHARDS`` (3 more rounds, each with
    whole-shard dk/dv receive buffers and the dk/dv partial it sends, fp32 or the input's dtype). A placed plan at the
    deepest depths ``distattn.schedule.pool.deepest`` admits holds no more on any rank, in either phase: 10 documents
    in one group of 16 ranks (16 steps, so every slot is reused), at 6 and 4 (the deepest whole-shard buffers admit)
    and at the deeper depths its pairs' key slices admit (10 and 6)."""
    import dataclasses

    from distattn.memory.executor import attention_buffers, executor_peak
    from distattn.schedule import MaskSpec
    from distattn.schedule.masked import make_masked_plan
    from distattn.schedule.placement import _place_cached
    from distattn.schedule.pool import FETCH_SHARDS, RETURN_SHARDS, deepest

    world, n = 16, 512
    mask = MaskSpec(causal=True, cu_seqlens=(0, 286, 1181, 2042, 2555, 4189, 6181, 6739, 7769, 7780, 8192))
    lay = _place_cached(mask, world, n, world)
    deep = deepest(make_masked_plan(world, "placed", mask, n, lay))
    assert deep[0] > FETCH_SHARDS - 1 and deep[1] > RETURN_SHARDS - 1, deep  # small slices: deeper than 6 and 4
    shape = dict(batch=B, heads=HQ, kv_heads=HKV, head_dim=D, dtype=torch.bfloat16)
    for depths in ((FETCH_SHARDS - 1, RETURN_SHARDS - 1), deep):
        deepest_lay = dataclasses.replace(lay, prefetch=depths[0], return_depth=depths[1])
        plan = make_masked_plan(world, "placed", mask, n, deepest_lay)
        assert plan.num_steps() >= max(depths) + 2
        for phase, partials in [(ph, pa) for ph in ("forward", "backward") for pa in ("fp32", "input")]:
            bound = attention_buffers("placed", world, n, phase=phase, partials=partials, groups=1, copied=(),
                                      outputs=False, **shape)
            assert bound.parts["deeper prefetch (placed)"] == (FETCH_SHARDS - 2) * 4 * B * n * HKV * D * 2
            returns = bound.parts.get("deeper returns (placed)", 0)
            assert returns == (0 if phase == "forward" else
                               (RETURN_SHARDS - 2) * 4 * B * n * HKV * D * (4 if partials == "fp32" else 2))
            base = attention_buffers("balanced", world, n, phase=phase, partials=partials, groups=1, copied=(),
                                     outputs=False, **shape)
            assert bound.total == base.total + bound.parts["deeper prefetch (placed)"] + returns
            for rank in range(world):
                peak = executor_peak(plan, n=n, phase=phase, partials=partials, groups=1, copied=(), rank=rank,
                                     **shape)
                assert peak.total <= bound.total, (depths, phase, partials, rank, peak, bound)
            shallow = executor_peak(make_masked_plan(world, "placed", mask, n, dataclasses.replace(
                deepest_lay, return_depth=1)), n=n, phase=phase, partials=partials, groups=1, copied=(), **shape)
            peak = executor_peak(plan, n=n, phase=phase, partials=partials, groups=1, copied=(), **shape)
            if phase == "backward":  # the deeper returns hold more: the replay counts them
                assert peak.total > shallow.total, (partials, peak, shallow)
