"""Kernel benchmark: distattn's Triton FlashAttention vs torch SDPA backends and flash-attn, on one GPU.

Not a test. Measures TFLOP/s of forward, backward and forward+backward (bf16, head dims 64 and 128, causal
and not, 16k tokens per batch: batch = 16384 // seqlen, seqlen 1k..32k), side by side in one run:
  * ``distattn``      distattn.flash_attn_func(..., backend="triton") (autograd, fp32 grad accumulators)
  * ``sdpa-flash``    torch SDPA forced to FLASH_ATTENTION   (torch.nn.attention.sdpa_kernel)
  * ``sdpa-cudnn``    torch SDPA forced to CUDNN_ATTENTION
  * ``sdpa-efficient``torch SDPA forced to EFFICIENT_ATTENTION
  * ``flash-attn``    flash_attn.flash_attn_func, when importable
plus the carrying cost: one 32k causal sequence whose keys are folded into the carried state as 1, 2, 4, 8
chunks (forward: fold_ per chunk; backward: backward_chunk_ per chunk).

FLOPs (the convention of every distattn benchmark: useful work only): 4 * b * h * s_q * s_k * d for the
forward, x0.5 when causal, x2.5 for the backward.
Heads: h = 2048 // d (model width 2048). Timing: triton.testing.do_bench (median of its repetitions).

Usage:
    python bench/kernel.py                       # GPU: full sweep -> bench/results/kernel/{kernel.md,csv,png}
    python bench/kernel.py --out DIR --seqlens 1024 4096 --head-dims 128
    python bench/kernel.py --smoke               # CPU (no CUDA): tiny size through TRITON_INTERPRET=1,
                                                 # proves the script works; NOT a performance number;
                                                 # writes runs/bench-smoke/kernel/ (ignored by git)
Without matplotlib the tables are written and kernel.png is skipped (one line says so).
"""
import argparse
import csv
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before distattn decorates its Triton kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import distattn  # noqa: E402
from bench._util import cpu_name, pyplot_or_note, smoke_out  # noqa: E402
from distattn import kernels  # noqa: E402
from distattn._plotstyle import figure_legend, style as plot_style, tight_with_legend  # noqa: E402

MODEL_WIDTH = 2048
TOTAL_TOKENS = 16384
SMOKE_LABEL = "CPU smoke, not a performance number"


def flops(b, h, s_q, s_k, d, causal, mode):
    fwd = 4 * b * h * s_q * s_k * d * (0.5 if causal else 1.0)
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd+bwd": 3.5 * fwd}[mode]


def time_ms(fn, grad_to_none=None, smoke=False):
    """Median milliseconds of fn(): do_bench on CUDA; one timed call after one warm-up on CPU."""
    if not smoke:
        import triton.testing

        return triton.testing.do_bench(fn, grad_to_none=grad_to_none, return_mode="median")
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


# ----------------------------------------------------------------------------- implementations

def _sdpa(backend_name):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def attn(q, k, v, causal):
        with sdpa_kernel([backend]):
            # (b, s, h, d) viewed as (b, h, s, d): unit stride in d, no copy
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
        return o.transpose(1, 2)
    return attn


def implementations(smoke):
    impls = {"distattn": lambda q, k, v, causal: distattn.flash_attn_func(q, k, v, causal=causal, backend="triton")}
    if smoke:
        return impls
    impls["sdpa-flash"] = _sdpa("FLASH_ATTENTION")
    impls["sdpa-cudnn"] = _sdpa("CUDNN_ATTENTION")
    impls["sdpa-efficient"] = _sdpa("EFFICIENT_ATTENTION")
    try:
        from flash_attn import flash_attn_func as fa_func

        impls["flash-attn"] = lambda q, k, v, causal: fa_func(q, k, v, causal=causal)
    except ImportError:
        pass
    return impls


def bench_one(attn, b, s, h, d, causal, dtype, device, smoke):
    """TFLOP/s for fwd, bwd, fwd+bwd of one implementation at one shape."""
    q, k, v = (torch.randn(b, s, h, d, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, s, h, d, dtype=dtype, device=device)
    ms = {"fwd": time_ms(lambda: attn(q, k, v, causal), smoke=smoke)}
    out = attn(q, k, v, causal)
    ms["bwd"] = time_ms(lambda: out.backward(dout, retain_graph=True), grad_to_none=[q, k, v], smoke=smoke)

    def fwd_bwd():
        attn(q, k, v, causal).backward(dout)
    ms["fwd+bwd"] = time_ms(fwd_bwd, grad_to_none=[q, k, v], smoke=smoke)
    return {mode: flops(b, h, s, s, d, causal, mode) / (t * 1e-3) / 1e12 for mode, t in ms.items()}


def bench_carry(s, h, d, n_chunks, dtype, device, smoke):
    """One causal sequence, keys folded in n_chunks: TFLOP/s of the chunked forward and backward."""
    be = kernels.get_backend("triton", device)
    q, k, v, dout = (torch.randn(1, s, h, d, dtype=dtype, device=device) for _ in range(4))
    scale = d ** -0.5
    bounds = [(i * s // n_chunks, (i + 1) * s // n_chunks) for i in range(n_chunks)]
    out_f32 = torch.zeros(q.shape, dtype=torch.float32, device=device)
    lse = torch.empty(1, h, s, dtype=torch.float32, device=device)
    out = torch.empty_like(q)

    def fwd():
        for i, (j0, j1) in enumerate(bounds):
            be.fold_(out_f32, lse, q, k[:, j0:j1], v[:, j0:j1], scale=scale, q_start=0, k_start=j0, causal=True,
                     fresh=i == 0, out_final=out if i == n_chunks - 1 else None)
    fwd()
    delta = be.delta(dout, out)
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=device) for t in (q, k, v))

    def bwd():
        for j0, j1 in bounds:
            be.backward_chunk_(dout, q, k[:, j0:j1], v[:, j0:j1], lse, delta, dq, dk[:, j0:j1], dv[:, j0:j1],
                               scale=scale, q_start=0, k_start=j0, causal=True)
    ms = {"fwd": time_ms(fwd, smoke=smoke), "bwd": time_ms(bwd, smoke=smoke)}
    return {mode: flops(1, h, s, s, d, True, mode) / (t * 1e-3) / 1e12 for mode, t in ms.items()}


# ----------------------------------------------------------------------------- reporting

def machine(smoke):
    import triton

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({cpu_name()})"
    fa = "absent"
    try:
        import flash_attn

        fa = flash_attn.__version__
    except ImportError:
        pass
    head = f"**{SMOKE_LABEL}.** " if smoke else ""
    return (f"{head}Machine: {dev}; torch {torch.__version__}, triton {triton.__version__}, flash-attn {fa}, "
            f"CUDA {torch.version.cuda}.")


def write_outputs(out_dir: Path, rows, carry_rows, smoke, setup: str):
    out_dir.mkdir(parents=True, exist_ok=True)
    fields = ["impl", "head_dim", "causal", "seqlen", "batch", "heads", "fwd", "bwd", "fwd+bwd"]
    with open(out_dir / "kernel.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields + ["note"])
        w.writeheader()
        w.writerows(rows)
    with open(out_dir / "kernel_carry.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["chunks", "seqlen", "heads", "head_dim", "fwd", "bwd"])
        w.writeheader()
        w.writerows(carry_rows)

    lines = ["# Kernel benchmark (TFLOP/s)", "", machine(smoke), "",
             f"FLOPs: 4*b*h*s*s*d forward, x0.5 causal, x2.5 backward. {setup}", "",
             "| impl | d | causal | seqlen | batch | fwd | bwd | fwd+bwd | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r[c]) for c in
                                       ["impl", "head_dim", "causal", "seqlen", "batch", "fwd", "bwd", "fwd+bwd",
                                        "note"]) + " |")
    lines += ["", "## Carrying cost: one causal sequence, keys folded as n chunks (distattn triton)", "",
              "| chunks | seqlen | heads | d | fwd | bwd |", "|---|---|---|---|---|---|"]
    for r in carry_rows:
        lines.append("| " + " | ".join(fmt(r[c]) for c in ["chunks", "seqlen", "heads", "head_dim", "fwd", "bwd"])
                     + " |")
    (out_dir / "kernel.md").write_text("\n".join(lines) + "\n")
    plot(out_dir / "kernel.png", rows, smoke)


def fmt(x) -> str:
    """How a value appears everywhere (table and console): TFLOP/s to 3 significant digits."""
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def flops_rate(tflops) -> str:
    """A rate given in TFLOP/s, in the unit that shows it as 1..999 (the CPU smoke run: kFLOP/s or MFLOP/s)."""
    if not isinstance(tflops, float):
        return str(tflops)  # "n/a"
    for unit, scale in (("TFLOP/s", 1.0), ("GFLOP/s", 1e3), ("MFLOP/s", 1e6), ("kFLOP/s", 1e9)):
        if tflops * scale >= 1:
            return f"{tflops * scale:.3g} {unit}"
    return f"{tflops * 1e12:.3g} FLOP/s"


def _rates(row, modes) -> str:
    """``fwd 12.3 TFLOP/s, bwd 4.56 TFLOP/s`` (a mode that did not run shows ``n/a``)."""
    return ", ".join(f"{m} {flops_rate(row[m])}" for m in modes)


def row_line(row) -> str:
    """One console line per measurement, with units (the table has the same numbers)."""
    shape = (f"{row['impl']:<14s} d={row['head_dim']} {'causal' if row['causal'] else 'non-causal'} "
             f"seqlen={row['seqlen']} tokens, batch {row['batch']}, {row['heads']} heads")
    return f"{shape}: " + (f"not run ({row['note']})" if row["note"] else _rates(row, ("fwd", "bwd", "fwd+bwd")))


def carry_line(row) -> str:
    """One console line per carrying-cost measurement, with units."""
    return (f"carry: {row['seqlen']} causal tokens, {row['heads']} heads, d={row['head_dim']}, keys folded as "
            f"{row['chunks']} chunk(s): {_rates(row, ('fwd', 'bwd'))}")


def plot(path, rows, smoke):
    """kernel.png: a panel per (head dim, causal), a line per implementation in its fixed style, one legend."""
    plt = pyplot_or_note(str(path))
    if plt is None:
        return

    panels = sorted({(r["head_dim"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.6), squeeze=False)
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    for ax, (d, causal) in zip(axes[0], panels):
        for impl in impls:
            pts = [(r["seqlen"], r["fwd+bwd"]) for r in rows if (r["head_dim"], r["causal"], r["impl"]) ==
                   (d, causal, impl) and isinstance(r["fwd+bwd"], float)]
            if pts:
                ax.plot(*zip(*pts), label=impl, gid=impl, **plot_style(impl))
        seqlens = sorted({r["seqlen"] for r in rows})
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
        ax.set_xticks(seqlens, [str(s) for s in seqlens])
        ax.set_title(f"d={d}, {'causal' if causal else 'non-causal'}: forward + backward", fontsize=9)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel("TFLOP/s")
    figure_legend(fig, axes.flat, title="implementation")
    fig.suptitle(machine(smoke).replace("**", ""), fontsize=8)
    tight_with_legend(fig, 0.8)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- main

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None,
                   help="output folder (md, csv, png); default bench/results/kernel, or runs/bench-smoke/kernel "
                        "for --smoke (a smoke run never writes into bench/results/)")
    # Defaults (None): the GPU sweep below, or the smoke run's tiny sizes; given explicitly they apply to either.
    p.add_argument("--seqlens", type=int, nargs="+", default=None, help="default 1024 2048 ... 32768")
    p.add_argument("--head-dims", type=int, nargs="+", default=None, help="default 64 128")
    p.add_argument("--carry-seqlen", type=int, default=None, help="default 32768")
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8], help="carrying cost: key chunks folded")
    p.add_argument("--smoke", action="store_true", help=f"tiny CPU run through the interpreter ({SMOKE_LABEL})")
    args = p.parse_args(argv)

    smoke = args.smoke or not torch.cuda.is_available()
    if smoke:
        device, dtype, total = "cpu", torch.float32, 64  # the interpreter's bf16 tl.dot is not exact
        seqlens, head_dims, carry_s, heads_for = args.seqlens or [32, 64], args.head_dims or [16], \
            args.carry_seqlen or 64, (lambda d: 2)
    else:
        device, dtype, total = "cuda", torch.bfloat16, TOTAL_TOKENS
        seqlens, head_dims = args.seqlens or [1024, 2048, 4096, 8192, 16384, 32768], args.head_dims or [64, 128]
        carry_s, heads_for = args.carry_seqlen or 32768, (lambda d: MODEL_WIDTH // d)
    try:
        out_dir = smoke_out("kernel", args.out) if smoke else Path(args.out or "bench/results/kernel")
    except ValueError as exc:
        p.error(str(exc))
    print(machine(smoke))

    setup = (f"{str(dtype)[6:]}; {total} tokens per batch (batch = tokens // seqlen); "
             f"heads = {heads_for(head_dims[0]) if smoke else f'{MODEL_WIDTH} // d'}.")
    # The carrying cost first (a few launches): a sweep stopped early by a time budget still leaves it.
    carry_rows, carry_d = [], head_dims[-1]
    for n in args.chunks:
        r = bench_carry(carry_s, heads_for(carry_d), carry_d, n, dtype, device, smoke)
        carry_rows.append({"chunks": n, "seqlen": carry_s, "heads": heads_for(carry_d), "head_dim": carry_d, **r})
        print(carry_line(carry_rows[-1]), flush=True)

    rows = []
    for d in head_dims:
        for causal in (False, True):
            for s in seqlens:
                b, h = max(1, total // s), heads_for(d)
                for name, attn in implementations(smoke).items():
                    row = {"impl": name, "head_dim": d, "causal": causal, "seqlen": s, "batch": b, "heads": h,
                           "fwd": "n/a", "bwd": "n/a", "fwd+bwd": "n/a", "note": ""}
                    try:
                        row.update(bench_one(attn, b, s, h, d, causal, dtype, device, smoke))
                    except Exception as exc:  # an SDPA backend that rejects a shape is a table entry, not a crash
                        row["note"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
                    if device == "cuda":
                        torch.cuda.empty_cache()
                    rows.append(row)
                    print(row_line(row), flush=True)
            write_outputs(out_dir, rows, carry_rows, smoke, setup)  # so far: a run stopped early keeps them

    write_outputs(out_dir, rows, carry_rows, smoke, setup)
    print(f"wrote {out_dir}/kernel.md, kernel.csv, kernel_carry.csv, kernel.png")


if __name__ == "__main__":
    main()
