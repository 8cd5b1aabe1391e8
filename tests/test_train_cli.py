"""launch/train.py's command line as a user meets it under torchrun: help once, errors in one line.

Every failure a user can cause (a bad flag, a missing file, an unusable --ckpt-dir, --resume must with
nothing to resume, a checkpoint of another model) ends every rank with exit status 2 and one
``train.py: error:`` line from rank 0, and no rank prints a traceback. torchrun still prints its own
failure report (~40 lines for 2 ranks; a worker cannot switch it off), whose root cause then names the
reason too. Jobs that fail before the process group exists run side by side (a few seconds each).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from test_train import JOB, ROOT, TRAIN, _torchrun

# One reason line + torchrun's report (~40 lines at 2 ranks); any rank's traceback would add 50+.
MAX_ERROR_LINES = 60
PREFLIGHT_TIMEOUT_S = 120  # ~5 s each when the machine is idle; six run at once on 2 cores


def _root_cause_exit_2(err: str) -> bool:
    """torchrun's report says the first worker to fail exited with status 2, and quotes our reason."""
    parts = err.split("Root Cause (first observed failure):", 1)
    return len(parts) == 2 and re.search(r"exitcode\s*: 2 ", parts[1]) is not None \
        and "traceback : train.py: error:" in parts[1]


def _start(args, env_extra=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(TRAIN),
           "--device", "cpu", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _assert_one_clean_error(name, rc, out, err, reason):
    lines = (out + err).splitlines()
    reasons = [line for line in lines if line.startswith("train.py: error:")]
    assert rc != 0, name
    assert len(reasons) == 1, f"{name}: expected one reason line (rank 0's), got {reasons}\n{err[-3000:]}"
    assert reason in reasons[0], f"{name}: {reasons[0]}"
    # The first rank to exit had status 2; torchrun may stop the others (SIGTERM) before they exit alike.
    assert _root_cause_exit_2(err), f"{name}: root cause not exit status 2\n{err[-3000:]}"
    assert "[rank" not in err and err.count("Traceback") <= 1, f"{name}: a rank printed a traceback\n{err}"
    assert len(lines) <= MAX_ERROR_LINES, f"{name}: {len(lines)} lines\n{err}"
    assert "[train] model" not in err, f"{name}: should fail before the model is built"


def test_preflight_errors_are_one_line_and_exit_2(tmp_path):
    """Each fault fails before step 1 (before the process group even exists), side by side."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    save = ["--steps", "2", "--save-every", "1", "--seq-len", "256"]
    cases = {
        "bad flag": (["--bogus"], {}, "unrecognized arguments: --bogus (see --help)"),
        "missing data": (["--data", str(tmp_path / "none.txt")], {}, f"--data {tmp_path / 'none.txt'}: no such file"),
        "unwritable ckpt dir": ([*save, "--ckpt-dir", str(afile / "ckpt")], {},
                                f"--ckpt-dir {afile / 'ckpt'} is not writable (Not a directory)"),
        "read-only ckpt dir": ([*save, "--ckpt-dir", str(tmp_path / "ro")], {"DISTATTN_CKPT_READ_ONLY": "1"},
                               "is not writable (Read-only file system)"),
        "full ckpt dir": ([*save, "--ckpt-dir", str(tmp_path / "full")], {"DISTATTN_CKPT_FREE_BYTES": "1000000"},
                          "has 1.0 MB free but one checkpoint of this model needs about 10."),
        "resume must, nothing": (["--resume=must", "--ckpt-dir", str(tmp_path / "typo")], {},
                                 f"--resume must: nothing to resume in --ckpt-dir {tmp_path / 'typo'} "
                                 f"(the directory does not exist)"),
    }
    procs = {name: (_start(args, env), time.monotonic()) for name, (args, env, _) in cases.items()}
    try:
        for name, (proc, t0) in procs.items():
            out, err = proc.communicate(timeout=PREFLIGHT_TIMEOUT_S)
            _assert_one_clean_error(name, proc.returncode, out, err, cases[name][2])
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    assert not (tmp_path / "full").exists() or not any((tmp_path / "full").iterdir())  # no probe left behind


def test_help_prints_once():
    proc = _start(["--help"])
    out, err = proc.communicate(timeout=PREFLIGHT_TIMEOUT_S)
    assert proc.returncode == 0, err
    assert out.count("usage: train.py") == 1 and "--resume [{auto,must}]" in out  # rank 0 only
    plain = subprocess.run([sys.executable, str(TRAIN), "--help"], capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0 and plain.stdout.count("usage: train.py") == 1


def test_resume_of_another_model_is_one_line_and_exit_2(tmp_path):
    """After the process group exists: DCP's size mismatch becomes one line on rank 0, status 2 everywhere."""
    ckpt = tmp_path / "ckpt"
    args = list(JOB)
    args[args.index("--steps") + 1] = "2"
    rc, _, err = _torchrun(2, *args, "--ckpt-dir", str(ckpt))
    assert rc == 0, err[-4000:]
    rc, out, err = _torchrun(2, *args, "--ckpt-dir", str(ckpt), "--resume", "--model", "tiny-gqa")
    lines = (out + err).splitlines()
    reasons = [line for line in lines if line.startswith("train.py: error:")]
    assert rc != 0 and len(reasons) == 1, err[-4000:]
    assert f"checkpoint {ckpt / 'step_00000002'} does not fit this model" in reasons[0]
    assert "Size mismatch" in reasons[0] and "resume with the --model it was trained with" in reasons[0]
    assert _root_cause_exit_2(err) and "[rank" not in err and len(lines) <= MAX_ERROR_LINES, err


def test_resume_with_nothing_warns_and_starts_fresh(tmp_path):
    """Plain --resume on an empty directory: a warning naming it, then training from step 0."""
    args = list(JOB)
    args[args.index("--steps") + 1] = "1"
    rc, out, err = _torchrun(2, *args, "--ckpt-dir", str(tmp_path / "empty"), "--resume")
    assert rc == 0, err[-4000:]
    assert (f"warning: --resume: no checkpoint to resume in --ckpt-dir {tmp_path / 'empty'} "
            f"(it holds no finished checkpoint); starting from step 0") in err
