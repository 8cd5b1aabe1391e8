"""What every method (baseline or ours) provides, and the sequence-parallel methods' shared body.

A method turns the full weights into this rank's parameters (:meth:`Method.shard`), and computes the
attention layer / the full LLaMA layer on this rank's sequence shard ``x (b, n, H)`` (rank ``r`` holds
tokens ``[r*n, (r+1)*n)``), returning this rank's shard of the output. ``placement`` says where each local
parameter sits in the full one, so tests and benchmarks can put gradients back together:
``None`` = replicated (the full tensor; its gradient is this rank's partial sum), ``(dim, index)`` =
``full.index_select(dim, index)``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from bench.baselines.layers import LayerShape, llama_layer, sp_attention, swiglu

__all__ = ["Method", "SequenceParallelMethod", "assemble_grads"]


class Method:
    """Interface of a method. Subclasses set ``name`` and implement :meth:`attention` and :meth:`mlp`."""

    name = "method"

    def check(self, shape: LayerShape, world: int) -> None:
        """Raise ``ValueError`` (same on every rank, before any communication) if ``shape`` cannot run."""

    def shard(self, w_full: dict, shape: LayerShape, rank: int, world: int) -> tuple[dict, dict]:
        """``(params, placement)``: default replicates every weight (sequence parallelism)."""
        return dict(w_full), {name: None for name in w_full}

    def attention(self, x_bnH, p: dict, shape: LayerShape, *, group=None, causal=True, backend=None):
        raise NotImplementedError

    def mlp(self, u_bnH, p: dict, shape: LayerShape, *, group=None):
        raise NotImplementedError

    def layer(self, x_bnH, p: dict, shape: LayerShape, *, group=None, causal=True, backend=None):
        """The full pre-norm LLaMA decoder layer on this rank's shard."""
        return llama_layer(x_bnH,
                           lambda u: self.attention(u, p, shape, group=group, causal=causal, backend=backend),
                           lambda u: self.mlp(u, p, shape, group=group), p["norm1"], p["norm2"])


class SequenceParallelMethod(Method):
    """Weights replicated, every token's projections and MLP computed where the token lives; only the
    attention core talks to other ranks (Ulysses, ring attention, distattn)."""

    def core(self, q, k, v, *, group, causal, backend):
        """Attention of this rank's ``q (b, n, h_q, d)`` over the whole sequence -> ``(b, n, h_q, d)``."""
        raise NotImplementedError

    def attention(self, x_bnH, p, shape, *, group=None, causal=True, backend=None):
        self.check(shape, dist.get_world_size(group))
        start = dist.get_rank(group) * x_bnH.shape[1]  # global position of this shard's first token
        return sp_attention(x_bnH, p["wq"], p["wk"], p["wv"], p["wo"], shape,
                            lambda q, k, v: self.core(q, k, v, group=group, causal=causal, backend=backend),
                            start)

    def mlp(self, u_bnH, p, shape, *, group=None):
        return swiglu(u_bnH, p["w_gate"], p["w_up"], p["w_down"])  # per token: no communication


def assemble_grads(per_rank: list[tuple[dict, dict]], full_shapes: dict) -> dict:
    """Full-weight gradients from every rank's ``(local grads, placement)``: replicated partials are summed,
    sharded ones are added into their rows/columns (overlapping shards, e.g. replicated kv heads, sum)."""
    out = {name: torch.zeros(shp, dtype=torch.float64) for name, shp in full_shapes.items()}
    for grads, placement in per_rank:
        for name, g in grads.items():
            where = placement[name]
            if where is None:
                out[name] += g.double()
            else:
                dim, index = where
                out[name].index_add_(dim, index, g.double())
    return out
