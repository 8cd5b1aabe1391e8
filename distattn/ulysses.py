"""Two-dimensional sequence parallelism: an all-to-all over heads (Ulysses) around the ring executor.

``P = U x R`` ranks (``distattn.topology``). Rank ``(r, u)`` holds ``n`` tokens of every head. The all-to-all over
its Ulysses group (``U`` ranks, inside a node) trades sequence for heads: afterwards the rank holds the ``U * n``
tokens of ring shard ``r`` (the whole Ulysses row's tokens) for ``1/U`` of the heads, and the ring executor
(``distattn.attention``, any schedule, any mask) runs over the ``R`` ranks of its ring on those. A second
all-to-all brings the output back to sequence shards (DeepSpeed-Ulysses, Jacobs et al. 2023; the 2-D combination
as in USP / LoongTrain)::

    (b, n, h_q, d) --a2a over U--> (b, U*n, h_q/U, d) --ring over R--> (b, U*n, h_q/U, d) --a2a--> (b, n, h_q, d)

Heads: rank ``u`` of a row gets query heads ``[u*h_q/U, (u+1)*h_q/U)`` and the kv heads they read (GQA). If
``h_kv < U``, each kv head is replicated ``U / h_kv`` times before the exchange (``U % h_kv == 0``) so every rank
holds exactly the one kv head its query heads read; its gradient is the sum over the replicas.

Layout: a rank's ``n`` tokens are ``S`` pieces, the ``u``-th ``1/U`` of every piece of ring shard ``r``'s local tokens
(``Layout(kind, R, U)``; ``S = Layout.pieces``: 2 for zigzag, its chunks; 1 for contiguous shards and for a
placement, where rank ``(r, u)`` holds local tokens ``[u*n, (u+1)*n)`` of ring shard ``r``, whatever its segments),
so after the all-to-all the pieces are put back piece by piece and the ring shard is in local (position) order.

Backward: q, k, v, dout, lse and ``delta = rowsum(dout * out)`` (computed here, on the sequence shards, so ``out``
never travels) go through the all-to-all; dq, dk, dv come back. Bytes: ``distattn.schedule.a2a_bytes``.

Reliability: before the first all-to-all every rank of the Ulysses group checks that the call agrees
(``distattn.agreement``), and every wait is bounded by the call's timeout; the ring executor checks its ring.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

import distattn.agreement as agreement
import distattn.kernels as kernels
from distattn.attention import DistAttnConfig, dist_attn_backward, dist_attn_forward, reject_call
from distattn.comm import COUNTERS, DistAttnError, bounded_wait
from distattn.communicators import describe, open_call
from distattn.schedule import pieces_of, ulysses_heads
from distattn.topology import Topology, topology

__all__ = ["ulysses_forward", "ulysses_backward"]


class _Row:
    """One call's all-to-alls over the Ulysses group of this rank."""

    def __init__(self, cfg: DistAttnConfig, topo: Topology, phase: str, checked: dict[str, torch.Tensor]):
        self.topo, self.cfg, self.phase = topo, cfg, phase
        like = next(iter(checked.values()))
        self.device = like.device
        self.lib, self.seq = open_call(topo.ulysses_group, cfg.timeout)
        self.call = describe(self.lib.position)
        self.stage = like.is_cuda and not self.lib.nccl  # gloo moves CUDA tensors through host memory
        self.S = pieces_of(cfg.schedule)  # pieces of a ring shard: 2 zigzag, 1 contiguous or placed
        b, n, h_q, _ = checked["q"].shape
        self.hq, self.hkv, self.replicas = ulysses_heads(h_q, checked["k"].shape[2], topo.U)
        if agreement.enabled():
            fields = agreement.call_fields(phase, self.seq, checked, cfg.fingerprint_fields())
            fields["ulysses"] = topo.U
            try:
                agreement.agree(self.lib, fields, self.device if self.lib.nccl else torch.device("cpu"),
                                cfg.timeout, f"{phase} {self.call} (Ulysses all-to-all), before the exchange")
            except DistAttnError:
                self.lib.abort()  # the peers then fail at once too; the next call rebuilds
                raise
            except (ValueError, TypeError) as exc:
                # Carry the failure on to this rank's ring group, whose other members (in Ulysses groups that
                # agreed) are about to check the ring executor's call: they raise too, instead of waiting.
                reject_call(topo.ring_group, phase, exc, cfg.timeout, self.device)

    def _a2a(self, send: torch.Tensor, what: str) -> torch.Tensor:
        """``all_to_all_single`` over the row: block ``i`` of dim 0 goes to Ulysses rank ``i``; bounded wait."""
        send = send.contiguous()
        recv = torch.empty_like(send)
        s, r = (send.cpu(), torch.empty(recv.shape, dtype=recv.dtype)) if self.stage else (send, recv)
        work = dist.all_to_all_single(r, s, group=self.lib.fetch, async_op=True)
        bounded_wait([work], self.cfg.timeout, f"distattn: rank {self.topo.index}, {self.phase} {self.call}: "
                                               f"the Ulysses all-to-all of {what}", poll=self.lib.nccl)
        if self.stage:
            recv.copy_(r)
        moved = send.numel() * send.element_size() * (self.topo.U - 1) // self.topo.U
        COUNTERS.bytes_sent += moved
        COUNTERS.bytes_recv += moved
        return recv

    # (b, n, h, d) sequence shard -> (b, U*n, h/U, d) head shard of the whole row
    def to_heads(self, x: torch.Tensor, what: str) -> torch.Tensor:
        U, S = self.topo.U, self.S
        b, n, h, d = x.shape
        send = x.reshape(b, n, U, h // U, d).permute(2, 0, 1, 3, 4)  # (U dest, b, n, h/U, d)
        recv = self._a2a(send, what)  # (U src, b, n, h/U, d): source u's n tokens = S pieces
        recv = recv.reshape(U, b, S, n // S, h // U, d).permute(1, 2, 0, 3, 4, 5)  # (b, S, U, n/S, h/U, d)
        return recv.reshape(b, U * n, h // U, d)

    # (b, U*n, h/U, d) head shard -> (b, n, h, d) sequence shard
    def to_sequence(self, y: torch.Tensor, what: str) -> torch.Tensor:
        U, S = self.topo.U, self.S
        b, m, hu, d = y.shape
        n = m // U
        send = y.reshape(b, S, U, n // S, hu, d).permute(2, 0, 1, 3, 4, 5)  # (U dest, b, S, n/S, h/U, d)
        recv = self._a2a(send, what)  # (U src = head block, b, S, n/S, h/U, d)
        return recv.permute(1, 2, 3, 0, 4, 5).reshape(b, n, U * hu, d)

    # (b, h, n) fp32 statistics of a sequence shard -> (b, h/U, U*n)
    def stats_to_heads(self, s: torch.Tensor, what: str) -> torch.Tensor:
        U, S = self.topo.U, self.S
        b, h, n = s.shape
        send = s.reshape(b, U, h // U, S, n // S).permute(1, 0, 2, 3, 4)  # (U dest, b, h/U, S, n/S)
        recv = self._a2a(send, what)  # (U src, b, h/U, S, n/S)
        return recv.permute(1, 2, 3, 0, 4).reshape(b, h // U, U * n)

    # (b, h/U, U*n) -> (b, h, n)
    def stats_to_sequence(self, s: torch.Tensor, what: str) -> torch.Tensor:
        U, S = self.topo.U, self.S
        b, hu, m = s.shape
        n = m // U
        send = s.reshape(b, hu, S, U, n // S).permute(3, 0, 1, 2, 4)  # (U dest, b, h/U, S, n/S)
        recv = self._a2a(send, what)  # (U src = head block, b, h/U, S, n/S)
        return recv.permute(1, 0, 2, 3, 4).reshape(b, U * hu, n)

    def replicate(self, kv: torch.Tensor) -> torch.Tensor:
        """kv heads fewer than ``U``: each one ``U / h_kv`` times, adjacent, so rank ``u`` gets the head its
        query heads read."""
        return kv if self.replicas == 1 else kv.repeat_interleave(self.replicas, dim=2)

    def unreplicate(self, grad: torch.Tensor) -> torch.Tensor:
        if self.replicas == 1:
            return grad
        b, n, h, d = grad.shape
        return grad.reshape(b, n, h // self.replicas, self.replicas, d).sum(3)


def _ring_config(cfg: DistAttnConfig, topo: Topology) -> DistAttnConfig:
    return dataclasses.replace(cfg, group=topo.ring_group, ring_stride=topo.U)


def ulysses_forward(q, k, v, cfg: DistAttnConfig):
    """``(out (b, n, h_q, d), lse (b, h_q, n) fp32)`` of this rank's sequence shards over a 2-D group."""
    topo = topology(cfg.group)
    ring = _ring_config(cfg, topo)
    if topo.U == 1:
        return dist_attn_forward(q, k, v, ring)
    row = _Row(cfg, topo, "forward", {"q": q, "k": k, "v": v})
    qh = row.to_heads(q, "q")
    kh, vh = row.to_heads(row.replicate(k), "k"), row.to_heads(row.replicate(v), "v")
    out_h, lse_h = dist_attn_forward(qh, kh, vh, ring)
    return row.to_sequence(out_h, "out"), row.stats_to_sequence(lse_h, "lse")


def ulysses_backward(dout, q, k, v, out, lse, cfg: DistAttnConfig):
    """``(dq, dk, dv)`` of this rank's sequence shards over a 2-D group."""
    topo = topology(cfg.group)
    ring = _ring_config(cfg, topo)
    if topo.U == 1:
        return dist_attn_backward(dout, q, k, v, out, lse, ring)
    row = _Row(cfg, topo, "backward", {"q": q, "k": k, "v": v, "dout": dout})
    dout = dout.to(q.dtype)
    delta = kernels.attn_delta(dout, out, backend=kernels.get_backend(cfg.backend, q.device))  # (b, h_q, n)
    qh, douth = row.to_heads(q, "q"), row.to_heads(dout, "dout")
    kh, vh = row.to_heads(row.replicate(k), "k"), row.to_heads(row.replicate(v), "v")
    lse_h, delta_h = row.stats_to_heads(lse, "lse"), row.stats_to_heads(delta, "delta")
    dqh, dkh, dvh = dist_attn_backward(douth, qh, kh, vh, None, lse_h, ring, delta=delta_h)
    dq = row.to_sequence(dqh, "dq")
    dk = row.unreplicate(row.to_sequence(dkh, "dk"))
    dv = row.unreplicate(row.to_sequence(dvh, "dv"))
    return dq, dk, dv
