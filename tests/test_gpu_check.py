"""bench/gpu_check.sh, the one-command GPU check, proven on CPU: its ``--dry-run`` writes every file a GPU run writes,
and a part that fails or overruns its budget is recorded while the next part still runs."""
import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DRY_RUN_TIMEOUT_S = 570  # ~50 s of CPU, ~2 min on a loaded two-core machine; the driver's dry budgets sum to 560 s
PARTS = ("machine", "tier", "kernel", "checkpoint", "memory", "packed", "peers")
FILES = ["command.txt", "machine.md", "machine.json", "summary.md", "summary.json",
         "tier/log.txt", "tier/junit.xml",
         "kernel/log.txt", "kernel/kernel.md", "kernel/kernel.csv", "kernel/kernel_carry.csv",
         "checkpoint/log.txt", "checkpoint/checkpoint.md", "checkpoint/checkpoint.csv",
         "memory/job0.log", "memory/memory.md", "memory/memory.csv",
         "packed/log.txt", "packed/packed.md", "packed/packed.csv", "peers/log.txt", "peers/peers.md",
         "peers/peers.csv", "peers/tables.md"]
PLOTS = ["kernel/kernel.png", "checkpoint/checkpoint.png", "memory/memory.png"]


def _driver():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = subprocess.run(["bash", "bench/gpu_check.sh", str(out), "--dry-run"], cwd=ROOT, capture_output=True,
                          text=True, timeout=DRY_RUN_TIMEOUT_S, env=dict(os.environ, PYTHON=sys.executable))
    return out, proc


def test_dry_run_writes_every_file_and_every_part_passes(dry_run):
    out, proc = dry_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    try:
        import matplotlib  # noqa: F401
        expected = FILES + PLOTS
    except ImportError:  # plots degrade to tables
        expected = FILES
    empty = [f for f in expected if not (out / f).is_file() or (out / f).stat().st_size == 0]
    assert not empty, f"missing or empty: {empty}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "dry" and [r["part"] for r in summary["parts"]] == list(PARTS)
    assert all(r["status"] == "passed" for r in summary["parts"]), summary["parts"]
    table = (out / "summary.md").read_text()
    assert all(f"| {part} | passed |" in table for part in PARTS), table
    tier = next(r for r in summary["parts"] if r["part"] == "tier")
    assert "skipped" in tier["note"] and "failed" not in tier["note"], tier  # CUDA hidden: the tier skips
    assert "not a measurement" in (out / "memory" / "memory.md").read_text()
    packed = (out / "packed" / "packed.md").read_text()
    assert "a dry run, not a GPU measurement" in packed
    assert all(f"| {s} |" in packed for s in ("balanced", "zigzag", "placed")), packed
    with open(out / "peers" / "peers.csv", newline="") as f:  # the peers harness: distattn and a peer, exact
        peers = {r["system"]: r for r in csv.DictReader(f)}
    assert peers["distattn (zigzag)"]["status"] == "ok" and peers["distattn (zigzag)"]["exact"] == "True", peers
    assert peers["PyTorch CP (alltoall)"]["status"] == "ok", peers
    assert "bench/gpu_check.sh" in (out / "command.txt").read_text()
    assert (out / "install.txt").read_text().startswith("distattn imports from this checkout")


def test_a_failing_part_is_recorded_and_the_next_part_runs(tmp_path, monkeypatch):
    gc = _driver()
    python = sys.executable
    monkeypatch.setattr(gc, "kernel_cmd", lambda out, mode: [python, "-c", "print('kernel half done'); exit(3)"])
    # past its budget: interrupted first (a part writes what it has), killed if it goes on; a child it started that
    # ignores the interrupt is killed with it, even when the part itself ends on the interrupt
    pid_file = tmp_path / "grandchild.pid"
    deaf = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)"
    on_interrupt = (f"import subprocess, sys, time\nchild = subprocess.Popen([sys.executable, '-c', {deaf!r}])\n"
                    f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
                    "try: time.sleep(60)\nexcept KeyboardInterrupt: print('wrote what it had')")
    monkeypatch.setattr(gc, "checkpoint_cmd", lambda out, mode: [python, "-c", on_interrupt])
    monkeypatch.setattr(gc, "packed_cmd", lambda out, mode: [python, "-c", deaf])
    monkeypatch.setattr(gc, "tier_cmd", lambda out, mode: [python, "-c", "raise SystemExit(0)"])
    monkeypatch.setitem(gc.BUDGET_S["dry"], "checkpoint", 4)
    monkeypatch.setitem(gc.BUDGET_S["dry"], "packed", 4)

    def broken_memory(*args):
        raise OSError("disk full (simulated)")
    monkeypatch.setattr(gc, "memory_part", broken_memory)
    rc = gc.main([str(tmp_path), "--dry-run", "--parts", "tier", "kernel", "checkpoint", "memory", "packed"])
    assert rc == 1
    rows = {r["part"]: r for r in json.loads((tmp_path / "summary.json").read_text())["parts"]}
    assert {k: r["status"] for k, r in rows.items()} == {"tier": "passed", "kernel": "failed",
                                                         "checkpoint": "timeout", "memory": "failed",
                                                         "packed": "timeout"}
    kernel_error = (tmp_path / "kernel" / "error.txt").read_text()
    assert "exit status 3" in kernel_error and "kernel half done" in kernel_error
    checkpoint_error = (tmp_path / "checkpoint" / "error.txt").read_text()
    assert "interrupted 2 s before its budget of 4 s" in checkpoint_error and "wrote what it had" in checkpoint_error
    assert "killed: past its budget of 4 s" in (tmp_path / "packed" / "error.txt").read_text()
    memory_error = (tmp_path / "memory" / "error.txt").read_text()
    assert "Traceback" in memory_error and "OSError: disk full (simulated)" in memory_error
    assert rows["checkpoint"]["seconds"] < 30 and rows["packed"]["seconds"] < 30  # stopped at the budget
    assert not _running(int(pid_file.read_text())), "the part's child outlived it"


def _running(pid: int, wait_s: float = 5.0) -> bool:
    """Whether process ``pid`` still runs (a zombie waiting for its reaper does not) after up to ``wait_s``."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        if state in ("Z", "X") or time.monotonic() > deadline:
            return state not in ("Z", "X")
        time.sleep(0.1)


def test_the_budgets_keep_a_run_under_9_minutes_and_quick_under_4():
    """Each part is killed at its budget, so the budgets bound the run (plus seconds of driver overhead)."""
    budgets = _driver().BUDGET_S
    assert sum(budgets["full"].values()) <= 9 * 60 - 15, budgets["full"]
    assert sum(budgets["quick"].values()) <= 4 * 60 - 5, budgets["quick"]
    assert set(budgets["full"]) == set(budgets["quick"]) == set(budgets["dry"]) == set(PARTS)


def test_a_checkout_that_does_not_import_is_installed_in_place_or_the_run_says_why(monkeypatch):
    """A GPU machine given a copy of the tree has nothing installed (``distattn.kernels`` is the top-level
    ``kernels/`` folder): the driver installs this checkout in place, offline, and says so; if distattn still does
    not import from here, it raises with both answers."""
    gc = _driver()
    answers, calls = [(False, "No module named 'distattn.kernels'"), (True, "here")], []
    monkeypatch.setattr(gc, "_imports_this_checkout", lambda env: answers.pop(0))
    monkeypatch.setattr(gc.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or
                        subprocess.CompletedProcess(cmd, 0, "", ""))
    found = gc.ensure_this_checkout({})
    assert calls == [gc.INSTALL] and {"--no-build-isolation", "--no-deps", "--use-pep517"} <= set(gc.INSTALL)
    assert found.startswith("installed this checkout") and "No module named" in found and "here" in found
    answers[:] = [(False, "/elsewhere/distattn/__init__.py"), (False, "/elsewhere/distattn/__init__.py")]
    with pytest.raises(RuntimeError, match="does not import from this checkout"):
        gc.ensure_this_checkout({})


def test_the_driver_draws_without_importing_distattn(tmp_path):
    """The driver installs the checkout itself when distattn does not import (a bare GPU machine), and an install's
    import hook is read only when a process starts: so the driver never imports distattn. On the first GPU run its
    memory plot did (``distattn._plotstyle``), and the part failed after its two jobs had passed."""
    pytest.importorskip("matplotlib")
    script = f"""
import importlib.abc, importlib.util, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "distattn" or name.startswith("distattn."):
            raise ImportError("distattn is not importable in this process (a bare GPU machine's driver)")
sys.meta_path.insert(0, Refuse())
spec = importlib.util.spec_from_file_location("gpu_check", {str(ROOT / "bench" / "gpu_check.py")!r})
gc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gc)
row = dict(model="small", seq_len=16384, remat=False, measured_GiB=3.43, predicted_GiB=3.29, error_pct=4.1,
           cublas_MiB=64.0, note="")
gc.write_memory(gc.Path({str(tmp_path)!r}), [row], "full")
assert not any(m == "distattn" or m.startswith("distattn.") for m in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "memory.png").stat().st_size > 0 and "3.43" in (tmp_path / "memory.md").read_text()
