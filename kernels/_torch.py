"""Pure-PyTorch backend of the kernel contract: the reference every other backend must agree with.

Runs on any device. Blockwise over keys (``block_k`` at a time), so memory stays O(s_q x block_k) per head,
never O(s_q x s_k). All arithmetic is fp32 whatever the input dtype.

Legend: ``b`` batch, ``q``/``k`` query/key positions, ``h`` kv heads, ``g`` query heads per kv head
(GQA group), ``d`` head dim. Queries are viewed as ``(b, s_q, h_kv, g, d)`` so GQA needs no repeated keys.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def _grouped(x_bshd: torch.Tensor, h_kv: int) -> torch.Tensor:
    """(b, s, h_q, d) -> (b, s, h_kv, g, d) fp32 view/copy."""
    b, s, h_q, d = x_bshd.shape
    return x_bshd.float().reshape(b, s, h_kv, h_q // h_kv, d)


def _causal_keep(q_start: int, s_q: int, k0: int, s_blk: int, device) -> torch.Tensor:
    """Boolean (s_q, s_blk): key at global k0 + j visible to query at global q_start + i."""
    q_pos = torch.arange(q_start, q_start + s_q, device=device)
    k_pos = torch.arange(k0, k0 + s_blk, device=device)
    return k_pos[None, :] <= q_pos[:, None]


def _key_blocks(s_q: int, s_k: int, q_start: int, k_start: int, causal: bool, block_k: int):
    """Yield (start, stop) of key blocks that at least one query can see."""
    last_q = q_start + s_q - 1
    for j0 in range(0, s_k, block_k):
        if causal and k_start + j0 > last_q:
            break  # this block and every later one lie entirely above the diagonal
        yield j0, min(j0 + block_k, s_k)


class TorchBackend:
    """Reference implementation of the backend protocol (see ``distattn.kernels``)."""

    name = "torch"

    def __init__(self, block_k: int = 128):
        self.block_k = block_k

    # -- forward ---------------------------------------------------------------------------------------
    def fold_(self, out_f32, lse, q, k, v, *, scale, q_start, k_start, causal, fresh, out_final):
        b, s_q, h_q, d = q.shape
        s_k, h_kv = k.shape[1], k.shape[2]
        q5 = _grouped(q, h_kv)  # (b, s_q, h, g, d)
        if fresh:
            acc = q5.new_zeros(q5.shape)
            m = q5.new_full((b, h_kv, h_q // h_kv, s_q), _NEG_INF)
        else:
            acc = _grouped(out_f32, h_kv).clone()
            m = lse.reshape(b, h_kv, h_q // h_kv, s_q).clone()
        l = torch.ones_like(m)  # noqa: E741  (l = running sum; a normalized state has l = 1)

        for j0, j1 in _key_blocks(s_q, s_k, q_start, k_start, causal, self.block_k):
            kb, vb = k[:, j0:j1].float(), v[:, j0:j1].float()
            s = torch.einsum("bqhgd,bkhd->bhgqk", q5, kb) * scale
            if causal:
                s = s.masked_fill(~_causal_keep(q_start, s_q, k_start + j0, j1 - j0, q.device), _NEG_INF)
            # -- online softmax: rescale what we have to the new running max --
            m_new = torch.maximum(m, s.amax(dim=-1))
            m_safe = torch.where(m_new == _NEG_INF, 0.0, m_new)  # all -inf so far: avoid (-inf) - (-inf)
            alpha = torch.exp(m - m_safe)
            p = torch.exp(s - m_safe[..., None])
            l = l * alpha + p.sum(dim=-1)  # noqa: E741
            acc = acc * alpha.permute(0, 3, 1, 2)[..., None] + torch.einsum("bhgqk,bkhd->bqhgd", p, vb)
            m = m_new

        # -- normalize: out = acc / l, lse = m + ln l; rows that saw nothing stay (0, -inf) --
        seen = l > 0  # m = -inf  =>  alpha = 0 and every p = 0, so l = 0 exactly
        l_safe = torch.where(seen, l, 1.0)
        out5 = acc / l_safe.permute(0, 3, 1, 2)[..., None]
        new_lse = torch.where(seen, m + torch.log(l_safe), _NEG_INF).reshape(b, h_q, s_q)
        out_bshd = out5.reshape(b, s_q, h_q, d)
        lse.copy_(new_lse)
        if out_final is not None:
            out_final.copy_(out_bshd)
        else:
            out_f32.copy_(out_bshd)

    def merge_(self, out_f32, lse, out_part, lse_part):
        # Two normalized partials over disjoint key sets: with m = max(lse1, lse2) and w_i = exp(lse_i - m),
        #   lse = m + ln(w1 + w2),  out = (w1 * out1 + w2 * out2) / (w1 + w2).
        # Both weights are <= 1 and one equals 1, so nothing overflows; if both sides are empty
        # (lse1 = lse2 = -inf) we take m = 0, both weights are 0 and the result stays (0, -inf).
        m = torch.maximum(lse, lse_part)
        m = torch.where(m == _NEG_INF, 0.0, m)
        w1, w2 = torch.exp(lse - m), torch.exp(lse_part.float() - m)
        total = w1 + w2
        seen = total > 0
        total_safe = torch.where(seen, total, 1.0)
        to_bshd = lambda t: t.permute(0, 2, 1)[..., None]  # (b, h, s) -> (b, s, h, 1)  # noqa: E731
        out = (to_bshd(w1) * out_f32 + to_bshd(w2) * out_part.float()) / to_bshd(total_safe)
        out_f32.copy_(out)
        lse.copy_(torch.where(seen, m + torch.log(total_safe), _NEG_INF))

    # -- backward --------------------------------------------------------------------------------------
    def delta(self, dout, out):
        return (dout.float() * out.float()).sum(dim=-1).transpose(1, 2).contiguous()  # (b, h_q, s_q)

    def backward_chunk_(self, dout, q, k, v, lse, delta, dq_acc, dk_acc, dv_acc, *, scale, q_start,
                        k_start, causal):
        b, s_q, h_q, d = q.shape
        s_k, h_kv = k.shape[1], k.shape[2]
        g = h_q // h_kv
        q5, do5 = _grouped(q, h_kv), _grouped(dout, h_kv)
        lse4 = lse.reshape(b, h_kv, g, s_q)
        # A row with lse = -inf saw no key anywhere: every p of it must be 0 (and not exp(nan)).
        lse_safe = torch.where(lse4 == _NEG_INF, float("inf"), lse4)[..., None]
        delta4 = delta.reshape(b, h_kv, g, s_q)[..., None]
        dq5 = torch.zeros_like(q5)

        for j0, j1 in _key_blocks(s_q, s_k, q_start, k_start, causal, self.block_k):
            kb, vb = k[:, j0:j1].float(), v[:, j0:j1].float()
            s = torch.einsum("bqhgd,bkhd->bhgqk", q5, kb) * scale
            if causal:
                s = s.masked_fill(~_causal_keep(q_start, s_q, k_start + j0, j1 - j0, q.device), _NEG_INF)
            p = torch.exp(s - lse_safe)  # masked: exp(-inf) = 0; empty rows: exp(-inf) = 0
            dv_acc[:, j0:j1] += torch.einsum("bhgqk,bqhgd->bkhd", p, do5)
            dp = torch.einsum("bqhgd,bkhd->bhgqk", do5, vb)
            ds = p * (dp - delta4)
            dq5 += torch.einsum("bhgqk,bkhd->bqhgd", ds, kb) * scale
            dk_acc[:, j0:j1] += torch.einsum("bhgqk,bqhgd->bkhd", ds, q5) * scale
        dq_acc += dq5.reshape(b, s_q, h_q, d)
