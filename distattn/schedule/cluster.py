"""The cluster a plan is timed on: links (NVLink inside a node, InfiniBand across) and attention FLOP/s.

What the per-pair timeline (``distattn.schedule.timeline``), the placement solver and the cost model
(``distattn.schedule.cost``, whose docstring states where the default rates come from) all read; kept apart so that
each of them imports it from below. :func:`cluster_from_env` is the one reading of ``DISTATTN_LINK`` /
``DISTATTN_GPUS_PER_NODE`` (``ib`` and 8 by default).

The presets' bandwidths and per-message latencies (:data:`LINKS`) are assumptions. ``bench/link_measure.py`` measures
them on a cluster with the executor's own rounds (``distattn.comm.PeerExchange``: one batch of sends and receives to
``m`` peers) and fits each kind of link (:func:`fit_link`) with the very formula the per-pair timeline charges a round,
``max(bytes sent, bytes received) / bandwidth + latency * messages``; ``DISTATTN_LINK=<that file>`` then times every
plan, the placement solver's candidates and ``schedule="auto"`` on the measured links (:func:`cluster_from_file`).
Imports nothing of distattn. Pure Python.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass

__all__ = ["Link", "LINKS", "Cluster", "BWD_FLOP_FACTOR", "H100_FA2_FLOPS", "cluster_from_env", "cluster_from_file",
           "fit_link", "LINKS_FORMAT"]

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
    domain; or the path of a links file ``bench/link_measure.py`` wrote: the links measured, :func:`cluster_from_file`,
    its node size unless ``DISTATTN_GPUS_PER_NODE`` or ``gpus_per_node`` names one)."""
    if gpus_per_node is None and "DISTATTN_GPUS_PER_NODE" in os.environ:
        gpus = os.environ["DISTATTN_GPUS_PER_NODE"]
        if not gpus.isdigit() or int(gpus) < 1:
            raise ValueError(f"DISTATTN_GPUS_PER_NODE={gpus!r} must be a positive integer")
        gpus_per_node = int(gpus)
    link = link or os.environ.get("DISTATTN_LINK", "ib")
    if link not in LINKS and (link.endswith(".json") or os.path.isfile(link)):
        try:  # read once per version of the file (every placed call asks twice: the agreement and the solve)
            stat = os.stat(link)
            version = (os.path.realpath(link), stat.st_mtime_ns, stat.st_size)
        except OSError:
            version = (link, None, None)  # cluster_from_file says what is wrong
        return _cluster_of_file(version, gpus_per_node)
    return Cluster.preset(link, gpus_per_node=8 if gpus_per_node is None else gpus_per_node)


LINKS_FORMAT = "distattn-links/1"
"""The ``format`` field of a links file (``bench/link_measure.py``)."""
_MAX_BANDWIDTH, _MAX_LATENCY = 1e13, 0.1
"""Bounds of a plausible measured link: 10 TB/s per direction (several times any GPU's), 100 ms per message."""


def fit_link(name: str, messages, nbytes, seconds) -> Link:
    """The link that charges rounds as the per-pair timeline does, fitted to measured rounds: least squares of
    ``seconds[i] = latency * messages[i] + nbytes[i] / bandwidth`` (``messages``: sends plus receives of the rank in
    the round, ``nbytes``: the larger of its bytes sent and received), with ``latency >= 0`` (a negative fit is
    refitted through the origin). ``ValueError`` when the rounds do not separate the two (bytes in proportion to the
    messages: one message size, or one size per peer count), do not resolve a positive bandwidth (times that fall with
    the bytes: measure sizes further apart) or give figures that are not plausible."""
    rows = [(float(m), float(b), float(t)) for m, b, t in zip(messages, nbytes, seconds, strict=True)]
    if len(rows) < 2 or any(not all(map(math.isfinite, r)) or min(r) < 0 for r in rows):
        raise ValueError(f"fit_link({name!r}): need at least 2 rounds of finite, non-negative figures, got {rows}")
    smm = sum(m * m for m, _, _ in rows)
    sbb = sum(b * b for _, b, _ in rows)
    smb = sum(m * b for m, b, _ in rows)
    smt = sum(m * t for m, _, t in rows)
    sbt = sum(b * t for _, b, t in rows)
    det = smm * sbb - smb * smb
    if not det > 1e-9 * smm * sbb:
        raise ValueError(f"fit_link({name!r}): the rounds' bytes are in proportion to their messages ({rows}): "
                         f"latency and bandwidth cannot be told apart; measure several message sizes")
    latency, inverse = (sbb * smt - smb * sbt) / det, (smm * sbt - smb * smt) / det
    if latency < 0:  # the bytes alone explain the times better: no latency
        latency, inverse = 0.0, (sbt / sbb if sbb else 0.0)
    if not inverse > 0:
        raise ValueError(f"fit_link({name!r}): the rounds do not resolve a bandwidth (the time does not grow with the "
                         f"bytes: {rows}); measure message sizes further apart")
    bandwidth = 1.0 / inverse
    if bandwidth > _MAX_BANDWIDTH or latency > _MAX_LATENCY:
        raise ValueError(f"fit_link({name!r}): {bandwidth:.3g} B/s and {latency:.3g} s per message is not a plausible "
                         f"link (at most {_MAX_BANDWIDTH:.0e} B/s, {_MAX_LATENCY} s): a timing error")
    return Link(name=f"{name}: {bandwidth / 1e9:.3g} GB/s, {latency * 1e6:.3g} us per message", bandwidth=bandwidth,
                latency=latency)


@functools.lru_cache(maxsize=8)
def _cluster_of_file(version: tuple, gpus_per_node: int | None) -> Cluster:
    """:func:`cluster_from_file` of ``version = (path, mtime, size)``: a file rewritten is read again."""
    return cluster_from_file(version[0], gpus_per_node)


def cluster_from_file(path: str, gpus_per_node: int | None = None) -> Cluster:
    """The cluster of a links file (``bench/link_measure.py``): its measured ``intra`` link inside a node and
    ``inter`` across (a preset where the file measured none, said in the link's name: ``ib`` across when it measured
    one node, ``nvlink`` inside when one GPU per node), its node size unless ``gpus_per_node`` names another.
    ``ValueError`` naming the file and what is wrong with it."""
    fix = f"measure again with `torchrun --nproc-per-node G bench/link_measure.py --out {path}`"
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"DISTATTN_LINK={path!r}: not a readable links file ({exc}); {fix}") from None
    if not isinstance(data, dict) or data.get("format") != LINKS_FORMAT:
        raise ValueError(f"DISTATTN_LINK={path!r}: not a links file of format {LINKS_FORMAT!r}; {fix}")

    def link(key: str) -> Link | None:
        entry = data.get(key)
        if entry is None:  # not measured: one node (inter), or one GPU per node (intra)
            return None
        ok = isinstance(entry, dict) and isinstance(entry.get("name"), str) and all(
            isinstance(entry.get(f), (int, float)) and not isinstance(entry.get(f), bool)
            and math.isfinite(entry[f]) for f in ("bandwidth", "latency"))
        if not ok or not (0 < entry["bandwidth"] <= _MAX_BANDWIDTH and 0 <= entry["latency"] <= _MAX_LATENCY):
            raise ValueError(f"DISTATTN_LINK={path!r}: {key!r} must hold a name, a bandwidth in (0, "
                             f"{_MAX_BANDWIDTH:.0e}] B/s and a latency in [0, {_MAX_LATENCY}] s, got {entry!r}; {fix}")
        return Link(name=entry["name"], bandwidth=float(entry["bandwidth"]), latency=float(entry["latency"]))

    intra, inter = link("intra"), link("inter")
    if intra is None and inter is None:
        raise ValueError(f"DISTATTN_LINK={path!r}: measures no link; {fix}")
    assumed = {"intra": (intra, "nvlink", "one GPU per node"), "inter": (inter, "ib", "one node")}
    intra, inter = (measured if measured is not None else  # the path stays out of the name: ranks compare names
                    Link(name=f"{LINKS[preset].name} (assumed: the links file measured {what})",
                         bandwidth=LINKS[preset].bandwidth, latency=LINKS[preset].latency)
                    for measured, preset, what in assumed.values())
    g = data.get("gpus_per_node") if gpus_per_node is None else gpus_per_node
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
        raise ValueError(f"DISTATTN_LINK={path!r}: gpus_per_node={g!r} must be a positive int; {fix}")
    return Cluster(gpus_per_node=g, intra=intra, inter=inter)
