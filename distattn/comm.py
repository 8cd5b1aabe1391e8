"""Peer-to-peer exchange for the sequence-parallel executor: one class, an explicit post/wait life cycle.

``PeerExchange.post(slot, sends, recvs)`` starts one round of batched ``isend``/``irecv``
(``torch.distributed.batch_isend_irecv``) and returns at once; ``wait(slot)`` completes it. The executor
posts the transfers of step ``t + 1`` before it computes step ``t``, so communication hides behind compute.
Two fetch slots alternate (double-buffered receives): at most two fetch rounds, and so two sets of receive
buffers, are alive at a time; the buffers come from the caching allocator each round rather than a fixed pool.

On CUDA the round is posted on a side stream: the side stream first waits for an event recorded on the
compute stream (so send buffers are final), every buffer is ``record_stream``-ed to the side stream (the
caching allocator then never reuses its memory before the side stream has passed the transfer; NCCL also
records its own internal stream), and
``wait`` makes only the *current* stream wait for the round's completion event — there is no device-wide
synchronize anywhere in the loop. CUDA tensors on a gloo group are staged through pinned CPU memory, so
several processes can share one GPU in tests.

Every rank must post the same rounds in the same order, each round's operations in plan order: that is how
sends meet their receives (NCCL matches point-to-point messages by posting order). The executor guarantees
it by deriving every round from the same plan object (``distattn.schedule``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["PeerExchange", "CommCounters", "COUNTERS", "reset_counters"]


@dataclass
class CommCounters:
    """Bytes this process sent and received through ``PeerExchange`` (cumulative)."""

    bytes_sent: int = 0
    bytes_recv: int = 0


COUNTERS = CommCounters()


def reset_counters() -> None:
    COUNTERS.bytes_sent = 0
    COUNTERS.bytes_recv = 0


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _Round:
    """One posted round: its requests and what ``wait`` must finish (copy-backs, events)."""

    def __init__(self, reqs, copy_back):
        self.reqs = reqs
        self.copy_back = copy_back  # [(device_tensor, staged_cpu_tensor)] for gloo + CUDA


class PeerExchange:
    """Batched point-to-point rounds on ``group`` with an explicit post/wait life cycle.

    Args:
        group: the process group (``None``: the default group). Peers are given as *group* ranks.
        device: where the tensors live; CUDA enables the side stream.
    """

    def __init__(self, group, device: torch.device):
        self.group = group
        self.device = torch.device(device)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._global = [dist.get_global_rank(group, r) if group is not None else r for r in range(self.world_size)]
        # CUDA tensors on a group without NCCL (e.g. gloo, or "cpu:gloo,cuda:gloo") travel through host memory.
        self._stage = self.device.type == "cuda" and "nccl" not in str(dist.get_backend(group))
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" and not self._stage else None
        self._rounds: dict[object, _Round] = {}
        self._tag = 0

    # -- life cycle --------------------------------------------------------------------------------------
    def post(self, slot, sends, recvs) -> None:
        """Start a round. ``sends``/``recvs``: lists of ``(peer_group_rank, [tensors])`` in plan order.

        Receive tensors must be preallocated with the expected shapes and dtypes; they are written in place.
        Raises ``RuntimeError`` if ``slot`` already holds a round that was not waited for.
        """
        if slot in self._rounds:
            raise RuntimeError(f"PeerExchange: slot {slot!r} was posted twice without wait(); wait() first")
        for peer, _ in list(sends) + list(recvs):
            if not 0 <= peer < self.world_size or peer == self.rank:
                raise RuntimeError(f"PeerExchange: invalid peer {peer} for rank {self.rank} of {self.world_size}")
        self._tag += 1
        ops, copy_back = self._make_ops(sends, recvs)
        COUNTERS.bytes_sent += sum(_nbytes(ts) for _, ts in sends)
        COUNTERS.bytes_recv += sum(_nbytes(ts) for _, ts in recvs)
        if not ops:
            self._rounds[slot] = _Round([], copy_back)
            return
        if self._stream is None:
            self._rounds[slot] = _Round(dist.batch_isend_irecv(ops), copy_back)
            return
        # NCCL hangs if the current device is not the tensors' device: pin it for the launch.
        with torch.cuda.device(self.device):
            ready = torch.cuda.current_stream(self.device).record_event()
            self._stream.wait_event(ready)  # send buffers were written on the compute stream
            with torch.cuda.stream(self._stream):
                reqs = dist.batch_isend_irecv(ops)
            for op in ops:
                op.tensor.record_stream(self._stream)  # allocator: no reuse before the side stream passes here
        self._rounds[slot] = _Round(reqs, copy_back)

    def wait(self, slot) -> None:
        """Complete the round in ``slot``; afterwards its receive tensors hold the data (on the current stream)."""
        rnd = self._rounds.pop(slot, None)
        if rnd is None:
            raise RuntimeError(f"PeerExchange: wait() on slot {slot!r} with nothing posted (waited twice?)")
        if self._stream is None or not rnd.reqs:
            for req in rnd.reqs:
                req.wait()
        else:
            with torch.cuda.stream(self._stream):
                for req in rnd.reqs:
                    req.wait()  # NCCL: orders the side stream after the transfer, does not block the host
                done = self._stream.record_event()
            torch.cuda.current_stream(self.device).wait_event(done)  # compute waits for this round only
        for dst, staged in rnd.copy_back:
            dst.copy_(staged, non_blocking=True)  # staged is pinned: an async host-to-device copy

    def pending(self) -> tuple:
        """Slots posted and not yet waited for."""
        return tuple(self._rounds)

    def close(self) -> None:
        """Assert that every round was waited for (a leaked round would leave peers blocked)."""
        if self._rounds:
            raise RuntimeError(f"PeerExchange closed with rounds still in flight: {sorted(map(str, self._rounds))}")

    # -- internals -------------------------------------------------------------------------------------
    def _make_ops(self, sends, recvs):
        ops, copy_back = [], []
        for peer, tensors in sends:
            for t in tensors:
                t = t.contiguous()
                if self._stage:
                    t = t.cpu()  # gloo sends from host memory; pinning would only add a second copy
                ops.append(dist.P2POp(dist.isend, t, self._global[peer], self.group, self._tag))
        for peer, tensors in recvs:
            for t in tensors:
                assert t.is_contiguous(), "receive buffers must be contiguous"
                buf = t
                if self._stage:
                    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    copy_back.append((t, buf))
                ops.append(dist.P2POp(dist.irecv, buf, self._global[peer], self.group, self._tag))
        return ops, copy_back
