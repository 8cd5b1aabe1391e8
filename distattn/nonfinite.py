"""NaN and Inf where one device puts them, also in the (query chunk, kv chunk) pairs a plan skips (issue 35).

What one device does. The one-device call computes attention as products of a (query rows x keys) probability
tile with an operand: ``out = P V``, ``dv = P^T dO``, ``dq = dS K``, ``dk = dS^T Q``. Masked entries of ``P`` and
``dS`` are exact zeros, chosen by select (the torch reference, to which the CPU backends hand every chunk that
holds a NaN or an infinity), but the product still multiplies them with the operand, and ``0 * NaN = 0 * inf =
NaN``: a non-finite element in column ``c`` of an operand reaches column ``c`` of every row (or key) of the tile,
seen or not. The target here is that call with the whole ``(query, key)`` matrix as one tile, which is what the
CPU kernels compute for sequences up to one tile (128 tokens) and what the rules below make independent of the
tiling. With ``c`` a (batch, head, dim) column, ``R(x, c)`` the rows of ``x`` with a non-finite element in column
``c`` (GQA: the query heads of a kv head's group together), and "row ``i`` sees key ``j``" the call's mask:

1. ``out[i, c]`` is NaN if row ``i`` sees some key (lse > -inf; a row that sees nothing stays 0) and some key of
   ``R(v, c)`` is masked for ``i``;
2. ``dv[j, c]`` is NaN if some row of ``R(dout, c)`` does not see key ``j``;
3. ``dk[j, c]`` is NaN for every key if ``R(q, c)`` is not empty;
4. ``dq[i, c]`` is NaN for every row if ``R(k, c)`` is not empty;

and everything else is what the visible products give, which the per-pair kernels compute already (a pair with
any visible (query, key) pair is never skipped). 3 and 4 need no visibility: a row with a non-finite query
element has only +-inf or NaN logits, so its ``dS`` is 0 or NaN against every key, and a key with a non-finite
element gives every row a +-inf or NaN logit, so ``dS`` is 0 or NaN there: the product is NaN, seen or not.
``out`` and ``dv`` multiply a finite, nonzero ``P`` where the key is seen, so a seen infinite value gives +-inf,
not NaN, and only masked rows/keys are set. A mask's bounds are nondecreasing down the rows, so the rows that see
key ``j`` are one interval ``[f(j), l(j)]``, and "some row of ``R`` does not see ``j``" is ``first(R) < f(j)`` or
``last(R) > l(j)``: two numbers per column say it all (rule 1 likewise with the keys' first and last).

fp64 SDPA (``F.scaled_dot_product_attention``'s math path) gives the same ``out``, ``dq`` and ``dv``; its ``dk``
differs where a row with a NaN ``delta`` has masked keys (its softmax backward computes the masked ``dS`` as
``0 * NaN``), so ``dk`` equals SDPA's where no key is masked (not causal). The Triton backward also leaves a NaN
``delta`` in the masked ``dS`` inside its blocks (``kernels/_triton_bwd.py``): on it ``dq``/``dk`` may hold more
NaN than the rules, as on one device.

Cost when every input is finite: one sum over each of the phase's tensors (v forward; q, k and dout backward)
and one all-reduce of one integer per phase, posted before the first step and read after the last, so it travels
while the steps compute (on CUDA its host read orders the host after the phase's kernels, as the agreement's
confirmation does). Only when some rank holds a non-finite value do the ranks exchange the first and last global
position of its non-finite rows per column (one all-reduce of ``2 * b * d * (2 * h_q + h_kv)`` int64 at most) and
set the elements above.

Legend: ``b`` batch, ``n`` tokens of this rank, ``h_q``/``h_kv`` heads, ``d`` head dim, ``T`` tokens in all.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from distattn.comm import bounded_wait

__all__ = ["Check", "Columns", "spread_backward", "spread_forward"]

_NONE = np.iinfo(np.int64).max // 2  # "no non-finite row": a first position past any stream


class Columns:
    """Per (batch, head, dim) column, the first and last global position of a row with a non-finite element."""

    def __init__(self, first: torch.Tensor, last: torch.Tensor):
        self.first, self.last = first, last  # (b, h, d) int64; no such row: first = _NONE, last = -1

    @property
    def any(self) -> torch.Tensor:
        return self.last >= 0

    def grouped(self, h_kv: int) -> Columns:
        """The columns of a GQA group together: ``(b, h_q, d)`` -> ``(b, h_kv, d)``."""
        b, h, d = self.first.shape
        return Columns(self.first.view(b, h_kv, h // h_kv, d).amin(2), self.last.view(b, h_kv, h // h_kv, d).amax(2))

    def per_query_head(self, h_q: int) -> Columns:
        """kv-head columns seen by every query head of their group: ``(b, h_kv, d)`` -> ``(b, h_q, d)``."""
        g = h_q // self.first.shape[1]
        return Columns(self.first.repeat_interleave(g, 1), self.last.repeat_interleave(g, 1))


def _local_columns(x_bshd: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(-first, last)`` of this rank's rows of ``x`` (``pos``: their global positions), ready for a MAX reduce."""
    bad = ~torch.isfinite(x_bshd)
    p = pos.view(1, -1, 1, 1)
    last = torch.where(bad, p, -1).amax(1)
    neg_first = torch.where(bad, -p, -_NONE).amax(1)
    return neg_first, last


class Check:
    """One phase's non-finite check: its one-integer all-reduce is posted before the first step (it travels while the
    steps compute) and read after the last; only if some rank holds a non-finite value, the columns follow."""

    def __init__(self, ex, tensors: list[torch.Tensor]):
        self.ex, self.tensors = ex, tensors
        # A sum is NaN or +-inf iff an element is (or, harmlessly, if finite values overflow fp32: the columns then
        # say there is nothing to set): one reduction per tensor, 40x cheaper than isfinite's mask on CPU.
        total = torch.stack([t.sum(dtype=torch.float32) for t in tensors]).sum()
        bad = ~torch.isfinite(total)
        self.flag = bad.to(torch.int64).reshape(1).to(ex._collective_device())
        self.work = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=ex.lib.fetch, async_op=True)

    def columns(self) -> list[Columns] | None:
        """The group's :class:`Columns` of each tensor (this rank's shards), or None when every rank's are finite."""
        ex = self.ex
        what = f"distattn: rank {ex.rank}, {ex.phase} {ex.call}, after the last step"
        bounded_wait([self.work], ex.cfg.timeout, f"{what}: non-finite check", poll=ex.lib.nccl,
                     gave_up=ex.lib.watch_collective)
        if not self.flag.item():
            return None
        like = self.tensors[0]
        pos = torch.from_numpy(positions(ex)).to(like.device)
        parts = [_local_columns(t, pos) for t in self.tensors]
        flat = torch.cat([x.reshape(-1) for pair in parts for x in pair]).to(self.flag.device)
        bounded_wait([dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=ex.lib.fetch, async_op=True)],
                     ex.cfg.timeout, f"{what}: non-finite columns", poll=ex.lib.nccl,
                     gave_up=ex.lib.watch_collective)
        flat, out, at = flat.to(like.device), [], 0
        for _, last in parts:
            size = last.numel()
            neg_first, last_all = flat[at:at + size].view(last.shape), flat[at + size:at + 2 * size].view(last.shape)
            out.append(Columns(-neg_first, last_all))
            at += 2 * size
        return out


def positions(ex) -> np.ndarray:
    """Global positions of this rank's ``n`` rows (the plan's layout; contiguous: ``[r*n, (r+1)*n)``)."""
    if ex.plan.layout is not None:
        return ex.plan.layout.positions(ex.rank, ex.n)
    return np.arange(ex.rank * ex.n, (ex.rank + 1) * ex.n, dtype=np.int64)


def _total(ex) -> int:
    return ex.n * ex.plan.world_size


def _dev(a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(like.device)


def spread_forward(check: Check, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Rule 1 on this rank's ``out (b, n, h_q, d)`` in place (``lse (b, h_q, n)``: which rows see a key); ``check``:
    of ``[v]``."""
    cols, ex = check.columns(), check.ex
    if cols is None:
        return
    vc = cols[0].per_query_head(out.shape[2])
    lo, hi = ex.spec.bounds_at(_total(ex), positions(ex))  # the keys each of this rank's rows sees
    lo, hi = _dev(lo, out).view(1, -1, 1, 1), _dev(hi, out).view(1, -1, 1, 1)
    masked = (vc.first.unsqueeze(1) < lo) | (vc.last.unsqueeze(1) > hi)  # (b, n, h_q, d)
    seen = (lse != float("-inf")).transpose(1, 2).unsqueeze(-1)
    out.masked_fill_(masked & seen, float("nan"))


def spread_backward(check: Check, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """Rules 2-4 on this rank's gradient accumulators ``dq (b, n, h_q, d)``, ``dk, dv (b, n, h_kv, d)`` in place;
    ``check``: of ``[q, k, dout]``."""
    cols, ex = check.columns(), check.ex
    if cols is None:
        return
    qc, kc, dc = cols
    h_q, h_kv = dq.shape[2], dk.shape[2]
    dk.masked_fill_(qc.grouped(h_kv).any.unsqueeze(1), float("nan"))
    dq.masked_fill_(kc.per_query_head(h_q).any.unsqueeze(1), float("nan"))
    dc = dc.grouped(h_kv)
    if not bool(dc.any.any()):
        return
    first, last = (_dev(a, dv).view(1, -1, 1, 1) for a in _rows_seeing(ex))  # rows that see each key of this rank
    dv.masked_fill_((dc.first.unsqueeze(1) < first) | (dc.last.unsqueeze(1) > last), float("nan"))


def _rows_seeing(ex) -> tuple[np.ndarray, np.ndarray]:
    """For each of this rank's keys ``j``, the first and last global row position that sees it (``f > l``: none).

    The bounds of all ``T`` rows, once (only a call with a non-finite ``dout`` gets here): rows with ``hi >= j``
    are a suffix and rows with ``lo <= j`` a prefix, as both bounds are nondecreasing."""
    total = _total(ex)
    lo, hi = ex.spec.bounds(total, 0, total)
    keys = positions(ex)
    return np.searchsorted(hi, keys, side="left"), np.searchsorted(lo, keys, side="right") - 1
