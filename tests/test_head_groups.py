"""Head groups (issue 36): the plan runs once per group of kv heads when a call's working memory would pass the
budget. The results are the one-group results bit for bit, for every schedule, GQA and packed documents; what one
call holds beyond its inputs and outputs shrinks with the groups (measured: live bytes at the dispatch level)."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

import distattn
from dist_utils import run_distributed
from distattn.schedule import head_groups, work_bytes
from distattn.schedule.heads import WORK_BYTES_ENV, work_budget

SPAWN_TIMEOUT_S = 180
EXACT = 1e-5  # against the one-device call (fp32)
MODEL_SLACK_B = 64  # measured minus modelled: the agreement's and the NaN check's few-byte tensors (not modelled)


def test_the_rule_picks_the_fewest_groups_that_fit():
    llama3 = dict(b=1, h_q=32, h_kv=8, d=128, itemsize=2, partial_itemsize=4)
    assert head_groups(n=4096, **llama3) == 1
    assert head_groups(n=607_104, **llama3) == 8  # every kv head alone
    for n in (4096, 16384, 65536, 607_104):
        g = head_groups(n=n, **llama3)
        assert 8 % g == 0
        fits = work_bytes(1, n, 32 // g, 8 // g, 128, 2, 4) <= work_budget()
        assert fits or g == 8
        assert g == 1 or work_bytes(1, n, 32 // (g // 2 or 1), 8 // (g // 2 or 1), 128, 2, 4) > work_budget()
    # the estimate is linear in the heads: g groups hold 1/g
    full, eighth = work_bytes(1, 607_104, 32, 8, 128, 2, 4), work_bytes(1, 607_104, 4, 1, 128, 2, 4)
    assert full == 8 * eighth
    assert head_groups(1, 64, 6, 3, 8, 4, 4, budget=1) == 3  # nothing fits: one kv head per group


def test_the_budget_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(WORK_BYTES_ENV, "12345")
    assert work_budget() == 12345
    for bad in ("0", "-5", "lots"):
        monkeypatch.setenv(WORK_BYTES_ENV, bad)
        with pytest.raises(ValueError, match=f"{WORK_BYTES_ENV}=.* must be a positive number of bytes"):
            work_budget()


def _run(world, schedule, cu, seed, h_q=4, h_kv=2):
    g = torch.Generator().manual_seed(seed)
    T = world * 12
    q, k, v, dout = (torch.randn(1, T, h, 8, generator=g) for h in (h_q, h_kv, h_kv, h_q))
    shard = lambda t: distattn.shard_sequence(t, schedule=schedule)  # noqa: E731
    mine = [shard(t).clone().requires_grad_() for t in (q, k, v)]
    if cu is None:
        out = distattn.dist_flash_attn_func(*mine, causal=True, schedule=schedule, timeout=60.0)
    else:
        cu_t = torch.tensor(cu, dtype=torch.int32)
        out = distattn.dist_flash_attn_varlen_func(*(t[0] for t in mine), cu_t, max(b - a for a, b in zip(cu, cu[1:])),
                                                   causal=True, schedule=schedule, timeout=60.0)[None]
    out.backward(shard(dout))
    return [out.detach(), *(t.grad for t in mine)]


def _reference(world, cu, seed, h_q=4, h_kv=2):
    g = torch.Generator().manual_seed(seed)
    T = world * 12
    q, k, v, dout = (torch.randn(1, T, h, 8, generator=g).double().requires_grad_() for h in (h_q, h_kv, h_kv, h_q))
    bounds = [0, T] if cu is None else cu
    rep = h_q // h_kv  # GQA: query head i reads kv head i // rep

    def sdpa(a, b):  # (1, s, h, d) -> (1, h, s, d), fp64 SDPA on one document
        qh, kh, vh = (t[:, a:b].transpose(1, 2) for t in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))
        return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(1, 2)

    out = torch.cat([sdpa(a, b) for a, b in zip(bounds, bounds[1:])], dim=1)
    out.backward(dout.detach())
    return [out.detach(), q.grad, k.grad, v.grad]


def _worker(rank, world):
    cases = [("ring", None), ("balanced", None), ("zigzag", None), ("balanced", [0, 5, 6, 6 + 7 * world, 12 * world])]
    found = []
    for i, (schedule, cu) in enumerate(cases):
        os.environ.pop(WORK_BYTES_ENV, None)
        one = _run(world, schedule, cu, i)
        os.environ[WORK_BYTES_ENV] = "1"  # nothing fits: one kv head (and its query heads) per pass
        grouped = _run(world, schedule, cu, i)
        ref = _reference(world, cu, i)
        shard = lambda t: distattn.shard_sequence(t, schedule=schedule)  # noqa: E731
        err = max((a.double() - shard(r)).abs().max().item() for a, r in zip(grouped, ref))
        found.append((schedule, cu is not None, all(torch.equal(a, b) for a, b in zip(one, grouped)), err))
    os.environ.pop(WORK_BYTES_ENV, None)
    return found


@pytest.mark.parametrize("world", [2, 3])
def test_grouped_calls_equal_one_group_bit_for_bit(world):
    for found in run_distributed(_worker, world, timeout=SPAWN_TIMEOUT_S):
        for schedule, docs, same, err in found:
            assert same, (schedule, docs)
            assert err < EXACT, (schedule, docs, err)


KERNEL_FNS = ("fold_", "merge_", "attn_delta", "backward_chunk_")  # their scratch is the kernels', not the call's


@contextlib.contextmanager
def _executor_bytes():
    """``live_bytes`` of a region with the kernels' transient scratch kept out (``LiveBytes.opaque``)."""
    from distattn import kernels
    from distattn.memory.measure import live_bytes

    saved = {name: getattr(kernels, name) for name in KERNEL_FNS}
    with live_bytes() as mem:
        for name in KERNEL_FNS:
            setattr(kernels, name, mem.opaque(saved[name]))
        try:
            yield mem
        finally:
            for name, fn in saved.items():
                setattr(kernels, name, fn)


def _memory_worker(rank, world):
    from distattn.attention import DistAttnConfig, dist_attn_backward, dist_attn_forward
    from distattn.memory.executor import executor_peak

    g = torch.Generator().manual_seed(rank)
    n, h_q, h_kv, d = 256, 8, 4, 16
    # bf16, as a model runs: the fp32 accumulators are the call's own memory, not its outputs
    q, dout = (torch.randn(1, n, h_q, d, generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(1, n, h_kv, d, generator=g).bfloat16() for _ in range(2))
    peaks = {}
    for budget in (None, "1"):
        if budget is None:
            os.environ.pop(WORK_BYTES_ENV, None)
        else:
            os.environ[WORK_BYTES_ENV] = budget
        for schedule in ("ring", "balanced", "zigzag"):
            cfg = DistAttnConfig(causal=True, scale=d ** -0.5, schedule=schedule, timeout=60.0)
            with _executor_bytes() as fwd:
                out, lse = dist_attn_forward(q, k, v, cfg)
            with _executor_bytes() as bwd:
                grads = dist_attn_backward(dout, q, k, v, out, lse, cfg)
            peaks[(budget, schedule)] = (fwd.peak_excluding([out, lse]), bwd.peak_excluding(list(grads)))
            plan = cfg.plan(n)
            model = [executor_peak(plan, batch=1, n=n, heads=h_q, kv_heads=h_kv, head_dim=d, phase=phase, copied=(),
                                   rank=rank).total for phase in ("forward", "backward")]
            peaks[(budget, schedule, "model")] = tuple(model)
    os.environ.pop(WORK_BYTES_ENV, None)
    return peaks


@pytest.mark.parametrize("world", [2, 4])
def test_four_groups_hold_at_most_a_quarter_and_a_bit_and_the_byte_model_counts_them(world):
    ranks = run_distributed(_memory_worker, world, timeout=SPAWN_TIMEOUT_S)
    for peaks in ranks:
        for schedule in ("ring", "balanced", "zigzag"):
            for budget in (None, "1"):  # one group, and four: the replay of distattn.memory.executor, to the byte
                measured, model = peaks[(budget, schedule)], peaks[(budget, schedule, "model")]
                assert all(0 <= m - p <= MODEL_SLACK_B for m, p in zip(measured, model)), (schedule, budget,
                                                                                          measured, model)
    for schedule in ("ring", "balanced", "zigzag"):
        # the call's peak, the busiest rank's (a rank's own peaks with one group and with four can fall at moments of
        # different make-up: the backward's reversed steps, Plan.run_order, took one rank's one-group peak below the
        # bar its four-group peak was held to; the busiest rank's moved by 2% at most)
        (fwd1, bwd1), (fwd4, bwd4) = ([max(peaks[(budget, schedule)][i] for peaks in ranks) for i in (0, 1)]
                                      for budget in (None, "1"))
        # beyond one group's share: delta (b, h_q, n) fp32 for the whole call, and the contiguous copies of the
        # group's slices that travel (k, v; q, dout on helper steps: bf16, a quarter of the heads each)
        delta, copies = 8 * 256 * 4, 256 * (2 * 4 + 2 * 8) // 4 * 16 * 2
        assert bwd4 <= (bwd1 - delta) / 4 + delta + copies + MODEL_SLACK_B, (schedule, bwd1, bwd4)
        # the forward also holds one group's finished out (bf16) and lse before they are copied into the call's
        assert fwd4 <= fwd1 / 4 + copies + 256 * 2 * (16 * 2 + 4) + MODEL_SLACK_B, (schedule, fwd1, fwd4)


@pytest.mark.parametrize("schedule", ["balanced", "zigzag", "ring"])
def test_at_llama3_8b_shapes_a_call_holds_under_a_quarter(schedule):
    """The issue's bar, on the byte model the test above holds to the executor: LLaMA-3-8B (32/8 heads, d 128,
    bf16), 607,104 tokens per rank, P = 8: what a call holds beyond q, k, v, out, lse and their gradients."""
    from distattn.memory.executor import attention_buffers

    shape = dict(batch=1, heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16, outputs=False, copied=())
    for phase in ("forward", "backward"):
        one = attention_buffers(schedule, 8, 607_104, groups=1, phase=phase, **shape)
        chosen = attention_buffers(schedule, 8, 607_104, phase=phase, **shape)  # the executor's choice: 8 groups
        assert chosen.total <= one.total / 4, (schedule, phase, one.total / 2 ** 30, chosen.total / 2 ** 30)
