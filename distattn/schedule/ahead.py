"""Placements solved ahead: the next batch's placement in worker processes while this batch's step runs.

The placement solver (``distattn.schedule.placement``) takes 0.1-1.3 s of CPU per batch at 16-64 ranks and up to ~8 s
at 256 (``bench/results/placement-sim/SOLVE-SPEED.md``), on the training loop's own thread, before the step can start:
every batch is a new solve. :func:`submit` hands a solve to a worker process, and ``place`` takes its result
(:func:`take`, waiting only for what is left of it) when the step asks for that placement. The worker runs the same
pure-Python solve on the same arguments, the cluster resolved in the caller, so the layout is the one the caller would
have solved (``tests/test_solve_ahead.py``), on every rank alike with no communication. An error of the solve is raised
where the placement is asked for, as inline; a worker that dies (killed, out of memory), or a request that does not
pickle or that the worker cannot read (a class of the caller's ``__main__``), costs a warning and an inline solve.

A worker is a ``python -c`` process serving ``distattn.schedule._ahead_worker`` over its stdin/stdout (pickled
requests and results; its descriptor 1 moved to stderr first, so nothing else writes to the answers' pipe):
neither ``fork`` (a training process holds CUDA contexts and communicator threads) nor ``multiprocessing``'s
``spawn`` (it re-runs the caller's ``__main__``, a training script without a main guard). It starts on the first ask
(importing the library takes it a few seconds) and ends with the process or at :func:`shutdown`.

Process-local: every rank asks its own workers for its own batches (the ranks of a node each solve the same
placement: CPU they have, and no communication). The library call is ``distattn.sharding.solve_ahead`` (the arguments
of ``distattn.sharding.placement``); ``launch/train.py --schedule placed`` asks for batches ``i + 1`` and ``i + 2``
before it runs step ``i``, on two workers.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import warnings
from concurrent.futures import Future, InvalidStateError

__all__ = ["PENDING", "KEEP", "WorkerDied", "start", "submit", "take", "ready", "pending", "served",
           "shutdown"]

PENDING = 8
"""Most solves asked for and not yet taken; asking for more drops the oldest (a loop that asks and never takes)."""
KEEP = 64
"""Taken placements kept for a second ask of the same key (the shards and the attention call's plan ask alike): as
many as the inline solves' cache keeps, so that a step sharding many micro-batches before its first forward (the HF
Trainer with gradient accumulation) finds each one's layout there again instead of solving it anew."""


class WorkerDied(RuntimeError):
    """The worker could not solve a placement: it ended before answering, or could not read the request."""


def _send(stream, data: bytes) -> None:
    """One message: its length (8 bytes, little-endian) and ``data``."""
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _recv(stream) -> bytes:
    """One message's bytes (:func:`_send`); ``EOFError`` at the end of the stream."""
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError
    (size,) = struct.unpack("<Q", head)
    if size > MAX_MESSAGE:
        raise ValueError(f"a message of {size} bytes: the stream is not the worker's")
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return data


READY = (1 << 64) - 1
"""The id of the worker's first message: it has imported the solver and takes requests."""
MAX_MESSAGE = 1 << 34
"""A length past this is not a message (something else wrote to the worker's pipe)."""
BOOT = ("import os, sys; out = os.dup(1); os.dup2(2, 1); sys.stdout = sys.stderr; "
        "from distattn.schedule._ahead_worker import serve; serve(out)")
"""The worker's command: its stdout pipe kept for the answers only, descriptor 1 (prints, C code, child processes)
sent to stderr before the library is imported."""


def _settle(fut: Future, ok: bool, value) -> None:
    """Resolve ``fut`` unless it was cancelled meanwhile (a cancel racing the answer is not an error)."""
    try:
        fut.set_result(value) if ok else fut.set_exception(value)
    except InvalidStateError:
        pass


class _Worker:
    """One worker process, its requests in flight (``id -> Future``), a thread writing the requests (never the
    caller: a request larger than the pipe would block it while the worker is solving) and one reading the answers."""

    def __init__(self):
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds distattn/
        self.proc = subprocess.Popen([sys.executable, "-c", BOOT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     cwd=root)  # the library this process runs, ahead of any other on the path
        self.lock = threading.Lock()
        self.inflight: dict[int, Future] = {}
        self.ready = threading.Event()  # set by the worker's first message, once it has imported the solver
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._write, name="distattn-solve-ahead-send", daemon=True).start()
        threading.Thread(target=self._read, name="distattn-solve-ahead-recv", daemon=True).start()

    def submit(self, rid: int, payload: bytes) -> Future:
        """Queue the pickled request ``payload`` as request ``rid``; the writer thread sends it."""
        fut = Future()
        with self.lock:
            self.inflight[rid] = fut
        self.outbox.put((rid, payload))
        return fut

    def _write(self) -> None:
        while True:
            item = self.outbox.get()
            if item is None:
                return
            rid, payload = item
            try:
                _send(self.proc.stdin, struct.pack("<Q", rid) + payload)
            except (OSError, ValueError) as exc:  # the worker is gone: its reader fails what is left
                with self.lock:
                    fut = self.inflight.pop(rid, None)
                if fut is not None:
                    _settle(fut, False, WorkerDied(f"could not reach the worker: {exc}"))

    def _read(self) -> None:
        why = None
        try:
            while True:
                data = _recv(self.proc.stdout)
                (rid,) = struct.unpack("<Q", data[:8])
                if rid == READY:
                    self.ready.set()
                    continue
                ok, value = pickle.loads(data[8:])
                with self.lock:
                    fut = self.inflight.pop(rid, None)
                if fut is not None:
                    _settle(fut, ok, value)
        except EOFError:
            pass
        except BaseException as exc:  # a stream that is not the worker's, or an answer that does not unpickle
            why = f"its answers could not be read: {exc!r}"
            self.proc.kill()
        finally:
            code = self.proc.wait()
            with self.lock:
                left, self.inflight = self.inflight, {}
            for fut in left.values():
                _settle(fut, False, WorkerDied(why or f"exit code {code}"))

    @property
    def load(self) -> int:
        with self.lock:
            return len(self.inflight)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self.outbox.put(None)
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_lock = threading.Lock()
_pending: collections.OrderedDict = collections.OrderedDict()  # key -> (Future, the worker solving it)
_taken: collections.OrderedDict = collections.OrderedDict()  # key -> Layout
_workers: list[_Worker] = []
_ids = itertools.count()
_served = 0  # placements taken from a worker's answer


def start(workers: int = 1, wait: float | None = None) -> bool:
    """Start up to ``workers`` worker processes now (each imports the library, a second or more), so that the first
    solve asked for does not wait for that; ``wait``: seconds to wait for them to be ready. Whether they all are."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r} must be a positive number of worker processes")
    with _lock:
        _workers[:] = [w for w in _workers if w.alive]
        while len(_workers) < workers:
            _workers.append(_Worker())
        started = list(_workers)
    return all(w.ready.wait(wait) for w in started) if wait is not None else all(w.ready.is_set() for w in started)


def submit(key: tuple, workers: int = 1) -> Future:
    """Start solving ``key = (spec, world_size, n, cluster, stride)`` (``place``'s arguments, the cluster resolved) in
    the least busy of ``workers`` processes (started on demand); a key asked for already keeps its solve."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r} must be a positive number of worker processes")
    with _lock:
        if key in _pending:
            return _pending[key][0]
        if key in _taken:  # solved and taken already: nothing to start
            fut = Future()
            fut.set_result(_taken[key])
            return fut
        try:
            payload = pickle.dumps(key, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # nothing pending: the placement is solved inline when asked for
            warnings.warn(f"a placement cannot be solved ahead ({exc!r}); it will be solved when asked for",
                          RuntimeWarning, stacklevel=3)
            fut = Future()
            fut.set_exception(exc)
            return fut
        _workers[:] = [w for w in _workers if w.alive]
        if len(_workers) < workers:
            _workers.append(_Worker())
        worker = min(_workers, key=lambda w: w.load)
        fut = worker.submit(next(_ids), payload)
        _pending[key] = (fut, worker)
        while len(_pending) > PENDING:
            _pending.popitem(last=False)[1][0].cancel()
        return fut


def take(key: tuple):
    """The placement of ``key`` solved ahead (waiting for the worker if it is still solving), or ``None`` when it was
    not asked for, when its worker is still starting (importing the library takes longer than most solves: the caller
    solves it inline, no later than without a worker), or when the worker could not solve it (a warning; the caller
    solves it inline). The solve's own error is raised here."""
    with _lock:
        if key in _taken:
            _taken.move_to_end(key)
            return _taken[key]
        entry = _pending.pop(key, None)
    if entry is None:
        return None
    fut, worker = entry
    if not fut.done() and not worker.ready.is_set():  # still importing the library: solving here is sooner
        fut.cancel()
        return None
    try:
        layout = fut.result()
    except WorkerDied as exc:
        warnings.warn(f"a placement asked for ahead was not solved by its worker ({exc}); solving it here",
                      RuntimeWarning, stacklevel=3)
        return None
    global _served
    with _lock:
        _served += 1
        _taken[key] = layout
        while len(_taken) > KEEP:
            _taken.popitem(last=False)
    return layout


def ready() -> bool:
    """Whether this process has workers and every one of them is ready (has imported the solver)."""
    with _lock:
        live = [w for w in _workers if w.alive]
    return bool(live) and all(w.ready.is_set() for w in live)


def pending() -> int:
    """Solves asked for and not yet taken."""
    with _lock:
        return len(_pending)


def served() -> int:
    """Placements taken from a worker's answer so far in this process (a second ask of one counts once)."""
    with _lock:
        return _served


def shutdown() -> None:
    """Stop the workers (their unfinished solves are dropped) and forget every placement asked for."""
    with _lock:
        workers, _workers[:] = list(_workers), []
        for fut, _ in _pending.values():
            fut.cancel()
        _pending.clear()
        _taken.clear()
    for w in workers:
        w.close()


atexit.register(shutdown)
