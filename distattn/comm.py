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

Recovery is a protocol (issue 21). The library's groups for a user group have an *epoch*: 0 when first built,
``e + 1`` after the groups of epoch ``e`` were aborted. Every rank that aborts epoch ``e`` leaves a mark in the job's
store (``abandoned``, with the call number), and builds epoch ``e + 1`` at its next call only once every rank of
the group has arrived at the same epoch's rendezvous in the store (``_Rendezvous``: one compare-and-set key per
epoch; a rank that gives up leaves it again, atomically, so ``dist.new_group``, a collective every rank must make
equally often, is called by all ranks or by none). A rank that does not arrive within ``DISTATTN_REBUILD_TIMEOUT``
(10 s; a short bound of its own, so that a dead peer is reported quickly) is named as gone or stalled, and the call
fails without touching the groups; the next call tries the same epoch again. A rank that was away (stalled) while
its peers abandoned its call finds the mark when its call fails, raises once saying so, and joins the rebuild at its
next call.
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
           "communicator", "default_timeout", "message_tag", "ROUNDS_PER_CALL"]

TIMEOUT_ENV = "DISTATTN_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
REBUILD_TIMEOUT_ENV = "DISTATTN_REBUILD_TIMEOUT"
DEFAULT_REBUILD_TIMEOUT_S = 10.0


class DistAttnError(RuntimeError):
    """A distributed attention call failed on this rank because of another rank (a timeout, or a peer that
    failed and aborted the library's communicators). The next call rebuilds the communicators.

    ``timed_out``: no message came within the timeout (rather than a closed connection)."""

    def __init__(self, message: str, *, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


def default_timeout() -> float:
    """``DISTATTN_TIMEOUT`` (seconds, > 0), else 300 s: the bound of every wait inside a call."""
    return _seconds_env(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)


def rebuild_timeout() -> float:
    """``DISTATTN_REBUILD_TIMEOUT`` (seconds, > 0), else 10 s: how long a rank waits for its peers to arrive at the
    rebuild of the library's groups after a failure before it reports them gone or stalled."""
    return _seconds_env(REBUILD_TIMEOUT_ENV, DEFAULT_REBUILD_TIMEOUT_S)


def _seconds_env(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"{name}={raw!r} must be a positive number of seconds (default {default:g})")
    return value


# -- the library's own communicators -------------------------------------------------------------------------
class Communicator:
    """The library's own process groups for one user group (same ranks, same group-rank order), at one epoch.

    ``fetch`` carries the fetch rounds and the agreement check, ``ret`` the return rounds: on NCCL two groups
    (two communicators, each on a high-priority stream where the API offers it, so returns never queue behind
    fetches); elsewhere one group serves both. ``seq`` numbers the calls made on this communicator (message
    tags and the agreement fingerprint carry it).

    ``dist.new_group`` is a collective: every member must reach it equally often, which is why it is called by
    the first distattn call (or the first after an abort), and only after every rank has arrived at the same
    epoch's rendezvous in the job's store (``_Rendezvous``). ``join_timeout``: how long to wait for the others
    there (the call's timeout for the first build, the shorter rebuild bound afterwards).

    The communicator keeps no reference to the user's group (only its ranks), so the cache can drop it, and free
    the library's groups, when the user's group is collected (``communicator``).
    """

    def __init__(self, group, timeout: float, *, epoch: int = 0, join_timeout: float | None = None):
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world_size))
        backend = str(dist.get_backend(group))
        self.nccl = "nccl" in backend
        self.epoch = epoch
        self.name = "default" if group is None else str(getattr(group, "group_name", "") or ranks)
        # Own groups only for a group spanning the whole job: dist.new_group names a group after a counter that
        # every process of the job advances (so all must call it), or, with use_local_synchronization, after a
        # hash that includes how many groups the calling process has, which differs between the members of a
        # subgroup as soon as they made different groups (a stale or mismatched name: the rendezvous hangs).
        # A subgroup's traffic therefore stays on the subgroup itself: bounded, tagged, never aborted.
        # In order: group rank r of the library's groups is group rank r of the user's group (a torch that cannot
        # keep an unsorted order, see distattn._compat, has the user's group serve as for a subgroup).
        self.owned = len(ranks) == dist.get_world_size() and keeps_order(ranks)
        self.fetch = self.ret = None
        self.seq = 0
        self.aborted = False
        self.timeout = timeout
        if not self.owned:
            self.fetch = self.ret = group
            return
        _Rendezvous(self.name, epoch, self.rank, self.world_size).join(timeout if join_timeout is None else join_timeout)
        if self.nccl:
            kw = dict(ranks=ranks, timeout=_group_timeout(timeout, True), backend=backend)
            options = _nccl_options() if backend == "nccl" else None  # a mixed backend takes no NCCL options
            self.fetch = new_group_in_order(**kw, pg_options=options)
            self.ret = new_group_in_order(**kw, pg_options=_nccl_options() if options is not None else None)
        else:
            self.fetch = self.ret = new_group_in_order(ranks=ranks, timeout=_group_timeout(timeout, False),
                                                       backend=backend)

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

    def abandoned_by_peers(self) -> bool:
        """Whether a rank of the group has abandoned this epoch (aborted its groups after a failure)."""
        return self.owned and _Rendezvous(self.name, self.epoch, self.rank, self.world_size).abandoned()

    def abort(self) -> None:
        """Tear the library's groups down (never the user's) and mark the epoch abandoned in the job's store.
        Peers waiting on this rank then fail at once on gloo (its connections close); on NCCL the communicators
        are aborted (``ncclCommAbort``)."""
        if self.aborted:
            return
        self.aborted = True
        if not self.owned:
            return  # the user's group: never aborted (its peers fail at their own timeout)
        _quietly(_Rendezvous(self.name, self.epoch, self.rank, self.world_size).abandon, self.seq)
        self.free()

    def free(self) -> None:
        """Destroy the library's groups (a local operation): after an abort, or when the user's group is gone."""
        groups = [g for g in {id(self.fetch): self.fetch, id(self.ret): self.ret}.values() if g is not None]
        self.fetch = self.ret = None
        self.aborted = True
        if not self.owned:
            return
        for group in groups:
            _quietly(getattr(group, "abort", None))
            _quietly(dist.destroy_process_group, group)
        alive = [weakref.ref(group) for group in groups]
        groups = group = None  # noqa: F841
        if any(ref() is not None for ref in alive):
            gc.collect()  # the last reference to a gloo group closes its sockets, which is what wakes the peers


class _Rendezvous:
    """One epoch's meeting point in the job's store, before ``dist.new_group`` (see the module doc).

    The key ``distattn/<group>/e<epoch>/arrived`` holds the sorted ranks that are waiting, or ``go`` once all have
    arrived. Every change is a compare-and-set, so arriving, giving up and the switch to ``go`` are atomic: a rank
    that gives up either leaves the set before ``go`` (and no rank calls ``new_group``) or finds ``go`` and goes on
    with the others. ``abandoned`` marks the epoch given up after a failure (value: the failed call's number)."""

    POLL_S = 0.005

    def __init__(self, name: str, epoch: int, rank: int, world_size: int):
        self.prefix = f"distattn/{name}/e{epoch}"
        self.rank, self.world_size, self.epoch = rank, world_size, epoch
        self.store = _job_store()

    def join(self, timeout: float) -> None:
        key = f"{self.prefix}/arrived"
        state = self._update(key, lambda ranks: ranks | {self.rank})
        deadline = time.monotonic() + timeout
        while state != "go":
            if time.monotonic() > deadline:
                present = _ranks(state)
                state = self._update(key, lambda ranks: ranks - {self.rank})
                if state == "go":  # everyone arrived while this rank was giving up: go on with them
                    break
                missing = sorted(set(range(self.world_size)) - present)
                what = "build" if self.epoch == 0 else f"rebuild (epoch {self.epoch}, after a failed call)"
                raise DistAttnError(f"distattn: rank {self.rank}: group rank(s) {missing} did not arrive at the {what} "
                                    f"of the library's communicators within {timeout:g} s: they are gone (dead) or "
                                    f"stalled, or not making this call; the next call tries again"
                                    + ("" if self.epoch == 0 else f" ({REBUILD_TIMEOUT_ENV} bounds this wait)"),
                                    timed_out=True)
            time.sleep(self.POLL_S)
            state = self.store.get(key).decode()

    def _update(self, key: str, change) -> str:
        current = self.store.get(key).decode() if self.store.check([key]) else ""
        while current != "go":
            ranks = change(_ranks(current))
            new = "go" if len(ranks) == self.world_size else ",".join(map(str, sorted(ranks)))
            got = self.store.compare_set(key, current, new).decode()
            if got == new:
                return new
            current = got
        return "go"

    def abandon(self, seq: int) -> None:
        self.store.set(f"{self.prefix}/abandoned", str(seq))

    def abandoned(self) -> bool:
        return self.store.check([f"{self.prefix}/abandoned"])


def _ranks(state: str) -> set[int]:
    return {int(r) for r in state.split(",") if r} if state not in ("", "go") else set()


def _job_store():
    """The job's key-value store (the one ``init_process_group`` made): the rendezvous of the library's groups
    lives there. torch has no public accessor; this is the one place distattn reads torch's (tested on torch
    2.11 and 2.13)."""
    return dist.PrefixStore("distattn-rdzv", dist.distributed_c10d._get_default_store())


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


_DEFAULT: list[Communicator] = []  # the default group's communicator, if built
_BY_GROUP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # user group -> [its communicator]


def communicator(group, timeout: float) -> Communicator:
    """The library's communicator for ``group``: cached while ``group`` lives (its groups are freed when the user's
    group is collected, so a new group per call leaves nothing behind); (re)built after an abort, at the next
    epoch (a collective, see the module doc)."""
    holder = _DEFAULT if group is None else _BY_GROUP.get(group)
    comm = holder[0] if holder else None
    if comm is None or comm.aborted:
        epoch = 0 if comm is None else comm.epoch + 1
        join = timeout if comm is None else min(timeout, rebuild_timeout())
        try:
            fresh = Communicator(group, timeout, epoch=epoch, join_timeout=join)
        except DistAttnError:
            raise
        except Exception as exc:  # noqa: BLE001 - a peer that never arrives: a bounded, named failure
            raise DistAttnError(f"distattn: rank {dist.get_rank(group)} could not build the library's "
                                f"communicators within {timeout:g} s (every rank of the group must make the "
                                f"same distattn call): {exc}") from exc
        if comm is not None and not fresh.owned:
            fresh.seq = comm.seq  # the same group again: tags keep growing, no stale message can match
        if holder is None:
            holder = []
            _BY_GROUP[group] = holder
            weakref.finalize(group, _free_holder, holder)  # the user's group collected: free the library's too
        holder[:] = [fresh]
        comm = fresh
    comm.set_timeout(timeout)
    return comm


def _free_holder(holder: list) -> None:
    for comm in holder:
        _quietly(comm.free)
    holder.clear()


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


# -- message tags -----------------------------------------------------------------------------------------
ROUNDS_PER_CALL = 4096
"""Tags a call cycles through. At most 4 rounds of one call are in flight at once (two fetch slots, two return
slots), so a round's tag repeats only 4096 rounds later, long after that round was waited for."""
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
        call: the call's sequence number; message tags are ``message_tag(call, round)``, unique among the
            messages of this call and its neighbours, and always below 2^31.
        return_group: the group for slots ``("return", ...)`` (``None``: ``group``); same ranks as ``group``.
    """

    def __init__(self, group, device: torch.device, *, timeout: float | None = None, call: int = 0,
                 return_group=None):
        self.group = group
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
