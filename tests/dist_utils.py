"""Run a function on N gloo ranks (processes) with a hard timeout; never hang the test session.

``run_distributed(fn, world_size, *args, timeout=120)`` starts ``world_size`` processes, each of which
initializes a gloo process group (file-store rendezvous: no ports to collide), calls
``fn(rank, world_size, *args)`` and sends back its return value. If any rank fails, ``RuntimeError`` carries
every failed rank's full traceback; if the ranks do not all finish within ``timeout`` seconds every process
is killed and ``TimeoutError`` names the ranks that timed out (plus the tracebacks of those that failed).
``fn`` must be a module-level function (it is pickled by name).

Ranks are forked from a forkserver (``multiprocessing``'s "forkserver" start method) that has imported torch and the
other modules in ``_PRELOAD`` once, instead of being spawned as fresh interpreters: importing torch costs 2-4 s of CPU
per rank on a small machine, transformers' LLaMA as much again, which over the suite's few hundred ranks was minutes
of CI. Each rank is still a new process, forked from one that ran nothing but those imports (no thread pool used, no
process group, no CUDA); it starts from the caller's environment of the moment plus ``env`` (sent along and set
first thing, as the forkserver's own environment is the one of the first call). Tests still run many cases inside
one ``fn`` per world size rather than one spawn per case: each spawn also pays the test module's own imports, the
rendezvous and the teardown.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import queue
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

__all__ = ["run_distributed"]

# Imported once in the forkserver, so that no rank pays for them: torch, its process groups, pytest (every test module
# that holds a rank's ``fn`` imports it) and the Hugging Face LLaMA that the HF tests' ranks build (importing it costs
# twice what torch does). A module that is not installed is skipped (the forkserver ignores its ImportError).
_PRELOAD = ["torch", "torch.distributed", "pytest", "transformers.models.llama.modeling_llama"]


def _worker(rank, world_size, init_file, fn, args, results, environ):
    try:
        # A forked rank inherits the forkserver's environment, not the caller's: take the caller's as it was.
        os.environ.clear()
        os.environ.update(environ)
        import torch.distributed as dist

        torch.set_num_threads(1)  # N ranks share a couple of cores: oversubscription only slows them down
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        # gloo's init returns on a rank once its own pairs are up, possibly before a peer has finished its
        # handshake; a rank whose fn needs no communication could then exit and close a socket the peer is still
        # connecting through ("Connection closed by peer" in the peer's init). One barrier: every rank is in.
        dist.barrier()
        try:
            value = fn(rank, world_size, *args)
            _leave_together(dist)
        finally:
            dist.destroy_process_group()
        buf = io.BytesIO()
        torch.save(value, buf)  # bytes through the queue: no shared-memory tensors outliving this process
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report anything, including KeyboardInterrupt from a kill
        results.put((rank, "error", traceback.format_exc()))


LEAVE_WAIT_S = 30.0  # how long a rank whose fn returned waits for the others to finish theirs


def _leave_together(dist) -> None:
    """Wait (bounded) until every rank's ``fn`` has returned before this rank tears its group down.

    gloo closes a rank's sockets when the rank leaves, and a group's connections are made lazily: a rank whose ``fn``
    returned right after creating a group (or a library's own communicators) could close a socket a slower peer is
    still connecting through, and that peer fails ("Connection closed by peer") or hangs. A peer that failed or died
    ends the wait at once (its sockets are closed), a hung one after ``LEAVE_WAIT_S``: either way this rank still
    reports what its ``fn`` returned."""
    import datetime
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=LEAVE_WAIT_S))
    except Exception:  # noqa: BLE001 - a peer that failed, died or hangs is reported by its own rank or the timeout
        pass


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0, env: dict | None = None,
                    may_die: tuple[int, ...] = ()) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the per-rank results.

    ``may_die``: ranks that are expected to kill themselves (fault tests): their result is ``None``."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts, the first call's
    results = ctx.Queue()
    environ = {**os.environ, **(env or {})}  # what the ranks start from (see _worker)
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, fn, args, results, environ),
                             daemon=True)
                 for r in range(world_size)]
        try:
            for p in procs:
                p.start()
            return _collect(procs, results, world_size, timeout, set(may_die))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)


def _collect(procs, results, world_size, timeout, may_die=frozenset()):
    deadline = time.monotonic() + timeout
    out: dict[int, object] = {}
    errors: dict[int, str] = {}
    while len(out) + len(errors) < world_size:
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(set(range(world_size)) - set(out) - set(errors))
            raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:g} s (timed out)"
                               + _format_errors(errors, world_size))
        try:
            rank, status, payload = results.get(timeout=min(left, 1.0))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)
                    and r not in out and r not in errors]
            for r in dead:
                if r in may_die:
                    out[r] = None
                else:
                    errors[r] = f"rank {r} died with exit code {procs[r].exitcode}"
            continue
        if status == "ok":
            out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            errors[rank] = payload
    if errors:
        raise RuntimeError(f"{len(errors)} of {world_size} ranks failed (ranks {sorted(errors)})"
                           + _format_errors(errors, world_size))
    return [out[r] for r in range(world_size)]


def _format_errors(errors: dict[int, str], world_size: int) -> str:
    """Every failed rank's full traceback, in rank order: the root cause is often not on the lowest rank
    (its peers then fail with 'Connection closed by peer')."""
    if not errors:
        return ""
    return "".join(f"\n\n----- rank {r} of {world_size} -----\n{errors[r].rstrip()}" for r in sorted(errors))


def refused(fn) -> str:
    """The text of the ``ValueError`` that ``fn()`` raises, or "no error" (a spawned rank's result for a bad input)."""
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return "no error"


@contextlib.contextmanager
def solver_depths(prefetch: int | None = None, return_depth: int | None = None, window_chunks: bool = True,
                  stream_deal: bool = True, even_loose: bool = True):
    """The placement solver timing prefetch depths ``1..prefetch`` and return depths ``1..return_depth`` only
    (``Layout.prefetch``, ``Layout.return_depth``; ``None``: up to the solver's deepest, ``PREFETCHES[-1]`` and
    ``RETURN_DEPTHS[-1]``) and, ``window_chunks=False``, the windowed deal in the snake only (``WINDOW_CHUNKS``),
    ``stream_deal=False``, without the stream deal (``distattn.schedule.streams``, ``STREAM_CLASSES``),
    ``even_loose=False``, without the looser evenings (``EVEN_LOOSE``), for examples pinned under the solver's former
    candidates; its cache is emptied on the way in and out, so no solve leaks
    across the change."""
    import distattn.schedule.solver as pl

    saved = pl.PREFETCHES, pl.RETURN_DEPTHS, pl.WINDOW_CHUNKS, pl.STREAM_CLASSES, pl.EVEN_LOOSE
    pl._place_cached.cache_clear()
    pl.PREFETCHES = saved[0] if prefetch is None else tuple(range(1, prefetch + 1))
    pl.RETURN_DEPTHS = saved[1] if return_depth is None else tuple(range(1, return_depth + 1))
    pl.WINDOW_CHUNKS = saved[2] if window_chunks else (False,)
    pl.STREAM_CLASSES = saved[3] if stream_deal else ()
    pl.EVEN_LOOSE = saved[4] if even_loose else ()
    try:
        yield
    finally:
        pl.PREFETCHES, pl.RETURN_DEPTHS, pl.WINDOW_CHUNKS, pl.STREAM_CLASSES, pl.EVEN_LOOSE = saved
        pl._place_cached.cache_clear()


@contextlib.contextmanager
def placed_forced(order: str | None = None, group: int | None = None, cut: float | None = None,
                  backward: str | None = None, prefetch: int | None = None, chunks: bool = False,
                  short_first: bool = False, head: float | None = None, return_depth: int | None = None,
                  even: str | None = None, share: float | None = None, tolerance: float | None = None):
    """Inside a rank: every placement the solver returns (``distattn.schedule.placement``, through which the shards and
    the plan both go) runs its steps in ``order`` (``Layout.order``), its backward in ``backward``
    (``Layout.backward``; ``head``: its local pair's head first or not, ``Layout.head``), fetches
    ``prefetch`` steps ahead (``Layout.prefetch``) and absorbs its partials ``return_depth`` steps after their round
    (``Layout.return_depth``), whatever the solver chose; with
    ``group``, groups of that size instead of the solver's choice, their documents cut by work when ``cut`` is given
    (``distattn.schedule.groups``), dealt in mirrored chunks with ``chunks`` (``distattn.schedule.deal``), a cut
    document's shortest piece first with ``short_first``, the groups' work evened with ``even``
    (``distattn.schedule.groups.even_groups``; to within ``tolerance`` of the mean, ``None``: the solver's ``EVEN``),
    over windows of that ``share`` (``distattn.schedule.windows``; with ``chunks``, a long piece over its window in
    mirrored chunks)."""
    import distattn.schedule.placement as pl

    solve = pl._place_cached

    def forced(spec, p, n, grp=None, *args, **kwargs):
        if group is not None and p % group == 0 and p > 1 and not spec.dense:
            grp, kwargs = group, dict(kwargs, cut=cut, chunks=chunks, short_first=short_first, even=even, share=share)
            kwargs.update({} if tolerance is None else {"tolerance": tolerance})
        lay = solve(spec, p, n, grp, *args, **kwargs)
        if lay.kind != "placed":
            return lay
        return dataclasses.replace(lay, order=order or lay.order, backward=backward or lay.backward,
                                   prefetch=prefetch or lay.prefetch, head=lay.head if head is None else head,
                                   return_depth=return_depth or lay.return_depth)

    pl._place_cached = forced
    try:
        yield
    finally:
        pl._place_cached = solve
