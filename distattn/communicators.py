"""The library's own communicators for a user's group, and the protocol that rebuilds them after a failure.

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

Every call has a *position* (issue 35): ``(step, k)``, the k-th call this process made on the group since the step
the user declared last (``distattn.set_step``; without one, the k-th call of the process). Every call takes its
position first, before anything can fail, so a call that fails takes one too, and positions never restart with an
epoch. When every call either succeeds on every rank or fails on every rank, the same position is the same point of
the same program on every rank: the same batch. The agreement covers the position, so two ranks at different points
(a stalled rank whose peers went on to later batches meanwhile) fail together instead of pairing different batches.
And they come back in step: a rank that fails a call aborts its groups and raises the job's *given-up mark* (the
latest position a rank gave up, in the store) to that call's position; a rank whose communicator must be rebuilt
first reads the mark, and a call at or below it fails at once, without any communication ("behind": the peers gave
that call up while this rank was away). A loop that skips (or retries) a failed batch therefore skips the same
batches on every rank. The rendezvous of an epoch compares positions too: the ranks build the new groups only when
all arrive at the same position, and a rank that finds a peer ahead leaves and fails its call as behind.
"""

from __future__ import annotations

import datetime
import time
import weakref

import torch.distributed as dist

from distattn._bounded import REBUILD_TIMEOUT_ENV, DistAttnError, rebuild_timeout, release
from distattn._compat import keeps_order, new_group_in_order

__all__ = ["Communicator", "communicator", "open_call", "set_step", "current_step"]

TAG_CALLS_PER_STEP = 1 << 16
"""Tag numbers of the calls of one declared step: a step's k-th call is tagged ``step * 2^16 + k`` (a batch makes a
few hundred calls), so consecutive calls never share a tag."""

_STEP: list = [None]  # the step the user declared last (``set_step``), for every group


def set_step(step: int) -> None:
    """Declare the step (batch) the calls that follow belong to: the same on every rank, never decreasing.

    Optional. Every call's position is ``(step, k)``, its rank in the step; the ranks' positions are checked equal
    before any transfer, and after a failure a rank that comes back behind its peers fails the calls they gave up
    (``distattn.communicators``). Without a declared step the position is the process's call count, which keeps the
    ranks aligned as long as they all make the same calls; a declared step also realigns ranks whose programs made
    different numbers of calls in an earlier step (one rank skipped a call). A loop that skips failed batches
    declares the batch's index (counting the skipped ones); the same index again for a retried batch is fine.
    """
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"distattn.set_step: step must be an int (the batch's index), not {type(step).__name__}")
    if step < 0 or (_STEP[0] is not None and step < _STEP[0]):
        last = "" if _STEP[0] is None else f" (the last declared step was {_STEP[0]})"
        raise ValueError(f"distattn.set_step: step {step} must be >= 0 and never decrease{last}: count the batches "
                         f"across epochs, as a global step does")
    _STEP[0] = step


def current_step() -> int | None:
    """The step declared last with ``set_step`` (``None``: none)."""
    return _STEP[0]


class _Calls:
    """This process's calls on one user group, across the epochs of its communicators: the communicator of the
    current epoch, and the position ``(step, k)`` of the latest call (step -1: none declared)."""

    def __init__(self):
        self.comm: Communicator | None = None
        self.step, self.k = -1, 0

    def take(self) -> tuple[int, int]:
        """The position of a new call."""
        step = -1 if _STEP[0] is None else _STEP[0]
        if step != self.step:
            self.step, self.k = step, 0
        self.k += 1
        return self.step, self.k


def _tag_number(position: tuple[int, int]) -> int:
    step, k = position
    return k if step < 0 else step * TAG_CALLS_PER_STEP + k


def describe(position: tuple[int, int]) -> str:
    """``"call 7"``, or ``"call 3 of step 12"`` once steps are declared."""
    step, k = position
    return f"call {k}" if step < 0 else f"call {k} of step {step}"


class Communicator:
    """The library's own process groups for one user group (same ranks, same group-rank order), at one epoch.

    ``fetch`` carries the fetch rounds and the agreement check, ``ret`` the return rounds: on NCCL two groups
    (two communicators, each on a high-priority stream where the API offers it, so returns never queue behind
    fetches); elsewhere one group serves both. ``position`` is the latest call's ``(step, k)`` and ``seq`` its tag
    number (message tags carry it): both belong to the process's calls on the user's group and go on across epochs.

    ``dist.new_group`` is a collective: every member must reach it equally often, which is why it is called by
    the first distattn call (or the first after an abort), and only after every rank has arrived at the same
    epoch's rendezvous in the job's store (``_Rendezvous``). ``join_timeout``: how long to wait for the others
    there (the call's timeout for the first build, the shorter rebuild bound afterwards).

    The communicator keeps no reference to the user's group (only its ranks), so the cache can drop it, and free
    the library's groups, when the user's group is collected (``communicator``).
    """

    def __init__(self, group, timeout: float, calls: _Calls, *, epoch: int = 0, join_timeout: float | None = None):
        self.calls = calls
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world_size))
        backend = str(dist.get_backend(group))
        self.nccl = "nccl" in backend
        self.epoch = epoch
        self.name = _group_name(group, ranks)
        # Own groups only for a group spanning the whole job: dist.new_group names a group after a counter that
        # every process of the job advances (so all must call it), or, with use_local_synchronization, after a
        # hash that includes how many groups the calling process has, which differs between the members of a
        # subgroup as soon as they made different groups (a stale or mismatched name: the rendezvous hangs).
        # A subgroup's traffic therefore stays on the subgroup itself: bounded, tagged, never aborted.
        # In order: group rank r of the library's groups is group rank r of the user's group (a torch that cannot
        # keep an unsorted order, see distattn._compat, has the user's group serve as for a subgroup).
        self.owned = len(ranks) == dist.get_world_size() and keeps_order(ranks)
        self.fetch = self.ret = None
        self.aborted = False
        self.timeout = timeout
        if not self.owned:
            self.fetch = self.ret = group
            return
        _Rendezvous(self.name, epoch, self.rank, self.world_size).join(timeout if join_timeout is None else join_timeout,
                                                                       self.position)
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

    @property
    def position(self) -> tuple[int, int]:
        """The latest call's ``(step, k)`` (see the module doc)."""
        return self.calls.step, self.calls.k

    @property
    def seq(self) -> int:
        """The latest call's tag number: its k without declared steps, ``step * 2^16 + k`` with them."""
        return _tag_number(self.position)

    @seq.setter
    def seq(self, value: int) -> None:  # as after ``value`` calls (tests of tags past 2^31)
        self.calls.k = value - (0 if self.calls.step < 0 else self.calls.step * TAG_CALLS_PER_STEP)

    def abandoned_by_peers(self) -> bool:
        """Whether a rank of the group has abandoned this epoch (aborted its groups after a failure)."""
        return self.owned and _Rendezvous(self.name, self.epoch, self.rank, self.world_size).abandoned()

    def peer_gave_up(self) -> str | None:
        """What the job's store says if a rank of the group gave the latest call (or a later one) up, e.g. failed
        and aborted while this rank waits in it; ``None``: none did. One store round trip (``bounded_wait`` asks it
        every ``WATCH_S`` of a wait)."""
        mark, why = _GivenUp(self.name).read()
        if mark < self.position:
            return None
        return f"{describe(mark)} was given up: {why}" if why else f"{describe(mark)} was given up"

    @property
    def watch(self):
        """``peer_gave_up`` where a wait may read the mark (``bounded_wait(gave_up=)``), else ``None``: the library's
        own groups (aborted with the call, so a wait given up early harms nothing) and NCCL (a pending transfer breaks
        a user's communicator either way). A gloo wait left blocked on the user's own subgroup would sever it at its
        bound, after the next calls had begun: those waits end on their timeout or a closed connection only."""
        return self.peer_gave_up if self.owned or self.nccl else None

    @property
    def watch_collective(self):
        """``watch`` for a collective's wait: NCCL only. gloo runs a collective on its group's worker thread, which
        the abort's teardown joins, so a collective given up early would hold the abort until its bound. A gloo
        collective therefore ends on a peer's closed connections or at its bound: one posted just before the peer's
        connections closed was seen to wait out its bound (the confirmation after the last step, in
        tests/test_reliability.py): a gap that remains on gloo."""
        return self.peer_gave_up if self.nccl else None

    def abort(self, cause: BaseException | None = None) -> None:
        """Tear the library's groups down (never the user's) and mark the call given up and the epoch abandoned in
        the job's store. Peers waiting on this rank then fail at once: they read the mark while they wait (``watch``),
        and on gloo its connections close; on NCCL the communicators are aborted (``ncclCommAbort``). ``cause``: the
        error that failed the call here (a timeout is named in the mark)."""
        if self.aborted:
            return
        self.aborted = True
        why = f"group rank {self.rank} failed it and aborted"
        if getattr(cause, "timed_out", False):
            why += " (no message within its timeout)"
        # this call failed here: the peers behind fail it too
        _quietly(_GivenUp(self.name).raise_to, self.position, why)
        if not self.owned:
            return  # the user's group: never aborted (its peers fail at the mark on NCCL, else at their own timeout)
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
        group = None  # noqa: F841  (release drops the last references)
        release(groups)  # a gloo group's teardown closes its sockets, which wakes the peers


class _Rendezvous:
    """One epoch's meeting point in the job's store, before ``dist.new_group`` (see the module doc).

    The key ``distattn/<group>/e<epoch>/arrived`` holds the ranks that are waiting, each with the position of its
    call (``rank=step:k``), or ``go`` once all have arrived at the same position. Every change is a compare-and-set,
    so arriving, giving up and the switch to ``go`` are atomic: a rank that gives up either leaves the set before
    ``go`` (and no rank calls ``new_group``) or finds ``go`` and goes on with the others. A rank that finds a peer
    waiting at a later position, or the given-up mark at or past its own, leaves: its call is behind (``Behind``).
    ``abandoned`` marks the epoch given up after a failure (value: the failed call's number)."""

    POLL_S = 0.005
    MARK_POLL_S = 0.05  # how often a waiting rank reads the given-up mark (a peer gave up while it waited)

    def __init__(self, name: str, epoch: int, rank: int, world_size: int):
        self.prefix = f"distattn/{name}/e{epoch}"
        self.name = name
        self.rank, self.world_size, self.epoch = rank, world_size, epoch
        self.store = _job_store()

    def join(self, timeout: float, position: tuple[int, int]) -> None:
        key = f"{self.prefix}/arrived"
        given_up = _GivenUp(self.name, self.store)
        state = self._update(key, lambda waiting: waiting if _ahead(waiting, position) else {**waiting,
                                                                                            self.rank: position})
        deadline, next_mark = time.monotonic() + timeout, 0.0
        while state != "go":
            waiting = _waiting(state)
            ahead = _ahead(waiting, position)
            late = Behind(self.rank, position, max(ahead.values()), given_up.read()[1]) if ahead else None
            if late is None and time.monotonic() > next_mark:
                next_mark = time.monotonic() + self.MARK_POLL_S
                late = given_up.check(self.rank, position)
            if late is not None or time.monotonic() > deadline:
                state = self._update(key, lambda w: {r: p for r, p in w.items() if r != self.rank})
                if state == "go":  # everyone arrived while this rank was giving up: go on with them
                    break
                if late is not None:
                    raise late
                missing = sorted(set(range(self.world_size)) - set(waiting))
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
            waiting = change(_waiting(current))
            done = len(waiting) == self.world_size and len(set(waiting.values())) == 1
            new = "go" if done else ",".join(f"{r}={p[0]}:{p[1]}" for r, p in sorted(waiting.items()))
            got = self.store.compare_set(key, current, new).decode()
            if got == new:
                return new
            current = got
        return "go"

    def abandon(self, seq: int) -> None:
        self.store.set(f"{self.prefix}/abandoned", str(seq))

    def abandoned(self) -> bool:
        return self.store.check([f"{self.prefix}/abandoned"])


def _waiting(state: str) -> dict[int, tuple[int, int]]:
    """The ranks waiting at a rendezvous and their positions (``rank=step:k,...``)."""
    if state in ("", "go"):
        return {}
    out = {}
    for entry in state.split(","):
        rank, _, pos = entry.partition("=")
        step, _, k = pos.partition(":")
        out[int(rank)] = (int(step), int(k))
    return out


def _ahead(waiting: dict, position: tuple[int, int]) -> dict:
    return {r: p for r, p in waiting.items() if p > position}


class _GivenUp:
    """The given-up mark of a group (``distattn/<group>/given-up`` in the job's store): the latest position at which
    some rank failed a call (aborted, or found a peer missing at a rebuild), with why (``step:k|why``). It only grows
    (compare-and-set)."""

    def __init__(self, name: str, store=None):
        self.key = f"distattn/{name}/given-up"
        self.store = _job_store() if store is None else store

    def read(self) -> tuple[tuple[int, int], str]:
        if not self.store.check([self.key]):
            return (-2, 0), ""  # below every position
        return _parse_mark(self.store.get(self.key).decode())

    def check(self, rank: int, position: tuple[int, int]) -> DistAttnError | None:
        """The error of a call at ``position`` that a peer already gave up (``None``: none did)."""
        mark, why = self.read()
        if mark > position:
            return Behind(rank, position, mark, why)
        if mark == position:  # a peer at this very call gave it up (e.g. a rank missing at the rebuild)
            return DistAttnError(f"distattn: rank {rank}: another rank of the group gave {describe(position)} up, so it "
                                 f"fails here too: {why}", timed_out="did not arrive" in why)
        return None

    def raise_to(self, position: tuple[int, int], why: str) -> None:
        current = self.store.get(self.key).decode() if self.store.check([self.key]) else ""
        new = f"{position[0]}:{position[1]}|{why}"
        while not current or _parse_mark(current)[0] < position:
            got = self.store.compare_set(self.key, current, new).decode()
            if got == new:
                return
            current = got


def _parse_mark(value: str) -> tuple[tuple[int, int], str]:
    pos, _, why = value.partition("|")
    step, _, k = pos.partition(":")
    return (int(step), int(k)), why


class Behind(DistAttnError):
    """This rank's call is at or below a position its peers already gave up (it was away: stalled, or slower to
    recover): it fails at once, with no communication, so that every rank fails the same calls."""

    def __init__(self, rank: int, position: tuple[int, int], given_up: tuple[int, int], why: str = ""):
        super().__init__(f"distattn: rank {rank}: {describe(position)} was already given up by the other ranks of the "
                         f"group (they failed calls up to {describe(given_up)} while this rank was away: stalled, or "
                         f"slower to recover from a failure); it fails here too, at once, so that every rank fails the "
                         f"same calls and the next batches pair up again (a loop that skips or retries failed batches "
                         f"is back in step after the calls up to {describe(given_up)})"
                         + (f". The latest they gave up: {why}" if why else ""))
        self.position, self.given_up = position, given_up


def _group_name(group, ranks=None) -> str:
    """The name every rank gives the group's keys in the job's store."""
    if group is None:
        return "default"
    return str(getattr(group, "group_name", "") or (ranks if ranks is not None else dist.get_process_group_ranks(group)))


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


_DEFAULT = _Calls()  # the default group's calls and communicator
_BY_GROUP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # user group -> its _Calls


def _calls_of(group) -> _Calls:
    if group is None:
        return _DEFAULT
    calls = _BY_GROUP.get(group)
    if calls is None:
        calls = _BY_GROUP[group] = _Calls()
        weakref.finalize(group, _free_calls, calls)  # the user's group collected: free the library's too
    return calls


def open_call(group, timeout: float) -> tuple[Communicator, int]:
    """Start a call on ``group``: its position is taken first (so a call that fails below has one too), then the
    library's communicator for the group is returned, (re)built if the last one was aborted; with the call's tag
    number. A rebuild first reads the given-up mark: a call the peers already gave up fails at once (``Behind``);
    a rebuild that fails raises the mark to this call (the peers behind fail it too)."""
    calls = _calls_of(group)
    position = calls.take()
    if calls.comm is None or calls.comm.aborted:
        _rebuild(group, calls, timeout, position)
    calls.comm.set_timeout(timeout)
    return calls.comm, calls.comm.seq


def communicator(group, timeout: float) -> Communicator:
    """The library's communicator for ``group``: cached while ``group`` lives (its groups are freed when the user's
    group is collected, so a new group per call leaves nothing behind). Asking for one that must be (re)built is a
    call of its own (it takes a position: a collective every rank must make); otherwise no call is started."""
    calls = _calls_of(group)
    if calls.comm is None or calls.comm.aborted:
        _rebuild(group, calls, timeout, calls.take())
    calls.comm.set_timeout(timeout)
    return calls.comm


def _rebuild(group, calls: _Calls, timeout: float, position: tuple[int, int]) -> None:
    """The communicator of the next epoch (the first: epoch 0), met at ``position`` (see the module doc)."""
    old = calls.comm
    epoch = 0 if old is None else old.epoch + 1
    join = timeout if old is None else min(timeout, rebuild_timeout())
    given_up = _GivenUp(_group_name(group))
    rank = dist.get_rank(group)
    late = given_up.check(rank, position)
    if late is not None:
        raise late
    try:
        calls.comm = Communicator(group, timeout, calls, epoch=epoch, join_timeout=join)
    except BaseException as exc:
        # the peers that arrive later fail this call too (a no-op when a peer gave it up first)
        _quietly(given_up.raise_to, position, str(exc).removeprefix("distattn: "))
        if isinstance(exc, (DistAttnError, KeyboardInterrupt, SystemExit)):
            raise
        raise DistAttnError(f"distattn: rank {rank} could not build the library's communicators within {timeout:g} s "
                            f"(every rank of the group must make the same distattn call): {exc}") from exc


def _free_calls(calls: _Calls) -> None:
    if calls.comm is not None:
        _quietly(calls.comm.free)
    calls.comm = None
