"""The worker process of ``distattn.schedule.ahead`` (started as ``python -c "... serve(out)"``, ``ahead.BOOT``)."""

from __future__ import annotations

import os
import pickle
import sys

from distattn.schedule.ahead import READY, WorkerDied, _recv, _send


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling (the caller raises it), else a ``RuntimeError`` naming it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"the placement solve failed: {exc!r}")


def serve(out_fd: int) -> None:
    """A request (its id, then ``(spec, world_size, n, cluster, stride)`` pickled) in, its id and ``(ok, layout or
    error)`` out on ``out_fd``, until stdin closes. A request that does not unpickle is answered with the error."""
    from distattn.schedule.placement import _place_cached

    inp, out = sys.stdin.buffer, os.fdopen(out_fd, "wb")
    try:
        _serve(inp, out, _place_cached)
    except BrokenPipeError:  # the caller ended while this worker answered: nobody left to answer, nothing to say
        os._exit(0)  # no flush of the closed pipe at exit (that would print the same error again)


def _serve(inp, out, _place_cached) -> None:
    _send(out, READY.to_bytes(8, "little"))  # imported: ready for requests
    while True:
        try:
            data = _recv(inp)
        except EOFError:
            return
        rid = data[:8]
        try:
            spec, p, n, cluster, stride = pickle.loads(data[8:])
        except Exception as exc:  # e.g. a class of the caller's __main__: the caller solves it itself
            answer = (False, WorkerDied(f"the worker could not read the request: {exc!r}"))
        else:
            try:
                answer = (True, _place_cached.__wrapped__(spec, p, n, None, cluster, stride))
            except Exception as exc:  # the caller raises it where it asks for the placement
                answer = (False, _portable(exc))
        _send(out, rid + pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL))


if __name__ == "__main__":
    sys.exit("started by distattn.schedule.ahead (ahead.BOOT), not by hand")
