"""launch/train_lock.py: one job per --ckpt-dir.

In-process: a live holder (another process) is named, a SIGKILLed one's lock is taken over, a normal end
leaves no holder, a linked lock file is refused. End to end: a second torchrun job on a busy directory stops
on every rank before building its model; after the first job is SIGKILLed, a third takes its lock over.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_train import JOB, JOB_TIMEOUT_S, ROOT, TRAIN, _torchrun
from test_train_cli import assert_one_clean_error

sys.path.insert(0, str(ROOT / "launch"))

import train_lock  # noqa: E402
from train_config import UsageError  # noqa: E402

# A process that takes a lock and waits starts in well under a second; generous for a loaded machine.
LOCK_CHILD_TIMEOUT_S = 60


_HOLD = """import os, sys, time
sys.path.insert(0, sys.argv[1])
import train_lock
from pathlib import Path
train_lock.acquire(Path(sys.argv[2]), print)
print("locked", flush=True)
time.sleep(600)
"""


def test_lock_is_exclusive_and_a_dead_holders_is_taken_over(tmp_path):
    """A live holder (another process) is named; once it is SIGKILLed its lock is taken over, and said so; a
    job that ends normally leaves no holder; a linked lock file is refused."""
    lines = []
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(ROOT / "launch"), str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UsageError, match=rf"--ckpt-dir {re.escape(str(tmp_path))} is in use by another job "
                                             rf"\(pid {holder.pid} on host {re.escape(socket.gethostname())}, since"):
            train_lock.acquire(tmp_path, lines.append)
    finally:
        holder.kill()  # SIGKILL: no chance to release
        holder.communicate(timeout=LOCK_CHILD_TIMEOUT_S)
    try:
        assert train_lock.acquire(tmp_path, lines.append)
        assert f"taking over the lock of pid {holder.pid} on host" in lines[0] and "without releasing" in lines[0]
        assert json.loads((tmp_path / train_lock.LOCK_FILE).read_text())["pid"] == os.getpid()
        with pytest.raises(UsageError, match=f"in use by another job \\(pid {os.getpid()} "):
            train_lock.acquire(tmp_path, lines.append)  # a second open file of this process: refused alike
    finally:
        train_lock.release()
    assert (tmp_path / train_lock.LOCK_FILE).read_text() == ""
    assert train_lock.acquire(tmp_path, lines.append) and len(lines) == 1  # released: nothing taken over
    train_lock.release()
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / train_lock.LOCK_FILE).symlink_to(tmp_path / train_lock.LOCK_FILE)
    with pytest.raises(OSError):
        train_lock.acquire(linked, lines.append)


def _holder_pid(ckpt: Path, job: subprocess.Popen, err: Path) -> int:
    """The pid recorded in ``ckpt``'s lock once ``job`` holds it (fails if the job ends first)."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        text = (ckpt / train_lock.LOCK_FILE).read_text() if (ckpt / train_lock.LOCK_FILE).exists() else ""
        if text:
            return json.loads(text)["pid"]
        assert job.poll() is None, f"the first job ended (status {job.returncode})\n{err.read_text()[-3000:]}"
        time.sleep(0.2)
    pytest.fail(f"the first job did not lock {ckpt} in {JOB_TIMEOUT_S} s\n{err.read_text()[-3000:]}")


def _kill_job(job: subprocess.Popen) -> None:
    """SIGKILL a torchrun job: its workers (each in a session of its own, so not in torchrun's process group)
    first, then torchrun; returns once every one of them has ended."""
    workers = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(p) == job.pid]
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    os.killpg(job.pid, signal.SIGKILL)
    job.communicate()
    deadline = time.monotonic() + LOCK_CHILD_TIMEOUT_S
    while any(_alive(pid) for pid in workers):  # reaped by init once torchrun is gone
        assert time.monotonic() < deadline, f"workers {workers} still alive after SIGKILL"
        time.sleep(0.1)


def _ppid(proc: Path) -> int | None:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    """Running (a zombie has ended: its files, and so its locks, are closed)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_second_job_stops_at_once_and_a_killed_jobs_lock_is_taken_over(tmp_path):
    """Job A trains on --ckpt-dir; job B on the same directory stops before building its model, on every rank,
    with one line naming A's holder; A is SIGKILLed (rank 0 too: no release); job C takes the lock over, says
    so, trains and saves, and leaves no holder behind."""
    ckpt, err = tmp_path / "ckpt", tmp_path / "a.err"
    long = [*JOB, "--ckpt-dir", str(ckpt), "--no-progress"]
    long[long.index("--steps") + 1] = "100000"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(TRAIN), *long]
    with open(err, "w") as err_file:
        job_a = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                                 stderr=err_file, start_new_session=True)
    try:
        pid_a = _holder_pid(ckpt, job_a, err)
        short = [*JOB, "--ckpt-dir", str(ckpt)]
        short[short.index("--steps") + 1] = "2"
        rc, out, err_b = _torchrun(2, *short, "--resume")
        assert_one_clean_error("second job", rc, out, err_b,
                               f"--ckpt-dir {ckpt} is in use by another job (pid {pid_a} on host "
                               f"{socket.gethostname()}, since")
        assert job_a.poll() is None, "the first job must not notice the second"
    finally:
        _kill_job(job_a)  # every rank and torchrun, SIGKILL: the lock is never released
    assert json.loads((ckpt / train_lock.LOCK_FILE).read_text())["pid"] == pid_a  # left behind
    rc, _, err_c = _torchrun(2, *short)
    assert rc == 0, err_c[-4000:]
    assert (f"--ckpt-dir {ckpt}: taking over the lock of pid {pid_a} on host {socket.gethostname()}" in err_c
            and "which ended without releasing it" in err_c), err_c[-3000:]
    assert "saved checkpoint step 2" in err_c
    assert (ckpt / train_lock.LOCK_FILE).read_text() == ""  # C ended normally: released
