"""Triton backend (kernels/_triton*.py) against an fp64 reference, through the backend protocol.

CPU tier: the kernels run under TRITON_INTERPRET=1 (set below, and in conftest.py, before anything imports
the kernels: Triton decides interpretation when it decorates them). Small shapes, fp16/fp32 only: the
interpreter's tl.dot on bf16 operands is not exact (measured), so bf16 lives in the GPU tier.
GPU tier (``@pytest.mark.gpu``, skipped without CUDA): bf16, 8k sequences, head dims 64/128/256.

Accuracy rule (tests/attn_ref.py): err(ours vs fp64) <= 2 x err(plain PyTorch, same dtype) + floor.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before distattn decorates its Triton kernels

import pytest  # noqa: E402

import distattn  # noqa: E402
from attn_ref import assert_all_close_by_rule, finite_err, make_qkv, reference_grads  # noqa: E402
from distattn import kernels  # noqa: E402
from distattn.kernels import _triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_OK, _WHY = _triton.is_available(DEVICE)
pytestmark = pytest.mark.skipif(not _OK, reason=f"triton backend unavailable: {_WHY}")

BE = _triton.TritonBackend() if _OK else None

# Same maths, different key-block order/boundaries: fp32 results agree to a few ulps of O(1) values.
FOLD_TOL_F32 = 5e-6
# Triton vs the torch backend, both accumulating in fp32 from fp32 inputs: a few ulps of O(1) values,
# gradients summed over up to s_q terms.
BACKEND_TOL_F32 = 2e-5


# ----------------------------------------------------------------------------- helpers

def _zeros_like_f32(t):
    return torch.zeros(t.shape, dtype=torch.float32, device=t.device)


def _forward(q, k, v, *, scale, q_start, k_start, causal, be=None):
    """One fused fresh+last fold: (out in q.dtype, lse fp32)."""
    be = be or BE
    b, s_q, h_q, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(b, h_q, s_q, dtype=torch.float32, device=q.device)
    be.fold_(None, lse, q, k, v, scale=scale, q_start=q_start, k_start=k_start, causal=causal, fresh=True,
             out_final=out)
    return out, lse


def _backward(dout, q, k, v, out, lse, *, scale, q_start, k_start, causal, be=None):
    be = be or BE
    dq, dk, dv = _zeros_like_f32(q), _zeros_like_f32(k), _zeros_like_f32(v)
    delta = be.delta(dout, out)
    be.backward_chunk_(dout, q, k, v, lse, delta, dq, dk, dv, scale=scale, q_start=q_start, k_start=k_start,
                       causal=causal)
    return dq, dk, dv


def _split(n, parts):
    """`parts` contiguous, uneven pieces of range(n) (quadratic cut points; tiny first pieces)."""
    cuts = sorted({round(n * i * i / parts / parts) for i in range(parts + 1)} | {0, n})
    return list(zip(cuts[:-1], cuts[1:]))


def _fold_chunks(q, k, v, chunks, *, scale, q_start, k_start, causal, out_f32=None, lse=None, last_dtype=None):
    """Fold key chunks in the given order: FRESH on the first, LAST (fused finalize) on the last if asked."""
    b, s_q, h_q, d = q.shape
    out_f32 = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if out_f32 is None else out_f32
    lse = torch.full((b, h_q, s_q), float("-inf"), device=q.device) if lse is None else lse
    final = None
    for i, (j0, j1) in enumerate(chunks):
        last = last_dtype is not None and i == len(chunks) - 1
        final = torch.empty(q.shape, dtype=last_dtype, device=q.device) if last else None
        BE.fold_(out_f32, lse, q, k[:, j0:j1], v[:, j0:j1], scale=scale, q_start=q_start, k_start=k_start + j0,
                 causal=causal, fresh=i == 0, out_final=final)
    return (final if final is not None else out_f32), lse


# ----------------------------------------------------------------------------- accuracy grid

# (b, s_q, s_k, h_q, h_kv, d, causal, dtype): a covering subset, not the product. Lengths 1/17/100/257 with
# s_q =, <, > s_k; head dims 16..256 (80/96 exercise the padded BLOCK_D); GQA 1, 4, MQA, 33 query heads.
F16, F32 = torch.float16, torch.float32
CASES = [
    (1, 1, 1, 1, 1, 16, False, F32),
    (2, 17, 17, 4, 1, 64, True, F16),      # MQA
    (1, 100, 17, 8, 2, 80, True, F32),     # s_q > s_k: bottom-right, the first 83 rows see no key
    (1, 17, 100, 2, 2, 96, True, F16),     # s_q < s_k
    (1, 257, 257, 1, 1, 128, False, F16),
    (1, 100, 257, 1, 1, 256, True, F32),
    (1, 17, 17, 33, 3, 16, False, F32),    # 33 query heads, groups of 11
    (1, 257, 100, 2, 1, 64, False, F32),   # MQA, s_q > s_k
    (2, 100, 100, 8, 2, 16, True, F16),    # GQA 4
    (1, 1, 257, 4, 1, 16, True, F16),      # one decoding row against a long cache
]


def _case_id(c):
    b, s_q, s_k, h_q, h_kv, d, causal, dt = c
    return f"b{b}-q{s_q}-k{s_k}-h{h_q}:{h_kv}-d{d}-{'causal' if causal else 'full'}-{str(dt)[6:]}"


# 2-byte inputs take the dK/dV kernel's descriptor path where aligned, fp32 its pointer path. The pointer path
# for 2-byte inputs too (unaligned inputs, GPUs before sm_90, DISTATTN_TMA=0): MQA, d 96 padded to 128, d 128;
# test_dkdv_descriptor_path_is_bit_identical_to_pointer_path covers the rest.
GRID = [(c, "desc") for c in CASES] + [(CASES[i], "ptr") for i in (1, 3, 4)]


@pytest.mark.parametrize("case,path", GRID, ids=[f"{_case_id(c)}-{p}" for c, p in GRID])
def test_forward_backward_against_fp64(case, path, monkeypatch):
    if path == "ptr":  # the dK/dV kernel's pointer path (unaligned inputs, GPUs before sm_90, DISTATTN_TMA=0)
        monkeypatch.setattr(_triton, "_TMA_MODE", "0")
    b, s_q, s_k, h_q, h_kv, d, causal, dtype = case
    q, k, v, dout = make_qkv(b, s_q, s_k, h_q, h_kv, d, dtype, seed=s_q + s_k + d)
    scale, q_start = d ** -0.5, s_k - s_q  # bottom-right alignment, as flash_attn_func
    kw = dict(scale=scale, q_start=q_start, k_start=0, causal=causal)
    qd, kd, vd, dod = (t.to(DEVICE) for t in (q, k, v, dout))
    out, lse = _forward(qd, kd, vd, **kw)
    grads = _backward(dod, qd, kd, vd, out, lse, **kw)
    ours = [t.cpu() for t in (out, lse, *grads)]
    ref_kw = dict(causal=causal, scale=scale, q_start=q_start)
    ref = reference_grads(q, k, v, dout, torch.float64, **ref_kw)
    base = reference_grads(q, k, v, dout, dtype, **ref_kw)
    assert ours[0].dtype == dtype and ours[1].dtype == torch.float32
    assert_all_close_by_rule(("out", "lse", "dq", "dk", "dv"), ours, base, ref, dtype)


# ----------------------------------------------------------------------------- carried state

@pytest.mark.parametrize("parts,order", [(1, "fwd"), (2, "fwd"), (3, "fwd"), (7, "fwd"), (3, "rev"), (7, "rev")])
def test_fold_in_chunks_equals_one_call(parts, order):
    # Global offsets: queries at 1030..1069, keys at 1000..1089 (causal: the last keys are seen by nobody,
    # so some chunks are skipped entirely; in "rev" order early rows carry an empty state for a while).
    b, s_q, s_k, h_q, h_kv, d = 1, 40, 90, 4, 2, 32
    q, k, v, dout = (t.to(DEVICE) for t in make_qkv(b, s_q, s_k, h_q, h_kv, d, F32, seed=parts))
    kw = dict(scale=d ** -0.5, q_start=1030, k_start=1000, causal=True)
    one_out, one_lse = _forward(q, k, v, **kw)
    chunks = _split(s_k, parts)
    chunks = chunks[::-1] if order == "rev" else chunks
    out, lse = _fold_chunks(q, k, v, chunks, last_dtype=F32, **kw)
    assert (out - one_out).abs().max() <= FOLD_TOL_F32
    assert (lse - one_lse).abs().max() <= FOLD_TOL_F32

    # the backward of the same chunks adds up to the backward of one call
    one = _backward(dout, q, k, v, one_out, one_lse, **kw)
    delta = BE.delta(dout, one_out)
    dq, dk, dv = _zeros_like_f32(q), _zeros_like_f32(k), _zeros_like_f32(v)
    for j0, j1 in chunks:
        BE.backward_chunk_(dout, q, k[:, j0:j1], v[:, j0:j1], one_lse, delta, dq, dk[:, j0:j1], dv[:, j0:j1],
                           scale=kw["scale"], q_start=kw["q_start"], k_start=kw["k_start"] + j0, causal=True)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), one):
        assert (got - want).abs().max() <= FOLD_TOL_F32, name


@pytest.mark.parametrize("causal", [False, True])
def test_merge_of_partial_from_second_state_equals_one_call(causal):
    b, s_q, s_k, h_q, h_kv, d = 2, 29, 50, 4, 1, 24  # d=24: padded head dim in the merge kernel too
    q, k, v, _ = (t.to(DEVICE) for t in make_qkv(b, s_q, s_k, h_q, h_kv, d, F16, seed=3))
    kw = dict(scale=0.25, q_start=s_k - s_q, k_start=0, causal=causal)
    chunks = _split(s_k, 5)
    mine_out, mine_lse = _fold_chunks(q, k, v, chunks[::2], **kw)       # this rank folds even chunks
    part_out, part_lse = _fold_chunks(q, k, v, chunks[1::2], **kw)      # a helper rank folds odd chunks
    BE.merge_(mine_out, mine_lse, part_out.half(), part_lse)            # the partial arrives in fp16
    one_out, one_lse = _forward(q, k, v, **kw)
    # fp16 rounding of the partial and of the one-call output: 2 ulps of O(1) values
    assert (mine_out - one_out.float()).abs().max() <= 2e-3
    assert finite_err(mine_lse, one_lse) <= 1e-5


def test_merge_empty_sides_and_garbage_in_empty_partial():
    b, s_q, h, d = 1, 20, 2, 16
    q, k, v, _ = (t.to(DEVICE) for t in make_qkv(b, s_q, s_q, h, h, d, F32, seed=1))
    full_out, full_lse = _fold_chunks(q, k, v, [(0, s_q)], scale=0.3, q_start=0, k_start=0, causal=False)
    empty = lambda: (torch.zeros_like(full_out), torch.full_like(full_lse, float("-inf")))  # noqa: E731

    o, lse = empty()
    BE.merge_(o, lse, *empty())                                          # empty + empty stays empty
    assert torch.all(o == 0) and torch.all(lse == float("-inf"))
    o, lse = empty()
    BE.merge_(o, lse, full_out, full_lse)                               # empty + full == full
    assert torch.allclose(o, full_out, rtol=0, atol=1e-7) and torch.equal(lse, full_lse)
    o, lse = full_out.clone(), full_lse.clone()
    nan_out = torch.full_like(full_out, float("nan"))                   # an empty partial may hold anything
    BE.merge_(o, lse, nan_out, torch.full_like(full_lse, float("-inf")))
    assert torch.allclose(o, full_out, rtol=0, atol=1e-7) and torch.equal(lse, full_lse)


def test_rows_that_see_no_key():
    # Causal with q_start < k_start: queries at 10..29, keys at 20..35. Rows 0..9 see nothing.
    b, s_q, s_k, h_q, h_kv, d = 1, 20, 16, 4, 2, 16
    q, k, v, dout = make_qkv(b, s_q, s_k, h_q, h_kv, d, F32, seed=5)
    kw = dict(scale=d ** -0.5, q_start=10, k_start=20, causal=True)
    qd, kd, vd, dod = (t.to(DEVICE) for t in (q, k, v, dout))
    out, lse = _forward(qd, kd, vd, **kw)
    dq, dk, dv = _backward(dod, qd, kd, vd, out, lse, **kw)
    for t in (out, lse, dq, dk, dv):
        assert not torch.isnan(t).any()
    assert torch.all(out[:, :10] == 0) and torch.all(lse[:, :, :10] == float("-inf"))
    assert torch.all(dq[:, :10] == 0)
    ref = reference_grads(q, k, v, dout, torch.float64, causal=True, scale=kw["scale"], q_start=10, k_start=20)
    base = reference_grads(q, k, v, dout, F32, causal=True, scale=kw["scale"], q_start=10, k_start=20)
    ours = [t.cpu() for t in (out, lse, dq, dk, dv)]
    assert_all_close_by_rule(("out", "lse", "dq", "dk", "dv"), ours, base, ref, F32)

    # a chunk seen by no query at all: state untouched, zero gradients
    out2, lse2 = _forward(qd, kd, vd, scale=kw["scale"], q_start=0, k_start=100, causal=True)
    assert torch.all(out2 == 0) and torch.all(lse2 == float("-inf"))
    grads = _backward(dod, qd, kd, vd, out2, lse2, scale=kw["scale"], q_start=0, k_start=100, causal=True)
    assert all(torch.all(g == 0) for g in grads)


def test_backward_is_deterministic():
    q, k, v, dout = (t.to(DEVICE) for t in make_qkv(2, 45, 70, 8, 2, 32, F32, seed=9))
    kw = dict(scale=32 ** -0.5, q_start=25, k_start=0, causal=True)
    out, lse = _forward(q, k, v, **kw)
    first = _backward(dout, q, k, v, out, lse, **kw)
    second = _backward(dout, q, k, v, out, lse, **kw)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- dK/dV through tensor descriptors

def _spy_dkdv(monkeypatch):
    """Record the TMA flag of every dK/dV launch."""
    seen, real = [], _triton._kernel

    def kernel(name):
        k = real(name)
        if name != "dkdv":
            return k

        class Spy:
            def __getitem__(self, grid):
                def launch(*a, **kw):
                    seen.append(kw["TMA"])
                    return k[grid](*a, **kw)
                return launch
        return Spy()
    monkeypatch.setattr(_triton, "_kernel", kernel)
    return seen


# (b, s_q, s_k, h_q, h_kv, d, dtype, mask): odd lengths (lse/delta rows padded for the descriptor), GQA, d 80,
# packed documents with a window (MASK 2, three query segments), softcap.
TMA_CASES = [
    (2, 45, 70, 8, 2, 32, F16, "causal"),
    (1, 33, 33, 6, 3, 80, F16, "full"),
    (1, 64, 64, 4, 1, 16, F16, "causal"),
    (1, 61, 61, 4, 2, 16, F16, "docs"),
    (1, 50, 50, 2, 1, 16, F16, "softcap"),
]


@pytest.mark.parametrize("case", TMA_CASES, ids=lambda c: f"q{c[1]}-k{c[2]}-h{c[3]}:{c[4]}-d{c[5]}-{c[7]}")
def test_dkdv_descriptor_path_is_bit_identical_to_pointer_path(case, monkeypatch):
    """The descriptor path only changes how tiles reach the kernel: the same sums in the same order."""
    b, s_q, s_k, h_q, h_kv, d, dtype, mask = case
    q, k, v, dout = (t.to(DEVICE) for t in make_qkv(b, s_q, s_k, h_q, h_kv, d, dtype, seed=s_q + d))
    kw = dict(scale=d ** -0.5, q_start=s_k - s_q, k_start=0, causal=mask == "causal")
    if mask == "docs":
        cu = torch.tensor([0, 1, 20, 47, s_q], dtype=torch.int32, device=DEVICE)
        kw["bounds"] = kernels.varlen_bounds(cu, cu, (0, s_q), causal=True, window=(9, 0))
    if mask == "softcap":
        kw["softcap"] = 2.0
    fwd_kw = {key: val for key, val in kw.items()}
    out = torch.empty_like(q)
    lse = torch.empty(b, h_q, s_q, dtype=torch.float32, device=DEVICE)
    BE.fold_(None, lse, q, k, v, fresh=True, out_final=out, **fwd_kw)
    delta = BE.delta(dout, out)

    def grads():
        dq, dk, dv = _zeros_like_f32(q), _zeros_like_f32(k), _zeros_like_f32(v)
        BE.backward_chunk_(dout, q, k, v, lse, delta, dq, dk, dv, **kw)
        return dq, dk, dv

    seen = _spy_dkdv(monkeypatch)
    with_desc = grads()
    monkeypatch.setattr(_triton, "_TMA_MODE", "0")
    with_ptr = grads()
    assert seen == [True, False]
    for a, w in zip(with_desc, with_ptr):
        assert torch.equal(a, w)
    assert all(torch.isfinite(t).all() for t in with_desc)


def test_dkdv_descriptor_path_needs_aligned_inputs(monkeypatch):
    """16-byte aligned rows and heads in 2 bytes take descriptors; anything else (d=20 in fp16: 40-byte heads; a
    base one element off; fp32) takes the pointer path and still gets the right answer. lse/delta with odd
    lengths are copied into 16-byte aligned rows. A broadcast dout (stride 0 over s: the gradient of
    ``out.sum(1)``) takes the pointer path too; (b, h, s, d) memory viewed as (b, s, h, d) takes descriptors."""
    seen = _spy_dkdv(monkeypatch)
    kw = dict(scale=0.3, q_start=0, k_start=0, causal=True)
    cases = ((16, 0, F16, ""), (20, 0, F16, ""), (16, 1, F16, ""), (16, 0, F32, ""), (16, 0, F16, "broadcast"),
             (16, 0, F16, "head-major"))
    for d, offset, dtype, layout in cases:
        q, k, v, dout = (t.to(DEVICE) for t in make_qkv(1, 23, 23, 2, 1, d, dtype, seed=d + offset))
        if offset:
            q = torch.cat([q.flatten(), q.flatten()[:offset]])[offset:].view(q.shape)  # data_ptr % 16 == 2
        if layout == "broadcast":
            dout = dout[:, :1].expand_as(dout)
        if layout == "head-major":
            q, k, v, dout = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, dout))
        out, lse = _forward(q, k, v, **kw)
        got = _backward(dout, q, k, v, out, lse, **kw)
        ref = reference_grads(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), torch.float64, causal=True, scale=0.3,
                              q_start=0)
        base = reference_grads(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), dtype, causal=True, scale=0.3, q_start=0)
        assert_all_close_by_rule(("dq", "dk", "dv"), [t.cpu() for t in got], base[2:], ref[2:], dtype)
    assert seen == [True, False, False, False, False, True]
    lse = torch.randn(2, 3, 23)
    padded = _triton._tma_stats(lse)
    assert torch.equal(padded, lse) and padded.stride() == (3 * 24, 24, 1) and _triton._tma_aligned(padded, 2)
    even = torch.randn(2, 3, 24)
    assert _triton._tma_stats(even) is even


def test_strided_inputs_and_accumulators():
    # q/k/v in (b, h, s, d) memory viewed as (b, s, h, d); state and gradients with non-unit d stride.
    b, s_q, s_k, h_q, h_kv, d = 2, 19, 23, 4, 2, 16
    q, k, v, dout = (t.to(DEVICE) for t in make_qkv(b, s_q, s_k, h_q, h_kv, d, F32, seed=11))
    kw = dict(scale=0.2, q_start=4, k_start=0, causal=True)
    want_out, want_lse = _forward(q, k, v, **kw)
    want = _backward(dout, q, k, v, want_out, want_lse, **kw)

    qs, ks, vs = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    wide = lambda t: torch.zeros(*t.shape[:-1], 2 * t.shape[-1], device=t.device)[..., ::2]  # noqa: E731
    out_f32, lse = wide(q), torch.zeros(b, s_q, h_q, device=DEVICE).transpose(1, 2)  # strided lse too
    BE.fold_(out_f32, lse, qs, ks, vs, scale=0.2, q_start=4, k_start=0, causal=True, fresh=True, out_final=None)
    assert torch.equal(out_f32, want_out) and torch.equal(lse, want_lse)
    dq, dk, dv = wide(q), wide(k), wide(v)
    BE.backward_chunk_(dout, qs, ks, vs, lse, BE.delta(dout, want_out), dq, dk, dv, **kw)
    for got, w in zip((dq, dk, dv), want):
        assert torch.equal(got, w)


def test_agrees_with_torch_backend():
    torch_be = kernels.get_backend("torch", DEVICE)
    q, k, v, dout = (t.to(DEVICE) for t in make_qkv(2, 33, 47, 6, 2, 40, F32, seed=13))
    kw = dict(scale=40 ** -0.5, q_start=14, k_start=0, causal=True)
    results = []
    for be in (BE, torch_be):
        out, lse = _forward(q, k, v, be=be, **kw)
        results.append((out, lse, *_backward(dout, q, k, v, out, lse, be=be, **kw)))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert finite_err(a, b) <= BACKEND_TOL_F32, name


def test_flash_attn_func_with_triton_backend():
    q, k, v, dout = (t.to(DEVICE).requires_grad_() for t in make_qkv(1, 17, 30, 4, 1, 16, F32, seed=2))
    out = distattn.flash_attn_func(q, k, v, causal=True, backend="triton")
    out.backward(dout.detach())
    ref = reference_grads(q.cpu(), k.cpu(), v.cpu(), dout.detach().cpu(), torch.float64, causal=True)
    base = reference_grads(q.cpu(), k.cpu(), v.cpu(), dout.detach().cpu(), F32, causal=True)
    ours = [t.detach().cpu() for t in (out, q.grad, k.grad, v.grad)]
    assert_all_close_by_rule(("out", "dq", "dk", "dv"), ours, (base[0], *base[2:]), (ref[0], *ref[2:]), F32)


HOPPER_SMEM = 232448  # bytes of shared memory per block on H100/H200 (227 KiB opt-in)


@pytest.mark.parametrize("kind", ["fwd", "dq", "dkdv"])
def test_config_filter(kind, monkeypatch):
    # The CUDA-only config filter (the list the heuristic picks from and autotune benchmarks) is plain Python:
    # check it here with Hopper's shared-memory limit.
    monkeypatch.setattr(_triton, "_max_shared_mem_cached", lambda device: HOPPER_SMEM)
    for dtype in (torch.bfloat16, torch.float32):
        for d in (16, 64, 80, 128, 256):
            block_d = _triton._block_d(d)
            q = torch.empty(1, 1, 1, d, dtype=dtype)
            kept = _triton._kept(kind, {"Q": q, "BLOCK_D": block_d, "LEN_BUCKET": 8192})
            assert kept, (dtype, d)
            for bm, bn, warps, stages in kept:
                assert (bm, bn, warps, stages) in _triton._CONFIGS[kind]
                assert _triton._smem_bytes(kind, bm, bn, stages, block_d, q.element_size()) <= HOPPER_SMEM
                if dtype == torch.float32:
                    assert bm * bn <= 32 * 32
    short = _triton._kept(kind, {"Q": torch.empty(1, 1, 1, 64, dtype=torch.bfloat16), "BLOCK_D": 64,
                                 "LEN_BUCKET": 64})
    assert short and all(max(bm, bn) <= 64 for bm, bn, _, _ in short)
    monkeypatch.setattr(_triton, "_max_shared_mem_cached", lambda device: 1)  # nothing fits: still one config
    assert len(_triton._kept(kind, {"Q": torch.empty(1, 1, 1, 64), "BLOCK_D": 64, "LEN_BUCKET": 64})) == 1


def test_is_available_reports_reason():
    ok, why = _triton.is_available("cpu")
    assert isinstance(ok, bool) and isinstance(why, str) and (ok or why)
    ok, why = _triton.is_available("meta")
    assert not ok and "CUDA" in why


# ----------------------------------------------------------------------------- GPU tier

def _naive_on_device(q, k, v, dout, dtype, *, causal, scale, q_start):
    """attn_ref's naive attention (out, lse, dq, dk, dv), but with the mask built on q's device."""
    qd, kd, vd = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    s = torch.einsum("bihd,bjhd->bhij", qd, kd.repeat_interleave(g, 2)) * scale
    if causal:
        q_pos = torch.arange(q.shape[1], device=q.device)[:, None] + q_start
        s = s.masked_fill(torch.arange(k.shape[1], device=q.device)[None, :] > q_pos, float("-inf"))
    lse = torch.logsumexp(s.float() if dtype != torch.float64 else s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    out = torch.einsum("bhij,bjhd->bihd", p, vd.repeat_interleave(g, 2))
    out.backward(dout.to(dtype))
    return [t.detach() for t in (out, lse, qd.grad, kd.grad, vd.grad)]


# GPU-only: bf16 tl.dot is not exact in the interpreter, and 8k sequences would take hours there.
# CUDA-only: the compiled kernels at 8k tokens, bf16/fp16, head dims 64/128/256 (one fold, then backward).
@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_long_sequences(d, causal, dtype):
    b, s, h_q, h_kv = 1, 8192, 2, 1
    q, k, v, dout = make_qkv(b, s, s, h_q, h_kv, d, dtype, seed=d, device="cuda")
    kw = dict(scale=d ** -0.5, q_start=0, k_start=0, causal=causal)
    out, lse = _forward(q, k, v, **kw)
    ours = [out, lse, *_backward(dout, q, k, v, out, lse, **kw)]
    ref_kw = dict(causal=causal, scale=kw["scale"], q_start=0)
    ref = _naive_on_device(q, k, v, dout, torch.float64, **ref_kw)
    base = _naive_on_device(q, k, v, dout, dtype, **ref_kw)
    assert_all_close_by_rule(("out", "lse", "dq", "dk", "dv"), ours, base, ref, dtype)


# CUDA-only: the compiled fold kernel carrying bf16 state over 3 chunks, GQA, unequal query/key lengths.
@pytest.mark.gpu
@pytest.mark.parametrize("s_q,s_k", [(1000, 3000), (3000, 1000), (257, 257)])
def test_gpu_bf16_gqa_chunks(s_q, s_k):
    q, k, v, dout = make_qkv(2, s_q, s_k, 8, 2, 128, torch.bfloat16, seed=1, device="cuda")
    kw = dict(scale=128 ** -0.5, q_start=s_k - s_q, k_start=0, causal=True)
    out, lse = _fold_chunks(q, k, v, _split(s_k, 3), last_dtype=torch.bfloat16, **kw)
    ours = [out, lse, *_backward(dout, q, k, v, out, lse, **kw)]
    ref_kw = dict(causal=True, scale=kw["scale"], q_start=s_k - s_q)
    ref = _naive_on_device(q, k, v, dout, torch.float64, **ref_kw)
    base = _naive_on_device(q, k, v, dout, torch.bfloat16, **ref_kw)
    assert_all_close_by_rule(("out", "lse", "dq", "dk", "dv"), ours, base, ref, torch.bfloat16)


def test_grid_axes_stay_within_cuda_limits(monkeypatch):
    """Launch grids are (sequence blocks, heads, batch): batch x heads beyond 65535 (CUDA's limit on grid axes
    1 and 2) still launches. Checked on the launcher's grids, without running 2^17 programs."""
    grids = []

    class Rec:
        def __getitem__(self, grid):
            return lambda *a, **kw: grids.append(grid({"BLOCK_M": 16, "BLOCK_N": 16}) if callable(grid) else grid)
    monkeypatch.setattr(_triton, "_kernel", lambda name: Rec())
    monkeypatch.setattr(_triton._fwd, "_merge_kernel", Rec())
    monkeypatch.setattr(_triton._bwd, "_bwd_preprocess_kernel", Rec())
    b, s, h, d = 4096, 33, 32, 16  # b * h = 131072
    q = torch.empty(b, s, h, d, dtype=F16, device="meta")
    acc = torch.empty(b, s, h, d, dtype=F32, device="meta")
    lse = torch.empty(b, h, s, dtype=F32, device="meta")
    kw = dict(scale=0.25, q_start=0, k_start=0, causal=True)
    BE.fold_(acc, lse, q, q, q, fresh=False, out_final=None, **kw)
    BE.merge_(acc, lse, acc, lse)
    BE.delta(q, q)
    BE.backward_chunk_(q, q, q, q, lse, lse, acc, acc, acc, **kw)
    assert len(grids) == 5
    for g in grids:
        assert g[1:] == (h, b) and all(x <= 65535 for x in g[1:]), g
