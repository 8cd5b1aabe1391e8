"""What ``launch/train.py`` shows: rank 0's progress line, per-step JSON records, the final summary.

Progress goes to stderr (one line rewritten in place on a terminal; a new line every ``log_every`` steps
otherwise, so logs stay readable). The JSON summary goes to stdout and is the last line the job prints.
"""

from __future__ import annotations

import json
import resource
import shutil
import sys
import time
from pathlib import Path

import torch

from train_config import UsageError


def peak_memory_bytes(device_type: str) -> int:
    """This process's peak memory: CUDA allocator peak on GPU, peak resident set size on CPU."""
    if device_type == "cuda":
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def human_bytes(n: float) -> str:
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit in ("B", "K") else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_count(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


class Progress:
    """Rank 0's progress bar on stderr: step, loss, tokens/s, per-rank peak memory, ETA."""

    def __init__(self, total_steps: int, first_step: int, enabled: bool, log_every: int, mem_label: str,
                 plain: bool = False):
        """``plain`` (``--no-progress``): no bar and no rewritten line, a plain line every ``log_every`` steps."""
        self.total = total_steps
        self.enabled = enabled
        self.plain = plain
        self.tty = sys.stderr.isatty() and not plain
        self.log_every = log_every or max(1, (total_steps - first_step) // 20)
        self.mem_label = mem_label
        self.first_step = first_step
        self.start = time.perf_counter()
        self._last_len = 0
        self.eval_loss: float | None = None  # the latest held-out loss, shown from then on

    def update(self, step: int, loss: float, tokens_per_s: float, peak_mem: list[int],
               eval_loss: float | None = None) -> None:
        if eval_loss is not None:
            self.eval_loss = eval_loss
        if not self.enabled:
            return
        done = step - self.first_step
        elapsed = time.perf_counter() - self.start
        eta = elapsed / max(done, 1) * (self.total - step)
        width = 20
        filled = int(width * step / self.total)
        mem = _per_rank(peak_mem)
        bar = "step" if self.plain else f"[{'#' * filled}{'.' * (width - filled)}]"
        held_out = f" eval {self.eval_loss:.4f}" if self.eval_loss is not None else ""
        line = (f"{bar} {step}/{self.total} loss {loss:.4f}{held_out} | "
                f"{human_count(tokens_per_s)} tok/s | {self.mem_label} {mem} | {_clock(elapsed)}<{_clock(eta)}")
        if self.tty:
            line = line[:shutil.get_terminal_size().columns - 1]  # a wrapped line cannot be rewritten with \r
            pad = " " * max(0, self._last_len - len(line))
            sys.stderr.write("\r" + line + pad)
            self._last_len = len(line)
            if step == self.total:
                sys.stderr.write("\n")
                self._last_len = 0
        elif step % self.log_every == 0 or step == self.total or done == 1:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        """End the rewritten line (a run that stops before its last step)."""
        if self.enabled and self.tty and self._last_len:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self._last_len = 0


def _per_rank(peak_mem: list[int]) -> str:
    """Every rank's peak up to 8 ranks; beyond that the extremes (the line must fit a terminal)."""
    if len(peak_mem) <= 8:
        return " ".join(f"r{r}:{human_bytes(m)}" for r, m in enumerate(peak_mem))
    hi = max(range(len(peak_mem)), key=peak_mem.__getitem__)
    lo = min(range(len(peak_mem)), key=peak_mem.__getitem__)
    return f"max r{hi}:{human_bytes(peak_mem[hi])} min r{lo}:{human_bytes(peak_mem[lo])}"


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m:d}:{s:02d}" if m < 60 else f"{m // 60:d}:{m % 60:02d}:{s:02d}"


def check_json_log(path: str | None) -> None:
    """``--log-json FILE``: its folder is created and the file opens for appending. Every rank, before the process
    group exists, so a bad path is one ``train.py: error:`` line, not rank 0's traceback after the model is built."""
    if path is None:
        return
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8"):  # append: a resumed job's records stay
            pass
    except OSError as exc:
        why = f"{exc.filename} is not a folder" if isinstance(exc, FileExistsError) else exc.strerror or exc
        raise UsageError(f"--log-json {path} cannot be written ({why}); pass a file in a writable folder") from exc


class JsonLog:
    """One JSON object per line per step (rank 0); appends when the job resumes.

    When appending, steps at or below the last step already in the file (logged by an attempt that crashed
    after its last checkpoint) are written again with ``"redone": true``.
    """

    def __init__(self, path: str | None, append: bool):
        self.logged_up_to = _last_step(path) if path and append else 0
        self.f = open(path, "a" if append else "w", encoding="utf-8") if path else None
        if self.f is not None and self.f.tell() > 0 and not _ends_with_newline(path):
            self.f.write("\n")  # a record torn by a crash stays alone on its line

    def write(self, record: dict) -> None:
        if self.f is not None:
            if record["step"] <= self.logged_up_to:
                record = {**record, "redone": True}
            self.f.write(json.dumps(record) + "\n")
            self.f.flush()

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"


def _last_step(path: str) -> int:
    """The highest ``step`` in an existing JSON log (0 if none); a torn last line is ignored."""
    last = 0
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    last = max(last, int(json.loads(line)["step"]))
                except (ValueError, KeyError, TypeError):
                    continue
    except FileNotFoundError:
        pass
    return last


def print_summary(summary: dict) -> None:
    """The job's last line: a JSON object on stdout."""
    sys.stderr.flush()
    print(json.dumps(summary), flush=True)
