"""CI smoke run of the scaling benchmark: ``bench/scaling.py --smoke`` on 2 CPU ranks (gloo, tiny shapes).

Runs the real command in a subprocess with a hard timeout and checks the table it writes: every method x
model x workload x size has a row, measured bytes equal the cost model's, Ulysses reports what it cannot
run, and the CPU banner says these are not performance numbers. matplotlib is optional for the scripts (``[bench]``;
``[test]`` has it for tests/test_plots.py): the PNGs are checked where it is installed, and the no-matplotlib path
is tested directly.
When the run fails, every rank's full stderr is shown (torchrun writes each rank's output to its own file),
so the rank with the root cause is never cut off by its peers' "Connection closed by peer".
"""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SMOKE_TIMEOUT = 240  # seconds; the run takes ~30 s on 2 shared cores


@pytest.mark.timeout(SMOKE_TIMEOUT + 30)
def test_scaling_smoke_writes_table(tmp_path):
    out = tmp_path / "scaling-cpu-smoke"
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "--log-dir", str(logs), "--redirects", "3",  # each rank's stdout/stderr in its own file
           str(ROOT / "bench" / "scaling.py"), "--smoke", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)  # the smoke run uses the default (torch) backend on CPU
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=SMOKE_TIMEOUT)
    assert proc.returncode == 0, f"scaling smoke run failed (exit {proc.returncode}):\n{_every_rank(logs, proc)}"

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
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "time.png").stat().st_size > 0 and (out / "bytes.png").stat().st_size > 0


def _every_rank(logs: Path, proc) -> str:
    """Every rank's full stderr (and stdout), then torchrun's own output: the failing rank is never cut off."""
    parts = []
    for rank_dir in sorted(logs.glob("*/attempt_*/*"), key=lambda p: (str(p.parent), int(p.name))):
        for stream in ("stderr", "stdout"):
            text = (rank_dir / f"{stream}.log").read_text() if (rank_dir / f"{stream}.log").exists() else ""
            if text.strip():
                parts.append(f"----- rank {rank_dir.name} {stream} -----\n{text.rstrip()}")
    parts.append(f"----- torchrun stdout -----\n{proc.stdout.rstrip()}\n----- torchrun stderr -----\n"
                 f"{proc.stderr.rstrip()}")
    return "\n".join(parts)


def test_plots_skipped_without_matplotlib(tmp_path, monkeypatch, capsys):
    """No matplotlib: no PNG, one line saying the plot was skipped and how to get it; nothing raises."""
    from bench import scaling

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    row = {"model": "tiny-mha", "workload": "attn", "world": 2, "tokens_per_rank": 32, "method": "ring",
           "status": "ok", "time_ms": "1.0", "bytes_sent_max": 10}
    scaling.write_plots([row], tmp_path, cpu=True)
    assert list(tmp_path.iterdir()) == []
    note = capsys.readouterr().out.strip()
    assert len(note.splitlines()) == 1 and "skipped" in note and 'pip install -e ".[bench]"' in note


def test_smoke_output_never_in_committed_results():
    """--smoke defaults to the ignored runs/bench-smoke/ and refuses a folder inside bench/results/."""
    from bench import scaling

    assert Path(scaling._parse(["--smoke"]).out) == ROOT / "runs" / "bench-smoke" / "scaling"
    with pytest.raises(SystemExit) as exc:
        scaling._parse(["--smoke", "--out", str(ROOT / "bench" / "results" / "scaling-cpu-tiny")])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        scaling._parse([])  # a real run names its results folder
    if not torch.cuda.is_available():  # CPU: tiny defaults, never the GPU-sized shapes
        args = scaling._parse(["--out", "somewhere"])
        assert args.models == scaling.SMOKE["models"] and args.tokens_per_rank == scaling.SMOKE["tokens_per_rank"]
