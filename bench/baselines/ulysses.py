"""DeepSpeed-Ulysses (Jacobs et al. 2023) as the ``R = 1`` case of distattn's two-dimensional path.

Legend: ``b`` batch, ``n`` tokens per rank, ``N = P*n``, ``h_q``/``h_kv`` heads, ``d`` head dim.

Projections, RoPE and the MLP run on this rank's tokens (weights replicated). The attention core is
``distattn.dist_flash_attn_func`` over ``group=(ulysses_group, ring_of_one)`` with ``U = P``, ``R = 1``
(``distattn.ulysses``)::

    q (b, n, h_q, d) --all-to-all: scatter heads, gather seq--> (b, N, h_q/P, d)    (same for k, v)
    out (b, N, h_q/P, d) = attention over all N tokens, this rank's heads (a ring of one rank: no ring traffic)
    out, lse --all-to-all: scatter seq, gather heads--> (b, n, h_q, d), (b, h_q, n)

Backward sends q, k, v, dout, lse and ``delta`` in and dq, dk, dv back (the library keeps no head-sharded
copies). GQA with ``h_kv < P`` replicates each kv head ``P / h_kv`` times (``P % h_kv == 0``). Heads that cannot
split (``distattn.schedule.ulysses_heads``) raise ``ValueError`` before any communication. Bytes are counted by
``distattn.comm.COUNTERS`` and predicted by ``distattn.schedule.a2a_bytes`` (``bench/model.py``).

Held to DeepSpeed-Ulysses itself (``tests/test_baselines_real.py``, ``bench/baselines/deepspeed_ulysses.py``, P = 2
and 4, MHA and GQA): the same outputs and gradients by the accuracy rule; not the same bytes: this one sends 1.40-1.43x
DeepSpeed's per rank (it re-sends q, k, v, dout, lse and delta in the backward where DeepSpeed keeps the head-sharded
tensors), so its byte and memory figures are the library's Ulysses, not DeepSpeed's.

The pair of groups is built once per process and parent group by :func:`distattn.make_2d_groups`, a collective
over the whole job (``dist.new_group``): :meth:`Ulysses.core` builds it on its first call, which every rank
reaches together (``check`` raises on every rank or on none).
"""

from __future__ import annotations

import torch.distributed as dist

import distattn
from bench.baselines.base import SequenceParallelMethod
from distattn.schedule import ulysses_heads

__all__ = ["Ulysses"]

_GROUPS: dict[int, tuple] = {}
"""id(parent group) -> (parent group, default group it was built under, (ulysses_group, ring_of_one))."""


def row_groups(group=None) -> tuple:
    """``(ulysses_group, ring_group)`` with ``U = P``, ``R = 1`` over ``group`` (default: the world), cached.

    The first call for a parent group is a collective over every process of the job (same order everywhere);
    a re-initialised default group gets new groups."""
    world_pg = dist.group.WORLD
    cached = _GROUPS.get(id(group))
    if cached is not None and cached[0] is group and cached[1] is world_pg:
        return cached[2]
    pair = distattn.make_2d_groups(dist.get_world_size(group), group)
    _GROUPS[id(group)] = (group, world_pg, pair)
    return pair


class Ulysses(SequenceParallelMethod):
    name = "ulysses"

    def check(self, shape, world):
        """Refuse exactly what the library refuses (``ulysses_heads``); no communication."""
        try:
            ulysses_heads(shape.heads_q, shape.heads_kv, world)
        except ValueError as exc:
            what, heads = (("heads_q", shape.heads_q) if shape.heads_q % world else ("heads_kv", shape.heads_kv))
            raise ValueError(f"Ulysses cannot run {what}={heads} on {world} ranks: {exc}; or use a method "
                             f"without this limit (distattn)") from None

    def core(self, q, k, v, *, group, causal, backend):
        return distattn.dist_flash_attn_func(q, k, v, causal=causal, backend=backend, group=row_groups(group))
