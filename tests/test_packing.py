"""distattn.packing: padding-free streams from document lists, padded batches and HF's flattened format."""

import pytest
import torch

import distattn
from distattn.packing import (IGNORE_INDEX, cu_seqlens_from_position_ids, pack_padded, pack_sequences,
                              shift_labels_by_document)


def test_pack_sequences_layout_and_tail_padding():
    p = pack_sequences([torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([5, 6])], multiple_of=4, pad_id=0)
    assert p.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 0, 0]
    assert p.cu_seqlens.tolist() == [0, 3, 4, 6] and p.cu_seqlens.dtype == torch.int32
    assert p.position_ids.tolist() == [0, 1, 2, 0, 0, 1, 0, 1]
    assert p.max_seqlen == 3 and p.num_tokens == 6
    labels = shift_labels_by_document(p.input_ids, p.cu_seqlens)
    assert labels.tolist() == [2, 3, IGNORE_INDEX, IGNORE_INDEX, 6, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]


def test_pack_padded_round_trip_left_and_right_padding():
    ids = torch.tensor([[0, 0, 7, 8], [9, 10, 11, 0]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]])
    p = pack_padded(ids, mask, multiple_of=3)
    assert p.input_ids.tolist() == [7, 8, 9, 10, 11, 0] and p.cu_seqlens.tolist() == [0, 2, 5]
    back = p.unpack(p.input_ids, 2, 4, fill=-1)
    assert back.tolist() == [[-1, -1, 7, 8], [9, 10, 11, -1]]


def test_flattened_position_ids_to_cu_seqlens():
    assert cu_seqlens_from_position_ids(torch.tensor([[0, 1, 2, 0, 0, 1]])).tolist() == [0, 3, 4, 6]
    with pytest.raises(ValueError, match="position_ids must start at 0"):
        cu_seqlens_from_position_ids(torch.tensor([1, 2, 0]))


def test_packed_attention_equals_each_document_alone():
    """The point of packing: attention over the stream equals attention over each document separately."""
    g = torch.Generator().manual_seed(0)
    lengths = [1, 2, 17, 5]
    docs = [torch.randn(n, 4, 16, generator=g) for n in lengths]
    p = pack_sequences([torch.zeros(n) for n in lengths])
    qkv = torch.cat(docs)
    out = distattn.flash_attn_varlen_func(qkv, qkv, qkv, p.cu_seqlens, p.cu_seqlens, p.max_seqlen, p.max_seqlen,
                                          causal=True)
    alone = torch.cat([distattn.flash_attn_func(d[None], d[None], d[None], causal=True)[0] for d in docs])
    assert torch.allclose(out, alone, atol=1e-6)


def test_bad_inputs():
    with pytest.raises(ValueError, match="multiple_of must be a positive int"):
        pack_sequences([torch.tensor([1])], multiple_of=0)
    with pytest.raises(ValueError, match="document 0 must be 1-D"):
        pack_sequences([torch.zeros(2, 2)])
    with pytest.raises(ValueError, match=r"must both be \(batch, seq\)"):
        pack_padded(torch.zeros(2, 3), torch.zeros(2, 4))
