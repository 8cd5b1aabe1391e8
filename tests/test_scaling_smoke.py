"""CI smoke run of the scaling benchmark: ``bench/scaling.py --smoke`` on 2 CPU ranks (gloo, tiny shapes).

Runs the real command in a subprocess with a hard timeout and checks the table it writes: every method x
model x workload x size has a row, measured bytes equal the cost model's, Ulysses reports what it cannot
run, and the CPU banner says these are not performance numbers.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMOKE_TIMEOUT = 240  # seconds; the run takes ~30 s on 2 shared cores


@pytest.mark.timeout(SMOKE_TIMEOUT + 30)
def test_scaling_smoke_writes_table(tmp_path):
    out = tmp_path / "scaling-cpu-smoke"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           str(ROOT / "bench" / "scaling.py"), "--smoke", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)  # the smoke run uses the default (torch) backend on CPU
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=SMOKE_TIMEOUT)
    assert proc.returncode == 0, f"scaling smoke run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

    table = (out / "results.md").read_text()
    assert "CPU smoke, not a performance number" in table
    rows = list(csv.DictReader((out / "results.csv").open()))
    methods = {"megatron", "ulysses", "ring", "balanced", "no_overlap"}
    models = {"tiny-mha", "tiny-gqa", "tiny-odd"}
    assert {(r["method"], r["model"], r["workload"], r["tokens_per_rank"]) for r in rows} == {
        (m, mo, w, n) for m in methods for mo in models for w in ("attn", "layer") for n in ("32", "64")}
    for r in rows:
        if r["model"] == "tiny-odd" and r["method"] == "ulysses":
            assert r["status"].startswith("Ulysses cannot run heads_q=3 on 2 ranks"), r
            continue
        assert r["status"] == "ok", r
        assert r["bytes_match"] == "True", r
        assert float(r["time_ms"]) > 0
        assert f"| {r['model']} | {r['workload']} | {r['tokens_per_rank']} | {r['method']} | ok |" in table
    assert (out / "time.png").stat().st_size > 0 and (out / "bytes.png").stat().st_size > 0
