"""distattn.flash_attn_varlen_func (packed documents) against an fp64 reference with an explicit boolean mask.

The reference (``attn_ref.varlen_mask``) is built from flash-attn's definitions, document by document, and
never from distattn's ``KeyBounds``: query row ``r`` of a document with ``l_q`` queries and ``l_k`` keys sits
on key position ``r + l_k - l_q`` (bottom-right), sees only its own document's keys, ``<= p`` when causal and
``[p - left, p + right]`` with a window. Both backends: torch (fp32/fp16/bf16) and triton through the
interpreter (fp32/fp16; the interpreter's bf16 ``tl.dot`` is not exact). Accuracy rule: tests/attn_ref.py.

Legend: ``total_q``/``total_k`` packed tokens, ``h_q``/``h_kv`` heads, ``d`` head dim.
"""

import random

import pytest
import torch

import distattn
from attn_ref import assert_all_close_by_rule, masked_reference_grads, varlen_mask
from distattn.kernels import _triton

TRITON_OK, TRITON_WHY = _triton.is_available("cpu")
F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16
NAMES = ("out", "lse", "dq", "dk", "dv")

_rng = random.Random(10)
TINY = [_rng.randint(1, 3) for _ in range(40)]  # 40 documents of 1-3 tokens


# name: (lens_q, lens_k or None (= lens_q), h_q, h_kv, d, causal, window, softcap)
CASES = {
    "docs-1-2-17-100-causal": ([1, 2, 17, 100], None, 2, 1, 16, True, (-1, -1), 0.0),
    "docs-100-17-2-1-full-d80": ([100, 17, 2, 1], None, 2, 2, 80, False, (-1, -1), 0.0),
    "one-doc-whole-stream-causal": ([70], None, 4, 2, 80, True, (-1, -1), 0.0),
    "one-doc-whole-stream-full-softcap": ([70], None, 2, 1, 16, False, (-1, -1), 5.0),
    "40-tiny-docs-causal-mqa": (TINY, None, 6, 1, 16, True, (-1, -1), 0.0),
    "40-tiny-docs-full": (TINY, None, 2, 1, 16, False, (-1, -1), 0.0),
    "empty-docs-middle-and-end-win7-7": ([5, 0, 0, 12, 0, 7, 0], None, 2, 1, 16, False, (7, 7), 0.0),
    "empty-first-doc-causal": ([0, 9, 0, 20], None, 2, 2, 16, True, (-1, -1), 0.0),
    "win1-0-full": ([17, 33, 1, 9], None, 2, 1, 16, False, (1, 0), 0.0),
    "win1-0-causal": ([17, 33, 1, 9], None, 2, 1, 16, True, (1, 0), 0.0),
    "win7-0-causal-mha": ([17, 33, 1, 9], None, 2, 2, 16, True, (7, 0), 0.0),
    "win64-0-causal": ([100, 17, 70], None, 2, 1, 16, True, (64, 0), 0.0),
    "win7-7-causal": ([30, 2, 25], None, 2, 1, 16, True, (7, 7), 0.0),  # causal wins: right = 0
    "win7-7-full-d80": ([30, 2, 25], None, 4, 2, 80, False, (7, 7), 0.0),
    "win3-5-full-softcap": ([40, 1, 23], None, 3, 1, 16, False, (3, 5), 5.0),
    "win0-0-full": ([20, 3], None, 2, 2, 16, False, (0, 0), 0.0),  # each row sees only its own position
    "win-unlimited-left-2-right": ([26, 11], None, 2, 1, 16, False, (-1, 2), 0.0),
    "win4-left-unlimited-right": ([26, 11], None, 2, 1, 16, False, (4, -1), 0.0),
    "win-larger-than-seq-full": ([50, 13], None, 2, 1, 16, False, (500, 500), 0.0),
    "win-larger-than-seq-causal": ([50, 13], None, 2, 1, 16, True, (500, 0), 0.0),
    "sq!=sk-causal": ([5, 0, 9], [3, 4, 9], 2, 1, 16, True, (-1, -1), 0.0),
    "sq!=sk-full": ([5, 0, 9], [3, 4, 9], 2, 1, 16, False, (-1, -1), 0.0),
    "sq!=sk-win2-1-full": ([5, 0, 9, 20], [3, 4, 9, 11], 2, 1, 16, False, (2, 1), 0.0),
    "sq<sk-win5-0-causal-softcap": ([3, 10, 1], [17, 12, 30], 6, 1, 16, True, (5, 0), 5.0),
    "block-aligned-docs-win16-causal": ([16, 16, 32, 15, 17], None, 2, 1, 16, True, (16, 0), 0.0),  # 16: triton tile
    "docs-with-queries-but-no-keys": ([3, 4, 2], [5, 0, 3], 2, 1, 16, False, (-1, -1), 0.0),
    "softcap0.3-win2-3-full": ([12, 1, 19], None, 2, 1, 16, False, (2, 3), 0.3),  # saturating tanh
    "softcap-causal-docs": ([1, 2, 17, 40], None, 2, 1, 16, True, (-1, -1), 5.0),
}



def _params():
    """Every case on torch in every dtype; on triton (the interpreter is slow) in fp32 or fp16, alternating."""
    out = []
    for i, name in enumerate(CASES):
        runs = [("torch", F32), ("torch", F16), ("torch", BF16), ("triton", (F32, F16)[i % 2])]
        out += [pytest.param(name, be, dt, id=f"{name}-{be}-{str(dt)[6:]}") for be, dt in runs]
    return out


def make_packed(lens_q, lens_k, h_q, h_kv, d, dtype, seed=0):
    """q, dout ``(total_q, h_q, d)``, k, v ``(total_k, h_kv, d)`` and int32 cumulative lengths."""
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    tq, tk = sum(lens_q), sum(lens_k)
    cu = lambda lens: torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)  # noqa: E731
    return mk(tq, h_q, d), mk(tk, h_kv, d), mk(tk, h_kv, d), mk(tq, h_q, d), cu(lens_q), cu(lens_k)


def _skip_unavailable(backend):
    if backend == "triton" and not TRITON_OK:
        pytest.skip(f"triton backend unavailable: {TRITON_WHY}")


def check_varlen(lens_q, lens_k, h_q, h_kv, d, causal, window, softcap, backend, dtype, seed=0):
    """Forward and backward of flash_attn_varlen_func against the explicit-mask fp64 reference."""
    lens_k = lens_q if lens_k is None else lens_k
    q, k, v, dout, cu_q, cu_k = make_packed(lens_q, lens_k, h_q, h_kv, d, dtype, seed=seed)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = distattn.flash_attn_varlen_func(qg, kg, vg, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                               window_size=window, softcap=softcap, return_lse=True,
                                               backend=backend)
    out.backward(dout)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (h_q, sum(lens_q)) and lse.dtype == torch.float32
    assert qg.grad.dtype == dtype and kg.grad.shape == k.shape and vg.grad.shape == v.shape

    mask = varlen_mask(lens_q, lens_k, causal=causal, window=window)
    b1 = lambda t: t.unsqueeze(0)  # noqa: E731  (the reference works on (1, total, h, d))
    kw = dict(softcap=softcap)
    ref = masked_reference_grads(b1(q), b1(k), b1(v), b1(dout), mask, torch.float64, **kw)
    base = masked_reference_grads(b1(q), b1(k), b1(v), b1(dout), mask, dtype, **kw)
    ref, base = ([t[0] for t in group] for group in (ref, base))
    ours = (out.detach(), lse, qg.grad, kg.grad, vg.grad)
    assert_all_close_by_rule(NAMES, ours, base, ref, dtype)

    # Rows that see no key: exactly 0 / -inf / zero gradient; keys nobody sees: zero gradients.
    dead_rows, dead_keys = ~mask.any(dim=1), ~mask.any(dim=0)
    assert torch.all(out.detach()[dead_rows] == 0) and torch.all(lse[:, dead_rows] == float("-inf"))
    assert torch.all(qg.grad[dead_rows] == 0)
    assert torch.all(kg.grad[dead_keys] == 0) and torch.all(vg.grad[dead_keys] == 0)
    assert torch.isfinite(lse[:, ~dead_rows]).all()


@pytest.mark.parametrize("name,backend,dtype", _params())
def test_varlen_against_explicit_mask(name, backend, dtype):
    _skip_unavailable(backend)
    check_varlen(*CASES[name], backend, dtype, seed=len(name))


def test_grid_is_complete():
    """The issue's grid: lengths 1, 2, 17, 100, whole stream, tiny and empty documents, windows, GQA/MQA,
    head dims 16 and 80, s_q != s_k per document, softcap, causal and not."""
    lens = {n for c in CASES.values() for n in c[0]}
    assert {0, 1, 2, 17, 100} <= lens
    assert any(len(c[0]) == 1 for c in CASES.values()) and any(len(c[0]) >= 40 for c in CASES.values())
    windows = {c[6] for c in CASES.values()}
    assert {(1, 0), (7, 0), (64, 0), (7, 7), (500, 500)} <= windows
    assert {c[2] // c[3] for c in CASES.values()} >= {1, 2, 6}
    assert {c[4] for c in CASES.values()} == {16, 80}
    assert any(c[1] is not None and c[1] != c[0] for c in CASES.values())
    assert {c[5] for c in CASES.values()} == {False, True} and {c[7] for c in CASES.values()} >= {0.0, 5.0}


# -- return conventions --------------------------------------------------------------------------------------
def _small_packed(dtype=F32):
    return make_packed([3, 5, 0, 4], [3, 5, 0, 4], 4, 2, 16, dtype, seed=1)


def test_return_lse_shape_and_values():
    q, k, v, _, cu_q, cu_k = _small_packed()
    out, lse = distattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True, return_lse=True)
    assert out.shape == (12, 4, 16) and lse.shape == (4, 12) and lse.dtype == torch.float32
    mask = varlen_mask([3, 5, 0, 4], [3, 5, 0, 4], causal=True)
    ref = masked_reference_grads(q[None], k[None], v[None], torch.zeros(1, 12, 4, 16), mask, torch.float64)
    assert (lse.double() - ref[1][0]).abs().max() < 1e-5
    plain = distattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True)
    assert isinstance(plain, torch.Tensor) and torch.equal(plain, out)


def test_return_attn_probs_gives_out_lse_none():
    q, k, v, _, cu_q, cu_k = _small_packed()
    res = distattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True, return_attn_probs=True)
    assert isinstance(res, tuple) and len(res) == 3 and res[2] is None
    out, lse = distattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True, return_lse=True)
    assert torch.equal(res[0], out) and torch.equal(res[1], lse) and res[1].shape == (4, 12)


def test_int64_cu_seqlens_and_larger_max_seqlen_accepted():
    q, k, v, _, cu_q, cu_k = _small_packed()
    a = distattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True)
    b = distattn.flash_attn_varlen_func(q, k, v, cu_q.long(), cu_k.long(), 64, 99, causal=True)
    assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_non_contiguous_views_of_packed_qkv(backend):
    """q, k, v as strided views of one ``(total, 3, h, d)`` tensor (the usual packed-qkv layout)."""
    _skip_unavailable(backend)
    lens = [5, 11, 1, 7]
    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(24, 3, 2, 16, generator=g)
    dout = torch.randn(24, 2, 16, generator=g)
    cu = torch.tensor([0, 5, 16, 17, 24], dtype=torch.int32)
    qkv_g = qkv.clone().requires_grad_()
    q, k, v = qkv_g[:, 0], qkv_g[:, 1], qkv_g[:, 2]
    assert not q.is_contiguous()
    out = distattn.flash_attn_varlen_func(q, k, v, cu, cu, 11, 11, causal=True, window_size=(3, 0),
                                          backend=backend)
    out.backward(dout)
    mask = varlen_mask(lens, lens, causal=True, window=(3, 0))
    qc, kc, vc = (qkv[None, :, i].contiguous() for i in range(3))
    ref = masked_reference_grads(qc, kc, vc, dout[None], mask, torch.float64)
    base = masked_reference_grads(qc, kc, vc, dout[None], mask, F32)
    grads = qkv_g.grad
    ours = (out.detach(), grads[:, 0], grads[:, 1], grads[:, 2])
    assert_all_close_by_rule(("out", "dq", "dk", "dv"), ours, [base[0][0]] + [t[0] for t in base[2:]],
                             [ref[0][0]] + [t[0] for t in ref[2:]], F32)


def test_all_documents_empty():
    q, k, v = torch.zeros(0, 2, 16), torch.zeros(0, 1, 16), torch.zeros(0, 1, 16)
    cu = torch.zeros(3, dtype=torch.int32)
    out, lse = distattn.flash_attn_varlen_func(q, k, v, cu, cu, 0, 0, return_lse=True)
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0)


def test_documents_do_not_leak():
    """Changing one document's keys/values changes no other document's output (bitwise)."""
    lens = [7, 9, 6]
    q, k, v, _, cu_q, cu_k = make_packed(lens, lens, 2, 1, 16, F32, seed=4)
    a = distattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9)
    k2, v2 = k.clone(), v.clone()
    k2[7:16] += 3.0
    v2[7:16] -= 5.0
    b = distattn.flash_attn_varlen_func(q, k2, v2, cu_q, cu_k, 9, 9)
    assert torch.equal(a[:7], b[:7]) and torch.equal(a[16:], b[16:])
    assert not torch.equal(a[7:16], b[7:16])


# -- validation: errors name the bad value -------------------------------------------------------------------
def _args(**over):
    """Valid arguments for 3 documents of 4 tokens; override any of them."""
    a = dict(q=torch.zeros(12, 4, 16), k=torch.zeros(12, 2, 16), v=torch.zeros(12, 2, 16),
             cu_seqlens_q=torch.tensor([0, 4, 8, 12], dtype=torch.int32),
             cu_seqlens_k=torch.tensor([0, 4, 8, 12], dtype=torch.int32), max_seqlen_q=4, max_seqlen_k=4)
    a.update(over)
    return a


def _call(a, **kw):
    return distattn.flash_attn_varlen_func(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"],
                                           a["max_seqlen_q"], a["max_seqlen_k"], **kw)


I32 = torch.int32
BAD = [
    ("float-cu", _args(cu_seqlens_q=torch.tensor([0.0, 4, 8, 12])), {}, TypeError,
     r"cu_seqlens_q must be int32 or int64, got torch.float32"),
    ("not-from-0", _args(cu_seqlens_k=torch.tensor([1, 4, 8, 12], dtype=I32)), {}, ValueError,
     r"cu_seqlens_k must start at 0, got .*1"),
    ("decreasing", _args(cu_seqlens_q=torch.tensor([0, 8, 4, 12], dtype=I32)), {}, ValueError,
     r"cu_seqlens_q must be non-decreasing.*4 < .*8"),
    ("last-not-total", _args(cu_seqlens_q=torch.tensor([0, 4, 8, 11], dtype=I32)), {}, ValueError,
     r"cu_seqlens_q\[-1\] = 11 must equal the number of packed tokens \(12\)"),
    ("last-not-total-k", _args(cu_seqlens_k=torch.tensor([0, 4, 8, 13], dtype=I32)), {}, ValueError,
     r"cu_seqlens_k\[-1\] = 13 .*\(12\)"),
    ("doc-counts-differ", _args(cu_seqlens_k=torch.tensor([0, 6, 12], dtype=I32)), {}, ValueError,
     r"cu_seqlens_q has 3 documents but cu_seqlens_k has 2"),
    ("max-seqlen-q-too-small", _args(max_seqlen_q=3), {}, ValueError, r"max_seqlen_q \(3\).*longest document \(4\)"),
    ("max-seqlen-k-too-small", _args(max_seqlen_k=2), {}, ValueError, r"max_seqlen_k \(2\).*longest document \(4\)"),
    ("cu-list", _args(cu_seqlens_q=[0, 4, 8, 12]), {}, TypeError, r"cu_seqlens_q must be a torch.Tensor"),
    ("cu-2d", _args(cu_seqlens_k=torch.tensor([[0, 4], [8, 12]], dtype=I32)), {}, ValueError,
     r"cu_seqlens_k must be 1-D.*\(2, 2\)"),
    ("cu-other-device", _args(cu_seqlens_q=torch.tensor([0, 4, 8, 12], dtype=I32, device="meta")), {}, ValueError,
     r"cu_seqlens_q is on meta but the tokens are on cpu"),
    ("max-seqlen-not-int", _args(max_seqlen_q=4.5), {}, ValueError, r"max_seqlen_q \(4.5\)"),
    ("4d-q", _args(q=torch.zeros(1, 12, 4, 16)), {}, ValueError,
     r"q must have 3 dims .*got shape \(1, 12, 4, 16\).*flash_attn_func"),
    ("4d-k", _args(k=torch.zeros(1, 12, 2, 16)), {}, ValueError, r"k must have 3 dims"),
    ("window-minus-2", _args(), {"window_size": (-2, 0)}, ValueError, r"window_size left .*-2"),
    ("window-float", _args(), {"window_size": (3, 1.5)}, ValueError, r"window_size right .*1.5"),
    ("window-not-pair", _args(), {"window_size": 4}, TypeError, r"window_size must be a pair .*got 4"),
    ("window-triple", _args(), {"window_size": (1, 2, 3)}, TypeError, r"window_size must be a pair"),
    ("softcap-negative", _args(), {"softcap": -1.0}, ValueError, r"softcap .*>= 0.*-1.0"),
    ("softcap-nan", _args(), {"softcap": float("nan")}, ValueError, r"softcap .*nan"),
    ("dropout", _args(), {"dropout_p": 0.1}, ValueError, r"dropout_p=0.1.*pass dropout_p=0.0"),
    ("alibi", _args(), {"alibi_slopes": torch.ones(4)}, ValueError, r"alibi_slopes.*RoPE"),
    ("block-table", _args(), {"block_table": torch.zeros(3, 1, dtype=I32)}, ValueError,
     r"block_table.*block_table=None"),
    ("causal-yes", _args(), {"causal": "yes"}, TypeError, r"causal must be a bool.*'yes'"),
    ("causal-none", _args(), {"causal": None}, TypeError, r"causal must be a bool.*None"),
]


@pytest.mark.parametrize("a,kw,exc,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_messages(a, kw, exc, match):
    with pytest.raises(exc, match=match):
        _call(a, **kw)
