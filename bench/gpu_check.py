"""One command for a GPU lent for 30 minutes: the GPU test tier, then every GPU measurement, into one folder.

    bash bench/gpu_check.sh OUT [--quick] [--dry-run]

Parts, in order; each runs as a subprocess with its own time budget (seconds: full / --quick), its output streamed to
the console with a ``[part]`` prefix and to ``OUT/<part>/log.txt``. A part that fails or runs past its budget is
recorded (``OUT/<part>/error.txt``: the exit status and the log's tail, or the driver's traceback) and the next
part runs; a part at its budget is first interrupted (SIGINT: pytest then prints its summary and writes its junit
file), then killed. The budgets add up to under 9 minutes (--quick: under 4), compile time included. They were set
from the first GPU run (H200, 2026-12-04, ``bench/results/gpu-2026-12-04/``): there the serial tier ran 35 of its 61
tests in 220 s, the kernel table needed ~90 s, checkpoint 42 s, memory 43 s, peers' three installed systems 32 s,
and packed had not finished its first schedule at 30 s. Kernel, checkpoint, packed and peers write their tables as
they go, so a part stopped at its budget keeps what it measured:

  machine     10 / 10   OUT/machine.md: nvidia-smi, torch.cuda.get_device_properties, versions, the command
  tier       175 / 70   ``pytest -m gpu -n 4`` over the GPU-tier files (4 workers: the tier is bound by Triton's
                        compiles, on the CPU): OUT/tier/junit.xml, the 30 slowest tests in its log (every part:
                        OUT/<part>/log.txt) (--quick: 16k/32k-token kernel cases, autotune and the planner's 32k job
                        left out)
  kernel      95 / 40   bench/kernel.py: distattn vs SDPA flash/cuDNN/efficient (flash-attn if installed), fwd, bwd,
                        fwd+bwd TFLOP/s, bf16, d 64/128, causal and not, 1k-32k (quick: d 128, 2k/16k), and the
                        carrying overhead, keys folded as 1 vs 8 chunks: OUT/kernel/kernel.{md,csv,png},
                        kernel_carry.csv
  checkpoint  50 / 30   bench/checkpoint.py: remat vs HF full-layer checkpointing, LLaMA-7B-shaped layers, one GPU,
                        8k/16k/32k tokens (quick: 8k/16k, 2 layers): OUT/checkpoint/checkpoint.{md,csv,png}
  memory      50 / 25   launch/train.py one-GPU jobs: distattn.memory's predicted peak vs the allocator's measured
                        peak (torch.cuda.max_memory_allocated): OUT/memory/memory.{md,csv,png}
  packed     100 / 40   bench/packed_time.py (issue 39): one packed long-tail batch, 4 ranks sharing the GPU over
                        gloo (CUDA tensors), LLaMA-3-8B heads, bf16, forward + backward per call under balanced,
                        zigzag and placed, beside the per-pair timeline's modelled ratio (quick: 2048 tokens per rank,
                        full: 4096): OUT/packed/packed.{md,csv}
  peers       45 / 20   python -m bench.peers --device cuda (issue 37): distattn beside the peers installed on the
                        machine, the same harness as on CPU with the ranks sharing the GPU over gloo (CUDA tensors),
                        bf16, LLaMA-3-8B heads, P = 4, 512 tokens per rank, dense causal, 20 s a row (quick: P = 2,
                        256 tokens, distattn and PyTorch CP, 10 s a row): OUT/peers/peers.{md,csv}, tables.md

First, distattn must import from this checkout (``OUT/install.txt``): a GPU machine given a copy of the tree has
nothing installed, and ``distattn.kernels`` lives in the top-level ``kernels/`` folder (setup.py's mapping), so the
checkout is installed in place when it does not (``pip install --no-deps --no-build-isolation --use-pep517 -e .``,
offline).
Then OUT/summary.md and OUT/summary.json: each part's status (passed / failed / timeout), seconds and budget.
Never needs the network. ``--dry-run`` runs the same parts on CPU with tiny stand-ins (CUDA hidden; the Triton
interpreter, gloo, tiny sizes; the tier's tests then skip) to prove the command end to end: NOT measurements.
Without matplotlib the tables are written and the plots are skipped (the part's log says so).
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import importlib.util
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench._util from a checkout

from bench._util import pyplot_or_note  # noqa: E402

PARTS = ("machine", "tier", "kernel", "checkpoint", "memory", "packed", "peers")
BUDGET_S = {"full": {"machine": 10, "tier": 175, "kernel": 95, "checkpoint": 50, "memory": 50, "packed": 100,
                     "peers": 45},
            "quick": {"machine": 10, "tier": 70, "kernel": 40, "checkpoint": 30, "memory": 25, "packed": 40,
                      "peers": 20},
            # dry run: ~50 s of CPU in all; these only stop a hang on a loaded machine (CI's pytest limit: 600 s)
            "dry": {"machine": 40, "tier": 100, "kernel": 100, "checkpoint": 90, "memory": 80, "packed": 90,
                    "peers": 60}}
TIER_WORKERS = 4  # pytest-xdist workers on a GPU: the tier is bound by Triton's compiles (CPU), and 16 cores share it
# issue 37's GPU part: the systems in the order they run (a part stopped at its budget keeps the rows it wrote; a
# peer that is not installed on the GPU machine, or refuses the work (ring-flash-attn: ranks sharing a GPU over gloo),
# is a row at no cost: no process starts), and each row's deadline (the P ranks' start, CUDA set-up, imports)
PEERS_SYSTEMS = ("distattn-zigzag", "torch-cp-alltoall", "deepspeed-ulysses", "distattn-2d", "megatron-core", "usp",
                 "ring-flash-attn")
PEERS_ROW_S = {"full": 20, "quick": 10, "dry": 50}
QUICK_TIER_EXCLUDE = "not s16384 and not s32768 and not autotune and not planner"
# (model preset, seq len, --remat) of the memory part's one-GPU jobs; CPU stand-in: tiny, one short job
MEMORY_JOBS = {"full": [("small", 16384, False), ("small", 32768, True)], "quick": [("small", 16384, True)],
               "dry": [("tiny", 128, True)]}
DRY_LABEL = "dry run on CPU (tiny stand-ins), not a measurement"


# ----------------------------------------------------------------------------- running one part

def run_logged(cmd: list[str], log: Path, budget_s: float, env: dict, prefix: str) -> tuple[str, int | None]:
    """Run ``cmd`` in its own session; stream its output to the console (``prefix``) and ``log``.
    Returns ``("passed" | "failed" | "timeout", exit status)``. ``grace_s(budget_s)`` before the budget ends the whole
    session gets SIGINT, so that a part can still write what it has (pytest prints its summary, failures' tracebacks
    and durations, and writes the junit file, on an interrupt; the first GPU run's tier lost them to SIGKILL); what
    still runs at the budget is killed."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w", encoding="utf-8") as fh:
        fh.write(f"$ {shlex.join(cmd)}\n")
        fh.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", start_new_session=True)

        def pump():
            for line in proc.stdout:
                fh.write(line)
                fh.flush()
                print(f"[{prefix}] {line}", end="", flush=True)
        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        grace = grace_s(budget_s, prefix)
        try:
            rc = proc.wait(timeout=budget_s - grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)  # the part and every process it started: write what you have
            try:
                proc.wait(timeout=grace)
                what = f"interrupted {grace:g} s before its budget of {budget_s:g} s"
            except subprocess.TimeoutExpired:
                what = f"killed: past its budget of {budget_s:g} s"
            with contextlib.suppress(ProcessLookupError):  # what is left of the part never runs beside the next
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            reader.join(5)
            fh.write(f"\n--- {what}\n")
            return "timeout", None
        reader.join(5)
    return ("passed" if rc == 0 else "failed"), rc


def grace_s(budget_s: float, part: str = "") -> float:
    """Seconds between a part's interrupt and its kill: a tenth of its budget, 2 to 15 s (at most half of it); the
    tier's 15 s (pytest-xdist's controller took ~8 s from an interrupt to its summary and junit file)."""
    return min(15.0, budget_s / 2) if part == "tier" else min(15.0, max(2.0, budget_s / 10), budget_s / 2)


def record_failure(part_dir: Path, status: str, rc, log: Path | None, exc: BaseException | None = None) -> None:
    """``part_dir/error.txt``: what failed, and the traceback or the last lines of the part's log."""
    part_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"status: {status}" + (f" (exit status {rc})" if rc is not None else "")]
    if exc is not None:
        lines += ["", "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))]
    if log is not None and log.is_file():
        lines += ["", f"last lines of {log.name}:", *log.read_text(errors="replace").splitlines()[-60:]]
    (part_dir / "error.txt").write_text("\n".join(lines) + "\n")


# ----------------------------------------------------------------------------- the parts

def part_env(mode: str) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if mode == "dry":
        env.update(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    return env


def tier_files() -> list[str]:
    """The test files holding GPU-tier tests (``pytest -m gpu`` selects the tests inside them)."""
    return [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "tests").glob("test_*.py"))
            if "mark.gpu" in p.read_text(encoding="utf-8")]


def tier_cmd(out: Path, mode: str) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-rA", "--timeout", "150", "-p", "no:cacheprovider",
           "--durations", "30", f"--junitxml={out / 'junit.xml'}", *tier_files()]
    cmd += [] if mode == "dry" else ["-n", str(TIER_WORKERS)]
    return cmd + (["-k", QUICK_TIER_EXCLUDE] if mode == "quick" else [])


def kernel_cmd(out: Path, mode: str) -> list[str]:
    base = [sys.executable, "bench/kernel.py", "--out", str(out), "--chunks", "1", "8"]
    if mode == "dry":
        return base + ["--smoke", "--seqlens", "32", "--carry-seqlen", "32"]
    if mode == "quick":
        return base + ["--seqlens", "2048", "16384", "--head-dims", "128", "--carry-seqlen", "16384"]
    return base + ["--seqlens", "1024", "4096", "16384", "32768", "--head-dims", "64", "128", "--carry-seqlen", "32768"]


def checkpoint_cmd(out: Path, mode: str) -> list[str]:
    base = [sys.executable, "bench/checkpoint.py", "--out", str(out), "--variants", "hf,remat", "--warmup", "1"]
    if mode == "dry":
        return base + ["--smoke", "--tokens", "64", "--steps", "1"]
    if mode == "quick":
        return base + ["--tokens", "8192", "16384", "--layers", "2", "--steps", "2"]
    return base + ["--tokens", "8192", "16384", "32768", "--layers", "4", "--steps", "3"]


def packed_cmd(out: Path, mode: str) -> list[str]:
    base = [sys.executable, "bench/packed_time.py", "--out", str(out), "--world", "4", "--docs", "longtail:2048",
            "--timeout", str(BUDGET_S[mode]["packed"])]
    if mode == "dry":
        return base + ["--device", "cpu", "--tokens-per-rank", "64", "--heads", "4", "2", "--head-dim", "16",
                       "--reps", "1"]
    return base + ["--tokens-per-rank", "2048" if mode == "quick" else "4096", "--reps", "2"]


def peers_cmd(out: Path, mode: str) -> list[str]:
    base = [sys.executable, "-m", "bench.peers", "--out", str(out), "--workloads", "llama3-gqa"]
    if mode == "dry":
        return base + ["--device", "cpu", "--world", "2", "--tokens", "16", "--systems", "distattn-zigzag",
                       "torch-cp-alltoall", "--timeout", str(PEERS_ROW_S[mode]), "--reps", "1"]
    gpu = ["--device", "cuda", "--dtype", "bfloat16", "--timeout", str(PEERS_ROW_S[mode])]
    if mode == "quick":
        return base + gpu + ["--world", "2", "--tokens", "256", "--reps", "2", "--systems", *PEERS_SYSTEMS[:2]]
    return base + gpu + ["--world", "4", "--tokens", "512", "--reps", "3", "--systems", *PEERS_SYSTEMS]


def memory_part(out: Path, mode: str, budget_s: float, env: dict) -> tuple[str, int | None]:
    """One-rank ``launch/train.py`` jobs; their summaries give the measured and the predicted peak per rank."""
    rows, status, rc, start = [], "passed", 0, time.monotonic()
    for i, (model, seq, remat) in enumerate(MEMORY_JOBS[mode]):
        device = ["--device", "cpu", "--dtype", "fp32"] if mode == "dry" else ["--device", "cuda"]
        cmd = [sys.executable, "launch/train.py", *device, "--model", model, "--seq-len", str(seq), "--batch-size",
               "1", "--steps", "2", "--no-progress", "--ckpt-dir", str(out / f"ckpt{i}")]
        cmd += ["--remat"] if remat else []
        left = budget_s - (time.monotonic() - start)
        job_status, rc = run_logged(cmd, out / f"job{i}.log", max(left, 1.0), env, "memory")
        row = {"model": model, "seq_len": seq, "remat": remat, "measured_GiB": "", "predicted_GiB": "",
               "error_pct": "", "cublas_MiB": "", "note": job_status}
        summary = _job_summary(out / f"job{i}.log") if job_status == "passed" else None
        if summary is None and job_status == "passed":
            job_status = "failed"  # finished without its JSON summary line
        if summary is not None:
            measured, predicted = max(summary["peak_mem_bytes"]), summary["predicted_peak_bytes"]
            row.update(measured_GiB=measured / 2**30, predicted_GiB=predicted / 2**30,
                       error_pct=100 * (measured - predicted) / predicted,
                       cublas_MiB=summary.get("measured_cublas_workspace_bytes", -1) / 2**20,
                       note=DRY_LABEL + "; measured is peak RSS" if mode == "dry" else "")
        else:
            status = job_status
        rows.append(row)
    write_memory(out, rows, mode)
    return status, rc


def _job_summary(log: Path) -> dict | None:
    """The JSON summary line train.py prints last on stdout (its stderr is interleaved in the log)."""
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if line.startswith("{") and "predicted_peak_bytes" in line:
            return json.loads(line)
    return None


def write_memory(out: Path, rows: list[dict], mode: str) -> None:
    fields = ["model", "seq_len", "remat", "measured_GiB", "predicted_GiB", "error_pct", "cublas_MiB", "note"]
    with open(out / "memory.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["# Peak memory per rank: distattn.memory's prediction vs the measured peak", "",
             f"**{DRY_LABEL}.**" if mode == "dry" else
             "launch/train.py on one GPU, 2 steps, batch 1; measured: torch.cuda.max_memory_allocated; cublas_MiB: "
             "what the cuBLAS workspaces hold of it (the model leaves them to the reserve; negative: not measurable "
             "on this torch).", "",
             "| " + " | ".join(fields) + " |", "|" + "---|" * len(fields)]
    lines += ["| " + " | ".join(fmt(r.get(f, "")) for f in fields) + " |" for r in rows]
    (out / "memory.md").write_text("\n".join(lines) + "\n")
    plt = pyplot_or_note(str(out / "memory.png"))
    if plt is None:
        return
    plot_color = _plotstyle().color

    done = [r for r in rows if isinstance(r["measured_GiB"], float)]
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = [f"{r['model']} {r['seq_len']}{' remat' if r['remat'] else ''}" for r in done]
    x = range(len(done))
    ax.bar([i - 0.2 for i in x], [r["predicted_GiB"] for r in done], 0.4, label="predicted", gid="predicted",
           color=plot_color("predicted"))
    ax.bar([i + 0.2 for i in x], [r["measured_GiB"] for r in done], 0.4, label="measured", gid="measured",
           color=plot_color("measured"))
    ax.set_xticks(list(x), labels)
    ax.set(ylabel="GiB per rank", title=DRY_LABEL if mode == "dry" else "peak memory: predicted vs measured")
    ax.legend()
    fig.savefig(out / "memory.png", dpi=120, bbox_inches="tight")
    plt.close(fig)


def _plotstyle():
    """``distattn/_plotstyle.py`` loaded by its path: importing it as ``distattn._plotstyle`` would run
    ``distattn/__init__`` (torch, and ``distattn.kernels``, which this process cannot find when it installed the
    checkout itself: the install's import hook is read only at a process's start; seen on the first GPU run)."""
    spec = importlib.util.spec_from_file_location("_distattn_plotstyle", ROOT / "distattn" / "_plotstyle.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def machine_part(out: Path, mode: str, command: str, env: dict) -> tuple[str, int | None]:
    """OUT/machine.md: the GPU (nvidia-smi, device properties), the versions, the command."""
    probe = ("import json, platform, torch, triton, transformers; p = torch.cuda.get_device_properties(0) "
             "if torch.cuda.is_available() else None; print(json.dumps({'python': platform.python_version(), "
             "'torch': torch.__version__, 'cuda': torch.version.cuda, 'triton': triton.__version__, "
             "'transformers': transformers.__version__, 'device': str(p) if p else 'no CUDA device (CPU)', "
             "'capability': list(torch.cuda.get_device_capability(0)) if p else None}))")
    res = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    if res.returncode:
        raise RuntimeError(f"probing the versions failed:\n{res.stderr[-3000:]}")
    info = json.loads(res.stdout.strip().splitlines()[-1])
    smi = _run_quiet(["nvidia-smi"]) if mode != "dry" else "(dry run: CUDA hidden)"
    commit = _run_quiet(["git", "-C", str(ROOT), "rev-parse", "HEAD"]).strip()
    if _run_quiet(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"]) != "(no output)":
        commit += " (with uncommitted changes)"
    lines = ["# Machine", "", f"Command: `{command}`", f"Mode: {mode}" + (f" ({DRY_LABEL})" if mode == "dry" else ""),
             f"Host: {platform.node()}; {platform.platform()}", f"distattn commit: {commit}", ""]
    lines += [f"- {k}: {v}" for k, v in info.items()]
    lines += ["", "## nvidia-smi", "", "```", smi.rstrip(), "```"]
    (out / "machine.md").write_text("\n".join(lines) + "\n")
    (out / "machine.json").write_text(json.dumps({**info, "command": command, "mode": mode,
                                                         "commit": commit}, indent=1) + "\n")
    print("\n".join(lines[:5 + len(info) + 2]), flush=True)
    return "passed", 0


_WHERE = ("import os, distattn, distattn.kernels as k; "
          "print(os.path.realpath(distattn.__file__)); print(os.path.realpath(k.__file__))")
# --use-pep517: without it an older pip (the H200 image's on 2026-12-04; 23.0.1 reproduces it) runs the legacy
# ``setup.py develop``, which new setuptools turns into a second pip call that builds in isolation: the network
INSTALL = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--use-pep517", "-e",
           str(ROOT)]


def _imports_this_checkout(env: dict) -> tuple[bool, str]:
    """Whether ``distattn`` and its kernels import from this checkout in the parts' environment, and from where."""
    res = subprocess.run([sys.executable, "-c", _WHERE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    if res.returncode:
        return False, (res.stderr.strip().splitlines() or ["(no error text)"])[-1]
    paths = res.stdout.strip().splitlines()[-2:]
    root = os.path.realpath(ROOT)
    return all(p.startswith(root + os.sep) for p in paths), ", ".join(paths)


def ensure_this_checkout(env: dict) -> str:
    """Every part imports distattn from this checkout. setup.py maps ``distattn.kernels`` to the top-level
    ``kernels/`` folder, so a checkout on PYTHONPATH alone cannot import the kernels (a GPU machine given a copy of
    the tree has nothing installed), and an install of another tree would measure other code: then this checkout is
    installed in place (``pip install --no-deps --no-build-isolation --use-pep517 -e .``: no network, the machine's
    own torch and build tools). Returns what was found or done; raises ``RuntimeError`` if distattn still does not
    import from here."""
    ok, where = _imports_this_checkout(env)
    if ok:
        return f"distattn imports from this checkout ({where})"
    res = subprocess.run(INSTALL, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    ok, after = _imports_this_checkout(env)
    if not ok:
        raise RuntimeError(f"distattn does not import from this checkout ({where}); `{shlex.join(INSTALL)}` "
                           f"(exit status {res.returncode}) did not fix it: {after}\n{res.stderr[-2000:]}")
    return f"installed this checkout ({shlex.join(INSTALL[2:])}): before, {where}; now {after}"


def _run_quiet(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout or "(no output)"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"({cmd[0]} unavailable: {exc})"


# ----------------------------------------------------------------------------- driver

def pytest_counts(log: Path) -> str:
    """pytest's closing tally (``3 passed, 2 skipped in 9.1s``) from its log, or what the log says so far."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    for line in reversed(text.splitlines()):
        if line.startswith("=") and (" passed" in line or " failed" in line or " skipped" in line or
                                     " error" in line or "no tests ran" in line):
            return line.strip("= ")
    done = {k: text.count(f" {k.upper()}") for k in ("passed", "failed", "skipped", "error")}
    return "unfinished: " + ", ".join(f"{v} {k}" for k, v in done.items() if v) if any(done.values()) else ""


def run_part(name: str, out: Path, mode: str, command: str, env: dict) -> dict:
    """Run one part; never raises: a failure is recorded in OUT/<name>/error.txt and in the returned row."""
    budget = BUDGET_S[mode][name]
    part_dir, log = out / name, out / name / "log.txt"
    start = time.monotonic()
    status, rc, exc = "failed", None, None
    try:
        if name == "machine":
            status, rc = machine_part(out, mode, command, env)
        elif name == "memory":
            part_dir.mkdir(parents=True, exist_ok=True)
            status, rc = memory_part(part_dir, mode, budget, env)
            log = None
        else:
            make = {"tier": tier_cmd, "kernel": kernel_cmd, "checkpoint": checkpoint_cmd, "packed": packed_cmd,
                    "peers": peers_cmd}[name]
            status, rc = run_logged(make(part_dir, mode), log, budget, env, name)
    except Exception as error:  # noqa: BLE001 - recorded, and the next part runs
        exc = error
    row = {"part": name, "status": status, "seconds": round(time.monotonic() - start, 1), "budget_s": budget,
           "note": pytest_counts(log) if name == "tier" else ""}
    if status != "passed":
        record_failure(part_dir, status, rc, log if log is not None and log.is_file() else None, exc)
        row["note"] = (row["note"] + "; " if row["note"] else "") + f"see {name}/error.txt"
    return row


def write_summary(out: Path, rows: list[dict], mode: str, command: str, total_s: float) -> None:
    (out / "summary.json").write_text(json.dumps({"command": command, "mode": mode, "seconds": round(total_s, 1),
                                                  "parts": rows}, indent=1) + "\n")
    lines = ["# GPU check", "", f"Command: `{command}`" + (f" — **{DRY_LABEL}**" if mode == "dry" else ""),
             f"Wall time: {total_s:.0f} s (budget {sum(r['budget_s'] for r in rows)} s). Machine: machine.md.", "",
             "| part | status | seconds | budget (s) | note |", "|---|---|---|---|---|"]
    lines += [f"| {r['part']} | {r['status']} | {r['seconds']:g} | {r['budget_s']} | {r['note']} |" for r in rows]
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", help="output folder (created; files of an earlier run there are overwritten)")
    p.add_argument("--quick", action="store_true", help="the subset budgeted under 4 minutes")
    p.add_argument("--dry-run", action="store_true", help=f"CPU, tiny stand-ins ({DRY_LABEL})")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="run only these parts")
    args = p.parse_args(argv)
    mode = "dry" if args.dry_run else "quick" if args.quick else "full"
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["bash", "bench/gpu_check.sh", *(argv if argv is not None else sys.argv[1:])])
    (out / "command.txt").write_text(command + "\n")
    env, rows, start = part_env(mode), [], time.monotonic()
    try:
        found = ensure_this_checkout(env)
    except Exception as exc:  # noqa: BLE001 - nothing can run: say why, in the summary too
        found = f"FAILED: {exc}"
    (out / "install.txt").write_text(found + "\n")
    print(f"=== gpu_check: {found}", flush=True)
    parts = [name for name in PARTS if name in args.parts]
    for i, name in enumerate(parts, 1):
        print(f"=== gpu_check {i}/{len(parts)}: {name} (budget {BUDGET_S[mode][name]} s, mode {mode})", flush=True)
        rows.append(run_part(name, out, mode, command, env))
        print(f"=== {name}: {rows[-1]['status']} in {rows[-1]['seconds']:g} s {rows[-1]['note']}", flush=True)
        write_summary(out, rows, mode, command, time.monotonic() - start)  # a killed run still leaves a summary
    print((out / "summary.md").read_text(), flush=True)
    return 0 if all(r["status"] == "passed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
