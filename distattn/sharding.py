"""Contiguous sequence sharding: rank ``r`` of ``P`` holds positions ``[r*n, (r+1)*n)`` of a length ``P*n`` axis."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["shard_sequence", "gather_sequence"]


def _world(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1  # no process group: one rank holds everything
    return dist.get_rank(group), dist.get_world_size(group)


def group_size(group=None) -> int:
    """Ranks in ``group`` (1 when no process group is initialized)."""
    return _world(group)[1]


def shard_sequence(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """This rank's contiguous slice of ``x`` along ``dim`` (no communication; differentiable).

    Raises:
        ValueError: ``x.size(dim)`` is not a multiple of the group size.
    """
    rank, world = _world(group)
    size = x.size(dim)
    if size % world:
        raise ValueError(f"sequence length {size} (dim {dim}) must be divisible by the group size {world}; pad "
                         f"the sequence to a multiple of {world}")
    n = size // world
    return x.narrow(dim, rank * n, n)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        # Every rank may use the whole gathered tensor, so the gradient of a shard is the sum over ranks
        # of their gradients for its slice (a reduce-scatter; all-reduce + slice also works on gloo).
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return shard_sequence(grad, ctx.dim, ctx.group), None, None


def gather_sequence(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """All ranks' shards concatenated along ``dim`` in rank order (differentiable).

    Args:
        x: this rank's shard, e.g. ``(b, n, h, d)`` with ``dim=1``; the same shape on every rank.
        dim: the sequence dimension.
        group: the sequence-parallel process group (``None``: the default group).

    Returns:
        The full tensor, ``(b, P*n, h, d)`` for ``dim=1``, on every rank.

    Gradients: every rank may use the whole gathered tensor, so the backward *sums* the gradients of all ranks
    for each shard (and every rank must run it). If every rank computes the same loss on the gathered tensor
    and calls ``backward()``, the shards get ``P`` times the gradient of that loss. Either compute the loss on
    this rank's shard (the sum over ranks is the full loss), or divide a loss computed on the gathered tensor
    by ``P``::

        loss = out.pow(2).sum()                                   # on the shard: right gradients
        loss = gather_sequence(out).pow(2).sum() / P              # on the whole tensor, every rank: / P
    """
    if _world(group)[1] == 1:
        return x
    return _GatherSequence.apply(x, dim, group)
