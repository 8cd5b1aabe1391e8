"""CPU attention, forward + backward of one causal head: torch reference vs the CPU default (sdpa) vs plain SDPA.

    python bench/cpu_attention.py --lens 4096 8192 16384 32768 --head-dim 64 128 --out bench/results/cpu-attention

One process, one run, side by side: ``distattn.flash_attn_func`` with ``backend="torch"`` (the reference, tiled
over queries and keys), with the CPU default (``backend=None``: ``sdpa``, PyTorch's fused CPU flash op per
piece + fp32 merge), and ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` with autograd.
Shape ``(1, s, 1, d)`` fp32. The machine may be shared: the table states the CPU model, the thread count and the
load average before and after, and uses ``--reps`` repetitions (best of). On a loaded shared machine run it with
``OMP_NUM_THREADS=1``: two OpenMP threads spin-waiting against other jobs were 10-30x slower.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import distattn  # noqa: E402
from bench._util import cpu_name  # noqa: E402


def _env_prefix() -> str:
    """The thread setting the run used (one thread avoids OpenMP spin-waits against other jobs on a shared box)."""
    n = os.environ.get("OMP_NUM_THREADS")
    return f"OMP_NUM_THREADS={n} " if n else ""


def _fwd_bwd(kind: str, q, k, v, dout) -> None:
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    if kind == "sdpa_plain":  # F.sdpa takes (b, h, s, d)
        out = F.scaled_dot_product_attention(qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2),
                                             is_causal=True).transpose(1, 2)
    else:
        out = distattn.flash_attn_func(qg, kg, vg, causal=True, backend="torch" if kind == "torch" else None)
    out.backward(dout)


def _time(kind, q, k, v, dout, reps) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        _fwd_bwd(kind, q, k, v, dout)
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--max-ref-len", type=int, default=1 << 30, help="skip the torch reference above this length")
    ap.add_argument("--out", default=None, help="folder for table.md (default: print only)")
    args = ap.parse_args(argv)

    kinds = [("torch", "torch reference"), ("default", "CPU default (sdpa)"), ("sdpa_plain", "F.sdpa")]
    load0 = os.getloadavg()
    head = (f"CPU: {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} "
            f"threads; fp32, batch 1, 1 head, causal, forward + backward, best of {args.reps}")
    lines = [head, f"load average at start: {load0[0]:.1f} {load0[1]:.1f} {load0[2]:.1f}", "",
             "| d | tokens | " + " | ".join(f"{label} (s)" for _, label in kinds) + " | reference / default | "
             "default / F.sdpa |", "|---|---|" + "---|" * (len(kinds) + 2)]
    print("\n".join(lines), flush=True)
    g = torch.Generator().manual_seed(0)
    _fwd_bwd("default", *(torch.randn(1, 256, 1, 64, generator=g) for _ in range(4)))  # warm up the op paths
    for d in args.head_dim:
        for s in args.lens:
            q, k, v, dout = (torch.randn(1, s, 1, d, generator=g) for _ in range(4))
            t = {}
            for kind, _ in kinds:
                skip = kind == "torch" and s > args.max_ref_len
                t[kind] = float("nan") if skip else _time(kind, q, k, v, dout, args.reps)
            row = (f"| {d} | {s} | " + " | ".join(f"{t[kd]:.2f}" for kd, _ in kinds)
                   + f" | {t['torch'] / t['default']:.1f}x | {t['default'] / t['sdpa_plain']:.2f}x |")
            lines.append(row)
            print(row, flush=True)
    load1 = os.getloadavg()
    cmd = " ".join(argv if argv is not None else sys.argv[1:])
    lines += ["", f"load average at end: {load1[0]:.1f} {load1[1]:.1f} {load1[2]:.1f}",
              f"command: {_env_prefix()}python bench/cpu_attention.py {cmd}"]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "table.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
    print("\n".join(lines[-3:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
