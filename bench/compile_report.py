"""Compile every Triton kernel config for Hopper (sm_90a) on a CPU-only machine and report what ptxas made of it.

    python bench/compile_report.py                      # every config of every kernel (slow: run it by hand)
    python bench/compile_report.py --quick              # the configs the launcher may pick, d 64/128 (CI)
    python bench/compile_report.py --d 128 --dtypes bf16 --out bench/results/compile-sm90/d128.md

No GPU is needed: ``triton.compile`` targets ``GPUTarget("cuda", 90, 32)`` and runs the bundled ptxas. The
arguments are the launcher's own: ``kernels._triton.TritonBackend`` is called on ``meta`` tensors of a real shape
(b=1, s=4096, 32 query heads) with the kernel objects replaced by recorders, so the specialization (pointer
alignment 16, strides divisible by 16, constexprs HEAD_DIM, BLOCK_D, MASK, SOFTCAP, FRESH/LAST, DOT_PREC, GROUP=1
for MHA) is exactly what a launch would compile; then each autotune config (BLOCK_M, BLOCK_N, num_warps,
num_stages) is added.

Per compiled config the table gives: registers per thread, spill stores/loads (bytes, ptxas -v), shared memory,
the MMA instruction of every product (``wgmma m64nNk16``, ``mma.sync`` or FMA; found by the PTX ``.loc`` line of
each instruction), and ``i32 offs``: int32 multiplications of a sequence or head stride by a non-constant in
the TTIR, i.e. ``rows * stride`` or ``head * stride`` that wraps at 2^31 (must be 0). ``kept``: the launcher's
config filter (``_triton._keep_config``) keeps it on a 227 KB (sm_90) device at a 4096-token bucket.

The ``--quick`` summary line: ``configs=N spilling=S narrow_mma=W int32_offsets=I`` (narrow: some product of a
2-byte config uses ``wgmma`` with N < 64 or falls back to ``mma.sync``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch

SMEM_SM90 = 232448  # bytes of shared memory per block (opt-in) on H100/H200
SEQ, H_Q = 4096, 32
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ATTN_KERNELS = ("fwd", "dq", "dkdv")


def sm90_unavailable() -> str:
    """Why this Triton cannot compile for sm_90 here ('' when it can)."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        make_backend(GPUTarget("cuda", 90, 32))
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(90).path
        if not os.path.exists(path):
            return f"ptxas not found at {path}"
    except Exception as exc:  # no nvidia backend, no ptxas, an API this script does not know
        return f"triton {getattr(sys.modules.get('triton'), '__version__', '?')} cannot target sm_90: {exc}"
    return ""


# ----------------------------------------------------------------------------- the launcher's real arguments

class _Recorder:
    """Stands in for a kernel: ``rec[grid](*args, **kw)`` records the call instead of launching it."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((self.name, args, kw))


def _describe(x):
    """A launch argument as something picklable that specializes the same way."""
    if isinstance(x, torch.Tensor):
        return ("tensor", str(x.dtype).replace("torch.", ""))
    return x


def launcher_calls(d: int, dtype: str, h_kv: int, causal: bool) -> list:
    """``[(kernel, args, kwargs)]`` the Triton launcher passes for a fold, a fresh+last forward, the backward,
    a merge and a delta of one chunk pair of shape (1, SEQ, H_Q / h_kv heads, d), on meta tensors."""
    from distattn.kernels import _triton as tr

    calls: list = []
    saved = (tr._kernel, tr._fwd._merge_kernel, tr._bwd._bwd_preprocess_kernel)
    tr._kernel = lambda name: _Recorder(name, calls)
    tr._fwd._merge_kernel = _Recorder("merge", calls)
    tr._bwd._bwd_preprocess_kernel = _Recorder("delta", calls)
    try:
        be = tr.TritonBackend()
        dt = DTYPES[dtype]
        meta = dict(device="meta")
        q = torch.empty(1, SEQ, H_Q, d, dtype=dt, **meta)
        k = torch.empty(1, SEQ, h_kv, d, dtype=dt, **meta)
        acc = torch.empty(1, SEQ, H_Q, d, dtype=torch.float32, **meta)
        lse = torch.empty(1, H_Q, SEQ, dtype=torch.float32, **meta)
        mask = dict(scale=d ** -0.5, q_start=0, k_start=0, causal=causal)
        be.fold_(acc, lse, q, k, k, fresh=False, out_final=None, **mask)
        be.fold_(None, lse, q, k, k, fresh=True, out_final=torch.empty_like(q), **mask)
        be.backward_chunk_(q, q, k, k, lse, lse, acc, torch.empty_like(k, dtype=torch.float32),
                           torch.empty_like(k, dtype=torch.float32), **mask)
        be.merge_(acc, lse, acc, lse)
        be.delta(q, q)
    finally:
        tr._kernel, tr._fwd._merge_kernel, tr._bwd._bwd_preprocess_kernel = saved
    out = []
    for name, args, kw in calls:
        if name == "fwd":
            name = "fwd" if kw["FRESH"] and kw["LAST"] else "fold"
        out.append((name, tuple(_describe(a) for a in args), dict(kw)))
    return out


# ----------------------------------------------------------------------------- one compile

@dataclass(frozen=True)
class Job:
    kernel: str  # fwd (fresh + last), fold (carried state), dq, dkdv, merge, delta
    d: int
    dtype: str
    h_kv: int
    causal: bool
    config: tuple  # (BLOCK_M, BLOCK_N, num_warps, num_stages); elementwise kernels: (BLOCK_M, -, 4, 3)
    kept: bool
    args: tuple
    kwargs: tuple


def _raw_kernel(kernel: str):
    from distattn.kernels import _triton_bwd as bwd
    from distattn.kernels import _triton_fwd as fwd

    return {"fwd": fwd._fwd_kernel, "fold": fwd._fwd_kernel, "dq": bwd._bwd_dq_kernel,
            "dkdv": bwd._bwd_dkdv_kernel, "merge": fwd._merge_kernel, "delta": bwd._bwd_preprocess_kernel}[kernel]


def _rebuild(a):
    if isinstance(a, tuple) and a and a[0] == "tensor":
        return torch.empty(0, dtype=getattr(torch, a[1]), device="meta")  # data_ptr 0: 16-byte aligned
    return a


_DOT = re.compile(r"tl\.dot\(\s*([^,]+?),\s*(tl\.trans\((\w+)\)|[\w.]+)")


def _product_label(src_line: str) -> str:
    m = _DOT.search(src_line)
    if not m:
        return "?"
    a = re.sub(r"\.to\(.*", "", m.group(1)).strip()
    b = f"{m.group(3)}^T" if m.group(3) else m.group(2)
    return f"{a}@{b}"


def mma_per_product(ptx: str) -> dict:
    """``{product label: sorted MMA instruction shapes}`` from the PTX's .file/.loc line table."""
    files = dict(re.findall(r'^\s*\.file\s+(\d+)\s+"([^"]+)"', ptx, flags=re.M))
    cache: dict = {}
    found: dict = {}
    loc = None
    for line in ptx.splitlines():
        s = line.strip()
        if s.startswith(".loc"):
            parts = s.split()
            loc = (parts[1], int(parts[2].rstrip(",")))
            continue
        m = re.match(r"(wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)|mma\.sync\.aligned\.(m\d+n\d+k\d+))", s)
        if not m or loc is None:
            continue
        shape = f"wgmma {m.group(2)}" if m.group(2) else f"mma.sync {m.group(3)}"
        if loc not in cache:
            try:
                with open(files.get(loc[0], "")) as f:
                    cache[loc] = _product_label(f.readlines()[loc[1] - 1])
            except (OSError, IndexError):
                cache[loc] = "?"
        found.setdefault(cache[loc], set()).add(shape)
    return {k: sorted(v) for k, v in found.items()}


_MULI = re.compile(r"^\s*%(\S+) = arith\.muli %(\S+), %(\S+) : (tensor<[^>]*xi32>|i32)")
_DEF = re.compile(r"^\s*%(\S+) = (tt\.splat|tt\.broadcast|tt\.expand_dims|arith\.constant) ?%?(\S*)")


def int32_stride_products(ttir: str) -> int:
    """Count ``x * stride_*s`` / ``x * stride_*h`` products computed in int32 where ``x`` is not a constant (a row
    or head index)."""
    defs = {}
    for line in ttir.splitlines():
        m = _DEF.match(line)
        if m:
            defs[m.group(1)] = (m.group(2), m.group(3))

    def root(v):
        seen = 0
        while v in defs and defs[v][0] != "arith.constant" and seen < 8:
            v, seen = defs[v][1], seen + 1
        return v

    def is_const(v):
        return v.startswith("c") and v.endswith("_i32") or (v in defs and defs[v][0] == "arith.constant") or \
            (root(v) in defs and defs[root(v)][0] == "arith.constant")

    count = 0
    for line in ttir.splitlines():
        m = _MULI.match(line)
        if not m:
            continue
        a, b = m.group(2), m.group(3)
        for x, y in ((a, b), (b, a)):
            r = root(x)
            if re.match(r"stride_\w*[sh]$", r) and not is_const(y):  # a sequence or head stride times a variable
                count += 1
                break
    return count


_REGS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_job(job: Job) -> dict:
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    knobs.nvidia.dump_ptxas_log = True  # ptxas -v goes to stdout, captured below
    knobs.compilation.always_compile = True  # a cached kernel would skip ptxas and its report
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    fn = _raw_kernel(job.kernel)
    kw = dict(job.kwargs)
    bm, bn, warps, stages = job.config
    if job.kernel in ATTN_KERNELS + ("fold",):
        kw.update(BLOCK_M=bm, BLOCK_N=bn)
    kw.update(num_warps=warps, num_stages=stages)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, opts = binder(*[_rebuild(a) for a in job.args], **kw)
    options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, spec, opts)
    log = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(log):
        ck = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    secs = time.perf_counter() - t0
    text = log.getvalue()
    regs = max([int(x) for x in _REGS.findall(text)] or [-1])
    spills = [(int(a), int(b)) for a, b in _SPILL.findall(text)] or [(0, 0)]
    return dict(job=job, regs=regs, spill_st=max(s for s, _ in spills), spill_ld=max(ld for _, ld in spills),
                smem=ck.metadata.shared, mma=mma_per_product(ck.asm["ptx"]),
                i32=int32_stride_products(ck.asm["ttir"]), secs=secs)


# ----------------------------------------------------------------------------- the grid

def jobs(quick: bool, ds, dtypes, causals, gqa: bool) -> list[Job]:
    from distattn.kernels import _triton as tr

    out = []
    for d in ds:
        for dtype in dtypes:
            elt = DTYPES[dtype].itemsize
            for causal in causals:
                for h_kv in ([H_Q, 8] if gqa else [H_Q]):
                    for name, args, kw in launcher_calls(d, dtype, h_kv, causal):
                        if h_kv != H_Q and name not in ("dkdv",):
                            continue  # GQA changes only the dK/dV kernel's work (its loop over the group)
                        if name in ("merge", "delta"):
                            if quick and (causal != causals[0] or dtype != dtypes[0]) or h_kv != H_Q:
                                continue
                            cfgs = [((kw["BLOCK_M"], 0, 4, 3), True)]  # launched with the defaults
                        else:
                            kind = "fwd" if name == "fold" else name
                            if quick and name == "fwd":
                                continue  # the fold (carried state) is the distributed path; fwd is its subset
                            cfgs = [((bm, bn, w, s), tr._keep_config(kind, bm, bn, s, kw["BLOCK_D"], elt, SEQ,
                                                                     SMEM_SM90, warps=w, tma=kw.get("TMA", False)))
                                    for bm, bn, w, s in tr._CONFIGS[kind]]
                            if quick or elt >= 4:  # fp32: only 32x32 tiles are ever kept (FMA, not MMA)
                                cfgs = [c for c in cfgs if c[1]]
                        for cfg, kept in cfgs:
                            out.append(Job(name, d, dtype, h_kv, causal, cfg, kept, args, tuple(sorted(kw.items()))))
    return out


def _narrow(r) -> bool:
    if r["job"].dtype == "fp32":
        return False  # fp32 "ieee" dots are FMA by design
    for shapes in r["mma"].values():
        for s in shapes:
            n = re.search(r"n(\d+)k", s)
            if s.startswith("mma.sync") or (n and int(n.group(1)) < 64):
                return True
    return False


def table(results) -> str:
    head = ("| kernel | d | dtype | h_q/h_kv | causal | BLOCK_M | BLOCK_N | warps | stages | kept | regs | "
            "spill st/ld (B) | smem (KB) | MMA per product | i32 offs |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        j = r["job"]
        bm, bn, w, s = j.config
        mma = "; ".join(f"{k}: {', '.join(v)}" for k, v in sorted(r["mma"].items())) or "none (FMA)"
        lines.append(f"| {j.kernel} | {j.d} | {j.dtype} | {H_Q}/{j.h_kv} | {int(j.causal)} | {bm} | {bn or '-'} | "
                     f"{w} | {s} | {'yes' if j.kept else 'no'} | {r['regs']} | {r['spill_st']}/{r['spill_ld']} | "
                     f"{r['smem'] / 1024:.0f} | {mma} | {r['i32']} |")
    return "\n".join(lines)


def summary(results) -> str:
    kept = [r for r in results if r["job"].kept]
    spilling = sum(1 for r in kept if r["spill_st"] or r["spill_ld"])
    narrow = sum(1 for r in kept if _narrow(r))
    i32 = sum(1 for r in results if r["i32"])
    return f"configs={len(kept)} spilling={spilling} narrow_mma={narrow} int32_offsets={i32}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="kept configs, d 64/128, bf16, causal, MHA (and GQA 32/8 for dK/dV) (CI)")
    ap.add_argument("--d", type=int, nargs="+", default=None)
    ap.add_argument("--dtypes", nargs="+", default=None, choices=sorted(DTYPES))
    ap.add_argument("--causal", type=int, nargs="+", default=None, choices=[0, 1])
    ap.add_argument("--no-gqa", action="store_true", help="skip the GQA (32/8 heads) dK/dV compiles")
    ap.add_argument("--no-tma", action="store_true",
                    help="the dK/dV kernel's pointer path (what the launcher uses without descriptors: unaligned "
                         "inputs, DISTATTN_TMA=0, GPUs before sm_90)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the table (markdown) here")
    args = ap.parse_args(argv)
    # Compile for the GPU target: the kernels must not be decorated as interpreted (read at first import).
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    if args.no_tma:
        os.environ["DISTATTN_TMA"] = "0"  # before the launcher is imported (it reads it once)
    why = sm90_unavailable()
    if why:
        print(f"SKIP: {why}")
        return 2
    ds = args.d or ([64, 128] if args.quick else [64, 80, 96, 128, 256])
    dtypes = args.dtypes or (["bf16"] if args.quick else ["bf16", "fp16", "fp32"])
    causals = [bool(c) for c in (args.causal or ([1] if args.quick else [0, 1]))]
    todo = jobs(args.quick, ds, dtypes, causals, gqa=not args.no_gqa)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        results = list(pool.map(compile_job, todo))
    text = table(results)
    print(text)
    line = summary(results)
    cmd = "python bench/compile_report.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        import triton

        with open(args.out, "w") as f:
            f.write(f"sm_90a compile report (triton {triton.__version__}, no GPU; shape b=1, s={SEQ}, "
                    f"h_q={H_Q})\n\ncommand: `{cmd}`\n\n{text}\n\n{line}\n")
    print(f"compiled {len(results)} in {time.perf_counter() - t0:.0f} s")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
