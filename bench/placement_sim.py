"""The placement's table (issue 25): every schedule on packed documents, on the simulator, and the solver's time.

    python bench/placement_sim.py --out bench/results/placement-sim

For P in --world and both document distributions (``distattn.schedule.cli.document_lengths``, seed 0) at
--seq-per-rank tokens per rank with LLaMA-3-8B attention shapes (32 q / 8 kv heads, d = 128, bf16): work makespan
vs perfect balance (total work / P), compute idle, the busiest rank's bytes (sent, forward + backward), pairs
computed and skipped, and for "placed" the solver's time (the minimum over --repeat uncached solves on one core)
and its groups. Writes README.md (the table) and results.csv. Pure simulation: no GPU, no process group.
"""

from __future__ import annotations

import argparse
import csv
import platform
import time
from pathlib import Path

from distattn.schedule import SCHEDULES, MaskSpec, Shapes, simulate
from distattn.schedule.cli import document_lengths
from distattn.schedule.cost import Cluster, predict
from distattn.schedule.placement import _divisors, _place_cached
from distattn.schedule.masked import make_masked_plan
from distattn.schedule.sim import _bytes_per_rank, step_costs

_MIB = 1 << 20


def solver_ms(spec: MaskSpec, p: int, n: int, repeat: int) -> tuple[float, str]:
    """Minimum CPU time of this thread over ``repeat`` uncached solves (the solver is single-threaded Python + numpy;
    CPU time, unlike wall time, does not count the waits of a machine shared with other jobs), and the layout's
    note."""
    best, note = float("inf"), ""
    for _ in range(repeat):
        t = time.thread_time()
        lay = _place_cached.__wrapped__(spec, p, n)
        best = min(best, time.thread_time() - t)
        note = lay.note
    return best * 1e3, note


def rows(worlds, dists, n, repeat):
    shapes = Shapes(seq_per_rank=n, heads_q=32, heads_kv=8, head_dim=128, dtype_bytes=2)
    for docs in dists:
        for p in worlds:
            spec = MaskSpec(causal=True, cu_seqlens=document_lengths(docs, p * n, seed=0))
            ms, note = solver_ms(spec, p, n, repeat)
            for schedule in SCHEDULES:
                rep = simulate(p, True, schedule, shapes, mask=spec)
                perfect = rep.work_makespan * (1 - rep.compute_idle_fraction)
                yield {
                    "docs": docs, "P": p, "schedule": schedule,
                    "makespan / perfect": f"{rep.work_makespan / perfect:.3f}",
                    "compute idle": f"{rep.compute_idle_fraction:.1%}",
                    "max MiB sent": f"{max(rep.bytes_sent) / _MIB:.0f}",
                    "pairs (skipped)": f"{rep.pairs} ({rep.pairs_skipped})",
                    **{f"cost model ms, {link}": f"{predict(p, shapes, schedule, mask=spec, cluster=Cluster.preset(link)).total * 1e3:.2f}"
                       for link in ("nvlink", "ib")},
                    "solver ms": f"{ms:.2f}" if schedule == "placed" else "",
                    "placement": note if schedule == "placed" else "",
                }


def group_rows(worlds, dists, n):
    """The placement forced to every group size ``k`` (a divisor of P): balance against the busiest rank's bytes,
    next to the fewest bytes of today's schedules on the same batch (the issue's bytes bar)."""
    shapes = Shapes(seq_per_rank=n, heads_q=32, heads_kv=8, head_dim=128, dtype_bytes=2)
    for docs in dists:
        for p in worlds:
            spec = MaskSpec(causal=True, cu_seqlens=document_lengths(docs, p * n, seed=0))
            bar = min(max(simulate(p, True, s, shapes, mask=spec).bytes_sent) for s in ("ring", "balanced", "zigzag"))
            chosen = _place_cached(spec, p, n).group
            for k in _divisors(p):
                plan = make_masked_plan(p, "placed", spec, n, _place_cached.__wrapped__(spec, p, n, k))
                rt = plan.run_table
                work = float((rt.stop - rt.start) @ rt.cost)
                makespan = float(step_costs(plan).sum())
                sent = sum(_bytes_per_rank(plan, phase, shapes, "fp32")[0] for phase in ("forward", "backward"))
                partners = max(len({j for i, j in plan.pairs() if i == r and j != r}) for r in range(p))
                yield {
                    "docs": docs, "P": p, "group k": k, "chosen": "yes" if k == chosen else "",
                    "makespan / perfect": f"{makespan * p / work:.3f}",
                    "compute idle": f"{1 - work / (p * makespan):.1%}",
                    "max MiB sent": f"{sent.max() / _MIB:.0f}",
                    "fewest MiB of today's": f"{bar / _MIB:.0f}",
                    "most kv ranks per rank": partners,
                }


def _markdown(table) -> list[str]:
    header = list(table[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(r[k]) for k in header) + " |" for r in table]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/placement-sim"))
    parser.add_argument("--world", type=int, nargs="+", default=[8, 16, 64, 256])
    parser.add_argument("--docs", nargs="+", default=["uniform:8192", "longtail:2048"])
    parser.add_argument("--seq-per-rank", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--groups", type=int, nargs="*", default=[8, 16, 64],
                        help="world sizes of the group-size table (balance vs bytes for every group size)")
    args = parser.parse_args(argv)
    table = list(rows(args.world, args.docs, args.seq_per_rank, args.repeat))
    groups = list(group_rows(args.groups, args.docs, args.seq_per_rank)) if args.groups else []
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    lines = _markdown(table)
    if groups:
        with open(args.out / "groups.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(groups[0]))
            writer.writeheader()
            writer.writerows(groups)
    readme = [
        "# Packed documents: every schedule on the simulator, and the placement solver's time",
        "",
        f"`python bench/placement_sim.py --out {args.out} --world {' '.join(map(str, args.world))} --groups "
        f"{' '.join(map(str, args.groups))}` "
        f"({args.seq_per_rank} tokens per rank, LLaMA-3-8B attention shapes: 32 q / 8 kv heads, d = 128, bf16; "
        f"documents drawn with seed 0; machine: {platform.machine()}, {platform.python_implementation()} "
        f"{platform.python_version()}, shared with other jobs, so solver times are the minimum CPU time of {args.repeat} solves).",
        "",
        "Before: ring, balanced, zigzag (today's schedules). After: placed (`distattn.schedule.placement`).",
        "Makespan / perfect: the simulator's work makespan over total work / P. Max MiB sent: the busiest rank, "
        "forward + backward. Pairs (skipped): (query rank, kv rank) pairs computed, and those of the dense causal "
        "plan not computed. Cost model ms: `distattn.schedule.cost.predict`'s forward + backward time of one "
        "layer (nvlink: every link NVLink; ib: 100 Gb/s InfiniBand between nodes of 8 GPUs; assumed rates).",
        "",
        *lines,
        "",
    ]
    if groups:
        readme += [
            "## Balance against bytes: every group size",
            "",
            f"The same batches (P = {', '.join(map(str, args.groups))}) with the placement forced to groups of k ranks "
            "(`groups.csv`). Chosen: the solver's pick (the smallest k whose groups balance). Most kv ranks per rank: "
            "the ranks whose k/v one rank fetches; every plan moves whole shards, so a rank's bytes grow with it. "
            "Fewest MiB of today's: the busiest rank's bytes under the best of ring, balanced and zigzag, the issue's "
            "bar. Every plan moves only the kv rows a pair's queries see (`Plan.key_ranges`). Balancing a document's causal "
            "work means dealing its blocks over the ranks of a group, and then each of them needs the others' earlier "
            "keys, so a rank's bytes grow with its group: only the group sizes too small to balance come near the bar.",
            "",
            *_markdown(groups),
            "",
        ]
    (args.out / "README.md").write_text("\n".join(readme))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
