"""bench/overlap.py's trace arithmetic (the GPU run itself needs NCCL and a GPU; the CPU run writes traces)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from overlap import overlap_of  # noqa: E402


def _k(name, ts, dur):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_hidden_fraction_counts_nccl_time_under_compute_kernels():
    events = [_k("ncclDevKernel_SendRecv", 0, 10), _k("_fwd_kernel", 5, 10), _k("ncclDevKernel_SendRecv", 20, 10),
              _k("_bwd_dkdv", 18, 4), {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100}]
    got = overlap_of(events)
    # nccl [0, 10) + [20, 30) = 20 us; under compute: [5, 10) and [20, 22) = 7 us
    assert got == {"nccl_us": 20, "compute_us": 14, "hidden_fraction": 7 / 20, "kernels": 4}


def test_no_communication_no_fraction():
    assert overlap_of([_k("_fwd_kernel", 0, 5)])["hidden_fraction"] is None
    # overlapping nccl kernels on two streams count once
    two = overlap_of([_k("nccl a", 0, 10), _k("nccl b", 5, 10), _k("attn", 0, 15)])
    assert two["nccl_us"] == 15 and two["hidden_fraction"] == 1.0
