"""The sdpa backend (kernels/_sdpa.py): PyTorch's fused attention ops behind the carried-state contract."""

import pytest
import torch

from distattn import kernels
from distattn.kernels._sdpa import causal_pieces
from attn_ref import assert_all_close_by_rule, make_qkv, reference_grads

# sdpa vs the torch reference, both fp32 from fp32 inputs, in a different summation order (and the CPU op's
# vectorized exp): a few ulps of O(1) outputs and gradients (measured <= 3e-6).
SDPA_TOL = 1e-5

# (s_q, s_k, q_start, k_start): diagonal pair, bottom-right, offsets either way, fully visible, invisible, 1x1
OFFSETS = [(16, 16, 0, 0), (13, 19, 6, 0), (19, 13, 0, 0), (16, 16, 5, 0), (16, 16, 0, 5), (7, 30, 40, 0),
           (7, 30, -3, 0), (30, 7, 0, 3), (5, 9, 0, 20), (1, 1, 0, 0)]


def _visible(s_q, s_k, diag, causal):
    return {(i, j) for i in range(s_q) for j in range(s_k) if not causal or j <= i + diag}


@pytest.mark.parametrize("causal", [False, True])
def test_causal_pieces_cover_every_visible_pair_once(causal):
    for s_q in range(0, 7):
        for s_k in range(0, 7):
            for diag in range(-8, 9):
                pairs = []
                for p in causal_pieces(s_q, s_k, diag, causal):
                    assert p.r1 > p.r0 and p.c1 > p.c0, p
                    assert not p.causal or p.r1 - p.r0 == p.c1 - p.c0, f"causal piece not square: {p}"
                    pairs += [(i, p.c0 + j) for i in range(p.r0, p.r1) for j in range(p.c1 - p.c0)
                              if not p.causal or j <= i - p.r0]
                assert len(pairs) == len(set(pairs)), (s_q, s_k, diag)
                assert set(pairs) == _visible(s_q, s_k, diag, causal), (s_q, s_k, diag)


def test_diagonal_and_off_diagonal_pairs_are_one_call():
    assert causal_pieces(64, 64, 0, True) == [(0, 64, 0, 64, True)]
    assert causal_pieces(64, 64, 64, True) == [(0, 64, 0, 64, False)]
    assert causal_pieces(64, 64, -64, True) == []


def _run(backend, q, k, v, dout, qs, ks, causal, cuts, **mask):
    """forward in one call, the same forward folded over key chunks ``cuts``, backward per chunk."""
    kw = dict(softmax_scale=0.3, q_start=qs, causal=causal, backend=backend, **mask)
    out, lse = kernels.forward(q, k, v, k_start=ks, **kw)
    st = kernels.new_state(q)
    dq = torch.zeros(q.shape, device=q.device)
    dk, dv = torch.zeros(k.shape, device=q.device), torch.zeros(k.shape, device=q.device)
    delta = kernels.attn_delta(dout, out, backend=backend)
    for j0, j1 in zip(cuts[:-1], cuts[1:]):
        kernels.fold_(st, q, k[:, j0:j1], v[:, j0:j1], k_start=ks + j0, **kw)
        kernels.backward_chunk_(dout, q, k[:, j0:j1], v[:, j0:j1], lse, delta, dq, dk[:, j0:j1], dv[:, j0:j1],
                                k_start=ks + j0, **kw)
    folded_out, folded_lse = kernels.finalize(st, q.dtype)
    return out, lse, folded_out, folded_lse, dq, dk, dv


def _assert_same(ours, ref, tol):
    for a, b in zip(ours, ref):
        fin = torch.isfinite(b)
        assert torch.equal(fin, torch.isfinite(a))
        if fin.any():
            assert (a[fin].float() - b[fin].float()).abs().max() <= tol


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s_q,s_k,qs,ks", OFFSETS)
def test_agrees_with_torch_backend(s_q, s_k, qs, ks, causal):
    q, k, v, dout = make_qkv(2, s_q, s_k, 6, 2, 16, torch.float32, seed=s_q + s_k)
    cuts = sorted({0, min(4, s_k), s_k})
    ours = _run("sdpa", q, k, v, dout, qs, ks, causal, cuts)
    ref = _run("torch", q, k, v, dout, qs, ks, causal, cuts)
    _assert_same(ours, ref, SDPA_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("parts", [1, 2, 5])
def test_backward_per_chunk_with_final_lse_adds_up(parts, dtype):
    # The identity the backend relies on: with the final lse (and delta), each chunk's op backward gives the
    # globally normalized gradients of its keys and the chunks' dq add up to the whole attention's.
    b, s, h_q, h_kv, d = 1, 48, 4, 2, 32
    q, k, v, dout = make_qkv(b, s, s, h_q, h_kv, d, dtype, seed=parts)
    cuts = [round(s * i / parts) for i in range(parts + 1)]
    out, lse, f_out, f_lse, dq, dk, dv = _run("sdpa", q, k, v, dout, 0, 0, True, cuts)
    ref = reference_grads(q, k, v, dout, torch.float64, causal=True, scale=0.3)
    base = reference_grads(q, k, v, dout, dtype, causal=True, scale=0.3)
    assert_all_close_by_rule(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), base, ref, dtype)
    assert_all_close_by_rule(("out", "lse"), (f_out, f_lse), base[:2], ref[:2], dtype)


@pytest.mark.parametrize("mask", ["window", "softcap"])
def test_masks_the_ops_cannot_express_fall_back_to_the_reference(mask):
    q, k, v, dout = make_qkv(1, 20, 20, 4, 2, 16, torch.float32, seed=5)
    if mask == "window":
        kw = dict(bounds=kernels.window_bounds(20, 20, causal=True, window=(5, 0), device="cpu"))
        causal = False
    else:
        kw, causal = dict(softcap=2.5), True
    ours = _run("sdpa", q, k, v, dout, 0, 0, causal, [0, 7, 20], **kw)
    ref = _run("torch", q, k, v, dout, 0, 0, causal, [0, 7, 20], **kw)
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)  # the same code ran


def test_unknown_device_is_a_clear_error():
    with pytest.raises(ValueError, match=r"backend='sdpa' cannot run on device meta"):
        kernels.get_backend("sdpa", "meta")


# CUDA-only: kernels/_sdpa.py's _CudaFlashOps (the CUDA flash op) through the backend protocol.
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_flash_ops_by_rule(causal):
    q, k, v, dout = (t.cuda() for t in make_qkv(2, 300, 300, 8, 2, 128, torch.bfloat16, seed=1))
    out, lse, f_out, f_lse, dq, dk, dv = _run("sdpa", q, k, v, dout, 0, 0, causal, [0, 100, 300])
    cpu = lambda *ts: [t.cpu() for t in ts]  # noqa: E731
    ref = reference_grads(*cpu(q, k, v, dout), torch.float64, causal=causal, scale=0.3)
    base = reference_grads(*cpu(q, k, v, dout), torch.bfloat16, causal=causal, scale=0.3)
    assert_all_close_by_rule(("out", "lse", "dq", "dk", "dv"), cpu(out, lse, dq, dk, dv), base, ref, torch.bfloat16)
