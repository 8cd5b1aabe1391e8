"""Checkpointing benchmark (the DistFlashAttn paper's Table 5): HF layer-boundary vs remat-aware checkpointing.

Not a test. A stack of LLaMA-7B-shaped decoder layers (hidden 4096, 32 heads of 128, MLP 11008; transformers'
``LlamaModel`` fed random ``inputs_embeds``), attention = distattn (``use_distattn``), bf16, one training
step (forward + backward) at 8k..64k tokens per GPU, side by side in one run:
  * ``hf``     HF's gradient checkpointing: every layer checkpointed at its input, the backward re-runs the
               whole layer, attention forward included (2 attention forwards per layer per step);
  * ``remat``  ``enable_remat_checkpointing``: checkpointed at attention's output, attention forward runs once;
  * ``none``   no checkpointing (``--variants none,hf,remat``), the memory ceiling; out-of-memory is recorded.
Reported per (tokens, variant): median step time, speedup over ``hf``, peak GPU memory
(``torch.cuda.max_memory_allocated``), activation bytes kept between forward and backward
(``distattn.checkpoint.retained_bytes``, an untimed step) next to the memory model's prediction for the decoder
layers (``distattn.memory``; the measurement also holds RoPE's cos/sin and the final norm), attention forward
executions per step, and model
TFLOP/s. FLOPs (the convention of every distattn benchmark) count useful work only, never recomputation:
per layer ``6 * tokens * matmul_params`` for the projections and MLP, plus attention
``4 * b * h * s * s * d * 0.5`` (causal) forward and x2.5 backward (x3.5 both).

Usage:
    python bench/checkpoint.py                        # one GPU: 8k..64k tokens, 4 layers
                                                      #   -> bench/results/checkpoint/{checkpoint.md,.csv,.png}
    python bench/checkpoint.py --tokens 8192 32768 --layers 8 --variants none,hf,remat
    torchrun --nproc-per-node 8 bench/checkpoint.py   # 8 GPUs, the sequence split across them: --tokens is
                                                      #   per GPU (the paper's setting), rank 0 writes
    python bench/checkpoint.py --smoke                # CPU: a tiny model through the same code path; proves
                                                      #   the script works, NOT a performance number;
                                                      #   writes runs/bench-smoke/checkpoint/ (ignored by git)
Without matplotlib the table and CSV are written and checkpoint.png is skipped (one line says so).

The paper reports 1.16x-1.31x (remat over HF checkpointing) at 8k-32k tokens per GPU on 8 A100s.
"""
import argparse
import csv
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench._util import cpu_name, pyplot_or_note, smoke_out  # noqa: E402
from distattn._compat import hf_checkpointing_disable, hf_checkpointing_enable  # noqa: E402
from distattn import checkpoint as ck  # noqa: E402
from distattn._plotstyle import style as plot_style  # noqa: E402
from distattn.integrations import hf  # noqa: E402

SMOKE_LABEL = "CPU smoke, not a performance number"
LLAMA_7B = dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
VARIANTS = ("none", "hf", "remat")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768, 65536], help="tokens per GPU")
    p.add_argument("--layers", type=int, default=4, help="LLaMA-7B-shaped decoder layers in the stack")
    p.add_argument("--variants", default="hf,remat", help="comma-separated subset of none,hf,remat")
    p.add_argument("--steps", type=int, default=5, help="timed steps per point (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--schedule", default="balanced", choices=("balanced", "ring"))
    p.add_argument("--backend", default=None, help="attention kernel backend (default: best available)")
    p.add_argument("--out", default=None, help="folder for checkpoint.md/.csv/.png (default bench/results/checkpoint, "
                   "or runs/bench-smoke/checkpoint for --smoke: a smoke run never writes into bench/results/)")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run: checks the script, not performance")
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        p.error(f"--variants: {bad} not in {VARIANTS}")
    try:
        out = smoke_out("checkpoint", args.out) if args.smoke else Path(args.out or "bench/results/checkpoint")
        args.out = str(out)
    except ValueError as exc:
        p.error(str(exc))
    if args.smoke:  # tiny defaults; sizes given on the command line still apply (e.g. a faster dry run)
        given = {a.split("=", 1)[0] for a in (argv if argv is not None else sys.argv[1:])}
        args.tokens = args.tokens if "--tokens" in given else [64, 128]
        args.layers = args.layers if "--layers" in given else 2
        args.steps = args.steps if "--steps" in given else 2
        args.warmup = args.warmup if "--warmup" in given else 1
        args.variants = args.variants if "--variants" in given else list(VARIANTS)
    return args


def init_group(device_type: str) -> tuple[int, int]:
    """torchrun's group if launched by it, else a one-rank group (the op always runs on a process group)."""
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if "RANK" in os.environ:
            dist.init_process_group(backend)
        else:
            store = os.path.join(tempfile.mkdtemp(prefix="distattn_bench_"), "rendezvous")
            dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def build(args, device, dtype, max_tokens):
    from transformers import LlamaConfig, LlamaModel

    shape = TINY if args.smoke else LLAMA_7B
    config = LlamaConfig(vocab_size=32, num_hidden_layers=args.layers, max_position_embeddings=max_tokens,
                         attn_implementation="sdpa", use_cache=False, **shape)
    torch.manual_seed(0)
    model = LlamaModel(config).to(device=device, dtype=dtype).train()
    return hf.use_distattn(model, schedule=args.schedule, backend=args.backend), config


def set_variant(model, variant: str):
    hf_checkpointing_disable(model)  # under whichever name this transformers 5.x has
    if variant == "hf":  # HF's default: non-reentrant checkpoint at every layer input
        hf_checkpointing_enable(model)
    elif variant == "remat":
        hf.enable_remat_checkpointing(model)


def step(model, embeds, positions):
    hidden = model(inputs_embeds=embeds, position_ids=positions).last_hidden_state
    hidden.float().square().mean().backward()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_flops(config, layers: int, tokens: int, world: int) -> float:
    """Useful FLOPs of one step on one rank (no recomputation): projections + MLP + causal attention."""
    h, f = config.hidden_size, config.intermediate_size
    d = h // config.num_attention_heads
    kv = config.num_key_value_heads * d
    matmul_params = h * h * 2 + h * kv * 2 + 3 * h * f  # q, o, k, v, gate/up/down
    linear = 6 * tokens * matmul_params
    # This rank's queries against every earlier key of the whole sequence: on average half of world*tokens.
    attn_fwd = 4 * config.num_attention_heads * tokens * (world * tokens) * d * 0.5
    return layers * (linear + 3.5 * attn_fwd)


def predicted_kept(config, variant: str, tokens: int, device, dtype, world: int) -> int:
    """The memory model's bytes kept by the decoder layers (``distattn.memory``): layers x per-layer list.

    What the measurement adds on top: RoPE's cos/sin and the final norm's saved tensors (outside the layers).
    """
    from distattn.memory import LayerSpec, layer_saved_tensors

    spec = LayerSpec(hidden=config.hidden_size, heads=config.num_attention_heads,
                     kv_heads=config.num_key_value_heads, ffn=config.intermediate_size)
    strategy = {"none": "none", "hf": "full", "remat": "remat"}[variant]
    precision = "fp32" if dtype == torch.float32 else "bf16"
    per_layer = layer_saved_tensors(spec, 1, tokens * world, impl="distattn", precision=precision,
                                    strategy=strategy, sp=world, device=device.type)
    return config.num_hidden_layers * sum(t.nbytes for t in per_layer)


def measure(args, model, config, variant, tokens, device, dtype, rank, world) -> dict:
    set_variant(model, variant)
    embeds = torch.randn(1, tokens, config.hidden_size, device=device, dtype=dtype)
    positions = torch.arange(rank * tokens, (rank + 1) * tokens, device=device)[None]
    row = {"tokens_per_gpu": tokens, "variant": variant}
    try:
        # Untimed: what the forward keeps for backward, and attention executions per step.
        ck.reset_counters()
        out, kept = ck.retained_bytes(lambda: model(inputs_embeds=embeds, position_ids=positions).last_hidden_state)
        out.float().square().mean().backward()
        row["attn_fwd_per_step"], row["kept_MiB"] = ck.COUNTERS.forward, kept / 2**20
        row["predicted_MiB"] = predicted_kept(config, variant, tokens, device, dtype, world) / 2**20
        del out
        model.zero_grad(set_to_none=True)
        for _ in range(args.warmup):
            step(model, embeds, positions)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(args.steps):
            model.zero_grad(set_to_none=True)
            sync(device)
            t0 = time.perf_counter()
            step(model, embeds, positions)
            sync(device)
            times.append(time.perf_counter() - t0)
        row["step_ms"] = statistics.median(times) * 1e3
        row["peak_GiB"] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
        row["TFLOPs"] = model_flops(config, args.layers, tokens, world) / (row["step_ms"] * 1e-3) / 1e12
    except torch.cuda.OutOfMemoryError:
        row["step_ms"] = float("nan")
        row["note"] = "OOM"
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def add_speedups(rows):
    hf_ms = {r["tokens_per_gpu"]: r["step_ms"] for r in rows if r["variant"] == "hf"}
    for r in rows:
        base = hf_ms.get(r["tokens_per_gpu"])
        r["speedup_vs_hf"] = base / r["step_ms"] if base and r["step_ms"] == r["step_ms"] else float("nan")


COLUMNS = ["tokens_per_gpu", "variant", "step_ms", "speedup_vs_hf", "peak_GiB", "kept_MiB", "predicted_MiB",
           "attn_fwd_per_step",
           "TFLOPs", "note"]


def write(rows, args, machine: str, world: int):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    with open(out / "checkpoint.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS + ["machine", "world", "layers", "smoke"])
        w.writeheader()
        for r in rows:
            w.writerow({**{c: r.get(c, "") for c in COLUMNS}, "machine": machine, "world": world,
                        "layers": args.layers, "smoke": args.smoke})
    title = f"# Checkpointing: HF layer-boundary vs remat-aware ({SMOKE_LABEL})" if args.smoke else \
        "# Checkpointing: HF layer-boundary vs remat-aware (DistFlashAttn Table 5)"
    lines = [title, "",
             f"Machine: {machine}; {world} rank(s); {args.layers} "
             f"{'tiny' if args.smoke else 'LLaMA-7B-shaped'} layers; schedule {args.schedule}; median of "
             f"{args.steps} steps after {args.warmup} warm-up.", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in COLUMNS) + " |" for r in rows]
    if args.smoke:
        lines += ["", f"**{SMOKE_LABEL}.** The GPU command is in the docstring of bench/checkpoint.py."]
    (out / "checkpoint.md").write_text("\n".join(lines) + "\n")
    plt = pyplot_or_note(str(out / "checkpoint.png"))
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for variant in dict.fromkeys(r["variant"] for r in rows):
        pts = [(r["tokens_per_gpu"], r["step_ms"]) for r in rows if r["variant"] == variant]
        ax.plot(*zip(*pts), label=variant, gid=variant, **plot_style(variant))
    ax.set(xscale="log", xlabel="tokens per GPU", ylabel="step time (ms)",
           title=SMOKE_LABEL if args.smoke else f"{args.layers} LLaMA-7B layers, {machine}")
    ax.legend()
    fig.savefig(out / "checkpoint.png", dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench/checkpoint.py needs a CUDA device; use --smoke for a CPU check of the script")
    device = torch.device("cpu") if args.smoke else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    rank, world = init_group(device.type)
    machine = f"CPU ({cpu_name()})" if args.smoke else torch.cuda.get_device_name(device)
    model, config = build(args, device, dtype, max(args.tokens) * world)
    rows = []
    for tokens in args.tokens:
        for variant in args.variants:
            rows.append(measure(args, model, config, variant, tokens, device, dtype, rank, world))
            if rank == 0:
                print({k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
        if rank == 0:  # the table so far: a run stopped early (a time budget) keeps what it measured
            add_speedups(rows)
            write(rows, args, machine, world)
    add_speedups(rows)
    if rank == 0:
        write(rows, args, machine, world)
        print(f"wrote {args.out}/checkpoint.md and checkpoint.csv" + (f"  ({SMOKE_LABEL})" if args.smoke else ""))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
