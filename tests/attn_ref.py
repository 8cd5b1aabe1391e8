"""Naive attention reference and the accuracy rule shared by every test file.

Accuracy rule (the project's, taken from flash-attention's tests): the error of our result against an fp64 reference
is at most ``ACCURACY_FACTOR`` times the error of plain PyTorch at the same precision, plus a small absolute
floor (when plain PyTorch happens to be exact on a tensor, e.g. an all-zero gradient).
"""

from __future__ import annotations

import torch

ACCURACY_FACTOR = 2.0
# Absolute floor per dtype, relative to the reference's magnitude: one or two ulps of the result's scale,
# so an exactly-right baseline (error 0) does not demand bit equality from a different summation order.
_FLOOR_REL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-12}

_NEG_INF = float("-inf")


def naive_attention(q, k, v, *, causal=False, scale=None, q_start=None, k_start=0, dtype=torch.float64):
    """softmax(q k^T * scale + mask) v computed in ``dtype`` (fp64 for the reference).

    Global positions: query i at ``q_start + i`` (default ``s_k - s_q``: bottom-right alignment), key j at
    ``k_start + j``; GQA by repeating k/v (only here). Rows that see no key give out 0 and lse -inf.
    Returns ``(out (b, s_q, h_q, d), lse (b, h_q, s_q))`` in ``dtype``/fp64; differentiable.
    """
    b, s_q, h_q, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    q_start = s_k - s_q if q_start is None else q_start
    qd, kd, vd = (t.to(dtype).transpose(1, 2) for t in (q, k, v))  # (b, h, s, d)
    kd = kd.repeat_interleave(h_q // h_kv, dim=1)
    vd = vd.repeat_interleave(h_q // h_kv, dim=1)
    s = (qd @ kd.transpose(-1, -2)) * scale
    if causal:
        q_pos = torch.arange(q_start, q_start + s_q)[:, None]
        k_pos = torch.arange(k_start, k_start + s_k)[None, :]
        s = s.masked_fill(k_pos > q_pos, _NEG_INF)
    lse = torch.logsumexp(s.double() if dtype == torch.float64 else s.float(), dim=-1)
    empty = lse == _NEG_INF
    p = torch.softmax(s, dim=-1)
    p = torch.where(empty[..., None], torch.zeros_like(p), p)  # softmax of an all -inf row is NaN
    out = (p @ vd).transpose(1, 2)
    return out, lse


def max_err(x, ref) -> float:
    return (x.double() - ref.double()).abs().max().item() if x.numel() else 0.0


def finite_err(x, ref) -> float:
    """Max error where the reference is finite; infinities must match exactly."""
    x, ref = x.double(), ref.double()
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isinf(x) & ~fin, ~fin), "infinities of x and the reference differ"
    return max_err(x[fin], ref[fin])


def assert_close_by_rule(name, ours, baseline, ref, dtype, magnitude=None):
    """Assert err(ours vs ref) <= ACCURACY_FACTOR * err(baseline vs ref) + floor.

    ``magnitude`` sets the floor's scale (default: max |ref|, at least 1). Pass the largest magnitude of a
    group of related results (e.g. all gradients) when one member can be exactly zero by cancellation
    (dq with a single visible key), where plain PyTorch is exact but any other summation order is not.
    """
    assert not torch.isnan(ours).any(), f"{name}: NaN in result"
    err_ours = finite_err(ours, ref)
    err_base = finite_err(baseline, ref)
    floor = _FLOOR_REL[dtype] * max(magnitude_of(ref) if magnitude is None else magnitude, 1.0)
    bound = ACCURACY_FACTOR * err_base + floor
    assert err_ours <= bound, (f"{name}: error {err_ours:.3e} exceeds {ACCURACY_FACTOR} x plain PyTorch "
                               f"{dtype} error {err_base:.3e} + floor {floor:.1e}")


def magnitude_of(*tensors) -> float:
    """Largest finite absolute value over ``tensors`` (0 if none)."""
    vals = [t[torch.isfinite(t)].abs().max().item() for t in tensors if torch.isfinite(t).any()]
    return max(vals, default=0.0)


def assert_all_close_by_rule(names, ours, baseline, ref, dtype):
    """The rule for a group (out, lse, dq, dk, dv): gradients share one floor magnitude."""
    grads = [r for n, r in zip(names, ref) if n.startswith("d")]
    mag = magnitude_of(*grads) if grads else None
    for name, o, b, r in zip(names, ours, baseline, ref):
        assert_close_by_rule(name, o, b, r, dtype, magnitude=mag if name.startswith("d") else None)


def reference_grads(q, k, v, dout, dtype, **kw):
    """out, lse, dq, dk, dv of the naive attention computed in ``dtype`` (inputs upcast/downcast)."""
    qd, kd, vd = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out, lse = naive_attention(qd, kd, vd, dtype=dtype, **kw)
    out.backward(dout.to(dtype))
    return out.detach(), lse.detach(), qd.grad, kd.grad, vd.grad


def make_qkv(b, s_q, s_k, h_q, h_kv, d, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(device)  # noqa: E731
    return mk(b, s_q, h_q, d), mk(b, s_k, h_kv, d), mk(b, s_k, h_kv, d), mk(b, s_q, h_q, d)


# -- explicit boolean masks (windows, packed documents), written from flash-attn's definitions ---------------
def band_mask(s_q, s_k, *, causal=False, window=(-1, -1)):
    """Bool ``(s_q, s_k)``: query ``i`` sees key ``j`` (flash-attn's semantics, bottom-right aligned).

    Query ``i`` sits on key position ``p = i + s_k - s_q``; it sees ``j`` iff ``0 <= j < s_k``,
    ``j <= p`` when causal, ``j >= p - left`` when ``left >= 0`` and ``j <= p + right`` when ``right >= 0``.
    """
    left, right = window
    p = torch.arange(s_q)[:, None] + (s_k - s_q)
    j = torch.arange(s_k)[None, :]
    keep = torch.ones(s_q, s_k, dtype=torch.bool)
    if causal:
        keep &= j <= p
    if left >= 0:
        keep &= j >= p - left
    if right >= 0:
        keep &= j <= p + right
    return keep


def varlen_mask(lens_q, lens_k, *, causal=False, window=(-1, -1)):
    """Bool ``(sum(lens_q), sum(lens_k))``: block diagonal, each document's block a :func:`band_mask`."""
    mask = torch.zeros(sum(lens_q), sum(lens_k), dtype=torch.bool)
    r0 = c0 = 0
    for lq, lk in zip(lens_q, lens_k):
        mask[r0:r0 + lq, c0:c0 + lk] = band_mask(lq, lk, causal=causal, window=window)
        r0, c0 = r0 + lq, c0 + lk
    return mask


def masked_attention(q, k, v, mask, *, scale=None, softcap=0.0, dtype=torch.float64):
    """softmax(logits masked by ``mask``) v computed in ``dtype``; ``mask`` bool ``(s_q, s_k)`` or ``(b, s_q, s_k)``.

    Logits are ``scale * q.k``, soft-capped to ``softcap * tanh(scale * q.k / softcap)`` when ``softcap > 0``.
    Rows with no visible key give out 0, lse -inf and zero gradients (never NaN).
    Returns ``(out (b, s_q, h_q, d), lse (b, h_q, s_q))``; differentiable in q, k, v.
    """
    b, s_q, h_q, d = q.shape
    h_kv = k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    keep = (mask if mask.dim() == 3 else mask[None]).to(q.device)[:, None]  # (b or 1, 1, s_q, s_k)
    qd, kd, vd = (t.to(dtype).transpose(1, 2) for t in (q, k, v))  # (b, h, s, d)
    kd = kd.repeat_interleave(h_q // h_kv, dim=1)
    vd = vd.repeat_interleave(h_q // h_kv, dim=1)
    s = (qd @ kd.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~keep, _NEG_INF)
    lse = torch.logsumexp(s.detach().double() if dtype == torch.float64 else s.detach().float(), dim=-1)
    empty = ~keep.any(dim=-1, keepdim=True)  # (b or 1, 1, s_q, 1)
    p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1)  # an all -inf row would give NaN (and NaN grads)
    p = p.masked_fill(empty, 0.0)
    return (p @ vd).transpose(1, 2), lse


def masked_reference_grads(q, k, v, dout, mask, dtype, **kw):
    """out, lse, dq, dk, dv of :func:`masked_attention` computed in ``dtype``."""
    qd, kd, vd = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out, lse = masked_attention(qd, kd, vd, mask, dtype=dtype, **kw)
    out.backward(dout.to(dtype))
    return out.detach(), lse.detach(), qd.grad, kd.grad, vd.grad
