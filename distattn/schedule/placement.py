"""The work-balanced placement of a packed stream: which blocks of which documents each rank holds.

Contiguous and zigzag shards balance dense causal work, but a packed stream of documents of varied length is
another mask: the ranks holding long documents' late tokens do most of the work. :func:`place` solves, from the
mask alone (``cu_seqlens``, causal, window; no tensors, no communication, so every rank derives the same answer),
a layout of kind ``"placed"`` (``distattn.schedule.layouts``) in which

* every rank holds exactly ``n`` tokens (token-wise layers stay balanced),
* the ranks form ``P / k`` *groups* of ``k`` neighbouring ranks; every document goes whole to one group when it
  fits (documents longer than a group's stream are cut across groups), the documents' work balanced over the
  groups by longest-processing-time first with a token capacity of ``k * n`` per group,
* inside a group the group's tokens (its documents in position order) are cut into blocks of ``B`` tokens and
  dealt to the group's ``k`` ranks (``distattn.schedule.deal``): every document's whole blocks in a snake
  (0, 1, .., k-1, k-1, .., 0), symmetric, so every (query rank, kv rank) pair of the group gets the same share of
  its work and the plan's steps stay equal across ranks, or in *mirrored chunks* (zigzag sharding of each document,
  every other one mirrored: the same balance, per document a quarter fewer keys borrowed); the remaining blocks
  (document ends, short documents) heaviest first to the least loaded rank of the group with room.

How the group size ``k`` and the deals are chosen (every candidate timed on the per-pair timeline), the block size,
and what a solve costs: the solver, ``distattn.schedule.solver``; :func:`place` is its cached entry, and
:func:`solve_ahead` runs it in a worker process for a later batch.

Ulysses x ring (``U`` ranks per ring rank, ``distattn.ulysses``): the placement is solved for the ring level,
``place(mask, R, U * n, stride=U)`` over the ``R`` ring ranks (``U`` global ranks apart), and rank ``(r, u)`` holds
the ``u``-th ``n`` of ring shard ``r``'s tokens in position order (``distattn.schedule.layouts.layout_of("placed", R,
U, mask=, n=)``), so the all-to-all gathers each ring shard whole and the ring's plan runs on the placement unchanged.
"""

from __future__ import annotations

from distattn.schedule.ahead import submit as _submit_ahead, take as _take_ahead
from distattn.schedule.cluster import Cluster, cluster_from_env
from distattn.schedule.layouts import Layout
from distattn.schedule.masks import MaskSpec
from distattn.schedule.settings import (ASSUMED_SHAPES, BALANCED, BLOCK, CUTS, DEEPER, EVEN, EVEN_LOOSE,
                                        EVEN_LOOSE_MAX_GROUP, EVEN_LOOSE_MAX_RANKS, EVEN_MAX_RANKS, EVEN_WIDE_MAX_RANKS,
                                        EVENED, FALLBACK_MAX_RANKS, MAX_BLOCKS_PER_RANK, NEAR, PIECES, WIDER_MAX_RANKS,
                                        WINDOW_CHUNKS, block_size)
from distattn.schedule.solver import _divisors, _place_cached  # noqa: F401  (tests, benches, the ahead worker)

__all__ = ["BLOCK", "MAX_BLOCKS_PER_RANK", "ASSUMED_SHAPES", "BALANCED", "CUTS", "PIECES", "EVEN", "EVENED",
           "EVEN_MAX_RANKS", "EVEN_LOOSE", "EVEN_LOOSE_MAX_RANKS", "EVEN_WIDE_MAX_RANKS", "EVEN_LOOSE_MAX_GROUP",
           "NEAR", "WIDER_MAX_RANKS", "WINDOW_CHUNKS", "DEEPER", "FALLBACK_MAX_RANKS", "place", "solve_ahead",
           "block_size"]


def place(spec: MaskSpec, world_size: int, n: int, cluster: Cluster | None = None, stride: int = 1) -> Layout:
    """The placement of the stream of ``world_size * n`` tokens under ``spec`` (cached; deterministic), timed on
    ``cluster`` (``None``: :func:`~distattn.schedule.cluster.cluster_from_env`, the cluster ``schedule="auto"``
    assumes). ``stride``: global ranks between neighbouring ring ranks (the Ulysses degree)."""
    key = _key(spec, world_size, n, cluster, stride)
    solved = _take_ahead(key)  # solved ahead in a worker (solve_ahead)
    return solved if solved is not None else _place_cached(*key[:3], None, *key[3:])


def solve_ahead(spec: MaskSpec, world_size: int, n: int, cluster: Cluster | None = None, stride: int = 1,
                workers: int = 1) -> None:
    """Start solving :func:`place`'s placement of these arguments in a worker process (one of ``workers``;
    ``distattn.schedule.ahead``), so that the call to :func:`place` that asks for it later (the next batch's) waits
    only for what is left of the solve. The same layout as an inline solve."""
    _submit_ahead(_key(spec, world_size, n, cluster, stride), workers)


def _key(spec: MaskSpec, world_size: int, n: int, cluster: Cluster | None, stride: int) -> tuple:
    """A solve's arguments, checked, the cluster resolved: what the cache and a worker solve by."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} must be the positive number of tokens per rank")
    return spec, world_size, n, cluster_from_env() if cluster is None else cluster, stride
