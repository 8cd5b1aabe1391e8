"""Every ```python block of README.md runs, as written, and its own asserts hold.

A block runs in this process unless an HTML comment on the line before it says otherwise:
``<!-- snippet: torchrun N -->`` runs it as a script under ``torchrun --standalone --nproc-per-node N`` (CPU,
gloo) in a subprocess with a hard timeout. The snippets are small enough that the whole file runs in well
under a minute; each one checks its own result (asserts against a single-device reference), so a zero exit
status means the documented code computes what the README says.
"""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
TORCHRUN_TIMEOUT_S = 150  # two ranks importing torch (+ transformers) on a shared two-core machine
_BLOCK = re.compile(r"(?:<!--\s*snippet:\s*(?P<marker>[^>]*?)\s*-->\s*\n)?```python\n(?P<code>.*?)^```",
                    re.S | re.M)


@dataclass(frozen=True)
class Snippet:
    line: int  # README line of the opening fence
    marker: str  # "" (in-process) or "torchrun N"
    code: str

    @property
    def ranks(self) -> int | None:
        match = re.fullmatch(r"torchrun (\d+)", self.marker)
        return int(match.group(1)) if match else None


def readme_snippets() -> list[Snippet]:
    text = README.read_text()
    out = []
    for m in _BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("code"))  # the fence's line number (1-based)
        out.append(Snippet(line=line, marker=m.group("marker") or "", code=m.group("code")))
    return out


SNIPPETS = readme_snippets()
IDS = [f"README.md:{s.line}" + (f"[{s.marker}]" if s.marker else "") for s in SNIPPETS]


def test_readme_has_the_snippets_we_expect():
    assert len(SNIPPETS) >= 3, f"found {len(SNIPPETS)} ```python blocks in {README}"
    assert README.read_text().count("```python") == len(SNIPPETS), "a ```python block was not parsed"
    for s in SNIPPETS:
        assert s.marker == "" or s.ranks is not None, f"README.md:{s.line}: unknown snippet marker {s.marker!r}"


@pytest.mark.parametrize("snippet", SNIPPETS, ids=IDS)
def test_snippet_checks_its_result_and_shows_how_to_launch(snippet):
    tree = ast.parse(snippet.code)
    checks = [n for n in ast.walk(tree) if isinstance(n, ast.Assert)
              or (isinstance(n, ast.Call) and "assert" in ast.unparse(n.func))]
    assert checks, f"README.md:{snippet.line}: the snippet asserts nothing, so running it proves nothing"
    if snippet.ranks is not None:
        assert "init_process_group" in snippet.code, f"README.md:{snippet.line}: no init_process_group line"
        assert re.search(r"torchrun --nproc-per-node \d+ \S+\.py", snippet.code), \
            f"README.md:{snippet.line}: the snippet does not show its launch command"


def _run_torchrun(path: Path, ranks: int) -> subprocess.CompletedProcess:
    """torchrun in its own session so that a timeout kills the launcher and every rank it started."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(path)]
    proc = subprocess.Popen(cmd, cwd=path.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TORCHRUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{path.name} did not finish within {TORCHRUN_TIMEOUT_S} s:\n{out}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


# The slow tier (tests/slow_tests.py) by kind rather than by id, since the ids carry README line numbers: every
# torchrun snippet but the first (4-7 s each on the 2-core machine) is slow; the first keeps torchrun in the fast tier.
_FIRST_TORCHRUN = next((i for i, s in enumerate(SNIPPETS) if s.ranks is not None), None)
RUNS = [pytest.param(s, id=i, marks=[pytest.mark.slow] if s.ranks is not None and n != _FIRST_TORCHRUN else [])
        for n, (s, i) in enumerate(zip(SNIPPETS, IDS))]


@pytest.mark.parametrize("snippet", RUNS)
def test_snippet_runs(snippet, tmp_path):
    if snippet.ranks is None:
        exec(compile(snippet.code, f"README.md:{snippet.line}", "exec"), {"__name__": "__readme__"})
        return
    script = tmp_path / f"readme_{snippet.line}.py"
    script.write_text(snippet.code)
    result = _run_torchrun(script, snippet.ranks)
    assert result.returncode == 0, f"README.md:{snippet.line} failed (exit {result.returncode}):\n{result.stdout}"
    for rank in range(snippet.ranks):  # every rank reached the snippet's last line (ranks' lines may interleave)
        assert f"rank {rank}: " in result.stdout, f"rank {rank} printed nothing:\n{result.stdout}"
