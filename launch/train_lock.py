"""One job per ``--ckpt-dir``: an exclusive lock that rank 0 of ``launch/train.py`` holds for the job's life.

``<ckpt-dir>/.lock`` is locked with ``flock``. The kernel releases the lock when the holding process ends,
however it ends (a crash, SIGKILL), so a lock left by a dead job is never mistaken for a live one: the next job
simply takes it. The file holds the holder's host, pid and start time, for the messages only: a second job is
told who has the directory, and a job that takes over a lock whose holder ended without releasing it (a crash,
or a job killed) says so. The file is never deleted (deleting a lock file lets two processes lock two different
files of one name); a job that ends normally empties it (:func:`release`).

A file system without ``flock`` (some Lustre mounts, FUSE) cannot protect the directory: the job is told so
and runs unprotected, as it did before the lock existed. On NFS, ``flock`` is the server's byte-range lock.

Every rank learning rank 0's outcome is ``train_ckpt.lock``'s agreement.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from train_config import UsageError

LOCK_FILE = ".lock"
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
_held: list = []  # the open lock files: closing one releases its lock, so they live until release()


class DirectoryBusy(UsageError):
    """Another live job holds the checkpoint directory's lock."""


def _holder(f) -> dict | None:
    """The holder recorded in the open lock file (``None``: empty or not ours)."""
    f.seek(0)
    try:
        info = json.loads(f.read() or "null")
    except ValueError:
        return None
    return info if isinstance(info, dict) else None


def describe(info: dict | None) -> str:
    if not info:
        return "holder not recorded yet"
    return f"pid {info.get('pid')} on host {info.get('host')}, since {info.get('since')}"


def acquire(ckpt_dir: Path, log) -> bool:
    """Lock ``ckpt_dir`` for this process's life (or until :func:`release`); ``False`` if its file system has
    no locks (logged). Raises ``DirectoryBusy`` naming the holder if another live process has it, ``OSError``
    if the lock file cannot be opened (a symbolic link is refused)."""
    path = ckpt_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    f = os.fdopen(fd, "r+", encoding="utf-8")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(f)
        f.close()
        raise DirectoryBusy(f"--ckpt-dir {ckpt_dir} is in use by another job ({describe(holder)}; lock file "
                            f"{path}); wait for that job to end, stop it, or pass another --ckpt-dir") from None
    except OSError as exc:
        f.close()
        if exc.errno not in _UNSUPPORTED:
            raise
        log(f"warning: --ckpt-dir {ckpt_dir}: its file system has no file locks ({exc.strerror}); nothing stops "
            f"a second job from writing there at the same time")
        return False
    previous = _holder(f)
    if previous:
        log(f"--ckpt-dir {ckpt_dir}: taking over the lock of {describe(previous)}, which ended without releasing "
            f"it (crashed or killed)")
    me = {"host": socket.gethostname(), "pid": os.getpid(),
          "since": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    f.seek(0)
    f.truncate()
    f.write(json.dumps(me))
    f.flush()
    _held.append(f)
    return True


def release() -> None:
    """Empty and unlock every lock this process holds (a job ending normally: the next one sees no holder)."""
    while _held:
        f = _held.pop()
        f.seek(0)
        f.truncate()
        f.close()  # closing the descriptor releases the flock
