"""Differentiable, byte-counted collectives for the baselines (Megatron TP+SP, Ulysses).

Legend: ``b`` batch, ``n`` tokens per rank, ``N = P*n`` tokens, ``H`` hidden size, ``P`` group size.

Every collective here is the one the real system runs, called through ``torch.distributed`` (NCCL on GPU,
gloo on CPU: in torch >= 2.4 gloo runs ``all_gather``, ``reduce_scatter`` and ``all_to_all`` on CPU tensors,
checked by ``tests/test_baselines.py``). Each call adds to :data:`COUNTERS` the bytes *this rank sends*
under the bandwidth-optimal algorithm NCCL uses for it, which is also what the cost model charges
(``bench/model.py``):

* all-gather of a per-rank tensor of ``B`` bytes (ring): ``(P - 1) * B``;
* reduce-scatter to a per-rank output of ``B`` bytes (ring): ``(P - 1) * B``;
* all-to-all of a per-rank tensor of ``B`` bytes (pairwise): ``(P - 1) / P * B``.

The counters are filled from the tensors actually passed to the collectives, so they check the *number and
sizes* of the collectives a baseline runs (e.g. Megatron's second all-gather of the input in backward)
against the model's closed forms. They do not see gloo's internal algorithm, which may move more.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["COUNTERS", "CollectiveCounters", "reset_counters", "all_gather_seq", "reduce_scatter_seq",
           "all_to_all", "all_gather_linear"]


@dataclass
class CollectiveCounters:
    """Bytes this process sent through the baselines' collectives (cumulative), and calls per kind."""

    bytes_sent: int = 0
    calls: dict = field(default_factory=dict)

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes_sent += int(nbytes)
        self.calls[kind] = self.calls.get(kind, 0) + 1


COUNTERS = CollectiveCounters()


def reset_counters() -> None:
    COUNTERS.bytes_sent = 0
    COUNTERS.calls = {}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# -- raw collectives (no autograd) ---------------------------------------------------------------------------
def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order."""
    world = dist.get_world_size(group)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    COUNTERS.add("all_gather", (world - 1) * _nbytes(x))
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's slice ``r`` of ``P`` equal slices along ``dim``."""
    world = dist.get_world_size(group)
    if x.size(dim) % world:
        raise ValueError(f"reduce-scatter: size {x.size(dim)} of dim {dim} must divide by the group size {world}")
    parts = [p.contiguous() for p in x.chunk(world, dim=dim)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    COUNTERS.add("reduce_scatter", (world - 1) * _nbytes(out))
    return out


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """Split ``x`` into ``P`` slices along ``scatter_dim``; slice ``j`` goes to rank ``j``; the received slices
    are concatenated along ``gather_dim`` in source-rank order."""
    world = dist.get_world_size(group)
    if x.size(scatter_dim) % world:
        raise ValueError(f"all-to-all: size {x.size(scatter_dim)} of dim {scatter_dim} must divide by the group "
                         f"size {world}")
    sends = [p.contiguous() for p in x.chunk(world, dim=scatter_dim)]
    recvs = [torch.empty_like(p) for p in sends]
    dist.all_to_all(recvs, sends, group=group)
    COUNTERS.add("all_to_all", (world - 1) * _nbytes(sends[0]))
    return torch.cat(recvs, dim=gather_dim)


# -- autograd wrappers ---------------------------------------------------------------------------------------
class _AllGatherSeq(torch.autograd.Function):
    """Forward all-gather along the sequence; backward reduce-scatter (every rank used every shard)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    """Forward reduce-scatter along the sequence; backward all-gather."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


class _AllToAll(torch.autograd.Function):
    """All-to-all; its gradient is the all-to-all with scatter and gather dims swapped."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


class _AllGatherLinear(torch.autograd.Function):
    """``all_gather(x) @ w.T`` without keeping the gathered input: Megatron-LM's column-parallel linear with
    sequence parallelism (``LinearWithGradAccumulationAndAsyncCommunication``) saves only the local shard and
    all-gathers it *again* in backward for the weight gradient, trading one collective for ``P``x less
    activation memory. Backward: all-gather ``x`` (weight grad), reduce-scatter ``grad_x``.
    """

    @staticmethod
    def forward(ctx, x_bnh, w, dim, group):
        ctx.dim, ctx.group = dim, group
        ctx.save_for_backward(x_bnh, w)
        return _gather(x_bnh, dim, group) @ w.t()

    @staticmethod
    def backward(ctx, grad_bNo):
        x_bnh, w = ctx.saved_tensors
        total_bNh = _gather(x_bnh, ctx.dim, ctx.group)  # the re-gather Megatron does instead of storing it
        grad_w = grad_bNo.flatten(0, -2).t() @ total_bNh.flatten(0, -2)
        grad_x = _reduce_scatter(grad_bNo @ w, ctx.dim, ctx.group)
        return grad_x, grad_w, None, None


def all_gather_seq(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    return _AllGatherSeq.apply(x, dim, group)


def reduce_scatter_seq(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    return _ReduceScatterSeq.apply(x, dim, group)


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group=None) -> torch.Tensor:
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


def all_gather_linear(x_bnh: torch.Tensor, w: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """``all_gather(x, dim) @ w.T`` with Megatron's memory-saving backward (see :class:`_AllGatherLinear`)."""
    return _AllGatherLinear.apply(x_bnh, w, dim, group)
