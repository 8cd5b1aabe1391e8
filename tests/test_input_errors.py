"""Odd inputs give the same clear ValueError/TypeError as the plain checks, never a bare AssertionError, TypeError
or torch's NotImplementedError: ``schedule="auto"`` with a bad ``cu_seqlens`` (the cost model reads it, so it is
validated first), and ``meta`` tensors (shapes without data) in every public function."""

import pytest
import torch

import distattn
from dist_utils import run_distributed

I32 = torch.int32
META = r"q, k, v are on the meta device \(shapes without data\).*CUDA \(triton backend\) and CPU.*\.to\('cuda'\)"
# (cu_seqlens, max_seqlen, error, message) for P = 2 ranks of 4 tokens: a stream of 8
BAD_CU = [
    (torch.tensor([[0, 8]], dtype=I32), 8, ValueError, r"cu_seqlens must be 1-D with batch \+ 1 >= 2 entries, got "
                                                       r"shape \(1, 2\)"),
    (torch.tensor([0, 1 << 40]), 1 << 40, ValueError, r"cu_seqlens\[-1\] = 1099511627776 is more than the stream "
                                                      r"holds \(8 = 2 ranks x 4 tokens\)"),
    (torch.tensor([0, 9], dtype=I32), 9, ValueError, r"is more than the stream holds \(8 = 2 ranks x 4 tokens\)"),
    (torch.tensor([0, 5, 3, 8], dtype=I32), 5, ValueError, r"cu_seqlens must be non-decreasing"),
    (torch.tensor([0.0, 8.0]), 8, TypeError, r"cu_seqlens must be int32 or int64, got torch.float32"),
    ([0, 8], 8, TypeError, r"cu_seqlens must be a torch.Tensor of int32 or int64, got list"),
    (torch.tensor([0, 8], dtype=I32, device="meta"), 8, ValueError, r"cu_seqlens is on the meta device.*pass a CPU "
                                                                    r"or CUDA tensor"),
    (torch.tensor([0, 8], dtype=I32), 4, ValueError, r"max_seqlen \(4\) must be an int >= the longest document \(8\)"),
]


def _meta(*shape):
    return torch.empty(*shape, device="meta")


def test_meta_tensors_on_one_device():
    q = _meta(1, 8, 2, 16)
    with pytest.raises(ValueError, match=META):
        distattn.flash_attn_func(q, q, q, causal=True)
    cu = torch.tensor([0, 8], dtype=I32, device="meta")
    with pytest.raises(ValueError, match=META):
        distattn.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 8, 8)
    cpu = torch.zeros(8, 2, 16)
    with pytest.raises(ValueError, match=r"cu_seqlens_q is on meta but the tokens are on cpu"):  # the device check
        distattn.flash_attn_varlen_func(cpu, cpu, cpu, cu, cu, 8, 8)


def _dist_worker(rank, world):
    x = torch.zeros(4, 2, 8)
    for schedule in ("auto", "balanced"):  # auto: the same error as the plain schedule, before the cost model
        for cu, max_seqlen, error, message in BAD_CU:
            with pytest.raises(error, match=message):
                distattn.dist_flash_attn_varlen_func(x, x, x, cu, max_seqlen, causal=True, schedule=schedule)
    q = _meta(1, 4, 2, 8)
    for schedule in ("auto", "balanced", "zigzag"):
        with pytest.raises(ValueError, match=META):
            distattn.dist_flash_attn_func(q, q, q, causal=True, schedule=schedule)
        with pytest.raises(ValueError, match=META):
            distattn.dist_flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 8], dtype=I32), 8,
                                                 schedule=schedule)
    # and a good call afterwards works (nothing above left a communicator half-used)
    out = distattn.dist_flash_attn_varlen_func(x + 1, x, x, torch.tensor([0, 3, 8], dtype=I32), 5, causal=True,
                                               schedule="auto")
    return tuple(out.shape)


def test_auto_with_bad_cu_seqlens_and_meta_tensors_across_ranks():
    assert run_distributed(_dist_worker, 2, timeout=180) == [(4, 2, 8)] * 2
