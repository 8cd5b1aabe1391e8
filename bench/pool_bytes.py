"""What a deepened placed plan holds: its receive pool and sends in flight against the budget (issue 39).

    python bench/pool_bytes.py --world 64 --cases longtail:2048,causal,7 'pile:4,window 4096,190' \
        --out bench/results/placement-sim/POOL-BYTES.md

For each seed: the library's placement (solved for NVLink, 4096 tokens per rank, LLaMA-3-8B attention shapes), its
prefetch and return depths, the deepest its buffers admit (``distattn.schedule.pool.deepest``), and on its busiest
rank the rows of its fetch and return pools and of the sends it holds in flight (``distattn.schedule.pool.pool_rows``,
the larger of the forward and the backward), in whole shards; its receive pool in bytes (the busiest ranks' fetch and
return pools; k/v in bf16, dk/dv partials in fp32) beside the pool of whole-shard buffers a plan held before
(``depth + 1`` whole shards per kind at the depths capped at 6 and 4); the executor's peak bytes in the backward on its
worst rank (``distattn.memory.executor.executor_peak``, the replay held to the real executor's allocations on gloo) and
what the memory planner counts for a placed call (``attention_buffers("placed")``). Counted, not measured on a GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.placement_worst import nvlink, spec_of  # noqa: E402
from distattn.memory.executor import attention_buffers, executor_peak  # noqa: E402
from distattn.schedule.masked import make_masked_plan  # noqa: E402
from distattn.schedule.placement import _place_cached  # noqa: E402
from distattn.schedule.pool import deepest, pool_rows  # noqa: E402

SHAPE = dict(batch=1, heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16)


def worst_rows(plan, which: str, depth: int) -> tuple[float, float]:
    """The busiest rank's (pool, sends in flight) in whole shards, the larger of the phases."""
    got = [pool_rows(plan.run_order(ph), ph, which, depth + 1) for ph in ("forward", "backward")]
    return tuple(max(int(g[i].max()) for g in got) / plan.chunk for i in (0, 1))


def row(docs: str, p: int, mask: str, seed: int, n: int) -> str:
    spec = spec_of(docs, p, mask, seed, n)
    lay = _place_cached.__wrapped__(spec, p, n, None, nvlink())
    plan = make_masked_plan.__wrapped__(p, "placed", spec, n, lay)
    admitted = deepest(plan)
    (fp, fs), (rp, rs) = worst_rows(plan, "fetch", lay.prefetch), worst_rows(plan, "return", lay.return_depth)
    kv_row = 2 * SHAPE["kv_heads"] * SHAPE["head_dim"] * 2  # bytes of one row of k and v (bf16); dk, dv fp32: twice
    pool = (fp + 2 * rp) * n * kv_row
    whole = ((min(lay.prefetch, 6) + 1) + 2 * (min(lay.return_depth, 4) + 1)) * n * kv_row
    bwd = max(executor_peak(plan, n=n, phase="backward", groups=1, rank=r, **SHAPE).total for r in range(p))
    planner = attention_buffers("placed", p, n, phase="backward", groups=1, **SHAPE).total
    mib = 2 ** 20
    return (f"| {docs} | {mask} | {seed} | {lay.prefetch} / {lay.return_depth} | {admitted[0]} / {admitted[1]} | "
            f"{fp:.2f} / {fs:.2f} | {rp:.2f} / {rs:.2f} | {pool / mib:.0f} | {whole / mib:.0f} | {bwd / mib:.0f} | "
            f"{planner / mib:.0f} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=64)
    ap.add_argument("--seq-per-rank", type=int, default=4096)
    ap.add_argument("--cases", nargs="+", required=True, help="docs,mask,seed (e.g. 'pile:4,window 4096,190')")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    lines = [f"`python bench/pool_bytes.py --world {args.world} --cases "
             + " ".join(f"'{c}'" if " " in c else c for c in args.cases) + "`: P = "
             f"{args.world}, {args.seq_per_rank} tokens per rank, LLaMA-3-8B attention shapes (bf16, 8 kv heads of "
             "128), batch 1, fp32 partials, one head group. Counted, not measured on a GPU.", "",
             "| docs | mask | seed | depths (fetch / return) | admitted | fetch pool / sends in flight (shards) | "
             "return pool / partials in flight (shards) | receive pool, MiB | whole-shard pool at depths up to 6 / 4, "
             "MiB | backward peak, MiB | planner's placed bound, MiB |", "|" + "---|" * 11]
    print("\n".join(lines), flush=True)
    for case in args.cases:  # the rows as they come, then the file
        docs, mask, seed = case.split(",")
        lines.append(row(docs, args.world, mask, int(seed), args.seq_per_rank))
        print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
