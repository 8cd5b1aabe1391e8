"""The cost model's schedule choice for a call: ``schedule="auto"`` at call time (``resolve_auto``) and before
sharding (``choose_schedule``, public as ``distattn.choose_schedule``), from the call's shapes and mask and the cluster
``DISTATTN_LINK`` / ``DISTATTN_GPUS_PER_NODE`` describe (``distattn.schedule.cost``)."""

from __future__ import annotations

import torch

from distattn._validate import check_window

__all__ = ["choose_schedule", "resolve_auto"]


def _cluster(link: str | None = None, gpus_per_node: int | None = None):
    """The cluster the cost model assumes (``distattn.schedule.cluster.cluster_from_env``: ``DISTATTN_LINK``,
    ``DISTATTN_GPUS_PER_NODE``), the same the placement of packed documents is timed on."""
    from distattn.schedule.cluster import cluster_from_env

    return cluster_from_env(link, gpus_per_node)


def _mask(causal: bool, window: tuple[int, int], cu_seqlens):
    """The call's ``MaskSpec`` for the cost model (``None``: dense)."""
    from distattn.schedule import MaskSpec

    cu = tuple(int(x) for x in cu_seqlens) if cu_seqlens is not None else None
    return MaskSpec(causal=causal, window=window, cu_seqlens=cu) if (cu or window != (-1, -1)) else None


def _shapes(q, k):
    from distattn.schedule import Shapes

    b, n, h_q, d = q.shape
    return Shapes(batch=b, seq_per_rank=n, heads_q=h_q, heads_kv=k.shape[2], head_dim=d,
                  dtype_bytes=q.element_size())


def resolve_auto(q, k, topo, *, causal, window, documents, partials) -> str:
    """``schedule="auto"`` at call time: the cost model's best schedule among those that run on the inputs'
    layout (contiguous shards: ring or balanced; the zigzag layout is chosen before sharding), for this group's
    Ulysses degree. Deterministic from the call's shapes, mask, options and ``DISTATTN_LINK``, so every rank
    resolves the same (and the agreement check compares the resolved name)."""
    from distattn.schedule.cost import choose

    mask = _mask(causal, window, documents)
    choice = choose(topo.world_size, _shapes(q, k), causal=causal, mask=mask, cluster=_cluster(),
                    partials=partials, allow={"ring", "balanced"}, ulysses=topo.U)
    return choice.best.schedule


def choose_schedule(world_size: int, heads_q: int, heads_kv: int, head_dim: int, seq_per_rank: int, *,
                    batch: int = 1, dtype: torch.dtype = torch.bfloat16, causal: bool = True, cu_seqlens=None,
                    window_size=(-1, -1), link: str | None = None, gpus_per_node: int | None = None,
                    partials: str = "fp32",
                    allow=None, ulysses: int | None = None):
    """The cost model's choice for a layer, made before sharding (so it may pick the zigzag layout or a
    two-dimensional group): ``choice.best.schedule`` and ``choice.best.ulysses`` (``U``; > 1: build the groups
    with ``make_2d_groups(U)``); ``print(choice.explain())`` shows every candidate's predicted time.

    ``link``: ``"ib"`` (NVLink in a node of ``gpus_per_node`` GPUs, 100 Gb/s InfiniBand across) or ``"nvlink"``
    (one NVLink domain); ``None``: ``DISTATTN_LINK`` / ``DISTATTN_GPUS_PER_NODE`` (defaults ``ib``, 8), as
    ``schedule="auto"`` at call time. ``allow``: restrict the candidates (``distattn.schedule.cost.choose``); ``ulysses``: the
    Ulysses degree the group already has (``None``: let the model pick it too).
    """
    from distattn.schedule import Shapes
    from distattn.schedule.cost import choose

    shapes = Shapes(batch=batch, seq_per_rank=seq_per_rank, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim,
                    dtype_bytes=torch.empty(0, dtype=dtype).element_size())
    mask = _mask(causal, check_window(window_size), cu_seqlens)
    return choose(world_size, shapes, causal=causal, mask=mask, cluster=_cluster(link, gpus_per_node),
                  partials=partials, allow=allow, ulysses=ulysses)
