"""Full-sequence parameter gradients under sequence parallelism: one supported way per wrapper.

With a sequence split over the ``P`` ranks of a sequence-parallel group, each rank's backward gives every
parameter only its *share* of the gradient (the part that flows through this rank's tokens: its loss term, its
queries' attention); the full-sequence gradient is the **sum** over the group. DDP and FSDP **average** over
their process group, so wrapping the model in either, unchanged, gives ``1/P`` of the gradient, with no error.

With data parallelism as well, the world is ``D x P`` ranks: ``D`` replicas, each a sequence-parallel group of
``P`` ranks working on its own batch. The gradient to step on is the mean over the replicas of each replica's
full-sequence gradient: the sum over all ``D * P`` ranks, divided by ``D`` (not by ``D * P``). Every function
here does exactly that over the reduction's process group, which must therefore consist of whole
sequence-parallel groups (the world, DDP's group, FSDP2's mesh); ``D = 1`` when it is the sequence-parallel group::

    plain loop   loss.backward(); reduce_gradients(model, group); optimizer.step()
    DDP          model = DDP(model); register_ddp_gradient_hook(model, group)        # once, before training
    FSDP2        fully_shard(...) per block and the root; set_fsdp_gradient_divide_factor(model, group)  # once
    other        any wrapper that averages over all D * P ranks: (loss * P).backward()

``group`` is the sequence-parallel group as everywhere in distattn (``None``: the world, a ``ProcessGroup``, a
``(ulysses_group, ring_group)`` pair or a ``DeviceMesh``; ``P = U * R`` for a two-dimensional one). The loss must
be each rank's term of the replica's full-sequence loss, e.g. ``integrations.hf.causal_lm_loss`` (the global token
mean, whose backward gives each rank exactly its share).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from distattn.sharding import group_size
from distattn.topology import split

__all__ = ["reduce_gradients", "register_ddp_gradient_hook", "set_fsdp_gradient_divide_factor"]

BUCKET_BYTES = 2**20
"""Gradients smaller than this are all-reduced together in flat buckets of at most this size (few collectives for the
norms and biases); a gradient of this size or more is all-reduced in place, alone. So the reduction holds at most this
much beyond the gradients themselves (DDP's 25 MiB buckets were a model's largest extra item at the peak of a long
sequence's step on a small model: ``bench/results/peers-train-step``), for one collective per large parameter."""


def _ranks(process_group) -> list[int]:
    """Global ranks of ``process_group`` (``None``: the world)."""
    if process_group is None:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(process_group)


def _replicas(group, process_group_ranks: list[int], what: str) -> int:
    """``D``, the number of data-parallel replicas in a reduction over ``process_group_ranks`` (``what`` names it in
    errors): the process group must hold this rank's whole sequence-parallel group, and a multiple of its size.

    No communication: every rank checks its own sequence-parallel group (a two-dimensional one: its Ulysses row and
    its ring, which between all ranks covers every member), so each rank of a misfit group raises."""
    ulysses_group, ring_group = split(group)
    mine = set(_ranks(ring_group)) | (set(_ranks(ulysses_group)) if ulysses_group is not None else set())
    outside = sorted(mine - set(process_group_ranks))
    p, world = group_size(group), len(process_group_ranks)
    if outside or world % p:
        raise ValueError(f"{what} reduces over {world} ranks {_short(process_group_ranks)}, which must be whole "
                         f"sequence-parallel groups of {p} ranks (ranks {outside} of this rank's group are outside "
                         f"it): reduce over the world (the default), or over a group that holds the sequence-parallel "
                         f"groups of the data-parallel replicas it averages")
    return world // p


def _short(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 8 else f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}]"


# -- plain loop -------------------------------------------------------------------------------------------------
def reduce_gradients(parameters, group=None, *, process_group=None) -> None:
    """Turn each rank's share into the full-sequence gradient, in place: call after ``loss.backward()``, before
    the optimizer step (with gradient accumulation: once, after the last micro-batch).

    Sums ``.grad`` over ``process_group`` and divides by the number of data-parallel replicas in it
    (``size / P``): the sum over the sequence-parallel group, averaged over replicas. A parameter that
    requires grad but has none gets a zero gradient first, so every rank joins the same collectives (a
    parameter no token of this rank reached, e.g. an expert, is still summed).

    Args:
        parameters: a module (its parameters) or an iterable of parameters, the same on every rank.
        group: the sequence-parallel group (``None``: the default group; a two-dimensional group: all its
            ``U * R`` ranks), the one the model's attention and ``shard_batch`` use.
        process_group: the ranks to reduce over (``None``: the world): the sequence-parallel group, or all
            the replicas of a data-parallel x sequence-parallel world.

    Raises:
        ValueError: ``process_group`` does not consist of whole sequence-parallel groups.
    """
    if isinstance(parameters, torch.nn.Module):
        parameters = parameters.parameters()
    params = [p for p in parameters if p.requires_grad]
    d = _replicas(group, _ranks(process_group), "reduce_gradients(process_group=...)")
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        by_kind.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in by_kind.values():
        for bucket in _buckets(grads):
            if len(bucket) == 1 and bucket[0].is_contiguous():  # in place: no copy of a large gradient
                dist.all_reduce(bucket[0], group=process_group)
                if d > 1:
                    bucket[0].div_(d)
                continue
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=process_group)
            if d > 1:
                flat.div_(d)
            for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
                g.copy_(part.view_as(g))


def _buckets(grads: list[torch.Tensor]):
    """Consecutive runs of ``grads`` (one dtype and device) of at most ``BUCKET_BYTES`` each; a gradient of
    ``BUCKET_BYTES`` or more goes alone (reduced in place)."""
    bucket, size = [], 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if nbytes >= BUCKET_BYTES:
            yield [g]
            continue
        if bucket and size + nbytes > BUCKET_BYTES:
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += nbytes
    if bucket:
        yield bucket


# -- DDP --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _HookState:
    process_group: object  # DDP's own
    replicas: int


def _sum_sequence_mean_replicas(state: _HookState, bucket):
    """DDP communication hook: the bucket's sum over DDP's group, divided by the replicas (DDP's default divides
    by the group's size, which is ``P`` times too much). Divided before the sum, as DDP's own hook does, so
    half-precision gradients do not overflow in it."""
    buf = bucket.buffer()
    if state.replicas > 1:
        buf.div_(state.replicas)
    work = dist.all_reduce(buf, group=state.process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def register_ddp_gradient_hook(ddp_model, group=None):
    """Make DDP sum the gradients over the sequence-parallel group and average them over data-parallel replicas.

    Registers a communication hook (``DistributedDataParallel.register_comm_hook``) that replaces DDP's
    average over its process group with the sum over it divided by the number of replicas in it (its size
    divided by ``P``). Call once, after wrapping and before the first backward; gradient accumulation with
    ``no_sync()`` works as with plain DDP. DDP allows one hook per model.

    Args:
        ddp_model: a ``torch.nn.parallel.DistributedDataParallel`` whose process group (default: the world)
            consists of whole sequence-parallel groups.
        group: the sequence-parallel group, the one the model's attention and ``shard_batch`` use.

    Returns:
        ``ddp_model``.

    Raises:
        TypeError: ``ddp_model`` is not a ``DistributedDataParallel``.
        ValueError: DDP's process group does not consist of whole sequence-parallel groups.
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"register_ddp_gradient_hook needs a DistributedDataParallel model, got "
                        f"{type(ddp_model).__name__}: wrap it first (model = DistributedDataParallel(model)); "
                        f"without DDP call distattn.reduce_gradients(model, group) after each backward")
    process_group = ddp_model.process_group
    d = _replicas(group, _ranks(process_group), "DDP's process group")
    ddp_model.register_comm_hook(_HookState(process_group, d), _sum_sequence_mean_replicas)
    return ddp_model


# -- FSDP2 ------------------------------------------------------------------------------------------------------
def set_fsdp_gradient_divide_factor(model, group=None):
    """Make FSDP2 (``fully_shard``) sum the gradients over the sequence-parallel group and average them over
    data-parallel replicas: every FSDP module of ``model`` divides the reduced gradient by the number of
    replicas in its mesh (the mesh's size divided by ``P``) instead of by the mesh's size.

    Uses ``FSDPModule.set_gradient_divide_factor`` (in torch 2.11 and 2.13; the older name
    ``set_reduce_scatter_divide_factor`` where it is missing) and, where torch has it,
    ``set_force_sum_reduction_for_comms(True)``: plain SUM collectives
    with the division after them (gloo has no ``PREMUL_SUM``). Call once, after ``fully_shard`` has been
    applied to the blocks and the root. A hybrid (HSDP) mesh divides by its replicate x shard size as a whole.

    Args:
        model: the root module after ``fully_shard``.
        group: the sequence-parallel group, the one the model's attention and ``shard_batch`` use.

    Returns:
        ``model``.

    Raises:
        TypeError: no module of ``model`` is an ``FSDPModule`` (call ``fully_shard`` first).
        ValueError: the FSDP mesh does not consist of whole sequence-parallel groups.
    """
    fsdp_module = _fsdp_module_class()
    modules = [m for m in model.modules() if isinstance(m, fsdp_module)]
    if not modules:
        raise TypeError(f"set_fsdp_gradient_divide_factor needs a model sharded with fully_shard (FSDP2), but no "
                        f"module of {type(model).__name__} is an FSDPModule: call fully_shard on its blocks and "
                        f"on the root first")
    mesh = next((p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")), None)
    ranks = mesh.mesh.flatten().tolist() if mesh is not None else _ranks(None)
    d = _replicas(group, ranks, "the FSDP mesh")
    for module in modules:
        setter = getattr(module, "set_gradient_divide_factor", None) or module.set_reduce_scatter_divide_factor
        setter(float(d))
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)
    return model


def _fsdp_module_class() -> type:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6: FSDP2 lived under _composable
        from torch.distributed._composable.fsdp import FSDPModule
    return FSDPModule
