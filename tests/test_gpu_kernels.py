"""GPU tier, kernels: the compiled Triton kernels and the ``sdpa`` backend on CUDA, against an fp64 reference.

``pytest -m gpu`` (skipped without CUDA; ``bench/gpu_check.sh`` runs it first). Accuracy rule (tests/attn_ref.py):
err(ours vs fp64) <= 2 x err(plain PyTorch, same dtype) + floor. At 16k and 32k tokens a full fp64 reference does
not fit, so ``dout`` is zero outside the last ``ROWS`` query rows: dk and dv then come from those rows alone
(every other row's dS is 0), out/lse/dq of those rows need only those rows, and the reference is those rows
against every key, which is exact, not an approximation.

Each test's comment names the CUDA-only branch it covers; ``tests/gpu_coverage.py`` maps every CUDA-only site of
``kernels/``, ``distattn/`` and ``launch/`` to a test of this tier (``tests/test_gpu_coverage.py`` checks it).
"""
import pytest
import torch

import distattn
from attn_ref import assert_all_close_by_rule, band_mask, make_qkv, masked_attention, varlen_mask
from distattn import kernels

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

if torch.cuda.is_available():
    from distattn.kernels import _triton

ROWS = 1024  # query rows checked at long lengths (their reference: ROWS x s_k logits per head, in fp64)
NAMES = ("out", "lse", "dq", "dk", "dv")
BF16, FP16 = torch.bfloat16, torch.float16


def _reference(q, k, v, dout, mask, dtype, rows, softcap=0.0):
    """out, lse, dq (of the last ``rows`` query rows), dk, dv of masked attention in ``dtype``; ``dout`` is zero
    above those rows, so their contribution is all of dk, dv."""
    qd = q[:, -rows:].detach().to(dtype).requires_grad_()
    kd, vd = (t.detach().to(dtype).requires_grad_() for t in (k, v))
    out, lse = masked_attention(qd, kd, vd, mask[-rows:], scale=q.shape[-1] ** -0.5, softcap=softcap, dtype=dtype)
    out.backward(dout[:, -rows:].to(dtype))
    return [t.detach() for t in (out, lse, qd.grad, kd.grad, vd.grad)]


def _run_ours(q, k, v, dout, rows, call):
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse, _ = call(qs, ks, vs)
    out.backward(dout)
    return [out[:, -rows:].detach(), lse[..., -rows:].detach(), qs.grad[:, -rows:], ks.grad, vs.grad]


def _check(b, s, h_q, h_kv, d, dtype, *, causal=False, window=(-1, -1), softcap=0.0, docs=None, seed=0,
           backend="triton"):
    q, k, v, dout = make_qkv(b, s, s, h_q, h_kv, d, dtype, seed=seed, device="cuda")
    rows = min(ROWS, s)
    dout[:, :s - rows] = 0
    if docs is None:
        mask = band_mask(s, s, causal=causal, window=window).cuda()
        call = lambda q, k, v: distattn.flash_attn_func(  # noqa: E731
            q, k, v, causal=causal, window_size=window, softcap=softcap, backend=backend, return_attn_probs=True)
    else:
        cu = torch.tensor(docs, dtype=torch.int32, device="cuda")
        lens = [e - a for a, e in zip(docs, docs[1:])]
        mask = varlen_mask(lens, lens, causal=causal, window=window).cuda()
        flat = lambda t: t.reshape(b * s, *t.shape[2:])  # noqa: E731  (b=1: packed documents in one stream)

        def call(q, k, v):
            out, lse, p = distattn.flash_attn_varlen_func(flat(q), flat(k), flat(v), cu, cu, s, s, causal=causal,
                                                          window_size=window, softcap=softcap, backend=backend,
                                                          return_attn_probs=True)
            return out.view(q.shape), lse.view(b, h_q, s), p
    ours = _run_ours(q, k, v, dout, rows, call)
    ref = _reference(q, k, v, dout, mask, torch.float64, rows, softcap)
    base = _reference(q, k, v, dout, mask, dtype, rows, softcap)
    assert ours[0].dtype == dtype and ours[1].dtype == torch.float32
    assert_all_close_by_rule(NAMES, ours, base, ref, dtype)


# (b, s, h_q, h_kv, d, causal, dtype): 1k..32k, head dims 64/96/128/256, MHA/GQA/MQA, bf16 and fp16. Few cases: each
# new (dtype, d, mask, length bucket) compiles kernels, and the tier has a time budget (bench/gpu_check.py).
# tests/test_triton.py's GPU tests add 8k for d 64/128/256 x causal/dense x bf16/fp16.
LENGTH_CASES = [
    (4, 1024, 8, 2, 64, True, BF16),
    (2, 4096, 4, 4, 96, False, BF16),
    (2, 4096, 4, 4, 96, True, FP16),
    (1, 2048, 4, 2, 256, True, BF16),
    (1, 16384, 2, 2, 64, False, FP16),
    (1, 32768, 2, 1, 128, True, BF16),
    (1, 32768, 4, 1, 128, False, FP16),
]


# CUDA-only: the compiled (not interpreted) Triton kernels, bf16 tl.dot, the _Heuristic config pick and
# kernels.__init__'s CUDA default (triton first); the dK/dV descriptor path on sm_90+ (_tma_device_cached).
@pytest.mark.parametrize("case", LENGTH_CASES, ids=lambda c: f"b{c[0]}-s{c[1]}-h{c[2]}:{c[3]}-d{c[4]}-"
                                                           f"{'causal' if c[5] else 'full'}-{str(c[6])[6:]}")
def test_triton_forward_backward_by_rule(case):
    b, s, h_q, h_kv, d, causal, dtype = case
    _check(b, s, h_q, h_kv, d, dtype, causal=causal, seed=s + d)


# (s, h_q, h_kv, d, causal, window, softcap, docs, dtype): sliding windows, softcap, packed documents (MASK 2)
MASK_CASES = [
    (4096, 4, 2, 128, True, (511, 0), 0.0, None, BF16),
    (4096, 4, 1, 64, False, (300, 700), 0.0, None, FP16),
    (2048, 4, 2, 128, True, (-1, -1), 30.0, None, BF16),
    (8192, 4, 2, 128, True, (-1, -1), 0.0, [0, 1000, 1001, 4500, 8192], BF16),
    (4096, 2, 1, 64, True, (255, 0), 20.0, [0, 2048, 3000, 4096], FP16),
    (4096, 4, 2, 96, False, (200, 100), 0.0, [0, 7, 2500, 4096], BF16),
]


# CUDA-only: the compiled kernels' MASK=2 (per-row key bounds) and SOFTCAP paths, incl. dK/dV via descriptors.
@pytest.mark.parametrize("case", MASK_CASES, ids=lambda c: f"s{c[0]}-d{c[3]}-w{c[5][0]}:{c[5][1]}-cap{c[6]:g}-"
                                                         f"{'docs' if c[7] else 'dense'}-{str(c[8])[6:]}")
def test_triton_masks_by_rule(case):
    s, h_q, h_kv, d, causal, window, softcap, docs, dtype = case
    _check(1, s, h_q, h_kv, d, dtype, causal=causal, window=window, softcap=softcap, docs=docs, seed=s + 7)


# CUDA-only: carried softmax statistics folded chunk by chunk through the compiled fold/merge/finalize kernels.
@pytest.mark.parametrize("n_chunks", [1, 8])
def test_triton_carried_chunks_by_rule(n_chunks):
    b, s, h_q, h_kv, d, dtype = 1, 8192, 4, 2, 128, BF16
    q, k, v, dout = make_qkv(b, s, s, h_q, h_kv, d, dtype, seed=n_chunks, device="cuda")
    rows, scale = ROWS, d ** -0.5
    dout[:, :s - rows] = 0
    bounds = [(i * s // n_chunks, (i + 1) * s // n_chunks) for i in range(n_chunks)]
    state = kernels.new_state(q)
    for j0, j1 in bounds:
        kernels.fold_(state, q, k[:, j0:j1], v[:, j0:j1], softmax_scale=scale, k_start=j0, causal=True,
                      backend="triton")
    out, lse = kernels.finalize(state, dtype)
    delta = kernels.attn_delta(dout, out, backend="triton")
    acc = [torch.zeros(t.shape, dtype=torch.float32, device="cuda") for t in (q, k, v)]
    for j0, j1 in bounds:
        kernels.backward_chunk_(dout, q, k[:, j0:j1], v[:, j0:j1], lse, delta, acc[0], acc[1][:, j0:j1],
                                acc[2][:, j0:j1], softmax_scale=scale, k_start=j0, causal=True, backend="triton")
    ours = [out[:, -rows:], lse[..., -rows:], acc[0][:, -rows:], acc[1], acc[2]]  # fp32 accumulators as they are
    mask = band_mask(s, s, causal=True).cuda()
    ref = _reference(q, k, v, dout, mask, torch.float64, rows)
    base = _reference(q, k, v, dout, mask, dtype, rows)
    assert_all_close_by_rule(NAMES, ours, base, ref, dtype)


def _pin_dkdv_config(monkeypatch, config):
    """Launch the dK/dV kernel with ``config`` whatever the path (the two paths' filters keep different lists, and
    a different tile order is a different sum order)."""
    real = _triton._Heuristic.pick
    monkeypatch.setattr(_triton._Heuristic, "pick",
                        lambda self, named: config if self.name == "dkdv" else real(self, named))


# CUDA-only: kernels/_triton.py backward_chunk_'s compiled descriptor branch (tma and q.device.type == "cuda":
# _ensure_allocator, _scratch) against the pointer branch (DISTATTN_TMA=0), same tiles: bit for bit.
@pytest.mark.parametrize("d,mask", [(64, "causal"), (128, "full"), (128, "docs"), (64, "softcap")])
def test_dkdv_descriptor_path_is_bit_identical_to_pointer_path(d, mask, monkeypatch):
    if not _triton._tma_device(torch.device("cuda", torch.cuda.current_device())):
        pytest.skip("no tensor descriptors on this GPU (sm_90+ and a Triton with make_tensor_descriptor)")
    b, s, h_q, h_kv, dtype = 2, 3000, 8, 2, torch.bfloat16
    q, k, v, dout = make_qkv(b, s, s, h_q, h_kv, d, dtype, seed=d, device="cuda")
    kw = dict(scale=d ** -0.5, q_start=0, k_start=0, causal=mask == "causal")
    if mask == "docs":
        cu = torch.tensor([0, 100, 1700, s], dtype=torch.int32, device="cuda")
        kw["bounds"] = kernels.varlen_bounds(cu, cu, (0, s), causal=True, window=(600, 0))
    if mask == "softcap":
        kw["softcap"] = 15.0
    be = _triton.TritonBackend()
    out, lse = torch.empty_like(q), torch.empty(b, h_q, s, dtype=torch.float32, device="cuda")
    be.fold_(None, lse, q, k, v, fresh=True, out_final=out, **kw)
    delta = be.delta(dout, out)
    _pin_dkdv_config(monkeypatch, (64, 64, 4, 2))

    def grads():
        acc = [torch.zeros(t.shape, dtype=torch.float32, device="cuda") for t in (q, k, v)]
        be.backward_chunk_(dout, q, k, v, lse, delta, *acc, **kw)
        torch.cuda.synchronize()
        return acc

    with_desc = grads()
    monkeypatch.setattr(_triton, "_TMA_MODE", "0")
    with_ptr = grads()
    for name, a, w in zip(("dq", "dk", "dv"), with_desc, with_ptr):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, w), f"{name}: max difference {(a - w).abs().max().item():.3e}"


# CUDA-only: kernels/_sdpa.py's _CudaFlashOps (device.type == "cuda") through the public API, windows and
# packed documents included, and kernels.available_backends on CUDA (triton first, sdpa offered).
@pytest.mark.parametrize("kind", ["causal", "window", "docs"])
def test_sdpa_backend_on_cuda_by_rule(kind):
    assert kernels.available_backends("cuda")[0] == "triton" and "sdpa" in kernels.available_backends("cuda")
    ok, why = kernels._sdpa_available(torch.device("cuda"))
    assert ok, why
    if kind == "causal":
        _check(2, 2048, 8, 2, 128, torch.bfloat16, causal=True, backend="sdpa", seed=3)
    elif kind == "window":
        _check(1, 2048, 4, 2, 64, torch.bfloat16, causal=True, window=(255, 0), backend="sdpa", seed=4)
    else:
        _check(1, 2048, 4, 1, 128, torch.bfloat16, causal=True, docs=[0, 700, 701, 2048], backend="sdpa", seed=5)
