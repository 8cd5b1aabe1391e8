"""schedule="auto": resolved by the cost model, before sharding (choose_schedule) or at call time (contiguous)."""

import pytest
import torch

import distattn
from attn_ref import max_err, reference_grads
from dist_utils import run_distributed
from distattn.schedule import Shapes
from distattn.schedule.cost import Cluster, choose

TOL = 1e-5  # fp32 against the fp64 reference on a few dozen tokens: round-off only


def test_choose_schedule_restricted_to_a_ulysses_degree():
    choice = distattn.choose_schedule(16, 32, 8, 128, 4096, link="ib", ulysses=4)
    assert {c.ulysses for c in choice.candidates} == {4}
    assert {c.schedule for c in choice.candidates} == {"ring", "balanced", "zigzag"}
    runnable = [c for c in choice.candidates if c.runnable]
    assert choice.best is runnable[0] and choice.best.total == min(c.total for c in runnable)
    free = distattn.choose_schedule(16, 32, 8, 128, 4096, link="ib")
    assert free.best.total <= choice.best.total  # a free choice of U is never worse than a fixed one
    # the same numbers as the cost model called directly
    direct = choose(16, Shapes(seq_per_rank=4096, heads_q=32, heads_kv=8, head_dim=128),
                    cluster=Cluster.preset("ib"), ulysses=4)
    assert [c.total for c in direct.candidates] == [c.total for c in choice.candidates]
    with pytest.raises(ValueError, match="ulysses=3 must be a positive int dividing world_size=16"):
        distattn.choose_schedule(16, 32, 8, 128, 4096, ulysses=3)


def _auto_worker(rank, world):
    from distattn import api
    from distattn.topology import topology

    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(1, 8 * world, h, 16, generator=g) for h in (4, 2, 2, 4))
    shards = [distattn.shard_sequence(t, schedule="auto").clone().requires_grad_() for t in (q, k, v)]
    out = distattn.dist_flash_attn_func(*shards, causal=True, schedule="auto")
    out.backward(distattn.shard_sequence(dout))
    ref = reference_grads(q, k, v, dout, torch.float64, causal=True)
    errs = [max_err(a, distattn.shard_sequence(b)) for a, b in zip([out] + [s.grad for s in shards],
                                                                  [ref[0], ref[2], ref[3], ref[4]])]
    picked = api.resolve_auto(shards[0], shards[1], topology(None), causal=True, window=(-1, -1), documents=None,
                              partials="fp32")
    return max(errs), picked


def test_auto_at_call_time_matches_the_reference_and_picks_a_contiguous_schedule():
    results = run_distributed(_auto_worker, 3, timeout=120)
    assert all(err < TOL for err, _ in results), results
    picked = {p for _, p in results}
    assert len(picked) == 1 and picked <= {"ring", "balanced"}
