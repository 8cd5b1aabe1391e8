"""Packed (padding-free) batches in the Hugging Face integration: which documents a forward's stream holds.

transformers' own padding-free format marks documents by ``position_ids`` that restart (a document starts
wherever the position does not follow the previous one: ``diff != 1``, transformers' rule) or by
``cu_seq_lens_q``/``cu_seq_lens_k`` keyword arguments. Under sequence parallelism each rank holds only its
slice of the stream, so no rank can tell the documents alone: a forward pre-hook on the model (installed by
``use_distattn``) runs once per forward on every rank, derives the documents of the *whole* stream (from the
``cu_seq_lens`` it was given, else from every rank's position boundaries, one small all-gather), and pins the
result to the ``position_ids`` tensor that transformers hands to every attention layer. The attention function
reads it there: documents -> ``dist_flash_attn_varlen_func``; one document -> the dense causal op.

Legend: ``b`` batch rows, ``n`` tokens per rank, ``T = P * n`` tokens in the stream.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distattn._ops import group_of
from distattn.sharding import group_size

__all__ = ["install_packing_hook", "stream_documents", "cu_seq_lens_documents"]

_ATTR = "_distattn_documents"  # on position_ids: tuple cu_seqlens of the whole stream, or None (one document)
_HOOKED = "_distattn_packing_hook"


def stream_documents(position_ids: torch.Tensor | None):
    """``(known, cu_seqlens)`` pinned to ``position_ids`` by the hook (``known`` False: no hook ran)."""
    if position_ids is None or not hasattr(position_ids, _ATTR):
        return False, None
    return True, getattr(position_ids, _ATTR)


def install_packing_hook(model, group_key: str) -> None:
    """Register (once) the forward pre-hook that derives the stream's documents on every forward."""
    old = getattr(model, _HOOKED, None)
    if old is not None:
        old.remove()
    handle = model.register_forward_pre_hook(lambda m, a, kw: _derive(kw, group_key), with_kwargs=True)
    setattr(model, _HOOKED, handle)


def _derive(kwargs: dict, group_key: str):
    group = group_of(group_key)
    world = group_size(group)
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        if world > 1:
            raise ValueError(f"distattn over {world} ranks needs position_ids: without them the model numbers "
                             f"each rank's tokens from 0 and RoPE is wrong; pass "
                             f"position_ids=batch['position_ids'] from distattn.integrations.hf.shard_batch")
        return None
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    total = position_ids.shape[-1] * world
    if cu_q is not None or cu_k is not None:
        cu = _from_cu_seq_lens(cu_q, cu_k, position_ids, total)
    else:
        cu = _from_positions(position_ids, group, world)
    if cu is not None and len(cu) == 2 and cu[-1] == total:
        cu = None  # one document over the whole stream: plain causal attention
    setattr(position_ids, _ATTR, cu)
    return None


def cu_seq_lens_documents(cu_q, cu_k) -> tuple[int, ...]:
    """The documents of transformers' ``cu_seq_lens_q``/``cu_seq_lens_k`` (equal: one self-attention stream)."""
    if cu_q is None or cu_k is None or not torch.equal(cu_q.cpu(), cu_k.cpu()):
        raise ValueError("distattn computes self-attention over one packed stream: pass cu_seq_lens_q and "
                         "cu_seq_lens_k equal (the whole stream's cumulative document lengths), or neither")
    return tuple(int(x) for x in cu_q.tolist())


def _from_cu_seq_lens(cu_q, cu_k, position_ids, total):
    cu = cu_seq_lens_documents(cu_q, cu_k)
    if position_ids.shape[0] != 1:
        raise ValueError(f"a packed stream is one row: got position_ids of shape {tuple(position_ids.shape)} "
                         f"with cu_seq_lens; pack the batch into one row (distattn.integrations.hf.shard_batch)")
    if cu[-1] > total:
        raise ValueError(f"cu_seq_lens_q[-1] = {cu[-1]} is more than the stream holds ({total} tokens over all "
                         f"ranks): pass the cumulative lengths of the WHOLE stream on every rank")
    return cu


def _boundaries(row: torch.Tensor) -> tuple[int, int, list[int]]:
    """(first position, last position, local indices where a new document starts after index 0)."""
    starts = (torch.diff(row) != 1).nonzero().flatten() + 1
    return int(row[0]), int(row[-1]), starts.tolist()


def _from_positions(position_ids: torch.Tensor, group, world: int):
    """Documents of the whole stream from every rank's position boundaries (one all-gather when world > 1)."""
    mine = [_boundaries(row) for row in position_ids.reshape(-1, position_ids.shape[-1]).cpu()]
    everyone = [mine]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine, group=group)
    n = position_ids.shape[-1]
    rows = []
    for b in range(len(mine)):
        starts = [0]
        for r, ranks_rows in enumerate(everyone):
            first, _, local = ranks_rows[b]
            if r > 0 and first != everyone[r - 1][b][1] + 1:
                starts.append(r * n)
            starts += [r * n + i for i in local]
        rows.append(tuple(starts) + (world * n,))
    if len(rows) == 1:
        return rows[0]
    if all(len(cu) == 2 for cu in rows):
        return None  # every row is one sequence: plain causal attention
    raise ValueError(f"position_ids restart inside rows of a batch of {len(rows)}: distattn packs documents into "
                     f"ONE stream (batch 1); build it with distattn.integrations.hf.shard_batch(list_of_documents) "
                     f"or shard_batch(input_ids, attention_mask=...)")
