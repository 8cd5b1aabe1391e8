"""tests/dist_utils.run_distributed reports every failed rank's traceback and names the ranks that time out."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_utils import run_distributed  # noqa: E402


def _fail_differently(rank, world_size):
    raise ValueError(f"root cause on rank {rank}")


def _rank1_hangs(rank, world_size):
    if rank == 0:
        raise KeyError("rank 0 failed first")
    time.sleep(60)


def test_every_failed_rank_is_reported():
    with pytest.raises(RuntimeError, match=r"2 of 2 ranks failed \(ranks \[0, 1\]\)") as exc:
        run_distributed(_fail_differently, 2, timeout=60)
    text = str(exc.value)
    for rank in (0, 1):
        assert f"----- rank {rank} of 2 -----" in text and f"ValueError: root cause on rank {rank}" in text


def test_timed_out_ranks_are_named_with_the_others_errors():
    with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2 did not finish within 20 s") as exc:
        run_distributed(_rank1_hangs, 2, timeout=20)
    assert "----- rank 0 of 2 -----" in str(exc.value) and "KeyError: 'rank 0 failed first'" in str(exc.value)
