"""The static options of one sequence-parallel attention call: ``DistAttnConfig``.

It owns the frozen config every layer of the way down reads (``distattn.api`` builds and validates it, the registered
op carries it, the executors, ``distattn.agreement`` and ``distattn.memory`` read it), what of it every rank must agree
on (``fingerprint_fields``) and the plan it implies (``plan``). It may import ``distattn.comm`` (the default timeout)
and ``distattn.schedule`` (the plan and mask objects), nothing above them: the executors
(``distattn.attention``, ``distattn.executor``, ``distattn.ulysses``) import it, not the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from distattn.comm import DEFAULT_TIMEOUT_S
from distattn.schedule import PARTIALS, SCHEDULES, MaskSpec, Plan, make_plan

__all__ = ["DistAttnConfig"]


@dataclass(frozen=True, kw_only=True)
class DistAttnConfig:
    """Static options of one sequence-parallel attention call (validated by ``distattn.api``)."""

    causal: bool
    """Causal mask on global positions (``k_pos <= q_pos``)."""
    scale: float
    """Softmax scale."""
    window: tuple[int, int] = (-1, -1)
    """flash-attn's ``(left, right)`` sliding window on global positions; -1: unlimited."""
    softcap: float = 0.0
    """Logit soft-capping (0: off)."""
    schedule: str = "balanced"
    """``"ring"``, ``"balanced"`` or ``"zigzag"`` (see ``distattn.schedule``; zigzag needs zigzag-sharded inputs)."""
    backend: str | None = None
    """Kernel backend name (``None``: best available on the tensors' device)."""
    group: object = None
    """Process group (``None``: the default group)."""
    overlap: bool = True
    """Post step ``t + 1``'s fetches (``t + Plan.prefetch``'s) before computing step ``t``; ``False`` waits first
    (ablation)."""
    cu_seqlens: tuple[int, ...] | None = None
    """Packed documents: cumulative lengths over the whole stream (identical on every rank), or None."""
    timeout: float = DEFAULT_TIMEOUT_S
    """Seconds any one wait inside a call may take before the call fails with ``DistAttnError``."""
    partials: str = "fp32"
    """dtype of the partial results sent back (helper outputs, dq/dk/dv partials): ``"fp32"`` or ``"input"``
    (q's dtype: half the bytes). Accumulation is fp32 either way; lse and delta always travel in fp32."""
    placement_window: tuple[int, int] | None = None
    """``"placed"``: the window the shards' placement was solved for (``distattn.sharding.placed_window``), which the
    plan's placement follows; ``None``: the call's ``window``."""
    ring_stride: int = 1
    """Global ranks between neighbouring ranks of ``group`` (a 2-D group's ring: the Ulysses degree ``U``): the links
    ``"placed"``'s placement is timed on, as ``distattn.sharding.placement`` solved the shards'."""

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not one of {SCHEDULES}; use schedule='balanced'")
        if self.partials not in PARTIALS:
            raise ValueError(f"partials={self.partials!r} is not one of {PARTIALS}; use partials='fp32'")

    def fingerprint_fields(self) -> dict:
        """Everything in the config that shapes the communication, as readable JSON-friendly values: all
        ranks must agree on these (``distattn.agreement``). A new option or mask metadata is checked on every
        call by adding it here; packed documents are checked by a hash of ``cu_seqlens`` and its length."""
        fields = {"causal": self.causal, "window": list(self.window), "softcap": self.softcap,
                  "schedule": self.schedule, "overlap": self.overlap, "scale": self.scale, "backend": self.backend,
                  "cu_seqlens": _documents_fingerprint(self.cu_seqlens), "partials": self.partials,
                  "placement_window": None if self.placement_window is None else list(self.placement_window),
                  "ring_stride": self.ring_stride}
        if self.schedule == "placed":  # the placement is timed on the cluster DISTATTN_LINK names: all ranks alike
            from distattn.schedule.cluster import cluster_from_env

            cluster = cluster_from_env()
            fields["placement_cluster"] = (f"{cluster.gpus_per_node} per node, {_link(cluster.intra)} inside, "
                                           f"{_link(cluster.inter)} across")  # a links file's figures in full
        return fields

    def mask_spec(self) -> MaskSpec:
        """The call's mask as data: what the plan (pairs, work) and the kernels (per-row bounds) both read."""
        return MaskSpec(causal=self.causal, window=self.window, cu_seqlens=self.cu_seqlens)

    def plan(self, n: int) -> Plan:
        """The plan for ``n`` tokens per rank (masked plans drop pairs that share no visible key)."""
        return make_plan(dist.get_world_size(self.group), self.causal, self.schedule, mask=self.mask_spec(), chunk=n,
                         placement_window=self.placement_window, stride=self.ring_stride)


def _documents_fingerprint(cu_seqlens) -> str | None:
    """A short, readable digest of the packed documents (None: no packing), for the agreement check."""
    if cu_seqlens is None:
        return None
    import hashlib

    digest = hashlib.blake2b(repr(tuple(cu_seqlens)).encode(), digest_size=8).hexdigest()
    return f"{len(cu_seqlens) - 1} documents, ends at {cu_seqlens[-1]}, #{digest}"


def _link(link) -> str:
    """A link as the agreement compares it: its name and its figures to the last bit (two links files may round
    alike in their names and still time a placement apart)."""
    return f"{link.name} ({link.bandwidth!r} B/s, {link.latency!r} s per message)"
