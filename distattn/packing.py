"""Padding-free batches: pack documents of varied length into one stream, and back.

A padding-free transformer runs every token-wise op on ``(sum of lengths, hidden)`` and masks attention by
document, instead of padding every sequence to the longest. These helpers build that layout from what users
have (a list of token sequences, a padded batch with its ``attention_mask``, or Hugging Face's flattened
format whose ``position_ids`` restart at 0 at each document) and describe it the way distattn's varlen
functions read it (``cu_seqlens``, cumulative document lengths starting at 0)::

    documents       [a0 a1 a2] [b0] [c0 c1]
    stream          a0 a1 a2 b0 c0 c1 | pad pad      (tail padded to a multiple of the group size)
    cu_seqlens      0 3 4 6                          (the padding tail is no document: nothing sees it)
    position_ids    0 1 2 0 0 1 | 0 1                (RoPE: each token's position within its document)
    shift_labels    a1 a2 -100 -100 c1 -100 | -100 -100   (never predict across a document boundary)

No torch.distributed here: the sequence-parallel split of the stream is ``distattn.shard_sequence``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Packed", "pack_sequences", "pack_padded", "cu_seqlens_from_position_ids", "shift_labels_by_document",
           "IGNORE_INDEX"]

IGNORE_INDEX = -100
"""Target value that losses skip (transformers' and PyTorch's convention)."""


@dataclass(frozen=True)
class Packed:
    """One packed stream and how to read it."""

    input_ids: torch.Tensor
    """``(T,)`` the documents concatenated, then ``pad`` tokens up to a multiple of ``multiple_of``."""
    cu_seqlens: torch.Tensor
    """``(documents + 1,)`` int32 cumulative lengths; ends at the real token count (before the padding tail)."""
    position_ids: torch.Tensor
    """``(T,)`` each token's position within its document (the tail counts from 0 too)."""
    max_seqlen: int
    """The longest document."""
    index: torch.Tensor | None = None
    """For a packed padded batch: ``(real tokens,)`` flat index into ``(batch * seq)`` of each stream token."""

    @property
    def num_tokens(self) -> int:
        """Real tokens (without the padding tail)."""
        return int(self.cu_seqlens[-1])

    def unpack(self, x: torch.Tensor, batch: int, seq: int, fill: float = 0.0) -> torch.Tensor:
        """Per-token results of the stream ``x (T, ...)`` back in the padded ``(batch, seq, ...)`` layout."""
        if self.index is None:
            raise ValueError("unpack() needs a stream built by pack_padded (it records where each token came from)")
        out = x.new_full((batch * seq, *x.shape[1:]), fill)
        out[self.index] = x[:self.num_tokens]
        return out.view(batch, seq, *x.shape[1:])


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _positions(lengths: list[int], total: int, device) -> torch.Tensor:
    """Positions within each document, then 0.. for the padding tail."""
    lengths = lengths + [total - sum(lengths)]
    return torch.cat([torch.arange(n, device=device) for n in lengths]) if lengths else torch.zeros(0, device=device)


def pack_sequences(sequences, *, multiple_of: int = 1, pad_id: int = 0) -> Packed:
    """Concatenate 1-D token tensors (documents) into one stream padded to a multiple of ``multiple_of``.

    Documents of length 0 are kept in ``cu_seqlens`` (they see and are seen by nothing).
    """
    if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of < 1:
        raise ValueError(f"multiple_of must be a positive int (the sequence-parallel group size), got {multiple_of!r}")
    seqs = [torch.as_tensor(s) for s in sequences]
    if not seqs:
        raise ValueError("pack_sequences needs at least one document")
    for i, s in enumerate(seqs):
        if s.dim() != 1:
            raise ValueError(f"document {i} must be 1-D (tokens), got shape {tuple(s.shape)}")
    lengths = [s.numel() for s in seqs]
    real = sum(lengths)
    total = max(_round_up(real, multiple_of), multiple_of)
    device = seqs[0].device
    stream = torch.full((total,), pad_id, dtype=seqs[0].dtype, device=device)
    stream[:real] = torch.cat(seqs) if real else stream[:0]
    cu = torch.tensor([0] + list(_cumsum(lengths)), dtype=torch.int32, device=device)
    return Packed(stream, cu, _positions(lengths, total, device), max(lengths))


def _cumsum(lengths):
    total = 0
    for n in lengths:
        total += n
        yield total


def pack_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor, *, multiple_of: int = 1,
                pad_id: int = 0) -> Packed:
    """Remove the padding of a ``(batch, seq)`` batch (``attention_mask`` 0 = pad) and pack its rows.

    Each row's kept tokens form one document, in order (left or right padding alike); ``Packed.unpack``
    puts per-token results back where they came from.
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(f"input_ids and attention_mask must both be (batch, seq), got {tuple(input_ids.shape)} "
                         f"and {tuple(attention_mask.shape)}")
    keep = attention_mask.bool()
    packed = pack_sequences([row[k] for row, k in zip(input_ids, keep)], multiple_of=multiple_of, pad_id=pad_id)
    index = keep.flatten().nonzero().flatten()
    return Packed(packed.input_ids, packed.cu_seqlens, packed.position_ids, packed.max_seqlen, index)


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document boundaries of Hugging Face's flattened format: a document starts wherever the position is 0.

    Args:
        position_ids: ``(T,)`` or ``(1, T)``, restarting at 0 at every document (``DataCollatorWithFlattening``).

    Returns:
        ``cu_seqlens`` int32 ``(documents + 1,)`` ending at ``T``.
    """
    pos = position_ids.reshape(-1)
    if position_ids.dim() == 2 and position_ids.shape[0] != 1:
        raise ValueError(f"flattened position_ids must be (1, T) or (T,), got {tuple(position_ids.shape)}")
    if pos.numel() == 0:
        return torch.zeros(1, dtype=torch.int32, device=pos.device)
    starts = (pos == 0).nonzero().flatten()
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError("position_ids must start at 0 (each document's positions count from 0)")
    end = torch.tensor([pos.numel()], device=pos.device)
    return torch.cat([starts, end]).to(torch.int32)


def shift_labels_by_document(labels: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Next-token targets of a packed stream that never cross a document boundary.

    Token ``i`` predicts ``labels[i + 1]`` when both are in the same document; a document's last token and
    every token of the padding tail get ``IGNORE_INDEX``.
    """
    t = labels.shape[-1]
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[..., :-1] = labels[..., 1:]
    ends = cu_seqlens.to(labels.device).long()[1:] - 1  # the last token of each document
    ends = ends[(ends >= 0) & (ends < t)]
    shifted[..., ends] = IGNORE_INDEX
    shifted[..., int(cu_seqlens[-1]):] = IGNORE_INDEX
    return shifted
