"""Placements solved ahead: the next batch's placement in worker processes while this batch's step runs.

The placement solver (``distattn.schedule.placement``) takes 0.1-3 s of CPU per batch at 16-64 ranks and up to ~10 s
at 256 (``bench/results/placement-sim/SOLVE-AHEAD.md``), on the training loop's own thread, before the step can start:
every batch is a new solve. :func:`submit` hands a solve to a worker process, and ``place`` takes its result
(:func:`take`, waiting only for what is left of it) when the step asks for that placement. The worker runs the same
pure-Python solve on the same arguments, the cluster resolved in the caller, so the layout is the one the caller would
have solved (``tests/test_solve_ahead.py``), on every rank alike with no communication. An error of the solve is raised
where the placement is asked for, as inline; a worker that dies (killed, out of memory) costs a warning and an inline
solve.

A worker is ``python -m distattn.schedule._ahead_worker`` talking over its stdin/stdout (pickled requests and results):
neither ``fork`` (a training process holds CUDA contexts and communicator threads) nor ``multiprocessing``'s
``spawn`` (it re-runs the caller's ``__main__``, a training script without a main guard). It starts on the first ask
(importing the library takes it a few seconds) and ends with the process or at :func:`shutdown`.

Process-local: every rank asks its own workers for its own batches. The library call is
``distattn.sharding.solve_ahead`` (the arguments of ``distattn.sharding.placement``); ``launch/train.py --schedule
placed`` asks for batch ``i + 1`` before it runs step ``i``.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import os
import pickle
import struct
import subprocess
import sys
import threading
import warnings
from concurrent.futures import Future

__all__ = ["PENDING", "KEEP", "WorkerDied", "start", "submit", "take", "pending", "served", "shutdown"]

PENDING = 8
"""Most solves asked for and not yet taken; asking for more drops the oldest (a loop that asks and never takes)."""
KEEP = 16
"""Taken placements kept for a second ask of the same key (the shards and the attention call's plan ask alike)."""


class WorkerDied(RuntimeError):
    """The worker process solving a placement ended before answering."""


def _send(stream, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _recv(stream):
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError
    (size,) = struct.unpack("<Q", head)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


class _Worker:
    """One worker process, its requests in flight (``id -> Future``) and the thread reading its answers."""

    def __init__(self):
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds distattn/
        path = os.pathsep.join([root] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
        self.proc = subprocess.Popen([sys.executable, "-m", "distattn.schedule._ahead_worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=path))
        self.lock = threading.Lock()
        self.inflight: dict[int, Future] = {}
        threading.Thread(target=self._read, name="distattn-solve-ahead", daemon=True).start()

    def submit(self, rid: int, args: tuple) -> Future:
        fut = Future()
        with self.lock:
            self.inflight[rid] = fut
            try:
                _send(self.proc.stdin, (rid, args))
            except (BrokenPipeError, OSError, ValueError) as exc:
                del self.inflight[rid]
                fut.set_exception(WorkerDied(f"could not reach the worker: {exc}"))
        return fut

    def _read(self) -> None:
        while True:
            try:
                rid, ok, value = _recv(self.proc.stdout)
            except (EOFError, OSError, ValueError, pickle.UnpicklingError):
                break
            with self.lock:
                fut = self.inflight.pop(rid, None)
            if fut is not None and not fut.cancelled():
                fut.set_result(value) if ok else fut.set_exception(value)
        code = self.proc.wait()
        with self.lock:
            left, self.inflight = self.inflight, {}
        for fut in left.values():
            if not fut.cancelled():
                fut.set_exception(WorkerDied(f"exit code {code}"))

    @property
    def load(self) -> int:
        with self.lock:
            return len(self.inflight)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_lock = threading.Lock()
_pending: collections.OrderedDict = collections.OrderedDict()  # key -> Future
_taken: collections.OrderedDict = collections.OrderedDict()  # key -> Layout
_workers: list[_Worker] = []
_ids = itertools.count()
_served = 0  # placements taken from a worker's answer


def start(workers: int = 1) -> None:
    """Start up to ``workers`` worker processes now (each imports the library, a second or so), so that the first
    solve asked for does not wait for that."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r} must be a positive number of worker processes")
    with _lock:
        _workers[:] = [w for w in _workers if w.alive]
        while len(_workers) < workers:
            _workers.append(_Worker())


def submit(key: tuple, workers: int = 1) -> Future:
    """Start solving ``key = (spec, world_size, n, cluster, stride)`` (``place``'s arguments, the cluster resolved) in
    the least busy of ``workers`` processes (started on demand); a key asked for already keeps its solve."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r} must be a positive number of worker processes")
    with _lock:
        if key in _pending:
            return _pending[key]
        if key in _taken:  # solved and taken already: nothing to start
            fut = Future()
            fut.set_result(_taken[key])
            return fut
        _workers[:] = [w for w in _workers if w.alive]
        if len(_workers) < workers:
            _workers.append(_Worker())
        fut = min(_workers, key=lambda w: w.load).submit(next(_ids), key)
        _pending[key] = fut
        while len(_pending) > PENDING:
            _pending.popitem(last=False)[1].cancel()
        return fut


def take(key: tuple):
    """The placement of ``key`` solved ahead (waiting for the worker if it is still solving), or ``None`` when it was
    not asked for (or its worker died: then a warning, and the caller solves inline). The solve's own error is raised
    here."""
    with _lock:
        if key in _taken:
            _taken.move_to_end(key)
            return _taken[key]
        fut = _pending.pop(key, None)
    if fut is None:
        return None
    try:
        layout = fut.result()
    except WorkerDied as exc:
        warnings.warn(f"the worker solving a placement ahead died ({exc}); solving it here", RuntimeWarning,
                      stacklevel=3)
        return None
    global _served
    with _lock:
        _served += 1
        _taken[key] = layout
        while len(_taken) > KEEP:
            _taken.popitem(last=False)
    return layout


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
        for fut in _pending.values():
            fut.cancel()
        _pending.clear()
        _taken.clear()
    for w in workers:
        w.close()


atexit.register(shutdown)
