"""Command line, model presets and up-front validation of ``launch/train.py``.

Everything here runs before the process group exists: it reads only the arguments, the torchrun
environment and the file system, which every rank sees alike, so a bad argument makes every rank exit with
the same one-line reason (printed by rank 0) before any collective could hang. Heavy imports
(transformers) stay out of this module so that a bad argument fails fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from train_errors import EXIT_BAD_ARGS, report_error

DEFAULT_DATA = Path(__file__).resolve().parent / "data" / "kjv.txt.gz"
DEFAULT_CKPT_DIR = "runs/train"

# LlamaConfig fields per preset. vocab_size comes from the tokenizer (256 for the byte-level default) and
# max_position_embeddings from --seq-len, so they are not listed. Shapes above `small` follow published models.
PRESETS: dict[str, dict] = {
    # ~0.9 M parameters with the byte vocabulary: trains visibly on a laptop CPU in a minute.
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4),
    "tiny-gqa": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2),
    "tiny-mqa": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=1),
    # ~26 M parameters with the byte vocabulary.
    "small": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=8),
    "small-gqa": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=2),
    # TinyLlama-1.1B shape (GQA 32/4).
    "llama-1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                     num_key_value_heads=4),
    # LLaMA-2-7B shape (MHA), and the same with 8 key/value heads.
    "llama-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32),
    "llama-7b-gqa": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8),
    # LLaMA-3-8B shape (GQA 32/8, rope theta 5e5).
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, rope_theta=500000.0),
}

class UsageError(Exception):
    """A bad argument or environment; the message is the one line rank 0 prints (exit status 2)."""


class JobFailed(Exception):
    """A failure during training that every rank saw alike (a checkpoint save); one line, exit status 1."""


@dataclass(frozen=True, kw_only=True)
class Env:
    """Where this process sits, from the torchrun environment (rank 0 of 1 without torchrun)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @classmethod
    def from_environ(cls) -> Env:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        return cls(rank=int(os.environ.get("RANK", "0")), world_size=world,
                   local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                   local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The arguments after validation, with every ``auto`` resolved."""

    args: argparse.Namespace
    """The parsed command line (for fields that need no resolving)."""
    env: Env
    """This process's rank and world."""
    device_type: str
    """``"cuda"`` or ``"cpu"``."""
    dist_backend: str
    """Process-group backend: ``"nccl"`` or ``"gloo"``."""
    attn_backend: str
    """distattn kernel backend: ``"triton"`` or ``"torch"``."""
    dtype: torch.dtype
    """Compute dtype (parameters and optimizer state stay fp32)."""
    sp_size: int
    """Ranks that split one sequence (the distattn group)."""
    ulysses: int = 1
    """Ranks of the sequence-parallel group that split the heads (``--ulysses``; 1: a flat ring of ``sp_size``)."""
    dp_size: int
    """Data-parallel replicas of the sequence-parallel group: ``world_size // sp_size``."""
    preset: dict | None
    """LlamaConfig fields of the preset, or ``None`` for a checkpoint directory (``args.model``)."""
    data_path: Path
    """The first ``--data`` path (the shipped corpus by default)."""
    data_paths: tuple[Path, ...] = ()
    """Every ``--data`` path, globs expanded (``train_formats.expand``)."""

    @property
    def cuda_index(self) -> int:
        """This rank's GPU: its local rank, wrapped round the node's GPUs (gloo ranks may share one)."""
        return self.env.local_rank % torch.cuda.device_count()

    @property
    def ranks_per_gpu(self) -> int:
        """Local ranks sharing this rank's GPU (1 unless gloo ranks outnumber the GPUs)."""
        return len(range(self.cuda_index, self.env.local_world_size, torch.cuda.device_count()))

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step over the whole job."""
        return self.args.batch_size * self.args.seq_len * self.dp_size


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line on rank 0 only (every rank still exits)."""

    def error(self, message):
        report_error(f"{message} (see --help)")
        sys.exit(EXIT_BAD_ARGS)

    def print_help(self, file=None):
        if Env.from_environ().rank == 0:  # once per job, not once per rank (every rank still exits 0)
            super().print_help(file)


def _train_docstring() -> str:
    """launch/train.py's module docstring (read here: train.py imports this module, not the other way round)."""
    import ast

    source = Path(__file__).with_name("train.py").read_text(encoding="utf-8")
    return ast.get_docstring(ast.parse(source)) or ""


def build_parser() -> argparse.ArgumentParser:
    # --help shows train.py's docstring (its commands and output contract) above the options, as written.
    p = _Parser(prog="train.py", description=_train_docstring(), formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument_group("model")
    a.add_argument("--model", default="tiny", help=f"a preset ({', '.join(PRESETS)}) or a local Hugging Face "
                   "checkpoint directory (config.json + safetensors weights)")
    a.add_argument("--schedule", default=None, choices=("balanced", "ring", "zigzag", "placed", "auto"),
                   help="distattn causal schedule (default: balanced; with --memory auto: auto, weighed with the "
                   "memory plan); zigzag lays each sequence out as chunks r and 2P-1-r of 2P (--seq-len a multiple "
                   "of twice the sequence-parallel size); placed (with --pack; with --ulysses, of the ring's "
                   "shards): every step's stream on the work-balanced placement of its documents; auto: the cost "
                   "model's pick for this model and group (distattn.choose_schedule; DISTATTN_LINK=ib|nvlink); with "
                   "--pack placed is a candidate too, judged on the first batch's documents")
    a.add_argument("--backend", default="auto", choices=("auto", "triton", "torch"),
                   help="distattn kernel backend (auto: triton on CUDA, torch on CPU)")
    a.add_argument("--remat", action="store_true",
                   help="distattn's rematerialization-aware checkpointing (saves activation memory)")
    a.add_argument("--tile-loss", type=int, default=None, metavar="TOKENS",
                   help="LM head + loss over tiles of TOKENS tokens of each rank's shard, logits recomputed per tile "
                   "in backward: the (tokens, vocab) logits never exist (distattn.integrations.hf.tile_loss)")
    a.add_argument("--tile-mlp", type=int, default=None, metavar="TOKENS",
                   help="every decoder layer's MLP over tiles of TOKENS tokens, recomputed per tile in backward: "
                   "only the MLP input is kept (distattn.integrations.hf.tile_mlp)")
    a.add_argument("--offload-checkpoints", action="store_true",
                   help="keep what checkpointing keeps per layer in host memory between forward and backward "
                   "(copied out as produced, prefetched a layer ahead); layer-boundary checkpointing, or with "
                   "--remat the layer input and attention's out/lse")
    a.add_argument("--offload-optimizer", action="store_true",
                   help="FSDP2 CPUOffloadPolicy: fp32 parameters, gradients and AdamW states in host memory, the "
                   "optimizer step on the CPU (pinned memory on CUDA)")
    a.add_argument("--host-mem", type=float, default=None,
                   help="GiB of host memory per node that offload may use (default: MemAvailable)")
    a.add_argument("--memory", choices=("manual", "auto"), default="manual",
                   help="auto: the planner (python -m distattn.memory plan) picks remat or offloaded checkpoints, "
                   "tiled loss and MLP (tile sizes searched), optimizer offload and, unless --schedule is given, the "
                   "schedule: the cheapest in modelled step time that fits --seq-len on this GPU and host; prints "
                   "its pick, predicted peak and the runner-up; refused, naming the closest fit, if nothing fits")
    a.add_argument("--gpu-mem", type=float, default=None, help="GiB per GPU that --memory auto plans for, as given "
                   "(default: the total the device reports less --gpu-reserve; needed on CPU)")
    a.add_argument("--gpu-reserve", type=float, default=None, metavar="GIB", help="GiB per GPU kept out of the "
                   "plan and the memory check (default 2: CUDA context, NCCL buffers, fragmentation: see README)")
    a.add_argument("--no-memory-check", action="store_true",
                   help="start even if the memory model predicts the step will not fit the GPU")
    a.add_argument("--sp-size", type=int, default=0,
                   help="ranks per sequence-parallel group (default 0: all ranks); the rest is data parallel")
    a.add_argument("--ulysses", type=int, default=1,
                   help="two-dimensional sequence parallelism: U consecutive ranks of each sequence-parallel group "
                   "split the heads (all-to-all), the sp/U groups of them form a ring (default 1: one ring). U "
                   "must divide --sp-size and the model's query heads (key/value heads: divide or be divided by U)")
    t = p.add_argument_group("training")
    t.add_argument("--seq-len", type=int, default=2048, help="tokens per sample, global (split over sp ranks)")
    t.add_argument("--batch-size", type=int, default=2, help="samples per step per data-parallel replica")
    t.add_argument("--steps", type=int, default=40, help="optimizer steps (in total, counting resumed ones)")
    t.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    t.add_argument("--warmup", type=int, default=None, help="linear warm-up steps (default: steps/10, "
                   "at most 100); cosine decay to lr/10 after")
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm (0: off)")
    t.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"),
                   help="compute dtype, parameters stay fp32 (auto: bf16 on CUDA, fp32 on CPU)")
    t.add_argument("--seed", type=int, default=0)
    d = p.add_argument_group("data")
    d.add_argument("--data", default=None, nargs="+", metavar="PATH",
                   help="training data: files, folders or globs of one format, detected from the content (text, "
                   "JSON Lines, Parquet, a datasets save_to_disk folder, a token .npy; see --data-format; default: "
                   "the shipped public-domain corpus launch/data/kjv.txt.gz)")
    d.add_argument("--pack", action="store_true", help="padding-free training on documents of varied length: "
                   "the data's documents (text: split at blank lines and 'Book chapter' headings; a record or an "
                   "indexed span otherwise) are packed back to back into --seq-len streams, and attention stays "
                   "inside each document")
    d.add_argument("--tokenizer", default=None, help="a local Hugging Face tokenizer directory (default: "
                   "bytes, vocab 256; for a checkpoint --model, its own tokenizer)")
    f = p.add_argument_group("data formats and evaluation (launch/train_formats.py, launch/train_eval.py)")
    f.add_argument("--data-format", default="auto", choices=("auto", "text", "jsonl", "parquet", "hf", "tokens"),
                   help="auto: from the content (refused when the name says otherwise); text: UTF-8, documents end "
                   "at blank lines; jsonl: one JSON object a line; parquet; hf: a datasets save_to_disk folder; "
                   "tokens: a 1-D integer .npy of token ids, documents from FILE.npy.idx (int64 offsets, .npy) "
                   "or the tokenizer's EOS, used as they are")
    f.add_argument("--text-field", default="text", metavar="NAME",
                   help="the JSON field / table column holding each document (default: text)")
    f.add_argument("--bos", action=argparse.BooleanOptionalAction, default=None,
                   help="prepend the tokenizer's BOS token to every document (default: when the tokenizer has one)")
    f.add_argument("--eos", action=argparse.BooleanOptionalAction, default=None,
                   help="append the tokenizer's EOS token to every document (default: when the tokenizer has one)")
    f.add_argument("--eval-data", default=None, nargs="+", metavar="PATH",
                   help="held-out data, as --data (same format flags): its loss and perplexity over the training "
                   "job's own sequence-parallel forward, without gradients, in the progress output and --log-json")
    f.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="evaluate every N steps (0, the default: after the last step only)")
    f.add_argument("--eval-samples", type=int, default=0, metavar="N",
                   help="held-out windows of --seq-len per evaluation, the first N in file order (default 0: all)")
    f.add_argument("--sample-tokens", type=int, default=0, metavar="N",
                   help="after the last step, greedy-decode N tokens after a prompt from the (held-out) data; every "
                   "rank runs N forwards of --seq-len tokens (the sequence-parallel path), rank 0 prints the text")
    r = p.add_argument_group("runtime")
    r.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"), help="auto: cuda if available")
    r.add_argument("--dist-backend", default="auto", choices=("auto", "nccl", "gloo"),
                   help="process-group backend (auto: nccl on CUDA, gloo on CPU; gloo ranks may share a GPU)")
    r.add_argument("--shard", default="auto", choices=("auto", "fsdp", "ddp"),
                   help="parameter parallelism when world > 1 (auto: FSDP2, DDP if the backend cannot)")
    c = p.add_argument_group("checkpoints and logs")
    c.add_argument("--ckpt-dir", default=DEFAULT_CKPT_DIR, help=f"checkpoint directory (default {DEFAULT_CKPT_DIR})")
    c.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    c.add_argument("--keep", type=int, default=2,
                   help="intact checkpoints to keep (older ones and damaged ones deleted first)")
    c.add_argument("--resume", nargs="?", const="auto", default=None, choices=("auto", "must"),
                   help="continue from the newest intact checkpoint in --ckpt-dir; if there is none: start "
                   "from step 0 with a warning (--resume, --resume auto) or refuse with exit code 2 "
                   "(--resume must)")
    c.add_argument("--log-json", default=None, help="write one JSON record per step to this file")
    c.add_argument("--log-every", type=int, default=0,
                   help="progress line every N steps when stderr is not a terminal (default: ~20 lines)")
    c.add_argument("--no-progress", action="store_true", help="no progress bar: a plain line (step, loss, tokens/s, "
                   "memory) every --log-every steps instead")
    c.add_argument("--crash-at-step", type=int, default=0,
                   help="testing: the last rank kills itself (SIGKILL) right after step N, the others are left waiting "
                   "in the next step (first torchrun attempt only)")
    x = p.add_argument_group("outputs and positions (launch/train_export.py)")
    x.add_argument("--export-hf", default=None, metavar="DIR",
                   help="after the last step, write the trained model as a Hugging Face folder (safetensors, "
                   "config, generation config, tokenizer) to DIR, a new or empty directory; launch/export_hf.py "
                   "converts a --ckpt-dir checkpoint the same way")
    x.add_argument("--rope-scaling", default=None, metavar="TYPE:FACTOR",
                   help="scale the model's RoPE positions: linear:F or yarn:F (F >= 1; max_position_embeddings "
                   "grows F times; kept in the exported config); without it, a --seq-len beyond the model's "
                   "max_position_embeddings trains with a warning")
    return p


def _check_ranges(args) -> None:
    for name in ("seq_len", "batch_size", "steps", "keep", "ulysses"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("save_every", "log_every", "crash_at_step", "sp_size", "grad_clip", "weight_decay", "eval_every",
                 "eval_samples", "sample_tokens"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for name in ("tile_loss", "tile_mlp"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be a positive number of tokens per tile, got "
                             f"{getattr(args, name)}; e.g. 4096 (a tile longer than the shard is one tile)")
    for name, least in (("gpu_mem", "> 0"), ("gpu_reserve", ">= 0"), ("host_mem", "> 0")):  # GiB
        value = getattr(args, name)
        if value is not None and not (value > 0 or value == 0 and least == ">= 0"):
            raise UsageError(f"--{name.replace('_', '-')} must be {least} GiB, got {value}")
    if args.offload_optimizer and args.shard == "ddp":
        raise UsageError("--offload-optimizer needs FSDP2 (CPUOffloadPolicy); drop --shard ddp")
    if not args.lr > 0:
        raise UsageError(f"--lr must be > 0, got {args.lr}")
    if args.warmup is not None and not 0 <= args.warmup <= args.steps:
        raise UsageError(f"--warmup must be between 0 and --steps ({args.steps}), got {args.warmup}")


def _resolve_parallel(args, env: Env) -> tuple[int, int]:
    args.schedule = args.schedule or ("auto" if args.memory == "auto" else "balanced")  # auto: weighed in train_plan
    world = env.world_size
    sp = args.sp_size or world
    if world % sp:
        raise UsageError(f"--sp-size {sp} does not divide the world size {world}; use a divisor of {world}")
    if sp % args.ulysses:
        raise UsageError(f"--ulysses {args.ulysses} does not divide the sequence-parallel size {sp} (world "
                         f"{world}{'' if sp == world else f', --sp-size {sp}'}); use a divisor of {sp}")
    if args.schedule == "placed" and not args.pack:
        raise UsageError("--schedule placed places packed documents: add --pack (without it every sample is one "
                         "dense causal sequence, where the balanced or zigzag schedule is already optimal)")
    unit = sp * (2 if args.schedule == "zigzag" else 1)  # zigzag: two chunks per rank
    if args.seq_len % unit:
        lo, hi = args.seq_len // unit * unit, (args.seq_len // unit + 1) * unit
        what = f"the sequence-parallel size {sp}" if unit == sp else f"twice the sequence-parallel size {sp} " \
            f"(--schedule zigzag: two chunks per rank)"
        raise UsageError(f"--seq-len {args.seq_len} is not divisible by {what}; use a multiple of {unit}, e.g. "
                         f"{lo or hi} or {hi}")
    return sp, world // sp


def check_heads(cfg: "RunConfig", config) -> None:
    """``--ulysses U`` splits the heads over U ranks: refuse a model whose heads cannot be split (before the
    process group exists; ``config``: the model's transformers config)."""
    if cfg.ulysses == 1:
        return
    from distattn.schedule import ulysses_heads

    heads_q = config.num_attention_heads
    heads_kv = getattr(config, "num_key_value_heads", None) or heads_q
    try:
        ulysses_heads(heads_q, heads_kv, cfg.ulysses)
    except ValueError as exc:
        raise UsageError(f"--ulysses {cfg.ulysses} with --model {cfg.args.model} ({heads_q} query heads, {heads_kv} "
                         f"key/value heads): {exc}") from exc


def resolve_schedule(cfg: "RunConfig", config, dataset=None) -> None:
    """``--schedule auto``: the cost model's best schedule for this model, sequence length and group
    (``distattn.choose_schedule`` at the group's Ulysses degree; ``DISTATTN_LINK=ib|nvlink`` and
    ``DISTATTN_GPUS_PER_NODE`` describe the cluster), chosen before sharding so it may pick the zigzag layout.
    With ``--pack`` the candidates include ``placed`` (on a 2-D group: the placement of the ring's shards) and
    the model reads the documents of the first batch of the run (sample 0 on, the same on every rank: a representative packed stream, since the
    documents change every step). Deterministic: every rank picks the same. Rank 0 logs the choice and why."""
    if cfg.args.schedule != "auto":
        return
    import distattn

    heads_q = config.num_attention_heads
    heads_kv = getattr(config, "num_key_value_heads", None) or heads_q
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads_q
    allow, cu_seqlens, total = {"ring", "balanced", "zigzag"}, None, cfg.args.seq_len
    if cfg.args.pack and dataset is not None and cfg.sp_size > 1:
        _, positions = dataset.batch(0, cfg.args.batch_size)
        total = positions.numel()  # the batch's samples are one stream, split over the group
        cu_seqlens = (positions == 0).nonzero().flatten().tolist() + [total]
        allow = allow | {"placed"}
    choice = distattn.choose_schedule(cfg.sp_size, heads_q, heads_kv, head_dim, total // cfg.sp_size,
                                      dtype=cfg.dtype, allow=allow, ulysses=cfg.ulysses, cu_seqlens=cu_seqlens)
    cfg.args.schedule = choice.best.schedule
    if cfg.env.rank == 0:
        docs = f" (the first batch's {len(cu_seqlens) - 1} documents)" if cu_seqlens else ""
        print(f"--schedule auto{docs}: {choice.why()}", flush=True)


def _resolve_model(args) -> dict | None:
    if args.model in PRESETS:
        return PRESETS[args.model]
    path = Path(args.model)
    if path.is_dir() and (path / "config.json").is_file():
        has_tokenizer = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
        if args.tokenizer is None and not has_tokenizer:
            raise UsageError(f"--model {args.model} has no tokenizer files; pass --tokenizer DIR with the "
                             f"tokenizer it was trained with")
        return None
    raise UsageError(f"unknown --model {args.model!r}: not a preset ({', '.join(PRESETS)}) nor a directory "
                     f"holding a Hugging Face config.json")


def _resolve_runtime(args, env: Env) -> tuple[str, str, str, torch.dtype]:
    has_cuda = torch.cuda.is_available()
    device = args.device if args.device != "auto" else ("cuda" if has_cuda else "cpu")
    if device == "cuda" and not has_cuda:
        raise UsageError("--device cuda but torch sees no CUDA device; use --device cpu (or auto)")
    dist_backend = args.dist_backend if args.dist_backend != "auto" else ("nccl" if device == "cuda" else "gloo")
    # NCCL refuses two ranks on one GPU; gloo ranks may share them (local rank r uses GPU r % devices).
    if device == "cuda" and dist_backend == "nccl" and env.local_world_size > torch.cuda.device_count():
        raise UsageError(f"{env.local_world_size} ranks on this node but only {torch.cuda.device_count()} "
                         f"CUDA devices; use --nproc-per-node {torch.cuda.device_count()}, --device cpu, or "
                         f"--dist-backend gloo (ranks then share the GPUs)")
    if dist_backend == "nccl" and device != "cuda":
        raise UsageError("--dist-backend nccl needs --device cuda; use --dist-backend gloo on CPU")
    attn = _resolve_attn_backend(args.backend, device)
    dtype_name = args.dtype if args.dtype != "auto" else ("bf16" if device == "cuda" else "fp32")
    return device, dist_backend, attn, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]


def _resolve_attn_backend(name: str, device: str) -> str:
    from distattn import kernels

    if name == "auto":  # triton on CUDA when it imports; the torch reference everywhere else
        name = "triton" if device == "cuda" and _backend_ok(kernels, "triton", device) else "torch"
    try:
        kernels.get_backend(name, device)
    except ValueError as exc:
        raise UsageError(f"--backend {name}: {exc}") from exc
    return name


def _backend_ok(kernels, name: str, device: str) -> bool:
    try:
        kernels.get_backend(name, device)
    except ValueError:
        return False
    return True


def _resolve_data(args) -> tuple[Path, ...]:
    import train_formats  # imports this module

    if args.data is None and not DEFAULT_DATA.is_file():
        raise UsageError(f"the shipped corpus {DEFAULT_DATA} is missing; pass --data FILE")
    paths = train_formats.expand(args.data) if args.data is not None else [DEFAULT_DATA]
    if args.eval_data is not None:
        train_formats.expand(args.eval_data, "--eval-data")
    if args.tokenizer is not None and not Path(args.tokenizer).is_dir():
        raise UsageError(f"--tokenizer {args.tokenizer}: no such directory (a local Hugging Face tokenizer)")
    return tuple(paths)


def resolve(args: argparse.Namespace, env: Env) -> RunConfig:
    """Validate ``args`` against ``env``; raise ``UsageError`` with a one-line reason."""
    _check_ranges(args)
    sp, dp = _resolve_parallel(args, env)
    preset = _resolve_model(args)
    data_paths = _resolve_data(args)
    device, dist_backend, attn, dtype = _resolve_runtime(args, env)
    if args.crash_at_step > args.steps:
        raise UsageError(f"--crash-at-step {args.crash_at_step} is after the last step ({args.steps})")
    return RunConfig(args=args, env=env, device_type=device, dist_backend=dist_backend, attn_backend=attn,
                     dtype=dtype, sp_size=sp, ulysses=args.ulysses, dp_size=dp, preset=preset,
                     data_path=data_paths[0], data_paths=data_paths)
