"""Masks beyond causal on one device: sliding windows and soft-capping in ``flash_attn_func``, the kernel
contract with ``bounds=`` (carried state over key chunks), and flash-attn's public signatures.

Every expected result comes from an explicit boolean mask built from flash-attn's definitions
(``attn_ref.band_mask``/``varlen_mask``), never from distattn's ``KeyBounds``. Accuracy rule: tests/attn_ref.py.
Triton runs through the interpreter (conftest.py), fp32/fp16 only, small shapes.

Legend: ``b`` batch, ``s_q``/``s_k`` lengths, ``h_q``/``h_kv`` heads, ``d`` head dim.
"""

import inspect

import pytest
import torch

import distattn
from attn_ref import (assert_all_close_by_rule, band_mask, make_qkv, masked_attention, masked_reference_grads,
                      naive_attention, varlen_mask)
from distattn import kernels
from distattn.kernels import _triton

TRITON_OK, TRITON_WHY = _triton.is_available("cpu")
F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16
NAMES = ("out", "lse", "dq", "dk", "dv")
# Same maths in a different key-chunk order: fp32 results agree to a few ulps of O(1) values (gradients are
# sums of up to a few dozen such terms).
FOLD_TOL = 1e-5


def _cu(lens):
    """int32 cumulative lengths ``[0, l0, l0 + l1, ...]``."""
    return torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)


def _skip_unavailable(backend):
    if backend == "triton" and not TRITON_OK:
        pytest.skip(f"triton backend unavailable: {TRITON_WHY}")


# -- the reference itself ------------------------------------------------------------------------------------
def test_reference_band_mask_matches_naive_causal():
    """The explicit-mask reference agrees with the existing causal reference (bottom-right, s_q != s_k)."""
    for s_q, s_k in ((9, 9), (5, 12), (12, 5)):
        q, k, v, _ = make_qkv(2, s_q, s_k, 4, 2, 8, torch.float64, seed=s_q)
        a = masked_attention(q, k, v, band_mask(s_q, s_k, causal=True))
        b = naive_attention(q, k, v, causal=True)
        assert (a[0] - b[0]).abs().max() < 1e-12
        assert torch.equal(torch.isinf(a[1]), torch.isinf(b[1]))
        fin = torch.isfinite(b[1])
        assert (a[1][fin] - b[1][fin]).abs().max() < 1e-12


def test_reference_band_mask_by_hand():
    # s_q=3, s_k=5, window (1, 0), not causal: rows at positions 2, 3, 4 see [1, 2], [2, 3], [3, 4]
    want = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(band_mask(3, 5, window=(1, 0)), want)
    # causal overrides a right window: (7, 7) causal == (7, 0)
    assert torch.equal(band_mask(6, 6, causal=True, window=(7, 7)), band_mask(6, 6, window=(7, 0)))
    # s_q > s_k, window (0, 0): the first rows sit before key 0 and see nothing
    m = band_mask(4, 2, window=(0, 0))
    assert m.sum(1).tolist() == [0, 0, 1, 1]
    # doc 0 has 2 queries on 1 key: bottom-right, query 0 sits at position -1 and sees nothing
    assert varlen_mask([2, 0, 1], [1, 3, 2], causal=True).tolist() == [
        [False, False, False, False, False, False],
        [True, False, False, False, False, False],
        [False, False, False, False, True, True]]


# -- flash_attn_func with window_size and softcap -------------------------------------------------------------
# (s_q, s_k, h_q, h_kv, d, causal, window, softcap), batch 2
DENSE = {
    "eq-win5-3-full": (24, 24, 4, 2, 16, False, (5, 3), 0.0),
    "eq-win5-0-causal-softcap": (24, 24, 4, 2, 16, True, (5, 0), 5.0),
    "eq-win0-0-full": (19, 19, 2, 2, 16, False, (0, 0), 0.0),
    "eq-win-larger-than-seq": (16, 16, 2, 1, 16, False, (100, 100), 0.0),
    "eq-win-left-unlimited-right-3": (21, 21, 2, 1, 16, False, (-1, 3), 0.0),
    "q<k-win-left-unlimited-causal": (9, 21, 2, 1, 16, True, (-1, 4), 0.0),
    "q<k-win7-7-causal": (20, 37, 2, 1, 16, True, (7, 7), 0.0),
    "q<k-win3-2-full-softcap-d80": (20, 37, 2, 2, 80, False, (3, 2), 5.0),
    "q>k-win4-0-causal": (37, 20, 4, 2, 16, True, (4, 0), 0.0),  # first 17 rows see nothing
    "q>k-win2-1-full": (37, 20, 3, 1, 16, False, (2, 1), 0.0),   # rows above key 0 - 1 see nothing
    "eq-softcap-causal": (30, 30, 2, 1, 16, True, (-1, -1), 5.0),
    "q>k-softcap0.3-causal": (20, 9, 2, 1, 16, True, (-1, -1), 0.3),  # saturating tanh, empty rows
    "q<k-softcap-full": (17, 30, 4, 2, 16, False, (-1, -1), 5.0),
}


# Regression (found by this grid): kernels.window_bounds with left = -1 (unlimited) returned ``lo`` as a 0-dim
# tensor instead of one entry per row (torch backend: TypeError; triton: out-of-bounds reads, a hang in the
# interpreter). The (-1, right) windows below keep it covered.


def _dense_params():
    out = []
    for i, name in enumerate(DENSE):
        runs = [("torch", F32), ("torch", F16), ("torch", BF16), ("triton", (F32, F16)[i % 2])]
        for be, dt in runs:
            out.append(pytest.param(name, be, dt, id=f"{name}-{be}-{str(dt)[6:]}"))
    return out


@pytest.mark.parametrize("name,backend,dtype", _dense_params())
def test_flash_attn_func_window_softcap(name, backend, dtype):
    _skip_unavailable(backend)
    s_q, s_k, h_q, h_kv, d, causal, window, softcap = DENSE[name]
    q, k, v, dout = make_qkv(2, s_q, s_k, h_q, h_kv, d, dtype, seed=len(name))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = distattn.flash_attn_func(qg, kg, vg, causal=causal, window_size=window, softcap=softcap,
                                        return_lse=True, backend=backend)
    out.backward(dout)
    assert out.dtype == dtype and lse.shape == (2, h_q, s_q) and lse.dtype == torch.float32
    mask = band_mask(s_q, s_k, causal=causal, window=window)
    ref = masked_reference_grads(q, k, v, dout, mask, torch.float64, softcap=softcap)
    base = masked_reference_grads(q, k, v, dout, mask, dtype, softcap=softcap)
    assert_all_close_by_rule(NAMES, (out.detach(), lse, qg.grad, kg.grad, vg.grad), base, ref, dtype)
    dead_rows, dead_keys = ~mask.any(1), ~mask.any(0)
    assert torch.all(out.detach()[:, dead_rows] == 0) and torch.all(lse[:, :, dead_rows] == float("-inf"))
    assert torch.all(qg.grad[:, dead_rows] == 0)
    assert torch.all(kg.grad[:, dead_keys] == 0) and torch.all(vg.grad[:, dead_keys] == 0)


@pytest.mark.parametrize("causal,window", [(False, (-1, 1)), (True, (-1, 0)), (True, (-1, 5))])
def test_window_bounds_have_one_entry_per_row(causal, window):
    """``KeyBounds`` are ``(s_q,)`` per the contract, whatever the window (kernel-level reproducer)."""
    b = kernels.window_bounds(5, 7, causal=causal, window=window, device="cpu")
    assert b.lo.shape == (5,) and b.hi.shape == (5,)
    want = band_mask(5, 7, causal=causal, window=window)
    j = torch.arange(7)[None, :]
    assert torch.equal((j >= b.lo[:, None]) & (j <= b.hi[:, None]), want)


def test_window_bounds_match_explicit_mask():
    for s_q, s_k in ((5, 7), (7, 5), (6, 6)):
        for causal, window in ((False, (2, 1)), (True, (3, 0)), (False, (0, -1)), (True, (1, 9)), (False, (9, 0))):
            b = kernels.window_bounds(s_q, s_k, causal=causal, window=window, device="cpu")
            j = torch.arange(s_k)[None, :]
            got = (j >= b.lo[:, None]) & (j <= b.hi[:, None])
            assert torch.equal(got, band_mask(s_q, s_k, causal=causal, window=window)), (s_q, s_k, causal, window)
            assert torch.all(b.lo[1:] >= b.lo[:-1]) and torch.all(b.hi[1:] >= b.hi[:-1])  # nondecreasing


def test_window_size_as_list_accepted():
    q, k, v, _ = make_qkv(1, 9, 9, 2, 1, 16, F32)
    a = distattn.flash_attn_func(q, k, v, window_size=[2, 1])
    b = distattn.flash_attn_func(q, k, v, window_size=(2, 1))
    assert torch.equal(a, b)


def test_window_actually_masks():
    """A window changes the result (guards against a window silently ignored)."""
    q, k, v, _ = make_qkv(1, 20, 20, 2, 2, 16, F32, seed=3)
    # one backend for both (the CPU default runs the dense call on PyTorch's fused op, windows on the reference)
    full = distattn.flash_attn_func(q, k, v, causal=True, backend="torch")
    win = distattn.flash_attn_func(q, k, v, causal=True, window_size=(3, 0), backend="torch")
    assert torch.equal(full[:, :4], win[:, :4])  # rows 0..3 see keys 0..p either way (bitwise: same tiles)
    assert (full[:, 4:] - win[:, 4:]).abs().amax(dim=(0, 2, 3)).min() > 1e-3


def test_deterministic_flag_accepted_and_repeatable():
    q, k, v, _ = make_qkv(1, 12, 12, 2, 1, 16, F32)
    a = distattn.flash_attn_func(q, k, v, causal=True, deterministic=True)
    b = distattn.flash_attn_func(q, k, v, causal=True, deterministic=False)
    assert torch.equal(a, b)


# -- kernel contract with bounds: chunks of keys fold / backpropagate to the one-call result --------------------
# lens_q, lens_k, causal, window, softcap, rows (query rows of the stream this "rank" holds), key cuts
CONTRACT = {
    "varlen-sq!=sk-causal-win": ([5, 0, 9, 20], [3, 4, 9, 11], True, (6, 0), 0.0, (0, 34), [7, 19]),
    "varlen-full-win-softcap": ([11, 1, 0, 15], [11, 1, 0, 15], False, (3, 4), 5.0, (0, 27), [5, 13]),
    "varlen-rows-subset": ([6, 13, 2, 9], [6, 13, 2, 9], True, (-1, -1), 0.0, (3, 25), [9, 21]),
    "dense-window-q<k": ([17], [29], False, (4, 2), 0.0, (0, 17), [3, 15]),
}


def _bounds_for(name, device="cpu"):
    lens_q, lens_k, causal, window, softcap, rows, cuts = CONTRACT[name]
    if name.startswith("dense"):
        bounds = kernels.window_bounds(lens_q[0], lens_k[0], causal=causal, window=window, device=device)
    else:
        bounds = kernels.varlen_bounds(_cu(lens_q), _cu(lens_k), rows, causal=causal, window=window)
    mask = varlen_mask(lens_q, lens_k, causal=causal, window=window)[rows[0]:rows[1]]
    total_k = sum(lens_k)
    chunks = list(zip([0] + cuts, cuts + [total_k]))
    return bounds, mask, chunks, softcap


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", list(CONTRACT))
def test_fold_and_backward_chunks_with_bounds(name, backend):
    _skip_unavailable(backend)
    bounds, mask, chunks, softcap = _bounds_for(name)
    s_q, s_k = mask.shape
    h_q, h_kv, d = 2, 1, 16
    q, k, v, dout = make_qkv(1, s_q, s_k, h_q, h_kv, d, F32, seed=s_k)
    kw = dict(softmax_scale=d ** -0.5, bounds=bounds, softcap=softcap, backend=backend)

    # forward: one call vs folding three key chunks (each at its global k_start) into a carried state
    one_out, one_lse = kernels.forward(q, k, v, **kw)
    state = kernels.new_state(q)
    for j0, j1 in chunks:
        kernels.fold_(state, q, k[:, j0:j1], v[:, j0:j1], k_start=j0, **kw)
    out, lse = kernels.finalize(state, F32)
    assert (out - one_out).abs().max() <= FOLD_TOL
    assert torch.equal(torch.isinf(lse), torch.isinf(one_lse))
    fin = torch.isfinite(one_lse)
    assert (lse[fin] - one_lse[fin]).abs().max() <= FOLD_TOL

    # backward: one call vs the sum over chunks (dq shared, dk/dv written per chunk)
    delta = kernels.attn_delta(dout, one_out, backend=backend)
    one = [torch.zeros(t.shape) for t in (q, k, v)]
    kernels.backward_chunk_(dout, q, k, v, one_lse, delta, *one, **kw)
    dq, dk, dv = (torch.zeros(t.shape) for t in (q, k, v))
    for j0, j1 in chunks:
        dk_c, dv_c = torch.zeros(1, j1 - j0, h_kv, d), torch.zeros(1, j1 - j0, h_kv, d)
        kernels.backward_chunk_(dout, q, k[:, j0:j1], v[:, j0:j1], one_lse, delta, dq, dk_c, dv_c, k_start=j0,
                                **kw)
        dk[:, j0:j1], dv[:, j0:j1] = dk_c, dv_c
    for nm, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), one):
        assert (got - want).abs().max() <= FOLD_TOL, nm

    # and both agree with the explicit-mask reference
    ref = masked_reference_grads(q, k, v, dout, mask, torch.float64, softcap=softcap)
    base = masked_reference_grads(q, k, v, dout, mask, F32, softcap=softcap)
    assert_all_close_by_rule(NAMES, (out, lse, dq, dk, dv), base, ref, F32)


# Small tiles for the torch backend: at the sizes above its default 128 x 128 tile holds a whole document, so
# block skipping and the "every row sees this block whole" shortcut are exercised only with small tiles.
SMALL_TILES = {
    "docs-sq!=sk-causal-win": ([5, 0, 9, 20, 1], [3, 4, 9, 11, 2], True, (6, 0), 0.0),
    "docs-full-win-softcap": ([11, 1, 0, 15, 7], [11, 1, 0, 15, 7], False, (3, 4), 2.0),
    "docs-causal": ([6, 13, 2, 9, 1, 1], [6, 13, 2, 9, 1, 1], True, (-1, -1), 0.0),
    "docs-full-q>k": ([9, 7, 3], [2, 7, 8], False, (1, 1), 0.0),
}


@pytest.mark.parametrize("blocks", [(1, 1), (4, 3), (16, 5)], ids=lambda b: f"bq{b[0]}-bk{b[1]}")
@pytest.mark.parametrize("name", list(SMALL_TILES))
def test_torch_backend_small_tiles_with_bounds(name, blocks):
    from distattn.kernels._torch import TorchBackend

    lens_q, lens_k, causal, window, softcap = SMALL_TILES[name]
    bounds = kernels.varlen_bounds(_cu(lens_q), _cu(lens_k), (0, sum(lens_q)), causal=causal, window=window)
    mask = varlen_mask(lens_q, lens_k, causal=causal, window=window)
    q, k, v, dout = make_qkv(1, sum(lens_q), sum(lens_k), 4, 2, 16, F32, seed=sum(blocks))
    kw = dict(softmax_scale=0.25, bounds=bounds, softcap=softcap, backend=TorchBackend(*blocks))
    out, lse = kernels.forward(q, k, v, **kw)
    grads = [torch.zeros(t.shape) for t in (q, k, v)]
    kernels.backward_chunk_(dout, q, k, v, lse, kernels.attn_delta(dout, out), *grads, **kw)
    ref = masked_reference_grads(q, k, v, dout, mask, torch.float64, scale=0.25, softcap=softcap)
    base = masked_reference_grads(q, k, v, dout, mask, F32, scale=0.25, softcap=softcap)
    assert_all_close_by_rule(NAMES, (out, lse, *grads), base, ref, F32)


# -- flash-attn's signatures ---------------------------------------------------------------------------------
_FA_TAIL = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
            ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
_E = inspect.Parameter.empty
FLASH_ATTN_FUNC = [("q", _E), ("k", _E), ("v", _E)] + _FA_TAIL
FLASH_ATTN_VARLEN_FUNC = ([("q", _E), ("k", _E), ("v", _E), ("cu_seqlens_q", _E), ("cu_seqlens_k", _E),
                           ("max_seqlen_q", _E), ("max_seqlen_k", _E)] + _FA_TAIL + [("block_table", None)])


@pytest.mark.parametrize("fn,want", [(distattn.flash_attn_func, FLASH_ATTN_FUNC),
                                     (distattn.flash_attn_varlen_func, FLASH_ATTN_VARLEN_FUNC)],
                         ids=["flash_attn_func", "flash_attn_varlen_func"])
def test_signature_is_flash_attns(fn, want):
    params = list(inspect.signature(fn).parameters.values())
    positional = [p for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert [(p.name, p.default) for p in positional] == want
    assert params[:len(positional)] == positional  # flash-attn's arguments first, in order
    assert all(p.kind == p.KEYWORD_ONLY for p in params[len(positional):])  # then distattn's, keyword-only
    assert {"return_lse", "backend"} <= {p.name for p in params[len(positional):]}


def test_positional_call_runs_causal():
    q, k, v, _ = make_qkv(1, 10, 10, 2, 2, 16, F32, seed=2)
    out = distattn.flash_attn_func(q, k, v, 0.0, None, True)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    ref = naive_attention(q, k, v, causal=True)[0]
    assert (out.double() - ref).abs().max() < 1e-5
    assert (distattn.flash_attn_func(q, k, v) - out).abs().max() > 1e-3  # not the non-causal result


def test_positional_varlen_call_window_and_softcap():
    lens = [6, 9]
    q, k, v, _ = make_qkv(1, 15, 15, 2, 1, 16, F32, seed=5)
    cu = torch.tensor([0, 6, 15], dtype=torch.int32)
    out = distattn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 9, 9, 0.0, None, True, (2, 0), 5.0)
    assert isinstance(out, torch.Tensor) and out.shape == q[0].shape
    ref = masked_attention(q, k, v, varlen_mask(lens, lens, causal=True, window=(2, 0)), softcap=5.0)[0][0]
    assert (out.double() - ref).abs().max() < 1e-5


def test_return_attn_probs_dense():
    q, k, v, _ = make_qkv(2, 8, 8, 2, 2, 16, F32)
    res = distattn.flash_attn_func(q, k, v, causal=True, window_size=(2, 0), return_attn_probs=True)
    assert isinstance(res, tuple) and len(res) == 3 and res[2] is None and res[1].shape == (2, 2, 8)


# -- validation of the new options on flash_attn_func -----------------------------------------------------------
BAD = [
    ("window-minus-2", {"window_size": (3, -2)}, ValueError, r"window_size right .*-2"),
    ("window-bool", {"window_size": (True, 0)}, ValueError, r"window_size left .*True"),
    ("window-float", {"window_size": (2.0, 0)}, ValueError, r"window_size left .*2.0"),
    ("window-scalar", {"window_size": 8}, TypeError, r"window_size must be a pair .*8"),
    ("window-none", {"window_size": None}, TypeError, r"window_size must be a pair .*None"),
    ("softcap-negative", {"softcap": -0.5}, ValueError, r"softcap .*>= 0.*-0.5"),
    ("softcap-nan", {"softcap": float("nan")}, ValueError, r"softcap .*nan"),
    ("softcap-inf", {"softcap": float("inf")}, ValueError, r"softcap .*inf"),
    ("softcap-string", {"softcap": "5"}, TypeError, r"softcap must be a number"),
    ("dropout", {"dropout_p": 0.5}, ValueError, r"dropout_p=0.5.*dropout_p=0.0"),
    ("alibi", {"alibi_slopes": torch.ones(2)}, ValueError, r"alibi_slopes.*RoPE"),
    ("causal-yes", {"causal": "yes"}, TypeError, r"causal must be a bool.*'yes'"),
    ("causal-none", {"causal": None}, TypeError, r"causal must be a bool.*None"),
    ("causal-int", {"causal": 1}, TypeError, r"causal must be a bool.*1"),
    ("deterministic-none", {"deterministic": None}, TypeError, r"deterministic must be a bool"),
]


@pytest.mark.parametrize("kw,exc,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_option_messages(kw, exc, match):
    q, k, v = torch.zeros(1, 4, 2, 16), torch.zeros(1, 4, 1, 16), torch.zeros(1, 4, 1, 16)
    with pytest.raises(exc, match=match):
        distattn.flash_attn_func(q, k, v, **kw)
