"""Rematerialization-aware checkpointing (distattn.checkpoint) and the registered op behind it.

One spawn of 3 gloo ranks covers group sizes 1 and 2 (subgroups of ranks {0} and {0, 1}) and 3 (the
default group). Per group size it checks that
  * ``torch.ops.distattn.attention`` gives bit-for-bit what ``dist_flash_attn_func`` gives (and, on one rank,
    what ``flash_attn_func`` gives, by the accuracy rule), and passes ``torch.library.opcheck``;
  * a stack of user-written blocks checkpointed with ``remat_checkpoint`` runs attention's forward once per
    block per step (plain checkpointing: twice), sends no more bytes than no checkpointing at all, and gives
    bit-identical gradients;
  * what a block keeps between forward and backward is exactly attention's ``out`` + ``lse`` (plus the
    block input the checkpoint holds).
"""

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

import distattn
from attn_ref import assert_all_close_by_rule, reference_grads
from dist_utils import run_distributed
from distattn import checkpoint as ck
from distattn import comm

TIMEOUT_S = 150  # three ranks sharing two cores: imports, three group sizes, opcheck
GROUP_SIZES = (1, 2, 3)
BATCH, N_PER_RANK, HIDDEN, HEADS_Q, HEADS_KV, HEAD_DIM, BLOCKS = 2, 4, 32, 4, 2, 8, 2
MODES = ("none", "plain", "remat")
COMPILE_GROUP_SIZE = 2


class Block(nn.Module):
    """A pre-norm transformer block that calls attention through the registered op (as users are told to)."""

    def __init__(self, group):
        super().__init__()
        self.group = group
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.q = nn.Linear(HIDDEN, HEADS_Q * HEAD_DIM)
        self.kv = nn.Linear(HIDDEN, 2 * HEADS_KV * HEAD_DIM)
        self.proj = nn.Linear(HEADS_Q * HEAD_DIM, HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))

    def forward(self, x):
        b, n, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, n, HEADS_Q, HEAD_DIM)
        k, v = self.kv(h).view(b, n, 2, HEADS_KV, HEAD_DIM).unbind(2)  # (b, n, h_kv, d) views
        x = x + self.proj(distattn.dist_flash_attn_func(q, k, v, causal=True, group=self.group).flatten(2))
        return x + self.mlp(self.norm2(x))


def _run(blocks, x, mode):
    for block in blocks:
        if mode == "none":
            x = block(x)
        elif mode == "plain":
            x = checkpoint(block, x, use_reentrant=False)
        else:
            x = ck.remat_checkpoint(block, x)
    return x


def _via_op(q, k, v, *, causal, group, return_lse):
    """The registered op called directly (what checkpoint policies and torch.compile see)."""
    out, lse = torch.ops.distattn.attention(q, k, v, causal, HEAD_DIM ** -0.5, -1, -1, 0.0,
                                            distattn._ops.group_key(group), "balanced", None, True, [])
    return out, lse


def _op_vs_function(group, world):
    """Bit equality of the op and the autograd.Function; on one rank, the rule against flash_attn_func."""
    out = {}
    g = torch.Generator().manual_seed(3)
    shard = lambda t: distattn.shard_sequence(t, group=group)  # noqa: E731
    full = [torch.randn(BATCH, world * N_PER_RANK, h, HEAD_DIM, generator=g) for h in (HEADS_Q, HEADS_KV, HEADS_KV)]
    dout = shard(torch.randn(BATCH, world * N_PER_RANK, HEADS_Q, HEAD_DIM, generator=g))
    for causal in (True, False):
        results = []
        for fn in (_via_op, distattn.dist_flash_attn_func):
            q, k, v = (shard(t).clone().requires_grad_() for t in full)
            o, lse = fn(q, k, v, causal=causal, group=group, return_lse=True)
            o.backward(dout)
            results.append((o, lse, q.grad, k.grad, v.grad))
        out[f"op_equals_function_causal{causal}"] = all(torch.equal(a, b) for a, b in zip(*results))
        if world == 1:
            out[f"op_single_causal{causal}"] = results[0]
    return out


def _blocks_case(group, world):
    torch.manual_seed(0)  # same weights on every rank
    blocks = nn.ModuleList(Block(group) for _ in range(BLOCKS))
    g = torch.Generator().manual_seed(1)
    x_full = torch.randn(BATCH, world * N_PER_RANK, HIDDEN, generator=g)
    w_full = torch.randn(BATCH, world * N_PER_RANK, HIDDEN, generator=g)
    x_shard, w_shard = (distattn.shard_sequence(t, group=group) for t in (x_full, w_full))
    res = {}
    for mode in MODES:
        blocks.zero_grad(set_to_none=True)
        x = x_shard.clone().requires_grad_()
        ck.reset_counters()
        comm.reset_counters()
        (_run(blocks, x, mode) * w_shard).sum().backward()
        res[mode] = {"forward": ck.COUNTERS.forward, "backward": ck.COUNTERS.backward,
                     "bytes": comm.COUNTERS.bytes_sent + comm.COUNTERS.bytes_recv,
                     "grads": [x.grad] + [p.grad for p in blocks.parameters()]}
        # What one block keeps between its forward and backward.
        xb = x_shard.clone().requires_grad_()
        y, kept = ck.retained_bytes(_run, blocks[:1], xb, mode)
        y.sum().backward()  # every rank runs the same backward: the op's communication stays in lockstep
        res[mode]["kept"] = kept
    tokens = BATCH * N_PER_RANK
    res["promise"] = {"input": tokens * HIDDEN * 4, "out": tokens * HEADS_Q * HEAD_DIM * 4,
                      "lse": tokens * HEADS_Q * 4}
    return res


def _opcheck(group, world):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(BATCH, N_PER_RANK, HEADS_Q, HEAD_DIM, generator=g, requires_grad=True)
    k, v = (torch.randn(BATCH, N_PER_RANK, HEADS_KV, HEAD_DIM, generator=g, requires_grad=True) for _ in range(2))
    from distattn._ops import group_key

    args = (q, k, v, True, HEAD_DIM ** -0.5, -1, -1, 0.0, group_key(group), "balanced", None, True, [])
    # Every rank runs the same sequence of checks, so the op's communication stays matched across ranks.
    torch.library.opcheck(torch.ops.distattn.attention.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    return True


def _compiled_remat(group, world):
    """``torch.compile`` (fullgraph, aot_eager) of a remat-checkpointed block: same gradients, one forward."""
    torch.manual_seed(0)
    block = Block(group)
    x_full = torch.randn(BATCH, world * N_PER_RANK, HIDDEN, generator=torch.Generator().manual_seed(2))
    x = distattn.shard_sequence(x_full, group=group).clone().requires_grad_()
    block(x).sum().backward()
    eager = x.grad.clone()
    x.grad = None
    compiled = torch.compile(lambda t: ck.remat_checkpoint(block, t), backend="aot_eager", fullgraph=True)
    ck.reset_counters()
    compiled(x).sum().backward()
    return {"same_grad": torch.equal(eager, x.grad), "forward": ck.COUNTERS.forward, "backward": ck.COUNTERS.backward}


def _checkpoint_cases(rank, world_size):
    import torch.distributed as dist

    groups = {1: dist.new_group([0]), 2: dist.new_group([0, 1]), 3: None}  # new_group: every rank calls it
    results = {}
    for size in GROUP_SIZES:
        if rank >= size:
            continue
        group = groups[size]
        results[size] = {**_op_vs_function(group, size), "blocks": _blocks_case(group, size),
                         "opcheck": _opcheck(group, size)}
        if size == COMPILE_GROUP_SIZE:  # compiling costs ~15 s of a shared CPU: one group size is enough
            results[size]["compiled"] = _compiled_remat(group, size)
    return results


@pytest.fixture(scope="module")
def spawned():
    return run_distributed(_checkpoint_cases, 3, timeout=TIMEOUT_S)


def _ranks(spawned, size):
    return [(r, res[size]) for r, res in enumerate(spawned) if size in res]


@pytest.mark.parametrize("size", GROUP_SIZES)
def test_op_equals_dist_flash_attn_func(spawned, size):
    for rank, res in _ranks(spawned, size):
        for causal in (True, False):
            assert res[f"op_equals_function_causal{causal}"], f"rank {rank} of {size}, causal={causal}"
        assert res["opcheck"]


@pytest.mark.parametrize("causal", [True, False])
def test_op_on_one_rank_matches_flash_attn_func(spawned, causal):
    out, lse, dq, dk, dv = spawned[0][1][f"op_single_causal{causal}"]
    g = torch.Generator().manual_seed(3)  # the inputs _op_vs_function drew for one rank
    full = [torch.randn(BATCH, N_PER_RANK, h, HEAD_DIM, generator=g) for h in (HEADS_Q, HEADS_KV, HEADS_KV)]
    dout = torch.randn(BATCH, N_PER_RANK, HEADS_Q, HEAD_DIM, generator=g)
    ref = reference_grads(*full, dout, torch.float64, causal=causal)
    q, k, v = (t.clone().requires_grad_() for t in full)
    base_out, base_lse = distattn.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    base_out.backward(dout)
    assert_all_close_by_rule(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv),
                             (base_out, base_lse, q.grad, k.grad, v.grad), ref, torch.float32)


@pytest.mark.parametrize("size", GROUP_SIZES)
def test_remat_runs_attention_forward_once(spawned, size):
    for rank, res in _ranks(spawned, size):
        blocks = res["blocks"]
        counts = {mode: (blocks[mode]["forward"], blocks[mode]["backward"]) for mode in MODES}
        assert counts == {"none": (BLOCKS, BLOCKS), "plain": (2 * BLOCKS, BLOCKS), "remat": (BLOCKS, BLOCKS)}, \
            f"rank {rank} of {size}: (forward, backward) executions per step {counts}"


@pytest.mark.parametrize("size", GROUP_SIZES)
def test_remat_repeats_no_communication(spawned, size):
    for rank, res in _ranks(spawned, size):
        moved = {mode: res["blocks"][mode]["bytes"] for mode in MODES}  # sent + received by this rank
        assert moved["remat"] == moved["none"], f"rank {rank} of {size}: bytes moved per step {moved}"
        if size > 1:  # plain checkpointing repeats the forward's transfers in backward
            assert moved["plain"] > moved["none"], f"rank {rank} of {size}: bytes moved per step {moved}"


@pytest.mark.parametrize("size", GROUP_SIZES)
def test_remat_gradients_are_bit_identical(spawned, size):
    for rank, res in _ranks(spawned, size):
        grads = {mode: res["blocks"][mode]["grads"] for mode in MODES}
        for mode in ("plain", "remat"):
            same = [torch.equal(a, b) for a, b in zip(grads[mode], grads["none"])]
            assert all(same), f"rank {rank} of {size}: {mode} gradients differ from no checkpointing at {same}"


@pytest.mark.parametrize("size", GROUP_SIZES)
def test_remat_keeps_only_attention_out_and_lse(spawned, size):
    for rank, res in _ranks(spawned, size):
        blocks, promise = res["blocks"], res["blocks"]["promise"]
        kept = {mode: blocks[mode]["kept"] for mode in MODES}
        # The block input is held by every variant (by the checkpoint, or saved by the first norm) and was
        # created before the block ran, so retained_bytes does not count it: what remains is exact.
        assert kept["remat"] == promise["out"] + promise["lse"], (rank, size, kept, promise)
        assert kept["plain"] == 0, (rank, size, kept)
        assert kept["none"] > kept["remat"], (rank, size, kept)


def test_remat_under_torch_compile(spawned):
    for rank, res in _ranks(spawned, COMPILE_GROUP_SIZE):
        assert res["compiled"] == {"same_grad": True, "forward": 1, "backward": 1}, (rank, res["compiled"])


def test_policy_saves_only_the_attention_op():
    assert ck.remat_policy(None, torch.ops.distattn.attention.default) == CheckpointPolicy.MUST_SAVE
    assert ck.remat_policy(None, torch.ops.aten.mm.default) == CheckpointPolicy.PREFER_RECOMPUTE


def test_fake_impl_gives_shapes_without_running():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 5, 4, 8, dtype=torch.bfloat16)
        k = torch.empty(2, 5, 2, 8, dtype=torch.bfloat16)
        before = ck.COUNTERS.forward
        out, lse = torch.ops.distattn.attention(q, k, k, True, 0.5, -1, -1, 0.0, "default", "balanced", None, True, [])
    assert ck.COUNTERS.forward == before
    assert out.shape == (2, 5, 4, 8) and out.dtype == torch.bfloat16
    assert lse.shape == (2, 4, 5) and lse.dtype == torch.float32


def test_op_needs_a_process_group():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="initialized process group"):
        distattn.dist_flash_attn_func(q, q, q)


def test_unknown_group_key_is_a_clear_error():
    from distattn._ops import group_of

    with pytest.raises(ValueError, match="no live process group is registered under 'nope'"):
        group_of("nope")
