"""Padded vs padding-free (packed) batches: activation memory, attention work, step time; and bytes across ranks.

Not a test. Two modes:

``python bench/varlen.py memory --out DIR`` (one process): a LLaMA-style model (transformers' LlamaForCausalLM,
random weights) trains one step on a batch of documents whose lengths are drawn from a distribution (uniform
1..N as in the padding-free literature, or long-tailed), side by side in one run:
  * ``padded``: every document padded to the longest, ``attention_mask`` marking the padding, transformers'
    SDPA attention (what a FlashAttention-style padded batch costs: every token-wise op runs on pad tokens);
  * ``packed``: the same documents packed into one stream (``distattn.integrations.hf.shard_batch``), attention
    kept inside each document by distattn's varlen path on a 1-rank group.
Reported: activation bytes kept per layer between forward and backward (measured:
``distattn.checkpoint.retained_bytes`` of a 2-layer and a 4-layer model, difference / 2), attention (query, key)
pairs computed (padded causal: ``b * N(N+1)/2``; packed: ``sum l(l+1)/2``), and the median fwd+bwd step time.

``torchrun --nproc-per-node P bench/varlen.py dist --out DIR``: one forward + backward of
``dist_flash_attn_varlen_func`` on a packed stream per rank count, the bytes every rank's counters saw next to
the simulator's prediction for the same plan, and the dense causal plan of the same stream for comparison.

CPU numbers are measured on this machine's CPU and say nothing about GPU speed; memory and pair counts are
device-independent.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench._util import cpu_name  # noqa: E402


def lengths(dist_name: str, count: int, longest: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    if dist_name == "uniform":
        return [int(x) for x in rng.integers(1, longest + 1, size=count)]
    # long-tailed: log-normal with median longest / 8, capped at longest
    return [int(min(longest, max(1, x))) for x in rng.lognormal(np.log(longest / 8), 1.2, size=count)]


def _model(layers: int, attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         attn_implementation=attn, use_cache=False)
    return LlamaForCausalLM(config).train()


def _padded_step(model, docs):
    width = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    mask = torch.zeros(len(docs), width, dtype=torch.long)
    for i, d in enumerate(docs):
        ids[i, :len(d)], mask[i, :len(d)] = d, 1
    labels = ids.masked_fill(mask == 0, -100)
    return lambda: model(input_ids=ids, attention_mask=mask, labels=labels).loss


def _packed_step(model, docs):
    from distattn.integrations import hf

    batch = hf.shard_batch(docs, labels=docs)
    return lambda: hf.causal_lm_loss(model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits,
                                     batch["shift_labels"])


def _kept_per_layer(make_step, docs, attn: str, packed: bool) -> float:
    from distattn import checkpoint as ck
    from distattn.integrations import hf

    kept = {}
    for layers in (2, 4):
        model = _model(layers, attn)
        if packed:
            hf.use_distattn(model)
        step = make_step(model, docs)
        loss, kept[layers] = ck.retained_bytes(step)
        loss.backward()
    return (kept[4] - kept[2]) / 2


def _time(make_step, docs, attn: str, packed: bool, repeats: int) -> float:
    from distattn.integrations import hf

    model = _model(2, attn)
    if packed:
        hf.use_distattn(model)
    step = make_step(model, docs)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        step().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def memory_mode(args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rows = []
    for dist_name in args.dists:
        lens = lengths(dist_name, args.batch, args.longest, args.seed)
        g = torch.Generator().manual_seed(args.seed)
        docs = [torch.randint(0, 256, (n,), generator=g) for n in lens]
        b, width = len(lens), max(lens)
        pairs = {"padded": b * width * (width + 1) // 2, "packed": sum(n * (n + 1) // 2 for n in lens)}
        tokens = {"padded": b * width, "packed": sum(lens)}
        for variant, make, attn, packed in (("padded", _padded_step, "sdpa", False),
                                            ("packed", _packed_step, "sdpa", True)):
            kept = _kept_per_layer(make, docs, attn, packed)
            step_s = _time(make, docs, attn, packed, args.repeats)
            rows.append({"lengths": f"{dist_name} 1..{args.longest}", "batch": b, "variant": variant,
                         "tokens": tokens[variant], "kept_bytes_per_layer": int(kept),
                         "attention_pairs": pairs[variant], "step_ms": round(step_s * 1e3, 1)})
            print(rows[-1], flush=True)
    dist.destroy_process_group()
    _write(args.out, "memory", rows, f"one process, {cpu_name()}, torch {torch.__version__}, "
           f"load average {os.getloadavg()[0]:.1f}")


def dist_mode(args) -> None:
    import torch.distributed as dist

    import distattn
    from distattn import comm
    from distattn.schedule import MaskSpec, Shapes, simulate

    dist.init_process_group("gloo")
    p, rank = dist.get_world_size(), dist.get_rank()
    n = args.tokens_per_rank
    total = p * n
    cu = [0]
    for length in lengths(args.dists[0], 10 * total, args.longest, args.seed):
        if cu[-1] >= total:
            break
        cu.append(min(total, cu[-1] + length))
    h_q, h_kv, d = 4, 2, 32
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, h, d, generator=g)[rank * n:(rank + 1) * n].requires_grad_() for h in (h_q, h_kv, h_kv))
    comm.reset_counters()
    out = distattn.dist_flash_attn_varlen_func(q, k, v, torch.tensor(cu, dtype=torch.int32), total, causal=True)
    out.sum().backward()
    sent = torch.tensor([comm.COUNTERS.bytes_sent], dtype=torch.int64)
    every = [torch.zeros_like(sent) for _ in range(p)]
    dist.all_gather(every, sent)
    shapes = Shapes(seq_per_rank=n, heads_q=h_q, heads_kv=h_kv, head_dim=d, dtype_bytes=4)
    rep = simulate(p, True, "balanced", shapes, mask=MaskSpec(causal=True, cu_seqlens=tuple(cu)))
    dense = simulate(p, True, "balanced", shapes)
    if rank == 0:
        row = {"P": p, "documents": len(cu) - 1, "pairs": rep.pairs, "pairs_skipped": rep.pairs_skipped,
               "work_vs_causal": round(rep.work_fraction, 4), "max_sent_measured": max(int(t) for t in every),
               "max_sent_simulated": max(rep.bytes_sent), "max_sent_dense_causal": max(dense.bytes_sent),
               "counters_equal_simulator": [int(t) for t in every] == list(rep.bytes_sent)}
        print(row, flush=True)
        _write(args.out, f"dist-P{p}", [row], f"gloo, {p} ranks, {cpu_name()}, fp32, {n} tokens per rank, "
               f"{args.dists[0]} lengths 1..{args.longest}")
    dist.destroy_process_group()


def _write(out: str, name: str, rows: list[dict], machine: str) -> None:
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    header = list(rows[0])
    lines = [f"<!-- {machine}; command: python {' '.join(sys.argv)} -->", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(r[k]) for k in header) + " |" for r in rows]
    (folder / f"{name}.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("memory", "dist"))
    parser.add_argument("--out", required=True, help="output folder (tables and CSV)")
    parser.add_argument("--dists", nargs="+", default=["uniform", "longtail"], choices=("uniform", "longtail"))
    parser.add_argument("--batch", type=int, default=8, help="documents per batch (memory mode)")
    parser.add_argument("--longest", type=int, default=512, help="N: document lengths 1..N")
    parser.add_argument("--tokens-per-rank", type=int, default=256, help="dist mode")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    (memory_mode if args.mode == "memory" else dist_mode)(args)


if __name__ == "__main__":
    main()
