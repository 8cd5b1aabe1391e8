"""Sequence sharding: which tokens of a length ``P*n`` axis each rank holds, for the layout of a schedule.

Rank ``r`` of ``P`` holds positions ``[r*n, (r+1)*n)`` for every schedule but ``"zigzag"``, where it holds chunks
``r`` and ``2P-1-r`` of ``2P`` (``distattn.schedule.layouts``). A two-dimensional group (``(ulysses_group,
ring_group)`` or a 2-D mesh, ``distattn.topology``) lays out by the sequence index ``r * U + u``. Pass the same
``schedule`` (and ``group``) to ``shard_sequence``, the attention call and ``gather_sequence``.

``schedule="placed"`` (packed documents): the shards follow a placement solved from the documents and the window
(:func:`placement`, the same on every rank, no communication; on a 2-D group too); pass it as ``layout=`` to
``shard_sequence``, ``gather_sequence`` and ``positions``, and ``schedule="placed"`` with the same ``cu_seqlens`` to the
attention call. The call does not see the layout, so :func:`placement` records, per documents, tokens and group, the
windows it solved for, and the call's plan runs on the placement its shards follow (:func:`placed_window`): the
call's own window when its documents were placed for it, else the one window they were placed for (a model whose
layers differ in window shares one sharding), and a ``ValueError`` when that is ambiguous.
"""

from __future__ import annotations

import contextlib
import numpy as np
import torch
import torch.distributed as dist

from distattn.schedule import SCHEDULES, Layout, layout_of
from distattn.schedule.build import placed_window

__all__ = ["shard_sequence", "gather_sequence", "positions", "layout", "placement", "solve_ahead",
           "placed_window"]


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _world(group) -> tuple[int, int]:
    if not _initialized():
        return 0, 1  # no process group: one rank holds everything
    from distattn.topology import split

    ug, rg = split(group)
    if ug is None:
        return dist.get_rank(rg), dist.get_world_size(rg)
    from distattn.topology import topology

    topo = topology(group)
    return topo.index, topo.world_size


def group_size(group=None) -> int:
    """Ranks in ``group`` (1 when no process group is initialized)."""
    return _world(group)[1]


def placement(cu_seqlens, n: int, group=None, *, window=(-1, -1)) -> Layout:
    """The work-balanced placement of a packed stream over ``group`` (``distattn.schedule.placement``): every rank
    derives the same layout from the same ``cu_seqlens`` (global, ints or a tensor), ``n`` tokens per rank and
    ``window`` (flash-attn's ``(left, right)``; its left side weighs the placement, ``distattn.schedule.build.
    placement_mask``), the layout ``schedule="placed"`` runs on. Pass the attention call's ``window_size`` here: the
    placement then balances the windowed work (a placement solved for causal work is communication bound under a
    window, ``bench/results/placement-sim/DIAGNOSIS.md``). Any causal flag and window run exactly on any placement;
    the call follows the placement recorded here (:func:`placed_window`). On a two-dimensional group (``U`` x ``R``,
    ``distattn.topology``) the placement is solved over the ``R`` ring ranks of ``U * n`` tokens and rank ``(r, u)``
    holds the ``u``-th ``n`` of ring shard ``r``'s tokens (``distattn.schedule.layouts``). Falls back to contiguous
    shards (``layout.note`` says why) for a stream it cannot place."""
    from distattn._validate import check_window
    from distattn.schedule.build import placement_mask, record_placement

    if isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = cu_seqlens.tolist()
    spec = placement_mask(cu_seqlens, check_window(window))
    _, world = _world(group)
    if world == 1:
        return Layout("contiguous", 1)
    ring, ulysses = _grid(group)
    record_placement(spec.cu_seqlens, ring, ulysses * n, spec.window)
    return layout_of("placed", ring, ulysses, mask=spec, n=n)


def solve_ahead(cu_seqlens, n: int, group=None, *, window=(-1, -1), workers: int = 1) -> None:
    """Start solving :func:`placement`'s layout for these arguments (the next batch's) in a worker process, while the
    step before runs; the :func:`placement` call that asks for it then waits only for what is left of the solve
    (``distattn.schedule.ahead``). The same layout as solved inline, on every rank alike. ``workers``: solves at once
    (where one solve takes longer than a step, ask two or more batches ahead). Nothing to do on one rank::

        lay = distattn.sharding.placement(cu_now, n, group)      # this batch (solved ahead last step, or now)
        distattn.sharding.solve_ahead(cu_next, n, group)         # the next batch, in a worker, while this one runs
    """
    from distattn._validate import check_window
    from distattn.schedule.build import placement_mask
    from distattn.schedule.placement import solve_ahead as _solve_ahead

    if isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = cu_seqlens.tolist()
    spec = placement_mask(cu_seqlens, check_window(window))
    if _world(group)[1] == 1:
        return
    ring, ulysses = _grid(group)
    _solve_ahead(spec, ring, ulysses * n, stride=ulysses, workers=workers)


@contextlib.contextmanager
def placement_source():
    """Where the placements asked for inside the block came from, for a training loop's log: yields a dict whose
    ``"source"`` is set when the block ends: ``"ahead"`` (a worker's, :func:`solve_ahead`), ``"inline"`` (solved in
    the block) or ``"cached"`` (asked for before)::

        with distattn.sharding.placement_source() as where:
            lay = distattn.sharding.placement(cu, n, group)
        log(where["source"])
    """
    from distattn.schedule import ahead
    from distattn.schedule.placement import _place_cached

    where, served, solves = {}, ahead.served(), _place_cached.cache_info().misses
    yield where
    where["source"] = ("ahead" if ahead.served() > served else
                       "inline" if _place_cached.cache_info().misses > solves else "cached")


def _grid(group) -> tuple[int, int]:
    """``(R, U)``: ring ranks and Ulysses ranks per ring rank of ``group`` (a flat group: ``(P, 1)``)."""
    from distattn.topology import split, topology

    if split(group)[0] is None:
        return group_size(group), 1
    topo = topology(group)
    return topo.R, topo.U


def layout(group=None, schedule: str = "balanced", lay: Layout | None = None) -> Layout:
    """The :class:`~distattn.schedule.Layout` of ``schedule`` on ``group`` (ring ranks x Ulysses ranks); ``lay``:
    a layout given by the caller (a placement), checked against the group."""
    if lay is not None:
        if not isinstance(lay, Layout) or lay.ranks != group_size(group):
            raise ValueError(f"layout={lay!r} must be a Layout over the group's {group_size(group)} ranks, e.g. "
                             f"distattn.sharding.placement(cu_seqlens, n, group)")
        grid = _grid(group) if _initialized() else (1, 1)
        if not lay.contiguous and (lay.world_size, lay.ulysses) != grid:  # same ranks, another grid: other shards
            raise ValueError(f"layout= was made for {lay.world_size} ring ranks x {lay.ulysses} Ulysses ranks, but "
                             f"the group is {grid[0]} x {grid[1]}, and the attention call's plan follows the group: "
                             f"make the layout for it, distattn.sharding.placement(cu_seqlens, n, group)")
        return lay
    if schedule == "placed":
        raise ValueError("schedule='placed' shards by a placement solved from the documents: pass "
                         "layout=distattn.sharding.placement(cu_seqlens, n, group) (the same on every rank)")
    if schedule not in SCHEDULES + ("auto",):
        raise ValueError(f"schedule={schedule!r} is not one of {SCHEDULES + ('auto',)}")
    # "auto" at call time picks among the schedules of contiguous shards (ring, balanced): contiguous layout
    if not _initialized():
        return layout_of(schedule, 1)
    return layout_of(schedule, *_grid(group))


_layout = layout  # the module function, under a name the ``layout=`` keywords below do not shadow


def positions(n: int, group=None, schedule: str = "balanced", rank: int | None = None, *,
              layout: Layout | None = None) -> torch.Tensor:
    """Global positions (int64) of the ``n`` local tokens of this rank (or of sequence index ``rank``):
    what rotary position ids must be for the shard (``layout``: a placement, see :func:`placement`)."""
    lay = _layout(group, schedule, layout)
    index = _world(group)[0] if rank is None else rank
    return torch.from_numpy(lay.positions(index, n))


def _index(lay: Layout, rank: int, n: int, device) -> torch.Tensor | None:
    """Positions of ``rank``'s shard as an index tensor, or None when they are one contiguous range."""
    if lay.segments_per_rank == 1 and lay.kind != "placed":
        return None
    return torch.from_numpy(lay.positions(rank, n)).to(device)


def shard_sequence(x: torch.Tensor, dim: int = 1, group=None, *, schedule: str = "balanced",
                   layout: Layout | None = None) -> torch.Tensor:
    """This rank's tokens of ``x`` along ``dim`` for ``schedule``'s layout, or for ``layout`` (a placement,
    :func:`placement`) when given (no communication; differentiable).

    Raises:
        ValueError: ``x.size(dim)`` is not a multiple of the group size (zigzag: of twice the group size).
    """
    rank, world = _world(group)
    lay = _layout(group, schedule, layout)
    size = x.size(dim)
    unit = world * lay.divisor()
    if size % unit:
        what = "the group size" if lay.divisor() == 1 else "twice the group size (zigzag: two chunks per rank)"
        raise ValueError(f"sequence length {size} (dim {dim}) must be divisible by {what} {unit}; pad the "
                         f"sequence to a multiple of {unit}")
    n = size // world
    index = _index(lay, rank, n, x.device)
    if index is None:
        (a, _), = lay.segments(rank, n)
        return x.narrow(dim, a, n)
    return x.index_select(dim, index)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, schedule, lay):
        ctx.dim, ctx.group, ctx.schedule, ctx.lay = dim, group, schedule, lay
        from distattn.topology import split

        ug, rg = split(group)
        x = x.contiguous()
        if ug is None:
            parts = [torch.empty_like(x) for _ in range(dist.get_world_size(rg))]
            dist.all_gather(parts, x, group=rg)
        else:  # sequence index r * U + u: gather the Ulysses row, then the ring
            row = [torch.empty_like(x) for _ in range(dist.get_world_size(ug))]
            dist.all_gather(row, x, group=ug)
            row = torch.cat(row, dim=dim).contiguous()
            rows = [torch.empty_like(row) for _ in range(dist.get_world_size(rg))]
            dist.all_gather(rows, row, group=rg)
            parts = [p for r in rows for p in r.chunk(dist.get_world_size(ug), dim=dim)]
        full = torch.cat(parts, dim=dim)  # shards in sequence-index order
        lay = _layout(group, schedule, lay)
        if lay.contiguous:
            return full
        n = x.size(dim)
        where = np.concatenate([lay.positions(g, n) for g in range(len(parts))])  # position of each row of full
        return full.index_select(dim, torch.from_numpy(np.argsort(where)).to(x.device))

    @staticmethod
    def backward(ctx, grad):
        # Every rank may use the whole gathered tensor, so the gradient of a shard is the sum over ranks
        # of their gradients for its slice (a reduce-scatter; all-reduce + slice also works on gloo).
        from distattn.topology import all_reduce

        grad = grad.contiguous()
        all_reduce(grad, ctx.group)  # all U * R ranks of a two-dimensional group
        return shard_sequence(grad, ctx.dim, ctx.group, schedule=ctx.schedule, layout=ctx.lay), None, None, None, None


def gather_sequence(x: torch.Tensor, dim: int = 1, group=None, *, schedule: str = "balanced",
                    layout: Layout | None = None) -> torch.Tensor:
    """All ranks' shards put back in sequence order along ``dim`` (differentiable); ``schedule``: the layout
    the shards were made with (``shard_sequence``).

    Args:
        x: this rank's shard, e.g. ``(b, n, h, d)`` with ``dim=1``; the same shape on every rank.
        dim: the sequence dimension.
        group: the sequence-parallel process group (``None``: the default group; a pair or a 2-D mesh:
            ``distattn.topology``).
        schedule: the schedule whose layout the shards follow (``"zigzag"``: two chunks per rank).
        layout: the placement the shards follow (``schedule="placed"``; :func:`placement`), else None.

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
    _layout(group, schedule, layout)  # an unknown schedule raises here, on every rank
    if _world(group)[1] == 1:
        return x
    return _GatherSequence.apply(x, dim, group, schedule, layout)
