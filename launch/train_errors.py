"""How ``launch/train.py`` fails: one reason line from rank 0, the reason in torchrun's report, one exit status on
every rank.

Owns :func:`report_error` (the ``train.py: error:`` line, torchrun's error file, the wait of a rank other than 0 for
rank 0 to go first), :func:`exit_now` (leaving at once, without the interpreter's teardown) and the exit status of a
bad argument, :data:`EXIT_BAD_ARGS`. Imports only the standard library and ``torch.distributed``'s
``is_initialized``; the rest of ``launch/`` imports it (``train_config`` for argparse's errors, ``train`` for its
exit).

Why leave at once: torchrun stops every other worker with SIGTERM as soon as one exits, and the interpreter's teardown
(seconds on a loaded machine) resets a Python SIGTERM handler to the default early in it, so a rank stopped during its
teardown showed up in torchrun's report as killed (exit -15) next to the real reason (seen in CI twice: a rank other
than 0 after its wait, and rank 0 still tearing down when that rank left).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch

EXIT_BAD_ARGS = 2


# How long a non-zero rank waits before exiting on an error found before the process group exists: it bounds how
# far rank 0 may lag its peers (a loaded machine starting many ranks at once: seconds) and still be the first to
# exit, so that torchrun names rank 0 as root cause. torchrun stops the waiting ranks (SIGTERM) as soon as rank 0
# exits, so the wait delays only a fault that rank 0 does not share.
_DEFER_S = 10.0
_pending_line: str | None = None
"""A non-zero rank's reason line, written to its error file only when it leaves (:func:`exit_now`)."""


def report_error(message: str, code: int = EXIT_BAD_ARGS) -> None:
    """``train.py: error: <message>``: one line on rank 0's stderr, and the reason in torchrun's report.

    A worker that exits non-zero always makes torchrun print its failure report (~40 lines; nothing a worker
    can switch off). torchrun gives each worker an error file (``TORCHELASTIC_ERROR_FILE``, which its
    ``@record`` decorator fills with a traceback); a message written there replaces the report's
    "traceback: To enable traceback see: <docs link>" lines, so the report ends with the reason too.

    torchrun names as root cause the failure with the earliest error-file timestamp (whole seconds, ties: the
    first seen), and stops every other worker with SIGTERM as soon as one exits. So rank 0 writes its file now,
    and every other rank writes its own (with the real time, hence never before rank 0's) only as it leaves, with
    exit status ``code`` in both ways out: when torchrun stops it (a SIGTERM handler) or when it exits on its
    own (``exit_now``; before the process group exists, after waiting ``_DEFER_S`` for rank 0 to go first, and
    then without returning). Every rank that reports the error thus exits with ``code``, and no report shows a
    time in the future.
    """
    global _pending_line
    line = f"train.py: error: {message}"
    if int(os.environ.get("RANK", "0")) == 0:  # train_config.Env's reading; that module imports this one
        print(line, file=sys.stderr, flush=True)
        _write_error_file(line)
        return
    _pending_line = line
    signal.signal(signal.SIGTERM, lambda *_: exit_now(code))
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        time.sleep(_DEFER_S)
        # Rank 0 did not fail first: this rank's own fault. Leave at once, not through the caller's sys.exit: the
        # interpreter's teardown takes seconds on a loaded machine and resets this handler to the default early in
        # it, so torchrun's SIGTERM landing then would show this rank as killed (exit -15; seen in CI).
        exit_now(code)


def exit_now(code: int) -> None:
    """Leave at once with ``code``, after writing a pending reason line (:func:`report_error`) to the error file."""
    global _pending_line
    if _pending_line is not None:
        _write_error_file(_pending_line)
        _pending_line = None
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _write_error_file(line: str) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            with open(path, "w", encoding="utf-8") as f:
                json.dump({"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}, f)
        except OSError:
            pass  # the report keeps torchrun's default text; rank 0 printed the line anyway
