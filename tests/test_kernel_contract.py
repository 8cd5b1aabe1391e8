"""The carried-state contract (torch backend): folding, merging, chunked backward equal one call."""

import pytest
import torch

from distattn import kernels
from attn_ref import assert_all_close_by_rule, assert_close_by_rule, make_qkv, naive_attention, reference_grads

# The same maths in a different summation order: fp32 agrees to a few ulps of O(1) values.
FOLD_TOL = 2e-6
# lse of fp16 inputs, folded in pieces vs one call. The torch reference forms fp32 logits: a few ulps. PyTorch's CPU
# flash op (the sdpa backend, CPU default) forms the logits of 2-byte inputs less exactly (~4e-5 from fp64 at |lse|
# ~ 5, still 25x better than plain fp16 PyTorch), so its pieces agree to that.
LSE_TOL_HALF = {"torch": 1e-5, "sdpa": 1e-4}


def _split(n, parts):
    """Split range(n) into `parts` contiguous, uneven pieces (some may be empty when parts > n)."""
    cuts = sorted({round(n * i * i / parts / parts) for i in range(parts + 1)} | {0, n})
    return list(zip(cuts[:-1], cuts[1:]))


def _fold_all(q, k, v, chunks, scale, q_start, causal, state=None, backend=None):
    state = kernels.new_state(q) if state is None else state
    for j0, j1 in chunks:
        kernels.fold_(state, q, k[:, j0:j1], v[:, j0:j1], softmax_scale=scale, q_start=q_start,
                      k_start=j0, causal=causal, backend=backend)
    return state


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
@pytest.mark.parametrize("causal", [False, True])
def test_fold_in_chunks_equals_one_call(parts, causal):
    q, k, v, _ = make_qkv(2, 37, 61, 6, 2, 24, torch.float32, seed=parts)
    scale, q_start = 24 ** -0.5, 61 - 37
    one_out, one_lse = kernels.forward(q, k, v, softmax_scale=scale, q_start=q_start, causal=causal)
    out, lse = kernels.finalize(_fold_all(q, k, v, _split(61, parts), scale, q_start, causal), q.dtype)
    assert (out - one_out).abs().max() <= FOLD_TOL
    assert (lse - one_lse).abs().max() <= FOLD_TOL
    ref_out, _ = naive_attention(q, k, v, causal=causal)
    assert_close_by_rule("out", out, naive_attention(q, k, v, causal=causal, dtype=torch.float32)[0], ref_out,
                         torch.float32)


@pytest.mark.parametrize("backend", ["torch", "sdpa"])
@pytest.mark.parametrize("parts", [2, 3, 7])
@pytest.mark.parametrize("causal", [False, True])
def test_partial_from_second_state_merges_to_one_call(parts, causal, backend):
    q, k, v, _ = make_qkv(1, 29, 50, 4, 1, 16, torch.float16, seed=3)
    scale, q_start = 0.25, 50 - 29
    chunks = _split(50, parts)
    mine = _fold_all(q, k, v, chunks[::2], scale, q_start, causal, backend=backend)     # this rank: even chunks
    remote = _fold_all(q, k, v, chunks[1::2], scale, q_start, causal, backend=backend)  # a helper: odd chunks
    kernels.merge_(mine, remote.out.half(), remote.lse, backend=backend)  # partial may arrive in any dtype
    out, lse = kernels.finalize(mine, torch.float16)
    one_out, one_lse = kernels.forward(q, k, v, softmax_scale=scale, q_start=q_start, causal=causal, backend=backend)
    assert out.dtype == torch.float16
    assert (out.float() - one_out.float()).abs().max() <= 2e-3  # remote half rounding + final rounding
    finite = torch.isfinite(one_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite] - one_lse[finite]).abs().max() <= LSE_TOL_HALF[backend]


def test_merge_handles_empty_sides():
    q, k, v, _ = make_qkv(1, 4, 4, 2, 2, 8, torch.float32)
    full = kernels.new_state(q)
    kernels.fold_(full, q, k, v, softmax_scale=0.3)
    empty = kernels.new_state(q)
    both = kernels.new_state(q)
    kernels.merge_(both, empty.out, empty.lse)        # empty + empty stays empty, no NaN
    assert torch.all(both.out == 0) and torch.all(both.lse == float("-inf"))
    left = kernels.new_state(q)
    kernels.merge_(left, full.out, full.lse)          # empty + full == full
    assert torch.equal(left.out, full.out) and torch.equal(left.lse, full.lse)
    right = kernels.AttnState(full.out.clone(), full.lse.clone())
    kernels.merge_(right, empty.out, empty.lse)       # full + empty == full
    assert torch.equal(right.out, full.out) and torch.equal(right.lse, full.lse)


def test_fold_of_fully_masked_chunk_keeps_state():
    # keys strictly after every query: the causal fold must leave the state untouched
    q, k, v, _ = make_qkv(1, 5, 5, 2, 1, 8, torch.float32)
    st = kernels.new_state(q)
    kernels.fold_(st, q, k, v, softmax_scale=0.3, q_start=0, k_start=0, causal=True)
    before = kernels.AttnState(st.out.clone(), st.lse.clone())
    kernels.fold_(st, q, k, v, softmax_scale=0.3, q_start=0, k_start=5, causal=True)
    assert torch.equal(st.out, before.out) and torch.equal(st.lse, before.lse)


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_in_chunks_equals_reference(parts, causal):
    b, s_q, s_k, h_q, h_kv, d = 2, 23, 41, 8, 2, 16
    q, k, v, dout = make_qkv(b, s_q, s_k, h_q, h_kv, d, torch.float32, seed=7)
    scale, q_start = d ** -0.5, s_k - s_q
    out, lse = kernels.forward(q, k, v, softmax_scale=scale, q_start=q_start, causal=causal)
    delta = kernels.attn_delta(dout, out)
    dq = torch.zeros(q.shape)
    dk, dv = torch.zeros(k.shape), torch.zeros(k.shape)
    for j0, j1 in _split(s_k, parts):
        dk_c, dv_c = torch.zeros(b, j1 - j0, h_kv, d), torch.zeros(b, j1 - j0, h_kv, d)
        kernels.backward_chunk_(dout, q, k[:, j0:j1], v[:, j0:j1], lse, delta, dq, dk_c, dv_c,
                                softmax_scale=scale, q_start=q_start, k_start=j0, causal=causal)
        dk[:, j0:j1], dv[:, j0:j1] = dk_c, dv_c
    ref = reference_grads(q, k, v, dout, torch.float64, causal=causal)
    base = reference_grads(q, k, v, dout, torch.float32, causal=causal)
    assert_all_close_by_rule(("dq", "dk", "dv"), (dq, dk, dv), base[2:], ref[2:], torch.float32)


def test_backward_accumulates_into_existing_buffers():
    q, k, v, dout = make_qkv(1, 8, 8, 2, 2, 8, torch.float32)
    out, lse = kernels.forward(q, k, v, softmax_scale=0.3)
    delta = kernels.attn_delta(dout, out)
    bufs = [torch.ones(q.shape), torch.ones(k.shape), torch.ones(k.shape)]
    fresh = [torch.zeros(q.shape), torch.zeros(k.shape), torch.zeros(k.shape)]
    for acc in (bufs, fresh):
        kernels.backward_chunk_(dout, q, k, v, lse, delta, *acc, softmax_scale=0.3)
    for a, f in zip(bufs, fresh):
        assert torch.allclose(a, f + 1, atol=1e-6)


@pytest.mark.parametrize("block_k", [1, 5, 64])
def test_result_independent_of_key_block(block_k):
    from distattn.kernels._torch import TorchBackend

    q, k, v, _ = make_qkv(1, 13, 19, 3, 1, 8, torch.float32)
    a = kernels.forward(q, k, v, softmax_scale=0.4, causal=True, q_start=6, backend=TorchBackend(block_k))
    b = kernels.forward(q, k, v, softmax_scale=0.4, causal=True, q_start=6)
    assert (a[0] - b[0]).abs().max() <= FOLD_TOL and (a[1] - b[1]).abs().max() <= FOLD_TOL
