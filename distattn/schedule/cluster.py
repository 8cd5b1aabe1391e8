"""The cluster a plan is timed on: links (NVLink inside a node, InfiniBand across) and attention FLOP/s.

What the per-pair timeline (``distattn.schedule.timeline``), the placement solver and the cost model
(``distattn.schedule.cost``, whose docstring states where the default rates come from) all read; kept apart so that
each of them imports it from below. :func:`cluster_from_env` is the one reading of ``DISTATTN_LINK`` /
``DISTATTN_GPUS_PER_NODE`` (``ib`` and 8 by default). Imports nothing of distattn. Pure Python.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["Link", "LINKS", "Cluster", "BWD_FLOP_FACTOR", "H100_FA2_FLOPS", "cluster_from_env"]

BWD_FLOP_FACTOR = 2.5  # FlashAttention backward: 5 matmuls of the forward's size vs 2 (dq, dk, dv, dp, recompute s)
H100_FA2_FLOPS = 350e12  # assumed: FA2 forward on H100 SXM, bf16, head dim 128 (cost.py's docstring)


@dataclass(frozen=True, kw_only=True)
class Link:
    """One GPU's link of a kind."""

    name: str
    bandwidth: float
    """bytes/s per direction per rank"""
    latency: float
    """seconds per message posted"""

    def __post_init__(self):
        for key in ("bandwidth", "latency"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (
                    key == "bandwidth" and value == 0):
                raise ValueError(f"Link.{key}={value!r} must be a positive number ({key} in "
                                 f"{'bytes/s per direction' if key == 'bandwidth' else 'seconds per message'})")


LINKS = {
    "nvlink": Link(name="NVLink 4 (H100), 300 GB/s effective", bandwidth=300e9, latency=3e-6),
    "ib": Link(name="InfiniBand 100 Gb/s", bandwidth=12.5e9, latency=5e-6),
}
"""Presets (assumptions, see ``distattn.schedule.cost``'s docstring)."""


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Nodes of ``gpus_per_node`` GPUs joined by ``intra``; nodes joined by ``inter``; ``flops`` per GPU."""

    gpus_per_node: int = 8
    intra: Link = LINKS["nvlink"]
    inter: Link = LINKS["ib"]
    flops: float = H100_FA2_FLOPS
    """effective attention FLOP/s of one GPU (forward rate; backward is charged 2.5x the FLOPs at this rate)"""

    def __post_init__(self):
        g = self.gpus_per_node
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ValueError(f"Cluster.gpus_per_node={g!r} must be a positive int (e.g. 8)")
        if isinstance(self.flops, bool) or not isinstance(self.flops, (int, float)) or self.flops <= 0:
            raise ValueError(f"Cluster.flops={self.flops!r} must be a positive FLOP/s rate (e.g. 350e12)")

    @classmethod
    def preset(cls, link: str, gpus_per_node: int = 8, **kw) -> "Cluster":
        """``"nvlink"``: every link NVLink (one NVLink domain); ``"ib"``: NVLink in a node, 100 Gb/s IB across."""
        if link not in LINKS:
            raise ValueError(f"link={link!r} is not one of {tuple(LINKS)}; pass 'nvlink' or 'ib'")
        inter = LINKS["nvlink"] if link == "nvlink" else LINKS["ib"]
        return cls(gpus_per_node=gpus_per_node, intra=LINKS["nvlink"], inter=inter, **kw)

    def ring_link(self, world_size: int) -> Link:
        """The link a ring over all ``world_size = R * U`` ranks (``U`` apart) is charged to."""
        return self.intra if world_size <= self.gpus_per_node else self.inter

    def a2a_link(self, ulysses: int) -> Link:
        """The link of the all-to-all over ``ulysses`` adjacent ranks."""
        return self.intra if ulysses <= self.gpus_per_node else self.inter


def cluster_from_env(link: str | None = None, gpus_per_node: int | None = None) -> Cluster:
    """The cluster the cost model and the placement assume; unset parts from ``DISTATTN_LINK`` (``ib`` default:
    NVLink inside a node of ``DISTATTN_GPUS_PER_NODE`` = 8 GPUs, 100 Gb/s InfiniBand across; ``nvlink``: one NVLink
    domain)."""
    if gpus_per_node is None:
        gpus = os.environ.get("DISTATTN_GPUS_PER_NODE", "8")
        if not gpus.isdigit() or int(gpus) < 1:
            raise ValueError(f"DISTATTN_GPUS_PER_NODE={gpus!r} must be a positive integer")
        gpus_per_node = int(gpus)
    return Cluster.preset(link or os.environ.get("DISTATTN_LINK", "ib"), gpus_per_node=gpus_per_node)
