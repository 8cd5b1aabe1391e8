"""torchtitan's inner attention, served by distattn over a sequence-parallel group (``torchtitan`` face).

Legend: ``b`` batch rows, ``n`` this rank's tokens per row, ``S = P * n`` the row's whole length, ``h`` heads,
``d`` head dim. torchtitan hands its inner attention ``(b, n, h, d)`` (its ``B, L, N, H``), as flash-attn does.

:class:`DistAttention`'s config is a ``VarlenAttention.Config``, so torchtitan treats it as a masked backend: its
data path (``Decoder.get_attention_masks``; the Trainer's ``post_dataloading_process``) turns the per-document
``positions`` of the WHOLE row into a ``VarlenMetadata`` whose ``cu_seq_q`` are the global document boundaries of
the ``b`` rows laid end to end (``b * S`` tokens); this module cuts them per row and runs
``distattn.dist_flash_attn_varlen_func``. Without masks (no ``positions``) the attention is dense causal
(``distattn.dist_flash_attn_func``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchtitan.models.common.attention import VarlenAttention, VarlenMetadata
from torchtitan.protocols.module import Module

from distattn.api import dist_flash_attn_func, dist_flash_attn_varlen_func

__all__ = ["DistAttention", "sequence_parallel_group", "TITAN_SCHEDULES"]

TITAN_SCHEDULES = ("balanced", "ring", "zigzag")
"""The schedules the torchtitan plug-in runs: their layouts are fixed per length (``"placed"`` follows each batch's
documents, so the shards of inputs, labels and positions would change per batch; not offered here)."""

_GROUPS: dict[tuple[int, int, int], object] = {}


def sequence_parallel_group(sp_degree: int = 0, ulysses_degree: int = 1):
    """The sequence-parallel group of this rank for ``sp_degree`` ranks (0: the whole world) split as
    ``ulysses_degree`` x ring ranks: ``None`` (the world), a ``ProcessGroup``, or ``(ulysses_group, ring_group)``.

    Groups are blocks of ``sp_degree`` consecutive ranks (rank ``g`` of a block is ``(r, u) = divmod(g, U)``, as
    ``distattn.make_2d_groups``). Made once per process and cached; the first call is a collective (every rank of
    the job calls it, in the same order: the plug-in calls it from ``shard_batch`` and the first forward)."""
    world = dist.get_world_size()
    p = world if sp_degree == 0 else sp_degree
    key = (p, ulysses_degree, world)
    if key in _GROUPS:
        return _GROUPS[key]
    if world % p or p % ulysses_degree:
        raise ValueError(f"sp_degree={sp_degree} must divide the world size {world} and ulysses_degree="
                         f"{ulysses_degree} must divide the sequence-parallel size {p}")
    me, mine_block, mine_u, mine_r = dist.get_rank(), None, None, None
    for start in range(0, world, p):  # every process creates every group, in the same order
        ranks = list(range(start, start + p))
        if ulysses_degree == 1:
            g = dist.new_group(ranks) if p < world else None
            if me in ranks:
                mine_block = g
            continue
        for r in range(p // ulysses_degree):
            g = dist.new_group(ranks[r * ulysses_degree:(r + 1) * ulysses_degree])
            if me in ranks[r * ulysses_degree:(r + 1) * ulysses_degree]:
                mine_u = g
        for u in range(ulysses_degree):
            g = dist.new_group(ranks[u::ulysses_degree])
            if me in ranks[u::ulysses_degree]:
                mine_r = g
    _GROUPS[key] = mine_block if ulysses_degree == 1 else (mine_u, mine_r)
    return _GROUPS[key]


def _flash_window(window_size: tuple[int, int]) -> tuple[bool, tuple[int, int]]:
    """torchtitan's ``(left, right)`` window (-1: unlimited; ``(-1, 0)`` causal) as flash-attn's ``(causal,
    window_size)``."""
    left, right = window_size
    if right == 0:
        return True, (left if left >= 0 else -1, -1)
    return False, (left, right)


class DistAttention(Module):
    """Exact attention over the sequence split across a sequence-parallel group (distattn), as torchtitan's
    inner attention: ``forward(q, k, v, *, attention_masks, scale, enable_gqa, out_transform)`` on this rank's
    ``(b, n, h, d)`` shards. Built by :class:`~distattn.integrations.torchtitan.DistAttnConverter`."""

    @dataclass(kw_only=True, slots=True)
    class Config(VarlenAttention.Config):
        schedule: str = "balanced"
        """distattn's schedule: ``"balanced"`` or ``"ring"`` (contiguous shards), ``"zigzag"`` (two chunks per
        rank; ``shard_batch`` shards with it)."""
        sp_degree: int = 0
        """Ranks per sequence-parallel group (0: the whole world); groups are blocks of consecutive ranks."""
        ulysses_degree: int = 1
        """Ulysses ranks of each group (two-dimensional sequence parallelism: heads split over them)."""

        def __post_init__(self):
            if self.schedule not in TITAN_SCHEDULES:
                why = (" ('placed' lays out each batch by its documents; the torchtitan plug-in shards by a fixed "
                       "layout)" if self.schedule == "placed" else "")
                raise ValueError(f"schedule={self.schedule!r} must be one of {TITAN_SCHEDULES}{why}")
            for name in ("sp_degree", "ulysses_degree"):
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "sp_degree" else 1):
                    raise ValueError(f"{name}={value!r} must be an int >= {0 if name == 'sp_degree' else 1}")

    def __init__(self, config: Config) -> None:  # no super().__init__ of VarlenAttention: no CUDA impl to pick
        Module.__init__(self)
        self.window_size = tuple(config.window_size)
        self.schedule, self.sp_degree, self.ulysses_degree = config.schedule, config.sp_degree, config.ulysses_degree

    @property
    def group(self):
        """The sequence-parallel group (resolved at first use, :func:`sequence_parallel_group`)."""
        return sequence_parallel_group(self.sp_degree, self.ulysses_degree)

    def forward(self, q_bnhd: torch.Tensor, k_bnhd: torch.Tensor, v_bnhd: torch.Tensor, *, attention_masks=None,
                scale: float | None = None, enable_gqa: bool = False, out_transform=None, **kwargs) -> torch.Tensor:
        _check_inputs(q_bnhd, attention_masks)
        causal, window = _flash_window(self.window_size)
        common = dict(softmax_scale=scale, causal=causal, window_size=window, group=self.group,
                      schedule=self.schedule, return_lse=out_transform is not None)
        if attention_masks is None:
            res = dist_flash_attn_func(q_bnhd, k_bnhd, v_bnhd, **common)
            out, lse_bnh = (res[0], res[1].transpose(1, 2)) if out_transform is not None else (res, None)
        else:
            rows = _row_cu_seqlens(attention_masks, q_bnhd.shape[0], q_bnhd.shape[1], self.group)
            outs, lses = [], []
            for i, cu in enumerate(rows):
                max_len = int(max(b - a for a, b in zip(cu[:-1], cu[1:])))
                res = dist_flash_attn_varlen_func(q_bnhd[i], k_bnhd[i], v_bnhd[i],
                                                  torch.tensor(cu, dtype=torch.int32), max_len, **common)
                outs.append(res[0] if out_transform is not None else res)
                if out_transform is not None:
                    lses.append(res[1].transpose(0, 1))  # (h, n) -> (n, h)
            out = torch.stack(outs)
            lse_bnh = torch.stack(lses) if lses else None
        return out if out_transform is None else out_transform(out, lse_bnh)


def _check_inputs(q_bnhd, attention_masks) -> None:
    """What distattn cannot serve, said the same way on every rank (the facts are the same on all of them)."""
    from torch.distributed.tensor import DTensor

    if isinstance(q_bnhd, DTensor):
        raise ValueError("DistAttention got DTensor inputs: torchtitan's context parallelism (or a DTensor "
                         "sequence sharding) is on as well; distattn shards the sequence itself: set "
                         "parallelism.context_parallel_degree = 1 and shard the batch with "
                         "distattn.integrations.torchtitan.shard_batch")
    if attention_masks is not None and not isinstance(attention_masks, VarlenMetadata):
        raise TypeError(f"DistAttention serves torchtitan's VarlenMetadata masks (per-document positions) or none "
                        f"(dense causal), got {type(attention_masks).__name__}: build the masks with the model's "
                        f"get_attention_masks(positions) (the converter makes it return VarlenMetadata), or "
                        f"distattn.integrations.torchtitan.shard_batch")


_ROWS_CACHE: list = [None, None]  # (metadata object, its rows): every layer gets the same object


def _row_cu_seqlens(meta: VarlenMetadata, b: int, n: int, group) -> list[list[int]]:
    """Per-row global ``cu_seqlens`` (starting at 0, ending at ``S``) from torchtitan's ``b * S``-token metadata."""
    if _ROWS_CACHE[0] is meta:
        return _ROWS_CACHE[1]
    from distattn.sharding import group_size

    cu = list(meta.cu_seq_q_host) if meta.cu_seq_q_host is not None else meta.cu_seq_q.tolist()
    p = group_size(group)
    s = n * p
    if cu[-1] != b * s:
        raise ValueError(f"attention_masks cover {cu[-1]} tokens, but the batch is {b} rows x {s} tokens (this "
                         f"rank's {n} x {p} ranks): build them from the WHOLE rows' positions before sharding "
                         f"(distattn.integrations.torchtitan.shard_batch does), not from this rank's shard")
    rows = []
    for i in range(b):
        inner = [c - i * s for c in cu if i * s < c < (i + 1) * s]
        rows.append([0] + inner + [s])
    _ROWS_CACHE[0], _ROWS_CACHE[1] = meta, rows
    return rows
