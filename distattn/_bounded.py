"""Bounded waits and the error they raise: the shared helpers of every module that talks across ranks.

Every wait distattn makes is bounded (``timeout`` seconds, the ``DISTATTN_TIMEOUT`` default, 300 s): on gloo
``Work.wait(timeout=...)``; on NCCL host-side polling of ``Work.is_completed()`` (a hung transfer never returns from a
device-side wait). A wait that fails raises ``DistAttnError``, naming what it waited for and why (a timeout, or a peer
that closed its connections).

A wait may also watch the job's store (``gave_up``): a peer that fails a call marks it given up there before it closes
its connections (``distattn.communicators``), and the waiting rank reads the mark every ``WATCH_S`` and fails at once.
Closed connections alone do not always reach a waiting rank: NCCL has no such signal, and on gloo a receive posted
after the peer's connection closed was seen to wait out its whole bound (then to report the closed connection).
"""

from __future__ import annotations

import datetime
import gc
import os
import threading
import time
import weakref
from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["DistAttnError", "TIMEOUT_ENV", "DEFAULT_TIMEOUT_S", "REBUILD_TIMEOUT_ENV", "DEFAULT_REBUILD_TIMEOUT_S",
           "default_timeout", "rebuild_timeout", "bounded_wait", "all_gather_text", "reason", "left_waits", "release"]

TIMEOUT_ENV = "DISTATTN_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
REBUILD_TIMEOUT_ENV = "DISTATTN_REBUILD_TIMEOUT"
DEFAULT_REBUILD_TIMEOUT_S = 10.0
WATCH_S = 0.25  # how often a watched wait reads the given-up mark (one store round trip each time)
_LEFT: list[threading.Thread] = []  # wait threads a given-up watched wait left blocked in gloo (``left_waits``)


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


def bounded_wait(works, timeout: float, what: str, *, poll: bool = False,
                 gave_up: Callable[[], str | None] | None = None) -> None:
    """Wait for ``works`` at most ``timeout`` seconds each; ``DistAttnError`` naming ``what`` otherwise.

    gloo: ``Work.wait(timeout=...)``. NCCL: the host polls ``is_completed()`` (a hung transfer never returns
    from a device-side wait, so the bound has to be on the host), then orders the current stream after it.
    ``gave_up``: asked every ``WATCH_S`` while the wait lasts; the text it returns (a peer gave this call up: what the
    job's store says) ends the wait at once. On gloo a watched wait runs in a helper thread (gloo's own wait cannot
    be woken, and a timed-out gloo wait severs every connection of its group), which the caller joins in slices.
    """
    if not works:  # an empty round: nothing to wait for (and no helper thread to start)
        return
    error = None
    try:
        if poll:
            _poll(works, timeout, gave_up)
        elif gave_up is not None:
            _watched(works, timeout, gave_up)
        else:
            for work in works:
                work.wait(timeout=datetime.timedelta(seconds=timeout))
    except Exception as exc:  # noqa: BLE001
        error = exc
    if error is not None:
        # No frame of the raised error may keep a request (and so the group and its sockets) alive: the
        # caller's list is emptied too.
        works.clear()
        work = None  # noqa: F841
        if isinstance(error, _PeerGaveUp):
            raise DistAttnError(f"{what}: a peer failed and aborted the library's communicators (the job's store: "
                                f"{error})", timed_out="timeout" in str(error)) from None
        raise DistAttnError(f"{what}: {reason(error, timeout)}", timed_out=_timed_out(error)) from None


class _PeerGaveUp(Exception):
    """A watched wait ended by the given-up mark (the message: what ``gave_up`` returned)."""


def _check(gave_up) -> None:
    found = gave_up()
    if found is not None:
        raise _PeerGaveUp(found)


def _poll(works, timeout: float, gave_up) -> None:
    for work in works:
        deadline = time.monotonic() + timeout
        watch = time.monotonic() + WATCH_S
        while not work.is_completed():
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"timed out after {timeout:g} s")
            if gave_up is not None and now > watch:
                _check(gave_up)
                watch = time.monotonic() + WATCH_S
            time.sleep(50e-6)
        work.wait(timeout=datetime.timedelta(seconds=timeout))


def _watched(works, timeout: float, gave_up) -> None:
    """gloo's blocking waits in a daemon thread; this thread joins it in ``WATCH_S`` slices, reading the mark between
    them. A wait given up here leaves the thread blocked until gloo ends it (at the latest at ``timeout``): it holds
    the old group, never the next call's."""
    box: list[Exception] = []

    def wait_all(pending=list(works)):
        try:
            for work in pending:
                work.wait(timeout=datetime.timedelta(seconds=timeout))
        except Exception as exc:  # noqa: BLE001 - handed to the joining thread
            box.append(exc)
        pending.clear()

    thread = threading.Thread(target=wait_all, name="distattn-wait", daemon=True)
    thread.start()
    thread.join(WATCH_S)
    while thread.is_alive():
        try:
            _check(gave_up)
        except _PeerGaveUp:
            _LEFT.append(thread)  # still blocked on the old group: its teardown waits for it (``left_waits``)
            raise
        thread.join(WATCH_S)
    if box:
        raise box[0]


def left_waits() -> list[threading.Thread]:
    """The wait threads that given-up watched waits left blocked in gloo and that are still alive (:func:`release`)."""
    _LEFT[:] = [t for t in _LEFT if t.is_alive()]
    return list(_LEFT)


def release(groups: list) -> None:
    """Drop the last references to ``groups`` (destroyed process groups; the list is emptied), collecting them: a gloo
    group's teardown closes its sockets, which is what wakes peers still waiting on this rank. That teardown blocks
    until the group's pending work ends, i.e. until a given-up wait's bound when the peer it waits for failed but kept
    its connections open (:func:`left_waits`): then a daemon thread joins those waits first and drops the groups
    after, and the failing call (``distattn.communicators.Communicator.free``) raises at once."""
    left, mine = left_waits(), list(groups)
    groups.clear()
    if left:
        threading.Thread(target=_drop, args=(mine, left), name="distattn-free", daemon=True).start()
    else:
        _drop(mine)


def _drop(groups: list, after: list[threading.Thread] = ()) -> None:
    for thread in after:
        thread.join()  # at the latest at their bound
    alive = [weakref.ref(group) for group in groups]
    groups.clear()
    if any(ref() is not None for ref in alive):
        gc.collect()


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


def reason(error: Exception, timeout: float) -> str:
    text = str(error)
    if _timed_out(error):
        return f"no message within the timeout ({timeout:g} s; set timeout= or {TIMEOUT_ENV})"
    return (f"a peer failed and aborted the library's communicators, or died (gloo: "
            f"{text.strip().splitlines()[-1][:160]})")
