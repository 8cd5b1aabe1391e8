"""Measured bytes per rank of every schedule on gloo, next to the simulator's prediction (forward + backward).

    for P in 2 3 4 5 6 7 8; do
      python -m torch.distributed.run --standalone --nproc-per-node $P bench/schedule_bytes.py --out bench/results/schedule-bytes
    done

One causal attention call (forward + backward) per schedule on a LLaMA-3-8B-shaped layer scaled down for a CPU
(32 query / 8 kv heads, ``--head-dim`` 16, ``--tokens-per-rank`` 64, fp16): ring, balanced, zigzag, and every
two-dimensional ``U x R`` whose heads split, each with ``partials="fp32"`` and ``"input"``. Each rank reads
``distattn.comm.COUNTERS`` (what its exchange really posted: peer-to-peer rounds and all-to-alls) and the
busiest rank's bytes are written next to ``distattn.schedule.simulate``'s busiest rank for the same call; the
bytes of a real layer scale linearly in tokens, heads and head dim from these. Writes ``P<P>.md`` and a CSV.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import distattn  # noqa: E402
from distattn import comm  # noqa: E402
from distattn.schedule import Shapes, simulate, ulysses_heads  # noqa: E402


def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens-per-rank", type=int, default=64)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--heads-kv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=16)
    return ap.parse_args(argv)


def _variants(p: int, h_q: int, h_kv: int):
    for u in range(1, p + 1):
        if p % u:
            continue
        try:
            ulysses_heads(h_q, h_kv, u)
        except ValueError:
            continue
        for schedule in ("ring", "balanced", "zigzag"):
            for partials in ("fp32", "input"):
                yield u, schedule, partials


def main(argv=None) -> None:
    args = _parse(argv)
    dist.init_process_group("gloo")
    p, rank = dist.get_world_size(), dist.get_rank()
    n, d, h_q, h_kv = args.tokens_per_rank, args.head_dim, args.heads, args.heads_kv
    shapes = Shapes(batch=1, seq_per_rank=n, heads_q=h_q, heads_kv=h_kv, head_dim=d, dtype_bytes=2)
    groups = {u: (distattn.make_2d_groups(u) if u > 1 else None) for u in range(1, p + 1) if p % u == 0}
    rows = []
    for u, schedule, partials in _variants(p, h_q, h_kv):
        g = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(1, n, h, d, generator=g).half().requires_grad_() for h in (h_q, h_kv, h_kv))
        comm.reset_counters()
        out = distattn.dist_flash_attn_func(q, k, v, causal=True, group=groups[u], schedule=schedule,
                                            partials=partials, backend="torch")
        out.float().sum().backward()
        mine = torch.tensor([comm.COUNTERS.bytes_sent, comm.COUNTERS.bytes_recv], dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(p)]
        dist.all_gather(every, mine)
        sim = simulate(p, True, schedule, shapes, ulysses=u, partials=partials)
        measured = max(max(int(t[0]), int(t[1])) for t in every)
        predicted = max(max(s, r) for s, r in zip(sim.bytes_sent, sim.bytes_recv))
        exact = all(int(t[0]) == sim.bytes_sent[i] and int(t[1]) == sim.bytes_recv[i] for i, t in enumerate(every))
        rows.append({"P": p, "U": u, "R": p // u, "schedule": schedule, "partials": partials, "steps": sim.steps,
                     "max KiB/rank measured": f"{measured / 1024:.1f}", "max KiB/rank simulated": f"{predicted / 1024:.1f}",
                     "every rank equal": "yes" if exact else "NO"})
    if rank == 0:
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        head = list(rows[0])
        lines = [f"# P = {p}: bytes per rank, gloo counters vs simulator", "",
                 f"`python -m torch.distributed.run --standalone --nproc-per-node {p} bench/schedule_bytes.py "
                 f"--out {args.out}`; causal, fp16, b=1, n={n} tokens per rank, {h_q}/{h_kv} heads, d={d}; forward + "
                 f"backward; KiB sent or received by the busiest rank.", "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(str(r[c]) for c in head) + " |" for r in rows]
        (out_dir / f"P{p}.md").write_text("\n".join(lines) + "\n")
        with open(out_dir / f"P{p}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=head)
            w.writeheader()
            w.writerows(rows)
        print("\n".join(lines))
        bad = [r for r in rows if r["every rank equal"] != "yes"]
        if bad:
            raise SystemExit(f"{len(bad)} variants where the counters differ from the simulator: {bad}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
