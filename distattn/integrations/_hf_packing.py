"""Packed (padding-free) batches in the Hugging Face integration: which documents a forward's stream holds.

transformers' own padding-free format marks documents by ``position_ids`` that restart (a document starts
wherever the position does not follow the previous one: ``diff != 1``, transformers' rule) or by
``cu_seq_lens_q``/``cu_seq_lens_k`` keyword arguments. Under sequence parallelism each rank holds only its
slice of the stream, so no rank can tell the documents alone: a forward pre-hook on the model (installed by
``use_distattn``) runs once per forward on every rank, puts every rank's position ids back in sequence order
with the layout of the model's schedule (``gather_sequence``: one all-gather of ``b * T`` integers per forward,
two on a two-dimensional group, none per layer), derives the documents of the *whole* stream from them (or from
the ``cu_seq_lens`` it was given), and adds them to the model's keyword arguments (``DOCUMENTS_KWARG``), which
transformers hands to every attention layer. The attention function passes them to the op: documents -> attention
inside each document; one document -> plain causal attention.

``torch.compile``: the documents are data, not graph structure. All the data-dependent work (the all-gather, the
``diff != 1`` scan, the layout check) is inside one registered op, ``distattn::stream_documents``, whose output has
a shape fixed by the input's (``(T + 1,)``: the cumulative lengths padded at the end by repeating ``T``;
``distattn._ops.padded_documents``), and the attention op reads the values only when it runs. So the hook and the
model trace without a graph break (``fullgraph=True``), and a batch with other document boundaries, or another
length once the length is dynamic, runs the graphs already compiled (``tests/test_hf_compile.py``).

The same gathered stream guards the layout: a batch sharded with another layout than the model's schedule
(``shard_batch(..., schedule=...)`` and ``use_distattn(..., schedule=...)`` disagree, or another group) comes
back scrambled, with a document starting at a position other than 0, which ``shard_batch`` never makes
(positions count from 0 in every sequence and every document). Every rank sees the same stream, so every rank
raises the same ``ValueError`` before any attention runs.

Padding is the opposite of a packed batch: ``refuse_padding`` (the model's mask interface calls it) raises on every
rank for a 2-D ``attention_mask`` with a zero, also from an op, so a masked forward compiles too.

Legend: ``b`` batch rows, ``n`` tokens per rank, ``T = P * n`` tokens in the stream.
"""

from __future__ import annotations

import torch

import torch.distributed as dist

from distattn._ops import group_of, padded_documents
from distattn.sharding import gather_sequence, group_size, layout
from distattn.topology import all_reduce

__all__ = ["install_packing_hook", "stream_documents", "cu_seq_lens_documents", "refuse_padding", "DOCUMENTS_KWARG",
           "NO_PADDING_FIX"]

NO_PADDING_FIX = ("remove the padding instead: shard_batch(input_ids, labels, attention_mask=mask) packs the "
                  "rows padding-free (documents attend only within themselves), then call the model with its "
                  "input_ids and position_ids and no attention_mask")

DOCUMENTS_KWARG = "distattn_documents"
"""The keyword argument under which the hook hands the stream's documents to every attention layer: transformers
passes a model's extra keyword arguments down to its attention functions. Its value is the ``(T + 1,)`` tensor of
``distattn._ops.padded_documents``."""
_HOOKED = "_distattn_packing_hook"


def stream_documents(kwargs: dict):
    """``(known, documents)`` that the hook put into an attention layer's ``kwargs`` (``known`` False: no hook
    ran); ``documents`` is the ``(T + 1,)`` tensor of ``distattn._ops.padded_documents``."""
    documents = kwargs.get(DOCUMENTS_KWARG)
    return documents is not None, documents


def install_packing_hook(model, group_key: str, schedule: str = "balanced") -> None:
    """Register (once) the forward pre-hook that derives the stream's documents on every forward; ``schedule``
    is the model's attention schedule, whose layout the batch must have been sharded with."""
    old = getattr(model, _HOOKED, None)
    if old is not None:
        old.remove()
    handle = model.register_forward_pre_hook(lambda m, a, kw: _derive(a, kw, group_key, schedule), with_kwargs=True)
    setattr(model, _HOOKED, handle)


def _derive(args: tuple, kwargs: dict, group_key: str, schedule: str):
    """The model's arguments with ``DOCUMENTS_KWARG`` added. Under ``torch.compile`` this hook is traced: all the
    data-dependent work is inside the ``distattn::stream_documents`` op, whose output has a fixed shape."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        world = group_size(group_of(group_key))
        if world > 1:
            raise ValueError(f"distattn over {world} ranks needs position_ids: without them the model numbers "
                             f"each rank's tokens from 0 and RoPE is wrong; pass "
                             f"position_ids=batch['position_ids'] from distattn.integrations.hf.shard_batch")
        return None
    documents = torch.ops.distattn.stream_documents(position_ids, kwargs.get("cu_seq_lens_q"),
                                                    kwargs.get("cu_seq_lens_k"), group_key, schedule)
    return args, {**kwargs, DOCUMENTS_KWARG: documents}


@torch.library.custom_op("distattn::stream_documents", mutates_args=())
def _stream_documents_op(position_ids: torch.Tensor, cu_seq_lens_q: torch.Tensor | None,
                         cu_seq_lens_k: torch.Tensor | None, group_key: str, schedule: str) -> torch.Tensor:
    """The whole stream's documents as ``padded_documents`` (``(T + 1,)`` int64, CPU) from this rank's
    ``position_ids (b, n)``: one all-gather of the positions (none on one rank), then host work."""
    group = group_of(group_key)
    rows = position_ids.reshape(-1, position_ids.shape[-1])  # (b, n)
    stream = rows
    if group_size(group) > 1:  # (b, T): every rank's positions in sequence order, by the model's layout
        stream = gather_sequence(rows, 1, group, **_layout_of(schedule, cu_seq_lens_q, cu_seq_lens_k,
                                                                rows.shape[-1], group))
        _check_layout(stream, group, schedule)
    total = stream.shape[-1]
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        cu = _from_cu_seq_lens(cu_seq_lens_q, cu_seq_lens_k, position_ids, total)
    else:
        cu = _from_stream(stream)
    return padded_documents(cu, total)


@_stream_documents_op.register_fake
def _stream_documents_fake(position_ids, cu_seq_lens_q, cu_seq_lens_k, group_key, schedule):
    total = position_ids.shape[-1] * group_size(group_of(group_key))
    return torch.empty(total + 1, dtype=torch.int64, device="cpu")  # host memory: the op's reader is the host


def _layout_of(schedule: str, cu_q, cu_k, n: int, group) -> dict:
    """``gather_sequence``'s layout keywords: ``schedule="placed"`` shards a packed stream by the placement of its
    documents, which the hook learns from ``cu_seq_lens_q/k`` (``shard_batch(...)["cu_seq_lens"]``); a stream
    without them is one document per row, laid out contiguously."""
    if schedule != "placed":
        return {"schedule": schedule}
    if cu_q is None and cu_k is None:
        return {"schedule": "balanced"}
    from distattn.sharding import _grid, placed_window, placement

    cu = cu_seq_lens_documents(cu_q, cu_k)
    ring, ulysses = _grid(group)
    window = placed_window(cu, ring, ulysses * n, (-1, -1))  # the window shard_batch placed these documents for
    return {"schedule": "balanced", "layout": placement(cu, n, group, window=window)}


def _check_layout(stream: torch.Tensor, group, schedule: str) -> None:
    """Refuse a stream that the model's layout put back out of order (a document starting at position != 0)."""
    jumps = torch.diff(stream, dim=1) != 1  # (b, T - 1): a new document starts after each jump
    wrong = jumps & (stream[:, 1:] != 0)
    if not bool(wrong.any()):
        return
    row, i = (int(x) for x in wrong.nonzero()[0])
    lay = layout(group, "balanced" if schedule == "placed" else schedule)  # placed without documents: contiguous
    where = f"{lay.kind} over {lay.ranks} ranks" + (f", {lay.ulysses} per Ulysses group" if lay.ulysses > 1 else "")
    raise ValueError(f"the batch was not sharded with the layout of the model's attention schedule={schedule!r} "
                     f"({where}): "
                     f"its position_ids, put back in that order, jump from {int(stream[row, i])} to "
                     f"{int(stream[row, i + 1])} at token {i + 1} of {stream.shape[1]} (row {row}), where a new "
                     f"sequence or document would have to start at 0; shard the batch with "
                     f"shard_batch(..., group=group, schedule={schedule!r}), the group and schedule given to "
                     f"use_distattn")


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


def _from_stream(stream: torch.Tensor):
    """Documents of the whole ``(b, T)`` stream: one starts wherever the position does not follow the previous
    one (transformers' rule, ``diff != 1``)."""
    total = stream.shape[1]
    rows = []
    for row in stream.cpu():
        starts = (torch.diff(row) != 1).nonzero().flatten() + 1
        rows.append((0, *starts.tolist(), total))
    if len(rows) == 1:
        return rows[0]
    if all(len(cu) == 2 for cu in rows):
        return None  # every row is one sequence: plain causal attention
    raise ValueError(f"position_ids restart inside rows of a batch of {len(rows)}: distattn packs documents into "
                     f"ONE stream (batch 1); build it with distattn.integrations.hf.shard_batch(list_of_documents) "
                     f"or shard_batch(input_ids, attention_mask=...)")


# -- padding: refused, in an op so that a masked forward compiles -----------------------------------------
def refuse_padding(attention_mask: torch.Tensor, group_key: str) -> None:
    """Raise ``ValueError`` on every rank of the group if any rank's 2-D ``attention_mask`` has a zero.

    The check reads the mask's values (and all-reduces a flag), so it is an op: ``torch.compile`` traces it
    without a graph break and it raises when the compiled graph runs. Nothing consumes the op's flag, so
    ``torch._assert_async`` does: a side-effect-free op whose output is unused would be dropped from the graph.
    """
    ok = torch.ops.distattn.refuse_padding(attention_mask, group_key)
    torch._assert_async(ok, "distattn::refuse_padding let a padding attention_mask through")


@torch.library.custom_op("distattn::refuse_padding", mutates_args=())
def _refuse_padding_op(attention_mask: torch.Tensor, group_key: str) -> torch.Tensor:
    """``True`` (a 0-d bool CPU tensor) when no rank's mask has a zero; else ``ValueError`` on every rank."""
    group = group_of(group_key)
    padded = torch.tensor([0 if bool(attention_mask.all()) else 1], device=attention_mask.device)
    if group_size(group) > 1:  # the ranks hold different shards of the mask: agree before any attention
        all_reduce(padded, group, dist.ReduceOp.MAX)
    if padded.item():
        zeros = int((~attention_mask.bool()).sum())
        raise ValueError(f"distattn cannot apply a padding attention_mask: the mask has zeros on some rank of the "
                         f"group (this rank: {zeros} of {attention_mask.numel()}, shape "
                         f"{tuple(attention_mask.shape)}), and distattn attention is causal over the whole "
                         f"sequence with no per-token mask, so padded tokens would be attended to; "
                         f"{NO_PADDING_FIX} (an all-ones mask is accepted)")
    return torch.ones((), dtype=torch.bool)


@_refuse_padding_op.register_fake
def _refuse_padding_fake(attention_mask, group_key):
    return torch.empty((), dtype=torch.bool, device="cpu")
