"""``python -m bench.peers``: every system on every workload at each P, one row each, into ``bench/results/peers/``.

    python -m bench.peers --world 2 4 8 --tokens 64 --out bench/results/peers

Writes ``peers.csv`` (every field of every row), ``tables.md`` (one table per measure: ``bench.peers.tables``),
``peers.md`` (the table, the patches, the machine, the versions and the command) and ``machine.txt``. Each system x
workload runs in its own process group under ``--timeout`` seconds; a system that is not installed, refuses a
workload, crashes or hangs still has its row. Wall times are gloo on this machine's CPU cores (labelled CPU): compare
them within one run only.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.metadata
import os
import platform
import sys
import time
from pathlib import Path

from bench.peers.adapters import ADAPTERS
from bench.peers.harness import FIELDS, run_one
from bench.peers.patches import PATCHES
from bench.peers.tables import tables
from bench.peers.workload import WORKLOADS

_PACKAGES = ("torch", "deepspeed", "megatron-core", "yunchang", "triton")


def _args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, nargs="+", default=[2, 4, 8], help="P values")
    p.add_argument("--tokens", type=int, default=64, help="tokens per rank")
    p.add_argument("--systems", nargs="+", default=list(ADAPTERS), choices=list(ADAPTERS))
    p.add_argument("--workloads", nargs="+", default=None, help="workload names (default: all)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per system x workload")
    p.add_argument("--reps", type=int, default=3, help="timed calls after the measured one")
    p.add_argument("--out", default="bench/results/peers")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the ranks share this machine's GPUs over gloo, CUDA tensors (issue 37's GPU part)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    return p.parse_args(argv)


def _versions() -> dict[str, str]:
    out = {}
    for name in _PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def _kib(x):
    return "" if x is None else f"{x / 1024:.1f}"


def _err(row):
    errs = [e for e in (row.err_out, row.err_dq, row.err_dk, row.err_dv) if e is not None]
    return f"{max(errs):.1e}" if errs else ""


def markdown(rows, workloads, command: str, machine: str, versions: dict, device: str = "cpu") -> str:
    where = ("gloo over CPU; wall times labelled CPU" if device == "cpu" else
             "the ranks share the GPU(s), joined by gloo with CUDA tensors; wall times are the shared GPU's")
    live = "live CPU bytes" if device == "cpu" else "the CUDA caching allocator's allocated bytes"
    clock = "CPU" if device == "cpu" else "GPU"
    lines = ["# distattn and its peers on the same work (issue 37)", "",
             f"Command: `{command}`", "", f"Machine: {machine} ({where})", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()), "", "Workloads:", ""]
    lines += [f"- `{w.name}` P={w.world}: {w.describe()}" for w in workloads]
    lines += ["", "Per rank, the largest rank: bytes sent (forward + backward, KiB; the one counter: "
              "torch.distributed and functional collectives, ring convention), saved activations (KiB, inputs "
              "excluded), peak rise of " + live + " over forward + backward (KiB), work = visible (q, k) pairs x "
              "heads of the busiest rank / mean (1.00 = perfect balance), max error of out/dq/dk/dv vs fp64, exact = "
              "within 2x plain PyTorch's error.", "",
              "| P | workload | system | status | exact | max err | sent KiB | saved KiB | peak KiB | balance | "
              f"{clock} ms/call | calls | note |", "|" + "---|" * 13]
    for r in rows:
        exact = "" if r.exact is None else ("yes" if r.exact else "NO")
        bal = "" if r.balance is None else f"{r.balance:.2f}"
        ms = "" if r.wall_ms is None else f"{r.wall_ms:.1f}"
        note = (r.note or r.crosscheck).replace("|", "/")[:160]
        lines.append(f"| {r.world} | {r.workload} | {r.system} | {r.status} | {exact} | {_err(r)} | "
                     f"{_kib(r.sent_max)} | {_kib(r.saved_max)} | {_kib(r.peak_max)} | {bal} | {ms} | {r.calls} | "
                     f"{note} |")
    lines += ["", "Patches (bench/peers/patches.py; each tested by tests/test_peers.py):", ""]
    lines += [f"- `{k}`: {v}" for k, v in PATCHES.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = _args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.peers " + " ".join(sys.argv[1:] if argv is None else argv)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, {platform.platform()}"
    try:
        from bench._util import cpu_name
        machine = f"{cpu_name()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    except Exception:  # noqa: BLE001 - the plain description stays
        pass
    if args.device == "cuda":
        import torch
        gpus = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                if torch.cuda.is_available() else ["no CUDA device"])
        machine = f"{len(gpus)} x {gpus[0]}; {machine}"
    rows, workloads = [], []
    for world in args.world:
        for w in WORKLOADS(world, args.tokens, args.dtype):
            if args.workloads and w.name not in args.workloads:
                continue
            workloads.append(w)
            for system in args.systems:
                t0 = time.monotonic()
                row = run_one(system, w, timeout=args.timeout, reps=args.reps, device=args.device)
                rows.append(row)
                # after every row: a stopped run keeps its rows
                _write(out, rows, workloads, command, machine, args.device)
                print(f"P={world} {w.name:14s} {row.system:22s} {row.status:13s} exact={row.exact} "
                      f"sent={row.sent_max} peak={row.peak_max} ({time.monotonic() - t0:.0f} s) {row.note[:80]}",
                      flush=True)
    _write(out, rows, workloads, command, machine, args.device)
    print(f"wrote {out}/peers.csv, peers.md, machine.txt")
    return 0


def _write(out: Path, rows, workloads, command: str, machine: str, device: str = "cpu") -> None:
    with open(out / "peers.csv", "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=FIELDS)
        wr.writeheader()
        wr.writerows(dataclasses.asdict(r) for r in rows)
    with open(out / "peers.csv", newline="") as f:
        (out / "tables.md").write_text(tables(list(csv.DictReader(f))))
    versions = _versions()
    (out / "peers.md").write_text(markdown(rows, workloads, command, machine, versions, device))
    (out / "machine.txt").write_text(f"{machine}\n{command}\n" + "\n".join(f"{k} {v}" for k, v in versions.items())
                                     + "\n")


if __name__ == "__main__":
    sys.exit(main())
