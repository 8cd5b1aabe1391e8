"""``torch.compile`` of a whole Hugging Face model with distattn: graph breaks and recompiles, step by step.

    python bench/hf_compile.py                                    # 1 rank, aot_eager, fullgraph, dense + packed
    torchrun --nproc-per-node 2 bench/hf_compile.py               # 2 ranks (CPU: gloo)
    python bench/hf_compile.py --no-fullgraph --backend eager     # count the graph breaks instead of failing
    python bench/hf_compile.py --backend inductor --dynamic       # inductor (C++ on CPU: ~20 s per compile)

A tiny ``LlamaForCausalLM`` (2 layers, GQA 4/2, fp32) with ``use_distattn`` is compiled as
``torch.compile(model, backend=..., fullgraph=...)`` and runs forward + backward on 4 batches whose tokens per rank
and document boundaries change every step: ``dense`` rows (``shard_batch(ids)``), ``packed`` documents
(``shard_batch(list_of_documents)``; step 2 has step 1's length with other boundaries) and ``masked`` (the dense
rows with an all-ones 2-D ``attention_mask``, what HF tokenizers and ``Trainer`` pass). Each step also runs the
same model eagerly, after the compiled call (the process starts cold). Per step the table gives: graphs compiled
in that step (dynamo's ``unique_graphs``: a frame's first compile or a recompile; ``torch.compile(model)``
compiles the forward pre-hook and the forward as two frames), graph breaks so far
(``torch._dynamo.utils.counters``), the largest difference of the compiled loss and gradients from eager, and
seconds. A compile that fails (``fullgraph=True`` with a graph break) ends the mode's
run with its error. Summary line per mode: ``mode=M frames=F recompiles=R graph_breaks=B max_diff=D``
(``recompiles``: compiles after the first step).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

VOCAB = 48
DENSE_TOKENS = [16, 18, 20, 22]  # the whole sequence per step (divisible by 1 and 2 ranks)
PACKED_DOCS = [[5, 1, 9], [3, 7, 2, 4], [9, 7], [11, 6, 3]]  # documents per step; step 2: step 1's length
MODES = ("dense", "packed", "masked")  # masked: dense rows with an all-ones attention_mask, as tokenizers give


def make_model(layers: int = 2, dtype=torch.float32, group=None, *, distattn: bool = True):
    """A tiny LLaMA (GQA 4/2), the same weights on every rank and every call; with distattn over ``group``, or
    (``distattn=False``) with transformers' own eager attention."""
    import transformers

    from distattn.integrations import hf

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, initializer_range=0.2, use_cache=False,
                                      attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dtype).train()
    return hf.use_distattn(model, group) if distattn else model


def step_documents(mode: str) -> list[list[torch.Tensor]]:
    """The token ids of every step of ``mode``: its documents (a dense row is one document of the whole sequence)."""
    g = torch.Generator().manual_seed(1)
    if mode in ("dense", "masked"):
        return [[torch.randint(0, VOCAB, (n,), generator=g)] for n in DENSE_TOKENS]
    return [[torch.randint(0, VOCAB, (n,), generator=g) for n in lengths] for lengths in PACKED_DOCS]


def batches(mode: str, group=None) -> list[dict]:
    """This rank's ``shard_batch`` of every step of ``mode`` (the same token ids on every rank)."""
    from distattn.integrations import hf

    if mode in ("dense", "masked"):
        out = [hf.shard_batch(d[0][None], labels=d[0][None], group=group) for d in step_documents(mode)]
        if mode == "masked":  # this rank's shard of an all-ones mask: all ones
            out = [{**b, "attention_mask": torch.ones_like(b["input_ids"])} for b in out]
        return out
    return [hf.shard_batch(docs, labels=docs, group=group) for docs in step_documents(mode)]


def train_step(model, batch, group=None) -> tuple[torch.Tensor, dict]:
    """The global loss and this rank's share of every parameter gradient for one batch."""
    from distattn.integrations import hf

    model.zero_grad(set_to_none=True)
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                   attention_mask=batch.get("attention_mask")).logits
    loss = hf.causal_lm_loss(logits, batch["shift_labels"], group=group)
    loss.backward()
    # a compiled module names its parameters "_orig_mod.<name>"
    return loss.detach(), {name.removeprefix("_orig_mod."): p.grad.detach().clone()
                           for name, p in model.named_parameters()}


def graph_breaks() -> int:
    """Graph breaks so far (``torch._dynamo.utils.counters``)."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def graphs_compiled() -> int:
    """Graphs dynamo has compiled so far: first compiles and recompiles (not a trace it restarted)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def compile_run(mode: str, backend: str = "aot_eager", *, fullgraph: bool = True, dynamic: bool | None = None,
                layers: int = 2, group=None) -> list[dict]:
    """Every step of ``mode``, compiled and eager: ``[{tokens, graphs, graph_breaks, loss, grads, eager_loss,
    eager_grads, seconds, error}]`` (``graphs``: compiled in that step; ``error``: the compile's failure, last row)."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = make_model(layers, group=group)
    compiled = torch.compile(model, backend=backend, fullgraph=fullgraph, dynamic=dynamic)
    rows = []
    for batch in batches(mode, group):
        # compiled first: the process's first call is a compiled one (a cold start, as a job that compiles its
        # model before any eager step), so state the first call creates (backends, the library's own groups)
        # shows up as a recompile at the next step if a traced frame guards on it
        before, t0 = graphs_compiled(), time.perf_counter()
        row = dict(tokens=batch["input_ids"].shape[1], error=None)
        try:
            row["loss"], row["grads"] = train_step(compiled, batch, group)
        except Exception as exc:  # noqa: BLE001 - a failed compile is the figure this run reports
            row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
        row.update(graphs=graphs_compiled() - before, graph_breaks=graph_breaks(),
                   seconds=time.perf_counter() - t0)
        row["eager_loss"], row["eager_grads"] = train_step(model, batch, group)
        rows.append(row)
        if row["error"]:
            break
    return rows


def max_diff(row) -> float:
    """Largest |compiled - eager| over the loss and every gradient of a step."""
    pairs = [(row["loss"], row["eager_loss"])] + [(row["grads"][k], row["eager_grads"][k]) for k in row["grads"]]
    return max((a - b).abs().max().item() for a, b in pairs)


def summary(mode: str, rows: list[dict]) -> str:
    frames = rows[0]["graphs"]
    diff = max((max_diff(r) for r in rows if not r["error"]), default=float("nan"))
    line = (f"mode={mode} frames={frames} recompiles={sum(r['graphs'] for r in rows[1:])} "
            f"graph_breaks={rows[-1]['graph_breaks']} max_diff={diff:.1e}")
    return line + (f" error={rows[-1]['error']!r}" if rows[-1]["error"] else "")


def table(rows: list[dict]) -> str:
    lines = ["| step | tokens/rank | graphs compiled | graph breaks (total) | max diff vs eager | s |",
             "|---|---|---|---|---|---|"]
    for i, r in enumerate(rows):
        diff = "failed" if r["error"] else f"{max_diff(r):.1e}"
        lines.append(f"| {i} | {r['tokens']} | {r['graphs']} | {r['graph_breaks']} | {diff} | {r['seconds']:.1f} |")
    return "\n".join(lines)


def _init_group() -> None:
    """torchrun's group if launched by it, else a one-rank gloo group (distattn always runs on a process group)."""
    import torch.distributed as dist

    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        store = os.path.join(tempfile.mkdtemp(), "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


def main(argv=None) -> int:
    import torch.distributed as dist

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="aot_eager", help="torch.compile backend: eager, aot_eager, inductor")
    ap.add_argument("--no-fullgraph", action="store_true", help="allow graph breaks (and count them)")
    ap.add_argument("--dynamic", action="store_true", help="torch.compile(..., dynamic=True)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    _init_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        for mode in args.modes:
            rows = compile_run(mode, args.backend, fullgraph=not args.no_fullgraph, dynamic=args.dynamic or None)
            if rank == 0:
                print(f"\n{mode}: {world} rank(s), backend={args.backend}, fullgraph={not args.no_fullgraph}, "
                      f"dynamic={args.dynamic or None}, torch {torch.__version__}\n{table(rows)}")
                print(summary(mode, rows), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
