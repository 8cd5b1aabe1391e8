"""distattn's own op as a layer method, in its three configurations compared by the benchmark.

* ``balanced``: DistFlashAttn — load-balanced causal schedule, kv prefetch overlapped with compute;
* ``ring``: ring attention without load balancing (``schedule="ring"``), still overlapped;
* ``no_overlap``: the balanced schedule waiting for every transfer before computing (ablation).

Projections, RoPE and the MLP are per token (weights replicated); only the attention core communicates,
through ``distattn.dist_flash_attn_func`` and its byte counters (``distattn.comm.COUNTERS``).
"""

from __future__ import annotations

import distattn
from bench.baselines.base import SequenceParallelMethod

__all__ = ["DistAttnMethod"]


class DistAttnMethod(SequenceParallelMethod):
    """``dist_flash_attn_func`` with a fixed ``schedule`` and ``overlap``."""

    def __init__(self, name: str, schedule: str, overlap: bool = True):
        self.name, self.schedule, self.overlap = name, schedule, overlap

    def core(self, q, k, v, *, group, causal, backend):
        return distattn.dist_flash_attn_func(q, k, v, causal=causal, group=group, schedule=self.schedule,
                                             backend=backend, overlap=self.overlap)
