"""The worker process of ``distattn.schedule.ahead``: ``python -m distattn.schedule._ahead_worker``."""

from __future__ import annotations

import pickle
import sys

from distattn.schedule.ahead import _recv, _send


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling (the caller raises it), else a ``RuntimeError`` naming it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"the placement solve failed: {exc!r}")


def serve() -> None:
    """A request ``(id, (spec, world_size, n, cluster, stride))`` in, ``(id, ok, layout or error)`` out, until stdin
    closes."""
    from distattn.schedule.placement import _place_cached

    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a print in the library must not corrupt the answers
    while True:
        try:
            rid, (spec, p, n, cluster, stride) = _recv(inp)
        except EOFError:
            return
        try:
            answer = (rid, True, _place_cached.__wrapped__(spec, p, n, None, cluster, stride))
        except Exception as exc:  # the caller raises it where it asks for the placement
            answer = (rid, False, _portable(exc))
        _send(out, answer)


if __name__ == "__main__":
    serve()
