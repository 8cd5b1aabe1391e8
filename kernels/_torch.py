"""Pure-PyTorch backend of the kernel contract: the reference every other backend must agree with.

Runs on any device. Tiled over queries (``block_q`` rows) and keys (``block_k``), so memory stays
O(block_q x block_k) per head and work is proportional to the visible pairs: a (query block, key block) tile
that no row can see is never computed, and a tile every row sees whole pays for no mask. All arithmetic is
fp32 whatever the input dtype.

Which keys a row sees comes from one description (``_masks.KeyBounds``: per row an interval ``[lo, hi]`` of
global key positions, nondecreasing down the rows); ``causal=True`` without bounds is the interval
``[k_start, q_pos]``, nothing masked is the whole chunk. The bounds are read to the host once per call (this
is the reference, not the fast path).

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


class _Visibility:
    """Which keys of a chunk each query row sees, and the tiles that need computing (host-side plan)."""

    def __init__(self, s_q, s_k, q_start, k_start, causal, bounds, device):
        self.s_k, self.k_start = s_k, k_start
        if bounds is not None:
            lo, hi = bounds.lo.to(device, torch.int64), bounds.hi.to(device, torch.int64)
        else:
            lo = torch.full((s_q,), k_start, dtype=torch.int64, device=device)
            hi = torch.full((s_q,), k_start + s_k - 1, dtype=torch.int64, device=device)
            if causal:
                hi = torch.minimum(hi, torch.arange(q_start, q_start + s_q, device=device))
        self.lo, self.hi = lo, hi
        self.lo_h, self.hi_h = lo.tolist(), hi.tolist()

    def tiles(self, s_q: int, block_q: int, block_k: int):
        """Yield ``(i0, i1, [(j0, j1, masked), ...])`` for every query block with any visible key."""
        for i0 in range(0, s_q, block_q):
            i1 = min(i0 + block_q, s_q)
            # nondecreasing bounds: the block's extremes are its first and last rows
            k_lo = max(self.lo_h[i0] - self.k_start, 0)
            k_hi = min(self.hi_h[i1 - 1] - self.k_start + 1, self.s_k)
            full_lo = self.lo_h[i1 - 1] - self.k_start  # keys every row of the block sees: [full_lo, full_hi]
            full_hi = self.hi_h[i0] - self.k_start
            blocks = [(j0, min(j0 + block_k, k_hi), not (j0 >= full_lo and min(j0 + block_k, k_hi) - 1 <= full_hi))
                      for j0 in range(k_lo, k_hi, block_k)]
            if blocks:
                yield i0, i1, blocks

    def keep(self, i0, i1, j0, j1) -> torch.Tensor:
        """Boolean (i1 - i0, j1 - j0): row sees key."""
        k_pos = torch.arange(self.k_start + j0, self.k_start + j1, device=self.lo.device)
        return (k_pos[None, :] >= self.lo[i0:i1, None]) & (k_pos[None, :] <= self.hi[i0:i1, None])


def _scores(q5, kb, scale, softcap):
    """Logits ``(b, h, g, q, k)`` in fp32; with ``softcap`` also ``tanh`` (for the backward's chain rule)."""
    s = torch.einsum("bqhgd,bkhd->bhgqk", q5, kb) * scale
    if softcap:
        t = torch.tanh(s / softcap)
        return softcap * t, t
    return s, None


class TorchBackend:
    """Reference implementation of the backend protocol (see ``distattn.kernels``)."""

    name = "torch"

    def __init__(self, block_q: int = 128, block_k: int = 128):
        self.block_q, self.block_k = block_q, block_k

    # -- forward ---------------------------------------------------------------------------------------
    def fold_(self, out_f32, lse, q, k, v, *, scale, q_start, k_start, causal, fresh, out_final, bounds=None,
              softcap=0.0):
        b, s_q, h_q, d = q.shape
        s_k, h_kv = k.shape[1], k.shape[2]
        g = h_q // h_kv
        q5 = _grouped(q, h_kv)  # (b, s_q, h, g, d)
        if fresh:
            acc = q5.new_zeros(q5.shape)
            m = q5.new_full((b, h_kv, g, s_q), _NEG_INF)
        else:
            acc = _grouped(out_f32, h_kv).clone()
            m = lse.reshape(b, h_kv, g, s_q).clone()
        l = torch.ones_like(m)  # noqa: E741  (l = running sum; a normalized state has l = 1)
        l[m == _NEG_INF] = 0.0

        vis = _Visibility(s_q, s_k, q_start, k_start, causal, bounds, q.device)
        for i0, i1, blocks in vis.tiles(s_q, self.block_q, self.block_k):
            acc_i, m_i, l_i = acc[:, i0:i1], m[..., i0:i1], l[..., i0:i1]
            for j0, j1, masked in blocks:
                kb, vb = k[:, j0:j1].float(), v[:, j0:j1].float()
                s, _ = _scores(q5[:, i0:i1], kb, scale, softcap)
                if masked:
                    s = s.masked_fill(~vis.keep(i0, i1, j0, j1), _NEG_INF)
                # -- online softmax: rescale what we have to the new running max --
                m_new = torch.maximum(m_i, s.amax(dim=-1))
                m_safe = torch.where(m_new == _NEG_INF, 0.0, m_new)  # all -inf so far: avoid (-inf) - (-inf)
                alpha = torch.exp(m_i - m_safe)
                p = torch.exp(s - m_safe[..., None])
                l_i = l_i * alpha + p.sum(dim=-1)
                acc_i = acc_i * alpha.permute(0, 3, 1, 2)[..., None] + torch.einsum("bhgqk,bkhd->bqhgd", p, vb)
                m_i = m_new
            acc[:, i0:i1], m[..., i0:i1], l[..., i0:i1] = acc_i, m_i, l_i

        # -- normalize: out = acc / l, lse = m + ln l; rows that saw nothing stay (0, -inf) --
        # m = -inf  =>  alpha = 0 and every p = 0, so l = 0 exactly. ``!= 0``, not ``> 0``: a NaN l (a NaN
        # query, an infinite logit) is a row that saw something, and its NaN must come out, not a masked row.
        seen = l != 0
        l_safe = torch.where(seen, l, 1.0)
        out5 = torch.where(seen.permute(0, 3, 1, 2)[..., None], acc / l_safe.permute(0, 3, 1, 2)[..., None], 0.0)
        new_lse = torch.where(seen, m + torch.log(l_safe), _NEG_INF).reshape(b, h_q, s_q)
        out_bshd = out5.reshape(b, s_q, h_q, d)
        lse.copy_(new_lse)
        (out_final if out_final is not None else out_f32).copy_(out_bshd)

    def merge_(self, out_f32, lse, out_part, lse_part):
        # Two normalized partials over disjoint key sets: with m = max(lse1, lse2) and w_i = exp(lse_i - m),
        #   lse = m + ln(w1 + w2),  out = (w1 * out1 + w2 * out2) / (w1 + w2).
        # Both weights are <= 1 and one equals 1, so nothing overflows; if both sides are empty
        # (lse1 = lse2 = -inf) we take m = 0, both weights are 0 and the result stays (0, -inf).
        m = torch.maximum(lse, lse_part)
        m = torch.where(m == _NEG_INF, 0.0, m)
        w1, w2 = torch.exp(lse - m), torch.exp(lse_part.float() - m)
        total = w1 + w2
        seen = total != 0  # NaN weights propagate (a NaN partial is not an empty one)
        total_safe = torch.where(seen, total, 1.0)
        to_bshd = lambda t: t.permute(0, 2, 1)[..., None]  # (b, h, s) -> (b, s, h, 1)  # noqa: E731
        # An empty side (weight exactly 0) may hold anything in its output: select, never multiply by a zero
        # weight. A NaN weight is not zero: its NaN reaches the merged row.
        # In place, a block of query rows at a time: the state is scaled where it stands and the partial's share is
        # added block by block, so the scratch is one block (~1 MiB), not four partials' worth. The same operations
        # in the same order as (where(w1 != 0, w1 * out1, 0) + where(w2 != 0, w2 * out2, 0)) / total: bitwise equal.
        w1b, w2b, total_b = to_bshd(w1), to_bshd(w2), to_bshd(total_safe)
        out_f32.mul_(w1b).masked_fill_(w1b == 0, 0.0)
        _, s_q, h, d = out_f32.shape
        rows = max(1, (1 << 18) // max(1, h * d))
        for i in range(0, s_q, rows):
            part2 = w2b[:, i:i + rows] * out_part[:, i:i + rows].float()
            out_f32[:, i:i + rows].add_(part2.masked_fill_(w2b[:, i:i + rows] == 0, 0.0))
        out_f32.div_(total_b)
        lse.copy_(torch.where(seen, m + torch.log(total_safe), _NEG_INF))

    # -- backward --------------------------------------------------------------------------------------
    def delta(self, dout, out):
        return (dout.float() * out.float()).sum(dim=-1).transpose(1, 2).contiguous()  # (b, h_q, s_q)

    def backward_chunk_(self, dout, q, k, v, lse, delta, dq_acc, dk_acc, dv_acc, *, scale, q_start, k_start,
                        causal, bounds=None, softcap=0.0):
        b, s_q, h_q, d = q.shape
        s_k, h_kv = k.shape[1], k.shape[2]
        g = h_q // h_kv
        q5, do5 = _grouped(q, h_kv), _grouped(dout, h_kv)
        lse4 = lse.reshape(b, h_kv, g, s_q)
        # A row with lse = -inf saw no key anywhere: every p of it must be 0 (and not exp(nan)).
        lse_safe = torch.where(lse4 == _NEG_INF, float("inf"), lse4)
        delta4 = delta.reshape(b, h_kv, g, s_q)
        dq5 = torch.zeros_like(q5)

        vis = _Visibility(s_q, s_k, q_start, k_start, causal, bounds, q.device)
        for i0, i1, blocks in vis.tiles(s_q, self.block_q, self.block_k):
            qi, doi = q5[:, i0:i1], do5[:, i0:i1]
            lse_i, delta_i = lse_safe[..., i0:i1, None], delta4[..., i0:i1, None]
            for j0, j1, masked in blocks:
                kb, vb = k[:, j0:j1].float(), v[:, j0:j1].float()
                s, t = _scores(qi, kb, scale, softcap)
                p = torch.exp(s - lse_i)  # empty rows: exp(-inf) = 0
                if masked:
                    p = p.masked_fill(~vis.keep(i0, i1, j0, j1), 0.0)
                dv_acc[:, j0:j1] += torch.einsum("bhgqk,bqhgd->bkhd", p, doi)
                dp = torch.einsum("bqhgd,bkhd->bhgqk", doi, vb)
                ds = p * (dp - delta_i)
                if masked:  # an unseen key gets exactly 0, also when the row's delta is NaN (0 * NaN)
                    ds = ds.masked_fill(~vis.keep(i0, i1, j0, j1), 0.0)
                if softcap:  # d(softcap * tanh(x / softcap))/dx = 1 - tanh^2
                    ds = ds * (1.0 - t * t)
                dq5[:, i0:i1] += torch.einsum("bhgqk,bkhd->bqhgd", ds, kb) * scale
                dk_acc[:, j0:j1] += torch.einsum("bhgqk,bqhgd->bkhd", ds, qi) * scale
        dq_acc += dq5.reshape(b, s_q, h_q, d)
