"""Peer-to-peer exchange for the sequence-parallel executor: one class, an explicit post/wait life cycle.

``PeerExchange.post(slot, sends, recvs)`` starts one round of batched ``isend``/``irecv``
(``torch.distributed.batch_isend_irecv``) and returns at once; ``wait(slot)`` completes it. The executor posts the
transfers of step ``t + 1`` (``t + depth`` for a plan of prefetch depth ``depth``, ``Plan.prefetch``) before it computes
step ``t``, so communication hides behind compute. ``depth + 1`` fetch slots alternate (double-buffered
receives at depth 1): at most that many fetch rounds, and so sets of receive buffers, are alive at a time; the
executor keeps one set per slot in a pool and reuses it ``depth + 1`` steps later. Return rounds likewise: the executor
waits for step ``t``'s after computing step ``t + keep`` (``Plan.return_depth``: 1, up to 4 for a placed plan) over
``keep + 1`` return slots; the posting order, and so how messages meet, is the same at every depth.

What a fetch waits for: the side stream waits for an event recorded when the round is posted, i.e. after the
compute of step ``t - 1`` was enqueued (the round of step ``t + depth`` is posted before step ``t`` computes). That
is exactly what the pooled receive buffers need (slot ``(t + depth) % (depth + 1)`` was last read by step
``t - 1``); the sent tensors (q, k, v, dout, lse, delta) were final before step 0, so nothing waits on step ``t``'s
compute.

On CUDA the round is posted on a side stream of its kind's own, one for fetch rounds and one for return rounds (on
their own groups too), so a step's partials going back never queue behind the next step's prefetch (the per-pair
timeline, ``distattn.schedule.timeline``, models both streams): the side stream first waits for an event recorded on
the compute stream (so send buffers are final), every buffer is ``record_stream``-ed to the side stream (the
caching allocator then never reuses its memory before the side stream has passed the transfer; NCCL also
records its own internal stream), and
``wait`` makes only the *current* stream wait for the round's completion event — there is no device-wide
synchronize anywhere in the loop. CUDA tensors on a gloo group are staged through pinned CPU memory, so
several processes can share one GPU in tests.

Every rank must post the same rounds in the same order, each round's operations in plan order: that is how
sends meet their receives (NCCL matches point-to-point messages by posting order). The executor guarantees
it by deriving every round from the same plan object (``distattn.schedule``).

The library's own communicators and their recovery protocol live in ``distattn.communicators``; bounded waits and
``DistAttnError`` in ``distattn._bounded``. Their names are handed on here, where callers have always found them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from distattn._bounded import (DEFAULT_TIMEOUT_S, TIMEOUT_ENV, DistAttnError, all_gather_text, bounded_wait,
                               default_timeout, reason)
from distattn.communicators import Communicator, communicator

__all__ = ["PeerExchange", "CommCounters", "COUNTERS", "reset_counters", "DistAttnError", "Communicator",
           "communicator", "default_timeout", "message_tag", "ROUNDS_PER_CALL", "bounded_wait", "all_gather_text",
           "DEFAULT_TIMEOUT_S", "TIMEOUT_ENV", "backend_name"]


@torch.compiler.assume_constant_result
def backend_name(group) -> str:
    """``str(dist.get_backend(group))``, a constant to ``torch.compile``: traced, ``get_backend`` reads c10d's
    table of every process group and guards on its size, and the library opens its own groups at its first call
    (``distattn.communicators``), so a frame compiled at the first call recompiled at the second. A group's
    backend never changes while the group lives."""
    return str(dist.get_backend(group))


# -- message tags -----------------------------------------------------------------------------------------
ROUNDS_PER_CALL = 4096
"""Tags a call cycles through. At most 9 rounds of one call are in flight at once (two to five fetch slots, two to four
return slots), so a round's tag repeats only 4096 rounds later, long after that round was waited for."""
_CALLS_PER_CYCLE = (2 ** 31) // ROUNDS_PER_CALL  # 524,288 calls, then tags start again from call 0's


def message_tag(call: int, round_: int) -> int:
    """The tag of round ``round_`` of call ``call``: in ``[0, 2^31)`` for any number of calls (gloo and NCCL take a
    32-bit signed tag; an unbounded ``call * 4096 + round`` passed it after 2^19 calls, ~8k steps of a 32-layer
    model). Consecutive calls never share a tag, so a message left over from an abandoned call cannot match the
    next one; one would have to outlive 2^19 calls to meet its tag again (and after an abort, the library's groups
    are new ones anyway)."""
    return (call % _CALLS_PER_CYCLE) * ROUNDS_PER_CALL + round_ % ROUNDS_PER_CALL


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

    def __init__(self, reqs, copy_back, peers=(), stream=None):
        self.reqs = reqs
        self.stream = stream  # the side stream it was posted on (None: no side stream)
        self.copy_back = copy_back  # [(device_tensor, staged_cpu_tensor)] for gloo + CUDA
        self.peers = peers  # the ranks this round exchanges with (for error messages)


class PeerExchange:
    """Batched point-to-point rounds on ``group`` with an explicit post/wait life cycle.

    Args:
        group: the process group (``None``: the default group). Peers are given as *group* ranks.
        device: where the tensors live; CUDA enables the side streams (one for fetch slots, one for return slots).
        timeout: bound of every ``wait`` in seconds (``None``: ``default_timeout()``).
        call: the call's sequence number; message tags are ``message_tag(call, round)``, unique among the
            messages of this call and its neighbours, and always below 2^31.
        return_group: the group for slots ``("return", ...)`` (``None``: ``group``); same ranks as ``group``.
        gave_up: read while a wait lasts (``bounded_wait``): what the job's store says if a peer gave this call up
            (``Communicator.peer_gave_up``); ``None``: waits end on their timeout or a closed connection only.
    """

    def __init__(self, group, device: torch.device, *, timeout: float | None = None, call: int = 0,
                 return_group=None, gave_up=None):
        self.group = group
        self.gave_up = gave_up
        self.return_group = group if return_group is None else return_group
        self.timeout = default_timeout() if timeout is None else timeout
        self.call = call
        self.where = "outside a call"  # the executor's phase and step, for error messages
        self.device = torch.device(device)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._global = [dist.get_global_rank(group, r) if group is not None else r for r in range(self.world_size)]
        # CUDA tensors on a group without NCCL (e.g. gloo, or "cpu:gloo,cuda:gloo") travel through host memory.
        self._stage = self.device.type == "cuda" and "nccl" not in str(dist.get_backend(group))
        self._streams = ({kind: torch.cuda.Stream(self.device) for kind in ("fetch", "return")}
                         if self.device.type == "cuda" and not self._stage else None)
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
        ops, copy_back = self._make_ops(sends, recvs, self._group_of(slot))
        peers = tuple(sorted({peer for peer, _ in list(sends) + list(recvs)}))
        COUNTERS.bytes_sent += sum(_nbytes(ts) for _, ts in sends)
        COUNTERS.bytes_recv += sum(_nbytes(ts) for _, ts in recvs)
        if not ops:
            self._rounds[slot] = _Round([], copy_back, peers)
            return
        if self._streams is None:
            self._rounds[slot] = _Round(self._launch(ops, slot, peers), copy_back, peers)
            return
        stream = self._streams[_kind(slot)]  # fetch and return rounds each on their own: neither waits for the other
        # NCCL hangs if the current device is not the tensors' device: pin it for the launch.
        with torch.cuda.device(self.device):
            ready = torch.cuda.current_stream(self.device).record_event()
            stream.wait_event(ready)  # send buffers were written on the compute stream
            with torch.cuda.stream(stream):
                reqs = self._launch(ops, slot, peers)
            for op in ops:
                op.tensor.record_stream(stream)  # allocator: no reuse before the side stream passes here
        self._rounds[slot] = _Round(reqs, copy_back, peers, stream)

    def _launch(self, ops, slot, peers) -> list:
        """``batch_isend_irecv(ops)``; a failure to post (a peer closed the connection) is a ``DistAttnError``."""
        error = None
        try:
            return dist.batch_isend_irecv(ops)
        except Exception as exc:  # noqa: BLE001
            error = str(exc)
        ops.clear()  # the raised error's frames must not keep the group (and its sockets) alive
        raise DistAttnError(f"distattn: rank {self.rank}, {self.where}: posting the {_kind(slot)} round with rank(s) "
                            f"{list(peers)}: {reason(RuntimeError(error), self.timeout)}") from None

    def wait(self, slot) -> None:
        """Complete the round in ``slot``; afterwards its receive tensors hold the data (on the current stream)."""
        rnd = self._rounds.pop(slot, None)
        if rnd is None:
            raise RuntimeError(f"PeerExchange: wait() on slot {slot!r} with nothing posted (waited twice?)")
        what = (f"distattn: rank {self.rank}, {self.where}: waiting for the {_kind(slot)} round with rank(s) "
                f"{list(rnd.peers)}")
        reqs, copy_back, stream = rnd.reqs, rnd.copy_back, rnd.stream
        rnd = None  # a raised error's frames must not keep the requests (and so the group) alive
        if stream is None or not reqs:
            bounded_wait(reqs, self.timeout, what, gave_up=self.gave_up)
        else:
            with torch.cuda.stream(stream):
                # NCCL: the host polls until the transfer is done (bounded), then wait() orders the side stream
                bounded_wait(reqs, self.timeout, what, poll=True, gave_up=self.gave_up)
                done = stream.record_event()
            torch.cuda.current_stream(self.device).wait_event(done)  # compute waits for this round only
        for dst, staged in copy_back:
            dst.copy_(staged, non_blocking=True)  # staged is pinned: an async host-to-device copy

    def pending(self) -> tuple:
        """Slots posted and not yet waited for."""
        return tuple(self._rounds)

    def abort(self) -> None:
        """Drop every round in flight and the groups (what keeps a gloo group's sockets open); the caller
        aborts the communicator itself."""
        self._rounds.clear()
        self.group = self.return_group = None

    def close(self) -> None:
        """Assert that every round was waited for (a leaked round would leave peers blocked)."""
        if self._rounds:
            raise RuntimeError(f"PeerExchange closed with rounds still in flight: {sorted(map(str, self._rounds))}")

    # -- internals -------------------------------------------------------------------------------------
    def _group_of(self, slot):
        return self.return_group if _kind(slot) == "return" else self.group

    def _make_ops(self, sends, recvs, group):
        ops, copy_back = [], []
        tag = message_tag(self.call, self._tag)
        for peer, tensors in sends:
            for t in tensors:
                t = t.contiguous()
                if self._stage:
                    t = t.cpu()  # gloo sends from host memory; pinning would only add a second copy
                ops.append(dist.P2POp(dist.isend, t, self._global[peer], group, tag))
        for peer, tensors in recvs:
            for t in tensors:
                assert t.is_contiguous(), "receive buffers must be contiguous"
                buf = t
                if self._stage:
                    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    copy_back.append((t, buf))
                ops.append(dist.P2POp(dist.irecv, buf, self._global[peer], group, tag))
        return ops, copy_back


def _kind(slot) -> str:
    """``"fetch"``/``"return"`` for the executor's ``(kind, phase, index)`` slots; other slots are fetch-like."""
    return slot[0] if isinstance(slot, tuple) and slot and slot[0] in ("fetch", "return") else "fetch"
