"""Megatron-LM tensor + sequence parallelism (Korthikanti et al. 2022) around the same attention kernel.

Legend: ``b`` batch, ``n`` tokens per rank, ``N = P*n``, ``H`` hidden, ``hl`` query heads per rank (padded),
``d`` head dim, ``F`` MLP width.

Activations between blocks are sequence-sharded ``(b, n, H)``. Each block (attention, MLP)::

    x (b, n, H) --all-gather(seq)--> (b, N, H) --column-parallel QKV / gate,up (this rank's heads / F/P)-->
    attention over all N tokens with this rank's heads / SwiGLU --row-parallel Wo / W_down--> partial
    (b, N, H) --reduce-scatter(seq)--> (b, n, H)

Backward: the reduce-scatter's gradient is an all-gather; the column-parallel linear saves only the local
shard and all-gathers it *again* for its weight gradient, then reduce-scatters the input gradient
(Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``). Per block: 2 collectives forward, 3
backward; a full layer moves 6 all-gathers and 4 reduce-scatters of ``(b, n, H)`` per iteration, the
DistFlashAttn paper's count (Sec. 3.4; see ``bench/model.py``).

Heads not divisible by ``P``: query heads are padded with zero *dummy heads* to ``ceil(h_q/P)*P``, which
every rank computes (the wasted work is part of the baseline's cost, as for Megatron, which requires
``heads % P == 0``). Key/value heads: rank ``r`` projects the kv heads its real query heads read; when
``h_kv < P`` (GQA) a kv head is therefore projected on several ranks (replicated weights, summed gradients),
and when a rank's heads do not line up with whole kv groups its kv heads are expanded per query head
before the kernel. The MLP width is padded to a multiple of ``P`` the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

import distattn
from bench.baselines.base import Method
from bench.baselines.collectives import all_gather_linear, reduce_scatter_seq
from bench.baselines.layers import LayerShape, apply_rope

__all__ = ["MegatronTPSP", "MegatronPartition", "megatron_partition"]


def _ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class MegatronPartition:
    """What rank ``rank`` of ``world`` owns."""

    heads_padded: int  # query heads after padding to a multiple of world
    heads_local: int  # heads_padded / world, dummies included
    q_heads: tuple[int, ...]  # real query heads of this rank (global indices)
    kv_heads: tuple[int, ...]  # kv heads this rank projects (those its real query heads read)
    kv_index: tuple[int, ...]  # for each local query head (dummies too): which local kv head it reads
    ffn_local: int  # MLP columns per rank, padding included
    ffn_rows: tuple[int, int]  # [lo, hi) real MLP rows of this rank

    @property
    def native_gqa(self) -> bool:
        """Local q heads read local kv heads in whole, equal groups: the kernel's GQA applies directly."""
        n_kv = max(len(self.kv_heads), 1)
        if self.heads_local % n_kv:
            return False
        g = self.heads_local // n_kv
        return self.kv_index == tuple(i // g for i in range(self.heads_local))


def megatron_partition(shape: LayerShape, rank: int, world: int) -> MegatronPartition:
    hp = _ceil_to(shape.heads_q, world)
    hl = hp // world
    local = range(rank * hl, (rank + 1) * hl)
    q_heads = tuple(h for h in local if h < shape.heads_q)
    kv_heads = tuple(sorted({h // shape.group_size for h in q_heads}))
    kv_index = tuple(kv_heads.index(h // shape.group_size) if h < shape.heads_q else 0 for h in local)
    fl = _ceil_to(shape.ffn, world) // world
    rows = (min(rank * fl, shape.ffn), min((rank + 1) * fl, shape.ffn))
    return MegatronPartition(hp, hl, q_heads, kv_heads, kv_index, fl, rows)


def _head_rows(heads, d: int) -> torch.Tensor:
    """Row indices of ``heads`` in a ``(heads*d, H)`` projection weight."""
    return torch.tensor([h * d + i for h in heads for i in range(d)], dtype=torch.long)


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    """Append ``rows`` zero rows (dummy heads / MLP padding: computed, never trained)."""
    if rows == 0:
        return w
    return torch.cat([w, w.new_zeros(rows, w.shape[1])])


class MegatronTPSP(Method):
    """Megatron-LM tensor + sequence parallel attention/MLP blocks (see module docstring)."""

    name = "megatron"

    def shard(self, w_full, shape, rank, world):
        part = megatron_partition(shape, rank, world)
        d = shape.head_dim
        q_rows, kv_rows = _head_rows(part.q_heads, d), _head_rows(part.kv_heads, d)
        f_rows = torch.arange(*part.ffn_rows, dtype=torch.long)
        placement = {"wq": (0, q_rows), "wk": (0, kv_rows), "wv": (0, kv_rows), "wo": (1, q_rows),
                     "norm1": None, "norm2": None, "w_gate": (0, f_rows), "w_up": (0, f_rows),
                     "w_down": (1, f_rows)}
        params = {name: w_full[name] if where is None else w_full[name].index_select(*where).contiguous()
                  for name, where in placement.items()}
        return params, placement

    def attention(self, x_bnH, p, shape, *, group=None, causal=True, backend=None):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        part = megatron_partition(shape, rank, world)
        b, d, hl = x_bnH.shape[0], shape.head_dim, part.heads_local
        n_real = len(part.q_heads)
        wk, wv = p["wk"], p["wv"]
        if not part.kv_heads:  # only dummy heads here: they read one zero kv head
            wk = wv = p["wq"].new_zeros(d, x_bnH.shape[-1])
        n_kv = wk.shape[0] // d
        w_qkv = torch.cat([_pad_rows(p["wq"], (hl - n_real) * d), wk, wv])  # column-parallel, fused
        qkv = all_gather_linear(x_bnH, w_qkv, dim=1, group=group)  # (b, N, (hl + 2 n_kv) d)
        big_n = qkv.shape[1]
        q, k, v = qkv.split([hl * d, n_kv * d, n_kv * d], dim=-1)
        q = apply_rope(q.reshape(b, big_n, hl, d), 0, shape.rope_base)  # full sequence: positions from 0
        k = apply_rope(k.reshape(b, big_n, n_kv, d), 0, shape.rope_base)
        v = v.reshape(b, big_n, n_kv, d)
        if not part.native_gqa:  # heads do not line up with kv groups: one kv head per local query head
            idx = torch.tensor(part.kv_index, device=k.device)
            k, v = k.index_select(2, idx), v.index_select(2, idx)
        o = distattn.flash_attn_func(q, k, v, causal=causal, backend=backend)  # (b, N, hl, d)
        wo = p["wo"]
        wo = torch.cat([wo, wo.new_zeros(wo.shape[0], (hl - n_real) * d)], dim=1)  # row-parallel, padded
        y_partial = o.reshape(b, big_n, hl * d) @ wo.t()  # (b, N, H): this rank's heads' share
        return reduce_scatter_seq(y_partial, dim=1, group=group)

    def mlp(self, u_bnH, p, shape, *, group=None):
        part = megatron_partition(shape, dist.get_rank(group), dist.get_world_size(group))
        pad = part.ffn_local - (part.ffn_rows[1] - part.ffn_rows[0])
        w_gu = torch.cat([_pad_rows(p["w_gate"], pad), _pad_rows(p["w_up"], pad)])
        gate, up = all_gather_linear(u_bnH, w_gu, dim=1, group=group).chunk(2, dim=-1)  # (b, N, F/P) each
        w_down = p["w_down"]
        w_down = torch.cat([w_down, w_down.new_zeros(w_down.shape[0], pad)], dim=1)
        y_partial = (torch.nn.functional.silu(gate) * up) @ w_down.t()
        return reduce_scatter_seq(y_partial, dim=1, group=group)
