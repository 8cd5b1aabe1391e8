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
"""

from __future__ import annotations

import datetime
import gc
import time
import weakref

import torch.distributed as dist

from distattn._bounded import REBUILD_TIMEOUT_ENV, DistAttnError, rebuild_timeout
from distattn._compat import keeps_order, new_group_in_order

__all__ = ["Communicator", "communicator"]


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
