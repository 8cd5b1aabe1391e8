"""Baselines for the scaling benchmark, and distattn as a layer method, all on the same kernel backend.

``METHODS`` maps a name to a :class:`~bench.baselines.base.Method`:

* ``megatron``  — Megatron-LM tensor + sequence parallelism (all-gather / reduce-scatter around the
  projections, heads split across ranks, dummy heads padded in);
* ``ulysses``   — DeepSpeed-Ulysses: distattn's 2-D path with ``U = P``, ``R = 1`` (all-to-all sequence <->
  heads; query heads must divide by the group size, kv heads divide by it or divide it);
* ``ring``      — ring attention without load balancing (distattn with ``schedule="ring"``);
* ``balanced``  — DistFlashAttn (load-balanced schedule, overlapped kv prefetch);
* ``no_overlap``— DistFlashAttn waiting for each transfer before computing (ablation).

Each computes the layers of :mod:`bench.baselines.layers` on sequence-sharded activations and is tested
against the single-process reference (``tests/test_baselines.py``). The library never imports ``bench``.
"""

from bench.baselines.base import Method, assemble_grads
from bench.baselines.layers import LayerShape, init_weights
from bench.baselines.megatron import MegatronTPSP
from bench.baselines.seqpar import DistAttnMethod
from bench.baselines.ulysses import Ulysses

METHODS: dict[str, Method] = {
    "megatron": MegatronTPSP(),
    "ulysses": Ulysses(),
    "ring": DistAttnMethod("ring", schedule="ring"),
    "balanced": DistAttnMethod("balanced", schedule="balanced"),
    "no_overlap": DistAttnMethod("no_overlap", schedule="balanced", overlap=False),
}

__all__ = ["METHODS", "Method", "LayerShape", "init_weights", "assemble_grads", "MegatronTPSP", "Ulysses",
           "DistAttnMethod"]
