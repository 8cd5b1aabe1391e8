"""Peer-to-peer exchange for the sequence-parallel executor: one class, an explicit post/wait life cycle.

``PeerExchange.post(slot, sends, recvs)`` starts one round of batched ``isend``/``irecv``
(``torch.distributed.batch_isend_irecv``) and returns at once; ``wait(slot)`` completes it. The executor
posts the transfers of step ``t + 1`` before it computes step ``t``, so communication hides behind compute.
Two fetch slots alternate (double-buffered receives): at most two fetch rounds, and so two sets of receive
buffers, are alive at a time; the executor keeps one set per slot in a pool and reuses it two steps later.

What a fetch waits for: the side stream waits for an event recorded when the round is posted, i.e. after the
compute of step ``t - 1`` was enqueued (the round of step ``t + 1`` is posted before step ``t`` computes). That
is exactly what the pooled receive buffers need (slot ``(t + 1) % 2`` was last read by step ``t - 1``); the
sent tensors (q, k, v, dout, lse, delta) were final before step 0, so nothing waits on step ``t``'s compute.

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

Reliability (issue 14). The executor never talks on the user's group: ``communicator(group)`` returns the
library's own groups for it (``Communicator``: created by the first call, cached, rebuilt after an abort), so a
user collective can never interleave with attention traffic. Every wait is bounded (``timeout`` seconds, the
``DISTATTN_TIMEOUT`` default): on gloo ``Work.wait(timeout=...)``; on NCCL host-side polling of
``Work.is_completed()``. A rank that fails inside a call aborts its communicator: on gloo, destroying the
group and dropping every reference to it closes its TCP connections, so a peer blocked on a message from it
fails at once ("connection closed"), aborts its own communicator in turn, and the failure cascades to every
rank within milliseconds. Tags carry the call's sequence number, so a retried call never matches an earlier
call's messages.
"""

from __future__ import annotations

import datetime
import gc
import os
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distattn._compat import keeps_order, new_group_in_order

__all__ = ["PeerExchange", "CommCounters", "COUNTERS", "reset_counters", "DistAttnError", "Communicator",
           "communicator", "default_timeout"]

TIMEOUT_ENV = "DISTATTN_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0


class DistAttnError(RuntimeError):
    """A distributed attention call failed on this rank because of another rank (a timeout, or a peer that
    failed and aborted the library's communicators). The next call rebuilds the communicators.

    ``timed_out``: no message came within the timeout (rather than a closed connection)."""

    def __init__(self, message: str, *, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


def default_timeout() -> float:
    """``DISTATTN_TIMEOUT`` (seconds, > 0), else 300 s: the bound of every wait inside a call."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a positive number of seconds (default "
                         f"{DEFAULT_TIMEOUT_S:g})")
    return value


# -- the library's own communicators -------------------------------------------------------------------------
class Communicator:
    """The library's own process groups for one user group (same ranks, same group-rank order).

    ``fetch`` carries the fetch rounds and the agreement check, ``ret`` the return rounds: on NCCL two groups
    (two communicators, each on a high-priority stream where the API offers it, so returns never queue behind
    fetches); elsewhere one group serves both. ``seq`` numbers the calls made on this communicator (message
    tags and the agreement fingerprint carry it).

    ``dist.new_group`` is a collective: every member must reach it in the same order, which is why it is
    called by the first distattn call (or the first after an abort), a point every rank reaches.
    """

    def __init__(self, group, timeout: float):
        self.user_group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world_size))
        backend = str(dist.get_backend(group))
        self.nccl = "nccl" in backend
        # Own groups only for a group spanning the whole job: dist.new_group names a group after a counter that
        # every process of the job advances (so all must call it), or, with use_local_synchronization, after a
        # hash that includes how many groups the calling process has, which differs between the members of a
        # subgroup as soon as they made different groups (a stale or mismatched name: the rendezvous hangs).
        # A subgroup's traffic therefore stays on the subgroup itself: bounded, tagged, never aborted.
        # In order: group rank r of the library's groups is group rank r of the user's group (a torch that cannot
        # keep an unsorted order, see distattn._compat, has the user's group serve as for a subgroup).
        self.owned = len(ranks) == dist.get_world_size() and keeps_order(ranks)
        if not self.owned:
            self.fetch = self.ret = group
        elif self.nccl:
            kw = dict(ranks=ranks, timeout=_group_timeout(timeout, True), backend=backend)
            options = _nccl_options() if backend == "nccl" else None  # a mixed backend takes no NCCL options
            self.fetch = new_group_in_order(**kw, pg_options=options)
            self.ret = new_group_in_order(**kw, pg_options=_nccl_options() if options is not None else None)
        else:
            self.fetch = self.ret = new_group_in_order(ranks=ranks, timeout=_group_timeout(timeout, False),
                                                       backend=backend)
        self.seq = 0
        self.aborted = False
        self.timeout = timeout

    def set_timeout(self, timeout: float) -> None:
        """Bound the groups' own operations by ``timeout`` too (gloo collectives honour the group's timeout,
        not ``Work.wait``'s)."""
        if timeout != self.timeout and self.owned:
            for g in {id(self.fetch): self.fetch, id(self.ret): self.ret}.values():
                g.set_timeout(_group_timeout(timeout, self.nccl))
            self.timeout = timeout

    def next_call(self) -> int:
        """The sequence number of a new call on this communicator."""
        self.seq += 1
        return self.seq

    def abort(self) -> None:
        """Tear the library's groups down (never the user's). Peers waiting on this rank then fail at once
        on gloo (its connections close); on NCCL the communicators are aborted (``ncclCommAbort``)."""
        if self.aborted:
            return
        self.aborted = True
        if not self.owned:
            return  # the user's group: never aborted (its peers fail at their own timeout)
        groups = [g for g in {id(self.fetch): self.fetch, id(self.ret): self.ret}.values() if g is not None]
        self.fetch = self.ret = None
        for group in groups:
            _quietly(getattr(group, "abort", None))
            _quietly(dist.destroy_process_group, group)
        alive = [weakref.ref(group) for group in groups]
        groups = group = None  # noqa: F841
        if any(ref() is not None for ref in alive):
            gc.collect()  # the last reference to a gloo group closes its sockets, which is what wakes the peers


def _group_timeout(timeout: float, nccl: bool) -> datetime.timedelta:
    """The groups' own timeout. gloo: ``timeout`` (gloo collectives are bounded by it, not by ``Work.wait``).
    NCCL: a later backstop, so that distattn's host-side bound fires first and aborts cleanly; the NCCL
    watchdog, on its own timeout, tears the whole process down by default."""
    return datetime.timedelta(seconds=2 * timeout + 30 if nccl else timeout)


def _quietly(fn, *args) -> None:
    """Best effort: a group being torn down may already be half gone."""
    try:
        if fn is not None:
            fn(*args)
    except Exception:  # noqa: BLE001
        pass


def _nccl_options():
    try:
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = True
        return opts
    except (AttributeError, RuntimeError):  # a build without NCCL options
        return None


_COMMUNICATORS: dict[object, Communicator] = {}


def communicator(group, timeout: float) -> Communicator:
    """The library's communicator for ``group``: cached; (re)built after an abort (a collective, see above)."""
    key = "default" if group is None else group
    comm = _COMMUNICATORS.get(key)
    if comm is None or comm.aborted:
        old = _COMMUNICATORS.pop(key, None)
        try:
            comm = Communicator(group, timeout)
            if old is not None and not comm.owned:
                comm.seq = old.seq  # the same group again: tags keep growing, no stale message can match
        except Exception as exc:  # noqa: BLE001 - a peer that never arrives: a bounded, named failure
            raise DistAttnError(f"distattn: rank {dist.get_rank(group)} could not build the library's "
                                f"communicators within {timeout:g} s (every rank of the group must make the "
                                f"same distattn call): {exc}") from exc
        _COMMUNICATORS[key] = comm
    comm.set_timeout(timeout)
    return comm


def bounded_wait(works, timeout: float, what: str, *, poll: bool = False) -> None:
    """Wait for ``works`` at most ``timeout`` seconds each; ``DistAttnError`` naming ``what`` otherwise.

    gloo: ``Work.wait(timeout=...)``. NCCL: the host polls ``is_completed()`` (a hung transfer never returns
    from a device-side wait, so the bound has to be on the host), then orders the current stream after it.
    """
    error = None
    try:
        for work in works:
            if poll:
                deadline = time.monotonic() + timeout
                while not work.is_completed():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"timed out after {timeout:g} s")
                    time.sleep(50e-6)
            work.wait(timeout=datetime.timedelta(seconds=timeout))
    except Exception as exc:  # noqa: BLE001
        error = exc
    if error is not None:
        # No frame of the raised error may keep a request (and so the group and its sockets) alive: the
        # caller's list is emptied too.
        works.clear()
        work = None  # noqa: F841
        raise DistAttnError(f"{what}: {_reason(error, timeout)}", timed_out=_timed_out(error)) from None


def all_gather_text(group, text: str, device: torch.device, timeout: float, what: str) -> list[str]:
    """Every rank's ``text``, in group-rank order: the UTF-8 lengths first, then the zero-padded bytes (no
    pickle); each wait bounded by ``timeout`` (``DistAttnError`` naming ``what``).

    ``device``: where the collective's tensors live (the current CUDA device on NCCL, CPU otherwise)."""
    poll = "nccl" in str(dist.get_backend(group))
    n = dist.get_world_size(group)
    data = torch.tensor(list(text.encode()), dtype=torch.uint8)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(n)]
    mine = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    bounded_wait([dist.all_gather(lengths, mine, group=group, async_op=True)], timeout, what, poll=poll)
    longest = max(int(m.item()) for m in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:data.numel()] = data
    bufs = [torch.zeros(longest, dtype=torch.uint8, device=device) for _ in range(n)]
    bounded_wait([dist.all_gather(bufs, padded.to(device), group=group, async_op=True)], timeout, what, poll=poll)
    return [bytes(b[:int(m.item())].tolist()).decode() for b, m in zip(bufs, lengths)]


def _timed_out(error: Exception) -> bool:
    return isinstance(error, TimeoutError) or "timed out" in str(error).lower()


def _reason(error: Exception, timeout: float) -> str:
    text = str(error)
    if _timed_out(error):
        return f"no message within the timeout ({timeout:g} s; set timeout= or {TIMEOUT_ENV})"
    return (f"a peer failed and aborted the library's communicators, or died (gloo: "
            f"{text.strip().splitlines()[-1][:160]})")


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

    def __init__(self, reqs, copy_back, peers=()):
        self.reqs = reqs
        self.copy_back = copy_back  # [(device_tensor, staged_cpu_tensor)] for gloo + CUDA
        self.peers = peers  # the ranks this round exchanges with (for error messages)


class PeerExchange:
    """Batched point-to-point rounds on ``group`` with an explicit post/wait life cycle.

    Args:
        group: the process group (``None``: the default group). Peers are given as *group* ranks.
        device: where the tensors live; CUDA enables the side stream.
        timeout: bound of every ``wait`` in seconds (``None``: ``default_timeout()``).
        tag_base: added to every message tag (the executor passes ``seq * 4096``: tags unique per call).
        return_group: the group for slots ``("return", ...)`` (``None``: ``group``); same ranks as ``group``.
    """

    def __init__(self, group, device: torch.device, *, timeout: float | None = None, tag_base: int = 0,
                 return_group=None):
        self.group = group
        self.return_group = group if return_group is None else return_group
        self.timeout = default_timeout() if timeout is None else timeout
        self.tag_base = tag_base
        self.where = "outside a call"  # the executor's phase and step, for error messages
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
        ops, copy_back = self._make_ops(sends, recvs, self._group_of(slot))
        peers = tuple(sorted({peer for peer, _ in list(sends) + list(recvs)}))
        COUNTERS.bytes_sent += sum(_nbytes(ts) for _, ts in sends)
        COUNTERS.bytes_recv += sum(_nbytes(ts) for _, ts in recvs)
        if not ops:
            self._rounds[slot] = _Round([], copy_back, peers)
            return
        if self._stream is None:
            self._rounds[slot] = _Round(self._launch(ops, slot, peers), copy_back, peers)
            return
        # NCCL hangs if the current device is not the tensors' device: pin it for the launch.
        with torch.cuda.device(self.device):
            ready = torch.cuda.current_stream(self.device).record_event()
            self._stream.wait_event(ready)  # send buffers were written on the compute stream
            with torch.cuda.stream(self._stream):
                reqs = self._launch(ops, slot, peers)
            for op in ops:
                op.tensor.record_stream(self._stream)  # allocator: no reuse before the side stream passes here
        self._rounds[slot] = _Round(reqs, copy_back, peers)

    def _launch(self, ops, slot, peers) -> list:
        """``batch_isend_irecv(ops)``; a failure to post (a peer closed the connection) is a ``DistAttnError``."""
        error = None
        try:
            return dist.batch_isend_irecv(ops)
        except Exception as exc:  # noqa: BLE001
            error = str(exc)
        ops.clear()  # the raised error's frames must not keep the group (and its sockets) alive
        raise DistAttnError(f"distattn: rank {self.rank}, {self.where}: posting the {_kind(slot)} round with rank(s) "
                            f"{list(peers)}: {_reason(RuntimeError(error), self.timeout)}") from None

    def wait(self, slot) -> None:
        """Complete the round in ``slot``; afterwards its receive tensors hold the data (on the current stream)."""
        rnd = self._rounds.pop(slot, None)
        if rnd is None:
            raise RuntimeError(f"PeerExchange: wait() on slot {slot!r} with nothing posted (waited twice?)")
        what = (f"distattn: rank {self.rank}, {self.where}: waiting for the {_kind(slot)} round with rank(s) "
                f"{list(rnd.peers)}")
        reqs, copy_back = rnd.reqs, rnd.copy_back
        rnd = None  # a raised error's frames must not keep the requests (and so the group) alive
        if self._stream is None or not reqs:
            bounded_wait(reqs, self.timeout, what)
        else:
            with torch.cuda.stream(self._stream):
                # NCCL: the host polls until the transfer is done (bounded), then wait() orders the side stream
                bounded_wait(reqs, self.timeout, what, poll=True)
                done = self._stream.record_event()
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
        tag = self.tag_base + self._tag
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
