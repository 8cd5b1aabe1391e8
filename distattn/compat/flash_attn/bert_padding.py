"""flash-attn's ``flash_attn.bert_padding`` on distattn: between a padded batch and the packed (varlen) layout.

``from flash_attn.bert_padding import pad_input, unpad_input`` -> ``from distattn.compat.flash_attn.bert_padding
import pad_input, unpad_input``. Plain PyTorch indexing (differentiable: the backward of a gather is the scatter
flash-attn writes by hand), the results flash-attn documents: ``unpad_input`` returns five values as flash-attn
>= 2.6 (``seqused`` last), ``cu_seqlens`` int32 starting at 0, ``max_seqlen`` a Python int.

Legend: ``b`` batch, ``s`` padded length, ``nnz`` tokens kept, ``...`` any trailing dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["index_first_axis", "index_put_first_axis", "index_first_axis_residual", "unpad_input",
           "unpad_input_for_concatenated_sequences", "pad_input"]


def _at_least_2d(name: str, t) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() < 2:
        raise ValueError(f"{name} must be a tensor of at least 2 dims (rows, ...), got "
                         f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")


def index_first_axis(input, indices):
    """``input[indices]`` along the first dim: ``(n, ...)`` -> ``(len(indices), ...)``."""
    _at_least_2d("input", input)
    return input[indices]


def index_put_first_axis(values, indices, first_axis_dim: int):
    """Zeros of ``(first_axis_dim, ...)`` with ``values`` at rows ``indices`` (1-D)."""
    _at_least_2d("values", values)
    if indices.dim() != 1:
        raise ValueError(f"indices must be 1-D, got shape {tuple(indices.shape)}")
    out = values.new_zeros(first_axis_dim, *values.shape[1:])
    return out.index_put((indices,), values)


def index_first_axis_residual(input, indices):
    """``(input[indices], input)``: the gathered rows and the input itself as a residual (gradients of both reach
    ``input``)."""
    _at_least_2d("input", input)
    return input[indices], input.view_as(input)


def _packed(hidden_states, keep, lengths):
    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    return hidden_states.reshape(-1, *hidden_states.shape[2:])[indices], indices, cu_seqlens, int(lengths.max())


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """Keep the tokens of ``attention_mask`` (and of ``unused_mask``: allocated but unused), in order.

    Args:
        hidden_states: ``(b, s, ...)``.
        attention_mask: ``(b, s)`` bool/int, 1 = a token.
        unused_mask: ``(b, s)`` bool/int or None, 1 = a slot kept but not counted in ``seqused``.

    Returns:
        ``(hidden (nnz, ...), indices (nnz,) into the flattened (b * s), cu_seqlens (b + 1,) int32, max_seqlen int,
        seqused (b,) int32)`` (``seqused``: the ``attention_mask`` tokens of each row).
    """
    if attention_mask.dim() != 2 or hidden_states.shape[:2] != attention_mask.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must be (batch, seqlen) of hidden_states "
                         f"{tuple(hidden_states.shape)}")
    keep = attention_mask if unused_mask is None else attention_mask + unused_mask
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    return _packed(hidden_states, keep != 0, keep.sum(dim=-1, dtype=torch.int32)) + (used,)


def unpad_input_for_concatenated_sequences(hidden_states, attention_mask_in_length):
    """Several documents per row: row ``i``'s nonzero entries of ``attention_mask_in_length (b, s)`` are the lengths
    of its documents, packed from the row's start (e.g. ``[2, 3, 0, 0, 0, 0]``: two documents, 2 and 3 tokens).

    Returns:
        ``(hidden (nnz, ...), indices (nnz,), cu_seqlens (documents + 1,) int32 over every document, max_seqlen)``.
    """
    lengths_2d = attention_mask_in_length
    if lengths_2d.dim() != 2 or hidden_states.shape[:2] != lengths_2d.shape:
        raise ValueError(f"attention_mask_in_length {tuple(lengths_2d.shape)} must be (batch, seqlen) of "
                         f"hidden_states {tuple(hidden_states.shape)}")
    s = lengths_2d.shape[1]
    keep = torch.arange(s, device=lengths_2d.device)[None, :] < lengths_2d.sum(dim=-1, keepdim=True)
    documents = lengths_2d.flatten()[lengths_2d.flatten() != 0]
    return _packed(hidden_states, keep, documents)


def pad_input(hidden_states, indices, batch: int, seqlen: int):
    """The inverse of :func:`unpad_input`: ``(nnz, ...)`` -> ``(batch, seqlen, ...)``, zeros where no token."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
