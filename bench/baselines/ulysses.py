"""DeepSpeed-Ulysses (Jacobs et al. 2023): all-to-all from sequence-sharded to head-sharded and back.

Legend: ``b`` batch, ``n`` tokens per rank, ``N = P*n``, ``h_q``/``h_kv`` heads, ``d`` head dim.

Projections, RoPE and the MLP run on this rank's tokens (weights replicated). Around the attention core::

    q (b, n, h_q, d) --all-to-all: scatter heads, gather seq--> (b, N, h_q/P, d)    (same for k, v)
    out (b, N, h_q/P, d) = attention over all N tokens, this rank's heads (same kernel as every method)
    out --all-to-all: scatter seq, gather heads--> (b, n, h_q, d)

Backward runs the same four all-to-alls in reverse (dout in, dq/dk/dv out). Heads are split in contiguous
blocks, so query block ``j`` reads exactly kv block ``j`` (GQA) — which needs ``h_q % P == 0`` and
``h_kv % P == 0``; anything else raises ``ValueError`` before any communication.
"""

from __future__ import annotations

import distattn
from bench.baselines.base import SequenceParallelMethod
from bench.baselines.collectives import all_to_all

__all__ = ["Ulysses"]


class Ulysses(SequenceParallelMethod):
    name = "ulysses"

    def check(self, shape, world):
        for what, heads in (("heads_q", shape.heads_q), ("heads_kv", shape.heads_kv)):
            if heads % world:
                raise ValueError(f"Ulysses cannot run {what}={heads} on {world} ranks: the all-to-all splits "
                                 f"heads across ranks, so {what} must be a multiple of the group size; use a "
                                 f"group size dividing {heads}, or a method without this limit (distattn)")

    def core(self, q, k, v, *, group, causal, backend):
        # (b, n, h, d) -> (b, N, h/P, d): heads scattered (dim 2), sequence gathered (dim 1)
        q_h, k_h, v_h = (all_to_all(t, 2, 1, group) for t in (q, k, v))
        out_h = distattn.flash_attn_func(q_h, k_h, v_h, causal=causal, backend=backend)
        return all_to_all(out_h, 1, 2, group)  # (b, N, h_q/P, d) -> (b, n, h_q, d)
