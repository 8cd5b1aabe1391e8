"""The cost model's table: every candidate plan (flat ring/balanced/zigzag, Ulysses x ring) per model, P and link.

Not a measurement: every time here is *modelled* by ``distattn.schedule.cost`` from the plan objects the executors
run, with assumed link bandwidths and an assumed attention FLOP rate (stated in the output). One attention layer,
forward + backward, bf16 inputs, fp32 partials, batch 1.

    python bench/schedule_report.py --out bench/results/schedule-model

writes ``README.md`` (a summary table: the winner per model x link x P, the best flat plan, the why line; then the
full table per model and link) and ``results.csv`` (one row per candidate).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from distattn.schedule import Shapes  # noqa: E402
from distattn.schedule.cost import Cluster, choose  # noqa: E402

MODELS = {
    "llama-7b": (32, 32),  # MHA
    "llama-3-8b": (32, 8),  # GQA
    "33-head": (33, 33),  # MHA with a head count no power of two divides (LLaMA-7B-like, d=128)
}
"""name -> (query heads, kv heads); head dim 128 for all."""
LINK_TEXT = {"nvlink": "every link NVLink", "ib": "NVLink inside a node of 8, 100 Gb/s InfiniBand across"}
_MIB = 1 << 20


def _row(model: str, link: str, p: int, cand, best) -> dict:
    ms = (lambda s: round(s * 1e3, 3)) if cand.runnable else (lambda s: "")
    return {
        "model": model, "link": link, "P": p, "candidate": cand.label, "U": cand.ulysses,
        "R": cand.ring, "steps": cand.steps if cand.runnable else "",
        "fwd_MiB": round(cand.bytes_fwd / _MIB) if cand.runnable else "",
        "bwd_MiB": round(cand.bytes_bwd / _MIB) if cand.runnable else "",
        "fwd_ms": ms(cand.forward), "bwd_ms": ms(cand.backward), "total_ms": ms(cand.total),
        "compute_ms": ms(cand.compute), "exposed_comm_ms": ms(cand.exposed), "a2a_ms": ms(cand.a2a),
        "winner": cand is best, "note": f"cannot run: {cand.reason}" if not cand.runnable else "",
    }  # fmt: skip


def _table(rows: list[dict], columns: list[str]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = [("**yes**" if r[c] else "") if c == "winner" else str(r[c]) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output folder (README.md, results.csv)")
    parser.add_argument("--world", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--seq-per-rank", type=int, default=4096)
    parser.add_argument("--links", nargs="+", default=["nvlink", "ib"], choices=("nvlink", "ib"))
    parser.add_argument("--gpus-per-node", type=int, default=8)
    args = parser.parse_args(argv)

    rows, summary, clusters = [], [], {}
    for model, (hq, hkv) in MODELS.items():
        shapes = Shapes(batch=1, seq_per_rank=args.seq_per_rank, heads_q=hq, heads_kv=hkv, head_dim=128,
                        dtype_bytes=2)
        for link in args.links:
            cluster = clusters.setdefault(link, Cluster.preset(link, gpus_per_node=args.gpus_per_node))
            for p in args.world:
                choice = choose(p, shapes, causal=True, cluster=cluster)
                rows += [_row(model, link, p, c, choice.best) for c in choice.candidates]
                flat = min((c for c in choice.candidates if c.runnable and c.ulysses == 1),
                           key=lambda c: c.total)  # candidates are sorted: the first flat one is the best
                summary.append({"model": f"{model} ({hq}/{hkv})", "link": link, "P": p,
                                "predicted winner": choice.best.label, "winner ms": f"{choice.best.total * 1e3:.2f}",
                                "best flat": flat.label, "best flat ms": f"{flat.total * 1e3:.2f}",
                                "why": choice.why()})
                print(summary[-1], flush=True)
    _write(Path(args.out), rows, summary, clusters, args)


def _write(out: Path, rows: list[dict], summary: list[dict], clusters: dict, args) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    command = "python bench/schedule_report.py " + " ".join(sys.argv[1:])
    any_cluster = next(iter(clusters.values()))
    lines = [
        "# Which plan wins: the cost model's predictions (modelled, not measured)",
        "",
        "```", command, "```", "",
        f"One attention layer, forward + backward, causal, batch 1, {args.seq_per_rank} tokens per rank, bf16 "
        "inputs, fp32 partials, head dim 128. Models: llama-7b (32 q / 32 kv heads), llama-3-8b (32 / 8), and a "
        "33-head MHA layer (33 / 33: no Ulysses degree > 1 divides 33 heads, so only flat plans run). Links: "
        + "; ".join(f"`{k}`: {LINK_TEXT[k]}" for k in clusters) + ".",
        "",
        "Every time is predicted by `distattn.schedule.cost` (see its docstring; `python -m distattn.schedule "
        "explain` prints one block of this table) from the plan objects the executors run: per step, the slowest "
        "rank's compute against the transfers overlapping it, plus the first fetch, the last returns and the "
        "Ulysses all-to-alls. Assumed rates, not measured: "
        f"NVLink {any_cluster.intra.bandwidth / 1e9:g} GB/s per direction and {any_cluster.intra.latency * 1e6:g} us "
        f"per message (H100 NVLink 4, 450 GB/s peak per direction, charged at about two thirds), InfiniBand "
        f"{clusters.get('ib', any_cluster).inter.bandwidth / 1e9:g} GB/s (100 Gb/s) and "
        f"{clusters.get('ib', any_cluster).inter.latency * 1e6:g} us, {any_cluster.flops / 1e12:g} TFLOP/s of "
        "attention per GPU (FlashAttention-2 forward on H100, bf16, d=128), backward 2.5x the forward FLOPs. A ring "
        "spanning more than one node is charged entirely to the inter-node link, one NIC per GPU. "
        "Ulysses degrees above the node size are excluded (the all-to-all would cross nodes).",
        "",
        "MiB columns: the busiest rank's larger of bytes sent / received (ring transfers + all-to-alls). "
        "`exposed comm`: ring communication not hidden behind compute. `2d U=4 x zigzag R=4`: heads split over 4 "
        "ranks by an all-to-all inside the node, a zigzag ring over the 4 groups; `ulysses U=8`: R = 1.",
        "",
        "## Winners",
        "",
        *_table(summary, list(summary[0])),
    ]
    columns = ["P", "candidate", "steps", "fwd_MiB", "bwd_MiB", "fwd_ms", "bwd_ms", "total_ms", "compute_ms",
               "exposed_comm_ms", "a2a_ms", "winner", "note"]
    for model in MODELS:
        for link in clusters:
            block = [r for r in rows if r["model"] == model and r["link"] == link]
            lines += ["", f"## {model} ({MODELS[model][0]}/{MODELS[model][1]} heads), {link}", "",
                      *_table(block, columns)]
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'README.md'} and {out / 'results.csv'}")


if __name__ == "__main__":
    main()
