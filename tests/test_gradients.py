"""Full-sequence parameter gradients under each wrapper (distattn.gradients) against one process.

A tiny model (embedding -> q/k/v projection -> ``dist_flash_attn_func`` -> output projection -> LM head ->
``causal_lm_loss``) trains one step on its shard of the sequence; every wrapper's gradients, in fp32, are held
to the accuracy rule against the same model run on the whole sequence in one process in fp64 (the reference)
and fp32 (plain PyTorch, the baseline). One spawn per world size runs every case:

* 2 ranks (P = 2): the plain loop (``reduce_gradients``), DDP with ``register_ddp_gradient_hook``, FSDP2 with
  ``set_fsdp_gradient_divide_factor``, naive DDP with the loss scaled by P (the recipe for other wrappers), and
  naive DDP alone, which gives 1/P of the gradient (the pitfall these functions exist for); the first three
  also with gradient accumulation over two micro-batches (DDP: ``no_sync`` on the first);
* 3 ranks (P = 3): the plain loop;
* 4 ranks: data parallel 2 x sequence parallel 2 (replica d = ranks {2d, 2d+1} trains on its own batch; the
  reference is the mean of the two batches' full-sequence gradients) under the plain loop, DDP, FSDP2 and naive
  DDP; a two-dimensional sequence-parallel group (Ulysses 2 x ring 2) over the world with the plain loop; and a
  reduction group that cuts the sequence-parallel groups (DDP over the replicas only), refused on every rank.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from attn_ref import assert_close_by_rule, magnitude_of, naive_attention
from dist_utils import refused as _refused, run_distributed

import distattn
from distattn.integrations.hf import IGNORE_INDEX, causal_lm_loss, shard_batch

TIMEOUT_S = 240  # three spawns of 2-4 ranks, each importing torch and building FSDP2/DDP on a shared 2-core machine
BATCH, SEQ, VOCAB, HIDDEN, HEADS, HEAD_DIM = 2, 12, 32, 16, 2, 8  # SEQ divides by 2, 3 and 4 ranks
DP_REPLICAS = 2  # the 4-rank world: 2 replicas x 2 sequence-parallel ranks
RATIO_TOL = 1e-5  # naive DDP's gradient / the true one is 1/P up to fp32 rounding of a least-squares ratio


class TinyLM(torch.nn.Module):
    """One attention layer, all parameters in play; ``attend(q, k, v)`` is the attention (b, n, h, d)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HEADS * HEAD_DIM)
        self.out = torch.nn.Linear(HEADS * HEAD_DIM, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids, attend):
        x = self.embed(ids)
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, HEAD_DIM).unbind(2)  # (b, n, h, d) each
        return self.head(x + self.out(attend(q, k, v).reshape(b, n, HEADS * HEAD_DIM)))


def make_model(dtype=torch.float32) -> TinyLM:
    torch.manual_seed(0)  # the same weights in every process
    model = TinyLM().to(dtype)
    with torch.no_grad():
        model.qkv.weight.mul_(3.0)  # peaked attention: errors in the exchange would show
    return model


def make_ids(replica: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(10 + replica))


# -- spawned side -------------------------------------------------------------------------------------------
def _backward(model, ids, group, loss_scale: float = 1.0):
    """This rank's share: forward on its shard, the full-sequence mean loss (times ``loss_scale``), backward."""
    batch = shard_batch(ids, labels=ids, group=group)
    attend = lambda q, k, v: distattn.dist_flash_attn_func(q, k, v, causal=True, group=group)  # noqa: E731
    logits = model(batch["input_ids"], attend)
    (causal_lm_loss(logits, batch["shift_labels"], group=group) * loss_scale).backward()


def _grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient (FSDP2: gathered from the shards; a collective)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def _micro_batches(model, batches, group, loss_scale: float = 1.0, no_sync=None):
    """Backward on each of ``batches`` (gradient accumulation: each loss divided by their number); ``no_sync``:
    DDP's context, entered for all but the last."""
    for i, ids in enumerate(batches):
        skip = no_sync is not None and i < len(batches) - 1
        with no_sync() if skip else contextlib.nullcontext():
            _backward(model, ids, group, loss_scale / len(batches))


def _plain(batches, group, process_group=None):
    model = make_model()
    _micro_batches(model, batches, group)
    distattn.reduce_gradients(model, group, process_group=process_group)  # once, after the last micro-batch
    return _grads(model)


def _ddp(batches, group, *, hook: bool, loss_scale: float = 1.0):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make_model())
    if hook:
        distattn.register_ddp_gradient_hook(model, group)
    _micro_batches(model, batches, group, loss_scale, no_sync=model.no_sync)
    return _grads(model.module)


def _fsdp(batches, group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    fully_shard(model.embed, mesh=mesh)  # two FSDP modules: the setting must reach each
    fully_shard(model, mesh=mesh)
    distattn.set_fsdp_gradient_divide_factor(model, group)
    _micro_batches(model, batches, group)  # FSDP2 reduce-scatters after every micro-batch: each one divided
    return _grads(model)


def _cases_p(rank, world_size):
    """The sequence-parallel group is the world: P = world_size, no data parallelism."""
    one, two = [make_ids()], [make_ids(d) for d in range(DP_REPLICAS)]
    out = {"plain": _plain(one, None)}
    if world_size == 2:
        out["ddp"] = _ddp(one, None, hook=True)
        out["fsdp2"] = _fsdp(one, None)
        out["ddp naive, loss x P"] = _ddp(one, None, hook=False, loss_scale=world_size)
        out["ddp naive"] = _ddp(one, None, hook=False)
        # gradient accumulation over two micro-batches (the reference: the mean of their gradients)
        out["plain, 2 micro-batches"] = _plain(two, None)
        out["ddp, 2 micro-batches, no_sync"] = _ddp(two, None, hook=True)
        out["fsdp2, 2 micro-batches"] = _fsdp(two, None)
    return out


def _cases_dp_sp(rank, world_size):
    """4 ranks: replica d = ranks {2d, 2d+1}, each a sequence-parallel group on its own batch."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    sp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # new_group: every rank creates every group
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group, replica = sp_groups[rank // 2], rank // 2
    mine = [make_ids(replica)]
    out = {"plain": _plain(mine, group), "ddp": _ddp(mine, group, hook=True), "fsdp2": _fsdp(mine, group),
           "ddp naive": _ddp(mine, group, hook=False)}
    out["2-D sp over the world"] = _plain([make_ids()], distattn.make_2d_groups(2))
    # a reduction over the replicas only cuts each sequence-parallel group: refused, on every rank
    out["refused ddp"] = _refused(lambda: distattn.register_ddp_gradient_hook(
        DDP(make_model(), process_group=dp_groups[rank % 2]), group))
    out["refused plain"] = _refused(lambda: distattn.reduce_gradients(make_model(), group,
                                                                      process_group=dp_groups[rank % 2]))
    return out


@pytest.fixture(scope="module")
def spawned():
    return {world: run_distributed(_cases_dp_sp if world == 4 else _cases_p, world, timeout=TIMEOUT_S)
            for world in (2, 3, 4)}


# -- one process ----------------------------------------------------------------------------------------------
def _one_process(batches, dtype):
    """Mean over ``batches`` of each one's full-sequence mean loss, backward; the parameter gradients."""
    model = make_model(dtype)
    attend = lambda q, k, v: naive_attention(q, k, v, causal=True, dtype=dtype)[0]  # noqa: E731
    losses = []
    for ids in batches:
        targets = F.pad(ids[:, 1:], (0, 1), value=IGNORE_INDEX)  # token i predicts token i + 1
        logits = model(ids, attend)
        losses.append(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX))
    (sum(losses) / len(losses)).backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def references():
    """(fp64 reference, fp32 baseline) gradients: one batch, and the mean over the DP replicas' batches."""
    dp = [make_ids(d) for d in range(DP_REPLICAS)]
    return {"one batch": tuple(_one_process([make_ids()], dt) for dt in (torch.float64, torch.float32)),
            "dp": tuple(_one_process(dp, dt) for dt in (torch.float64, torch.float32))}


def _assert_grads(label, ours, reference, scale=1.0):
    ref, base = reference
    assert ours.keys() == ref.keys(), label
    mag = magnitude_of(*ref.values())  # one floor for all gradients
    for name in ref:
        assert_close_by_rule(f"{label}: {name}", ours[name] * scale, base[name], ref[name], torch.float32,
                             magnitude=mag)


def _ratio(ours, ref) -> float:
    """Least-squares factor between two gradient sets: <ours, ref> / <ref, ref>."""
    num = sum(float((ours[n].double() * ref[n]).sum()) for n in ref)
    return num / sum(float((ref[n] * ref[n]).sum()) for n in ref)


# -- checks -----------------------------------------------------------------------------------------------------
CASES = [(2, "plain", "one batch"), (2, "ddp", "one batch"), (2, "fsdp2", "one batch"),
         (2, "ddp naive, loss x P", "one batch"), (2, "plain, 2 micro-batches", "dp"),
         (2, "ddp, 2 micro-batches, no_sync", "dp"), (2, "fsdp2, 2 micro-batches", "dp"), (3, "plain", "one batch"), (4, "plain", "dp"), (4, "ddp", "dp"),
         (4, "fsdp2", "dp"), (4, "2-D sp over the world", "one batch")]


@pytest.mark.parametrize("world, case, batches", CASES)
def test_every_rank_steps_on_the_full_sequence_gradient(spawned, references, world, case, batches):
    for rank, res in enumerate(spawned[world]):
        _assert_grads(f"world {world} rank {rank} {case}", res[case], references[batches])


@pytest.mark.parametrize("world, sp, batches", [(2, 2, "one batch"), (4, 2, "dp")])
def test_naive_ddp_gives_one_over_p_of_the_gradient(spawned, references, world, sp, batches):
    """The pitfall: DDP averages over its world, so without the hook each replica's sum is divided by P."""
    for rank, res in enumerate(spawned[world]):
        ratio = _ratio(res["ddp naive"], references[batches][0])
        assert abs(ratio - 1 / sp) < RATIO_TOL, f"rank {rank}: naive DDP gradient / true gradient = {ratio:.6f}"
        _assert_grads(f"world {world} rank {rank} ddp naive x P", res["ddp naive"], references[batches], scale=sp)


def test_a_reduction_that_cuts_the_sequence_parallel_group_is_refused_on_every_rank(spawned):
    for rank, res in enumerate(spawned[4]):  # each rank caught the ValueError and sent its message
        for what, name in (("refused ddp", "DDP's process group"), ("refused plain", "reduce_gradients(process_group")):
            assert res[what].startswith(name), f"rank {rank} {what}: {res[what]}"
            assert "must be whole sequence-parallel groups of 2 ranks" in res[what], f"rank {rank}: {res[what]}"


def test_wrappers_are_checked_before_any_communication():
    model = make_model()
    with pytest.raises(TypeError, match=r"needs a DistributedDataParallel model, got TinyLM: wrap it first"):
        distattn.register_ddp_gradient_hook(model)
    with pytest.raises(TypeError, match=r"no module of TinyLM is an FSDPModule: call fully_shard"):
        distattn.set_fsdp_gradient_divide_factor(model)


def _reduce_with_large_and_small(rank, world_size):
    """Parameters larger and smaller than ``BUCKET_BYTES``, each rank's gradient ``rank + 1`` times a base: after
    ``reduce_gradients`` every gradient is the sum; the reduction's own bytes, at most one small bucket."""
    from distattn.gradients import BUCKET_BYTES
    from distattn.memory.measure import live_bytes

    torch.manual_seed(0)
    shapes = [(7,), (640, 512), (33, 5), (300, 1000), (3,)]  # 1.25 MiB and 1.14 MiB matrices among small ones
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    base = [torch.randn(s) for s in shapes]
    for p, b in zip(params, base):
        p.grad = b * (rank + 1)
    with live_bytes() as live:
        distattn.reduce_gradients(params)
    total = sum(range(1, world_size + 1))
    exact = all(torch.equal(p.grad, b * total) for p, b in zip(params, base))
    small = sum(b.numel() * 4 for b in base if b.numel() * 4 < BUCKET_BYTES)
    return exact, live.peak, small, max(b.numel() * 4 for b in base)


def test_large_gradients_are_reduced_in_place_and_small_ones_in_one_bucket():
    for exact, peak, small, largest in run_distributed(_reduce_with_large_and_small, 2, timeout=TIMEOUT_S):
        assert exact
        assert peak <= small < largest  # no copy of a large gradient: the extra bytes are the small ones' bucket
