"""Train a LLaMA model with distattn sequence parallelism: the torchrun entry point.

Every rank holds only its part of each sequence (``--seq-len`` is global: rank r of the sequence-parallel
group holds tokens ``[r*n, (r+1)*n)``, or two chunks with ``--schedule zigzag``); attention is exact over the
whole sequence through distattn, and the parameters are sharded with FSDP2 over all ranks. It runs wherever
torch runs: CUDA + NCCL + the Triton kernels when there are GPUs, CPU + gloo + the pure-PyTorch kernels otherwise
(chosen automatically; ``--device``, ``--dist-backend``, ``--backend`` override).

Quick start. CPU is enough: 4 gloo ranks train the ``tiny`` preset for 40 steps on the shipped public-domain
corpus, 2048-token sequences of which each rank holds 512. Measured: 60 s wall on an idle 2-core machine; the
loss falls from 5.6 (uniform over bytes) to 2.56::

    pip install -e ".[hf]" && torchrun --standalone --nproc-per-node 4 launch/train.py

One node, 8 GPUs, a LLaMA-7B-shaped model on 32k-token sequences (4k per GPU), with distattn's
rematerialization-aware checkpointing, a checkpoint every 100 steps, resumable::

    torchrun --standalone --nproc-per-node 8 launch/train.py --model llama-7b --seq-len 32768 --batch-size 1 \\
        --steps 1000 --lr 3e-4 --remat --save-every 100 --ckpt-dir runs/7b --resume --log-json runs/7b.jsonl

Survive crashes: torchrun restarts every rank, and ``--resume`` continues from the newest intact checkpoint
with the same data position (at most the steps since the last save are lost; the JSON log marks the steps
done again with ``"redone": true``)::

    torchrun --standalone --nproc-per-node 4 --max-restarts 3 launch/train.py --save-every 20 --resume

``--resume`` with nothing to resume in ``--ckpt-dir`` warns (naming the directory) and starts from step 0;
``--resume must`` refuses instead. Checkpoints (``train_ckpt``) carry a sha256 manifest written last and
checked before loading: a damaged newest one is skipped with a warning and the previous one is used, and
loading never runs code from the files nor reads any file outside the checkpoint (no symbolic links). One job
per ``--ckpt-dir`` at a time: a second one stops before step 1 naming the holder; a crashed job's lock is
taken over. Each save logs ``saved checkpoint step N to DIR (X MB, Y s)``.

Padding-free training on documents of varied length (``--pack``): the text is split into documents (blank lines;
the shipped corpus: its 1,189 chapters, 200 B to 13 KB) that are packed back to back into ``--seq-len`` streams,
cut where they overflow; attention stays inside each document and the plan skips the chunk pairs that share
none. The JSON summary adds ``real_tokens_per_s`` (every token is real: nothing is padded),
``documents_per_step``, ``attention_work_vs_causal``, ``pair_work_skipped``, ``pairs_skipped_per_step`` and
``predicted_compute_idle_per_step`` (the simulator's compute idle of the plan each step runs). ``--schedule placed``
shards every step's stream on the work-balanced placement of its documents (``distattn.schedule.placement``)::

    torchrun --standalone --nproc-per-node 4 launch/train.py --pack --seq-len 8192 --batch-size 1
    torchrun --standalone --nproc-per-node 4 launch/train.py --pack --seq-len 8192 --batch-size 1 --schedule placed

``DISTATTN_AUTOTUNE=1`` (CUDA, Triton backend): before step 1, rank 0 benchmarks the Triton kernels' launch configs
for this run's attention shapes (or reads them from its cache, ``DISTATTN_TUNE_CACHE``, default
``~/.cache/distattn/tune``) and every rank uses rank 0's choice (``distattn.autotune``); on CPU it logs
that it is skipped.

Token-wise work over tiles: ``--tile-loss TOKENS`` runs the LM head and the loss over tiles of each rank's shard,
recomputing each tile's logits in backward (the ``(tokens, vocab)`` logits never exist); ``--tile-mlp TOKENS`` runs
every MLP over tiles, keeping only its input for backward. Same loss and gradients (to fp32 rounding); they
compose with ``--remat``.

A Hugging Face model at the end: ``--export-hf DIR`` (new or empty; checked before step 1) gathers the trained
parameters on rank 0 after the last step and writes a Hugging Face folder there (``model.safetensors``,
``config.json``, ``generation_config.json``, the tokenizer: a ``--tokenizer``/``--model`` one as saved by
transformers, the byte tokenizer as an equivalent byte-level one) and logs ``exported the trained model to DIR``;
``AutoModelForCausalLM.from_pretrained(DIR)`` gives the fp32 weights bit for bit. Every checkpoint carries the
same config and tokenizer files (``hf/``, in its manifest), so ``python launch/export_hf.py CKPT_DIR OUT_DIR``
(or ``python -m launch.export_hf`` from the repository root) converts the newest intact checkpoint of a
``--ckpt-dir``, or one ``step_N`` directory, written at any world size::

    torchrun --standalone --nproc-per-node 4 launch/train.py --save-every 20 --export-hf runs/tiny-hf
    python launch/export_hf.py runs/train runs/tiny-hf-from-ckpt

Positions: a ``--seq-len`` beyond a ``--model DIR``'s ``max_position_embeddings`` trains with one warning that
names the RoPE scaling its config offers (``rope_parameters``); ``--rope-scaling linear:F`` or ``yarn:F`` (F >= 1)
applies one, ``max_position_embeddings`` grows F times, and the exported config keeps it. ``--resume`` at another
world size (DCP reshards parameters and optimizer state) logs the old and new layout (world, sp x dp, tokens per
rank) and which samples the next step reads: the data position is a global sample count.

Several nodes: ``launch/multinode.sh`` (torchrun rendezvous flags) and ``launch/train.slurm`` (SLURM).
Your own model and data: ``--model DIR`` (a local Hugging Face LLaMA-family checkpoint with safetensors weights;
its tokenizer is used), ``--tokenizer DIR`` (a local Hugging Face tokenizer), ``--data PATH...`` (files, folders or
globs, all of one format, recognized from the content; ``--data-format`` overrides)::

    text      UTF-8, plain or .gz; a blank line ends a document
    jsonl     JSON Lines, plain or .gz; the document is each object's --text-field (default "text")
    parquet   Parquet (pip install -e ".[data]"), the --text-field column, read a batch of rows at a time
    hf        a folder written by datasets' save_to_disk (".[data]"): one split's folder, --text-field column
    tokens    pre-tokenized: a 1-D integer .npy of token ids (uint16/uint32/int32/int64), memory-mapped; documents
              from FILE.npy.idx beside it (a .npy of int64 offsets: 0, each document's end, the token count),
              else end after each EOS id of the tokenizer; the ids are used as they are (no BOS/EOS added)

A file whose name says one format and whose content another (a .jsonl of plain text), mixed content or mixed
formats, binary data of no known format, a missing text field and token ids beyond the model's vocabulary stop
the job before step 1 with one ``train.py: error:`` line. Documents get the tokenizer's BOS and EOS tokens when it
has them (``--no-bos``/``--no-eos`` drop them; the byte tokenizer has none). Nothing holds the data set in memory:
documents are read lazily and tokenized once into a memory-mapped temporary file per rank (``TMPDIR``, 4 bytes a
token, gone when the job ends); token files are mapped as they are, so a corpus larger than RAM or ``TMPDIR`` is
best tokenized once (``python launch/train_tokenize.py --tokenizer DIR --out corpus.npy DATA...``).

Held-out loss: ``--eval-data PATH...`` (same formats and flags) is evaluated every ``--eval-every N`` steps and
after the last, over its first ``--eval-samples`` windows of ``--seq-len`` (default: all) in file order, with the
training step's own forward (the same sharding, packing and sequence-parallel attention) and no gradients; the
token-mean loss and its perplexity go to the progress output (``eval at step N: held-out loss L, perplexity P``)
and the JSON record of that step (``"eval_loss"``, ``"eval_ppl"``), the last one to the summary.
``--sample-tokens N`` greedy-decodes N tokens after the first 32 tokens of the held-out (else training) data at
the end: every rank runs N forwards of ``--seq-len`` tokens through the sequence-parallel path (the parameters
are sharded), rank 0 logs the text and the summary holds it (``"sample"``)::

    torchrun --standalone --nproc-per-node 4 launch/train.py --tokenizer tok/ --data 'corpus/*.parquet' \
        --eval-data held_out.jsonl --eval-every 100 --eval-samples 64 --sample-tokens 64
``--sp-size S`` splits each sequence over S ranks only; the world is then ``world/S`` data-parallel replicas.
``--schedule zigzag`` lays each sequence out as chunks ``r`` and ``2S-1-r`` of ``2S`` (causal work balanced by
layout); ``--ulysses U`` makes the sequence-parallel group two-dimensional: ``U`` consecutive ranks split the heads
by all-to-all and ``S/U`` of those groups form the ring (``U`` divides ``S`` and the model's query heads)::

    torchrun --standalone --nproc-per-node 4 launch/train.py --model tiny-gqa --ulysses 2 --schedule zigzag

Output: rank 0 draws a progress line on stderr (loss, tokens/s over the job, each rank's peak memory: CUDA
allocator peak on GPU, peak RSS on CPU); ``--log-json FILE`` writes one JSON record per step (its folder is
created); the last line on stdout is a JSON summary ``{"steps", "final_loss", "tokens_per_s", "world_size",
"seq_len", ...}``. A bad argument or an unusable path (missing or unreadable ``--data``, an ``--export-hf`` folder
that is not empty, a ``--ckpt-dir`` that is not writable, has no room for a checkpoint or is in use by another job,
a checkpoint of another model, a ``--log-json`` file that cannot be written) makes every rank exit with status 2,
rank 0 printing one ``train.py: error:`` line; the checks that need no process group run before it exists
(before step 1). torchrun then adds its own failure report, whose root cause quotes the same line.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


def _stopped_while_preparing(signum, frame) -> None:
    """SIGTERM before the process group exists: torchrun stops this rank because another one failed to prepare.

    Every rank checks the same arguments, paths and data before the process group exists, and torchrun stops the
    others with SIGTERM as soon as one exits. A rank still importing or loading when rank 0 finds the fault would
    otherwise show up as killed by a signal (exit -15) next to rank 0's status 2. It leaves with rank 0's status at
    once; ``start`` restores the default once the process group is up.
    """
    sys.stderr.flush()
    os._exit(2)  # train_errors.EXIT_BAD_ARGS (imported below, after torch: this must be in place first)


if "RANK" in os.environ:  # launched by torchrun: set before the slow imports, where a lagging rank spends its time
    signal.signal(signal.SIGTERM, _stopped_while_preparing)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import train_config  # noqa: E402
import train_data  # noqa: E402
import train_errors  # noqa: E402
import train_eval  # noqa: E402
import train_export  # noqa: E402
import train_lock  # noqa: E402
import train_log  # noqa: E402
import train_memory  # noqa: E402
import train_model  # noqa: E402
import train_offload  # noqa: E402
import train_placement  # noqa: E402
import train_report  # noqa: E402
import train_resume  # noqa: E402
import train_tune  # noqa: E402
from train_config import Env, JobFailed, RunConfig, UsageError  # noqa: E402
from train_errors import EXIT_BAD_ARGS  # noqa: E402
from train_groups import init_distributed, sequence_group  # noqa: E402
from train_report import packing_stats  # noqa: E402,F401 - re-exported for the tests

assert EXIT_BAD_ARGS == 2, "_stopped_while_preparing exits with it"


def log(msg: str) -> None:
    """A line on rank 0's stderr."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[train] {msg}", file=sys.stderr, flush=True)


def lr_at(step: int, cfg: RunConfig) -> float:
    """Linear warm-up to ``--lr``, then cosine decay to ``--lr / 10`` at the last step (``step`` is 1-based)."""
    args = cfg.args
    warmup = args.warmup if args.warmup is not None else min(100, args.steps // 10)
    if step <= warmup:
        return args.lr * step / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def setup_model(cfg: RunConfig, config, group, device):
    """Build, switch attention to distattn, optionally remat, shard; returns ``(model, shard_mode)``."""
    from distattn.integrations.hf import tile_loss, tile_mlp, use_distattn

    # --offload-optimizer: every rank builds the weights (train_model.shard says why)
    everywhere = cfg.env.world_size == 1 or cfg.args.offload_optimizer
    model = train_model.build(cfg, config, materialize=everywhere or cfg.env.rank == 0)
    use_distattn(model, group=group, schedule=cfg.args.schedule, backend=cfg.attn_backend)
    train_offload.enable_checkpointing(cfg, model)  # --remat, --offload-checkpoints
    if cfg.args.tile_mlp:
        tile_mlp(model, cfg.args.tile_mlp)
    if cfg.args.tile_loss:  # model(..., shift_labels=) returns the group's mean loss; the head stays in the root
        tile_loss(model, cfg.args.tile_loss, group=group)
    model, mode = train_model.shard(model, cfg, device, log, group)
    model.train()
    return model, mode


def train_step(model, optimizer, batch, cfg: RunConfig, group, mode: str,
               measure: dict | None = None) -> tuple[torch.Tensor, float]:
    """One optimizer step on this rank's shard of ``batch`` ``(b, seq)``; returns ``(loss, grad_norm)``.

    ``measure``: a dict that receives ``saved_activation_bytes``, what this step's forward saved for backward.
    """
    from distattn.memory import saved_activations

    counting = saved_activations(ignore=model.parameters()) if measure is not None else contextlib.nullcontext()
    with counting as saved:
        loss = batch_loss(model, batch, cfg, group, mode)
    if measure is not None:
        measure["saved_activation_bytes"] = saved.bytes
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.args.grad_clip or float("inf"))
    if hasattr(norm, "full_tensor"):  # FSDP2: a replicated DTensor
        norm = norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach(), float(norm)


def batch_loss(model, batch, cfg: RunConfig, group, mode: str) -> torch.Tensor:
    """The sequence-parallel group's mean loss of ``batch`` (the same on every rank of the group); the training
    step's forward, and held-out evaluation's (``train_eval``, under ``no_grad``)."""
    from distattn.integrations.hf import causal_lm_loss, shard_batch

    if cfg.args.pack:  # one packed stream: the batch's samples back to back, positions restarting per document
        ids, positions = batch
        window = train_placement.window_of(model, ids)  # placed: balance its work
        inputs = shard_batch(ids[None], labels=ids[None], group=group, schedule=cfg.args.schedule,
                             position_ids=positions[None], window=window)
    else:  # laid out as the model's attention schedule expects (zigzag: chunks r and 2P-1-r of 2P)
        inputs = shard_batch(batch, labels=batch, group=group, schedule=cfg.args.schedule)
    docs = train_placement.placed_documents(cfg, inputs)
    with train_model.autocast(cfg, mode):
        # This rank's term of the global token mean; parameter gradients are summed over the sp group by the
        # FSDP2/DDP reduction (train_model's docstring).
        if cfg.args.tile_loss:  # the same loss, computed inside the model's forward over tiles (no logits)
            return model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"],
                         shift_labels=inputs["shift_labels"], **docs).loss
        logits = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], **docs).logits
        return causal_lm_loss(logits, inputs["shift_labels"], group=group)


def crash_now(cfg: RunConfig, step: int) -> bool:
    """``--crash-at-step``: simulate a crash, on torchrun's first attempt only (restarts then succeed)."""
    return cfg.args.crash_at_step == step and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


@dataclass
class Job:
    """A started job: the process group is up, the model sharded, the checkpoint (if any) loaded."""

    cfg: RunConfig
    device: torch.device
    group: object  # the sequence-parallel group (None: all ranks; a pair or a 2-D mesh with --ulysses)
    model: torch.nn.Module
    mode: str  # "fsdp2" / "ddp" / "none"
    optimizer: torch.optim.Optimizer
    state: object  # train_ckpt.TrainState; its .progress dict is the job's position
    damaged: set  # checkpoints found damaged on resume: never counted by --keep
    first_step: int = 0  # the step this run starts after (a resumed run: the checkpoint's)
    predicted_activations: int = 0  # the memory model's saved-activation bytes of one forward per rank
    predicted_peak: int = 0  # the memory model's peak bytes of one step per rank
    step_memory: dict = field(default_factory=dict)  # the step's predicted and measured peaks (train_memory)
    hf_files: dict | None = None  # rank 0: the model's config and tokenizer files (checkpoints' hf/, --export-hf)


def start(cfg: RunConfig, config, dataset, tokenizer_name: str) -> Job:
    import train_ckpt  # torch.distributed.checkpoint: ~1 s of imports that a bad argument should not wait for

    device = init_distributed(cfg)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # from here on errors are agreed on: see _stopped_while_preparing
    if cfg.args.save_every or cfg.args.resume:  # one job per --ckpt-dir, before anything there is read or deleted
        train_ckpt.lock(Path(cfg.args.ckpt_dir), log)
    group = sequence_group(cfg)
    model, mode = setup_model(cfg, config, group, device)
    log(train_report.describe(cfg, config, dataset, tokenizer_name, mode))
    optimizer = torch.optim.AdamW(train_model.param_groups(model, cfg.args.weight_decay), lr=cfg.args.lr,
                                  betas=(0.9, 0.95), eps=1e-8)
    progress = {"step": 0, "samples": 0, "loss": float("nan"), "seq_len": cfg.args.seq_len, "seed": cfg.args.seed,
                "data": " ".join(map(str, cfg.data_paths)), **train_export.layout(cfg)}
    state = train_ckpt.TrainState(model, optimizer, progress)
    damaged = train_resume.maybe_resume(cfg, state, log)
    log(train_memory.describe(cfg, config))
    train_tune.autotune_attention(cfg, config, device, log)
    return Job(cfg=cfg, device=device, group=group, model=model, mode=mode, optimizer=optimizer, state=state,
               damaged=damaged, first_step=progress["step"],
               predicted_activations=train_memory.predicted_activation_bytes(cfg, config),
               predicted_peak=train_memory.step_prediction(cfg, config, mode).total,
               step_memory=train_memory.prediction_fields(cfg, config, mode),
               hf_files=train_export.files(cfg, config))


def run_step(job: Job, dataset, step: int) -> dict:
    """Train step ``step`` (1-based); returns its JSON record."""
    cfg, progress = job.cfg, job.state.progress
    t0 = time.perf_counter()
    lr = lr_at(step, cfg)
    for param_group in job.optimizer.param_groups:
        param_group["lr"] = lr
    dp_rank = cfg.env.rank // cfg.sp_size  # replicas read consecutive, disjoint samples
    first = progress["samples"] + dp_rank * cfg.args.batch_size
    batch = dataset.batch(first, cfg.args.batch_size)
    # placed: the next batches' placements started in workers, this batch's taken (solved while the last steps ran)
    solved = train_placement.placements(job, dataset, batch, step, first)
    batch = tuple(t.to(job.device) for t in batch) if cfg.args.pack else batch.to(job.device)
    measured = {} if step == job.first_step + 1 else None  # what the first step's forward saves, once
    # the whole step's peak, device and host, once AdamW holds its states (the second step; a one-step run: the first)
    step_mem = train_memory.StepMeasure(job) if step == min(job.first_step + 2, cfg.args.steps) else None
    with step_mem or contextlib.nullcontext():
        loss, grad_norm = train_step(job.model, job.optimizer, batch, cfg, job.group, job.mode, measured)
    if step_mem is not None:
        job.step_memory.update(step_mem.fields)
    loss_value, peak = train_report.gather_stats(loss, cfg.device_type, job.device)  # a collective: every rank is done
    dt = time.perf_counter() - t0
    progress.update(step=step, samples=progress["samples"] + cfg.args.batch_size * cfg.dp_size, loss=loss_value)
    record = {"step": step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm, "step_time_s": dt,
              "tokens_per_s": cfg.tokens_per_step / dt, "samples": progress["samples"], "peak_mem_bytes": peak}
    if cfg.args.pack:
        record.update(train_report.packing_stats(batch[1], cfg.sp_size, cfg.args.schedule, cfg.ulysses), **solved)
    if measured:
        record.update(measured, predicted_activation_bytes=job.predicted_activations)
    return record


def train(job: Job, dataset) -> dict:
    """The training loop from the job's current step to ``--steps``; returns the summary."""
    import train_ckpt

    cfg, args, progress = job.cfg, job.cfg.args, job.state.progress
    first_step, rank0 = progress["step"], cfg.env.rank == 0
    bar = train_log.Progress(args.steps, first_step, enabled=rank0, log_every=args.log_every, plain=args.no_progress,
                             mem_label="peak alloc" if cfg.device_type == "cuda" else "peak rss")
    jlog = train_log.JsonLog(args.log_json if rank0 else None, append=bool(args.resume))
    timed_tokens, timed_s, peak, packed, saved_bytes, evals = 0, 0.0, [], [], None, []
    try:
        for step in range(first_step + 1, args.steps + 1):
            record = run_step(job, dataset, step)
            peak = record["peak_mem_bytes"]
            if "documents" in record:
                packed.append(record)
            saved_bytes = record.get("saved_activation_bytes", saved_bytes)
            if step > first_step + 1 or step == args.steps:  # the first step warms up: not in the average
                timed_tokens, timed_s = timed_tokens + cfg.tokens_per_step, timed_s + record["step_time_s"]
            if train_eval.due(cfg, step):
                record.update(train_eval.run(job, dataset.eval_set, batch_loss))
                evals.append(record)
                log(f"eval at step {step}: held-out loss {record['eval_loss']:.4f}, "
                    f"perplexity {record['eval_ppl']:.2f}")
            jlog.write(record)
            bar.update(step, record["loss"], timed_tokens / timed_s if timed_s else record["tokens_per_s"], peak,
                       record.get("eval_loss"))
            if args.save_every and (step % args.save_every == 0 or step == args.steps):
                train_ckpt.save(job.state, Path(args.ckpt_dir), step, args.keep, job.damaged, log,
                                extra={f"hf/{name}": data for name, data in (job.hf_files or {}).items()})
            if crash_now(cfg, step):
                bar.close()
                log(f"--crash-at-step {step}: rank {cfg.env.world_size - 1} kills itself (SIGKILL, simulated failure)")
                if cfg.env.rank == cfg.env.world_size - 1:
                    os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no process-group shutdown
                # The other ranks carry on into the next step's collectives and wait there, as after a real
                # crash, until torchrun sees the dead worker and stops them.
    finally:
        bar.close()
        jlog.close()
    summary = train_report.summary(job, progress, timed_tokens / timed_s if timed_s else None, peak, saved_bytes, evals,
                                   packed)
    if args.sample_tokens and progress["step"] == args.steps:
        summary["sample"] = train_eval.sample(job, dataset, log)
    return summary


def prepare(argv) -> tuple[RunConfig, train_data.PackedSequences | train_data.DocumentStream, object, str]:
    """Everything that can fail from a bad argument, before any process-group communication."""
    cfg = train_config.resolve(train_config.build_parser().parse_args(argv), Env.from_environ())
    train_tune.check_env()  # a bad DISTATTN_AUTOTUNE fails here, before the process group exists
    if cfg.env.rank != 0:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # warnings once, from rank 0
    train_eval.check(cfg)
    tokenizer = train_data.make_tokenizer(cfg.args.tokenizer, cfg.args.model if cfg.preset is None else None)
    dataset = train_data.load(cfg, tokenizer)
    config = train_model.hf_config(cfg, tokenizer.vocab_size)
    train_export.rope_guard(cfg, config)  # --rope-scaling applied, or a --seq-len past the model's positions warned
    train_config.check_heads(cfg, config)  # --ulysses: the heads must split over the Ulysses ranks
    train_memory.plan(cfg, config, log, dataset)  # --memory auto: checkpointing, tiles, offload and schedule
    train_config.resolve_schedule(cfg, config, dataset)  # --schedule auto: the cost model's pick, before sharding
    train_data.check_vocab(dataset, config.vocab_size)
    if dataset.eval_set is not None:
        train_data.check_vocab(dataset.eval_set, config.vocab_size, "--eval-data")
        train_eval.eval_sample_count(cfg, dataset.eval_set)  # enough held-out windows for every replica
    train_resume.check_checkpoint_dir(cfg, config, log)
    train_log.check_json_log(cfg.args.log_json)  # its folder created; rank 0 opens it after the first step
    train_export.preflight(cfg, config)  # --export-hf: a new or empty, writable directory with room
    train_memory.check(cfg, config)  # a job predicted not to fit the GPU stops here, before any allocation
    train_model.check_weights(cfg)  # --model DIR: safetensors present (rank 0 alone reads them, after this)
    train_offload.check(cfg, config)  # offload: pinned memory on CUDA, and the node's host memory
    return cfg, dataset, config, tokenizer.name


def fail(message: str, code: int) -> int:
    """One line from rank 0, the process group shut down, exit status ``code`` on every rank.

    Every rank reaches this together: errors after the process group exists are agreed on by all ranks
    (train_ckpt), so none is left waiting in a collective.
    """
    train_errors.report_error(message, code)
    return finish(code)


def main(argv=None) -> int:
    try:
        cfg, dataset, config, tokenizer_name = prepare(argv)
        job = start(cfg, config, dataset, tokenizer_name)
        summary = train(job, dataset)
        train_export.export_at_end(cfg, job.model, job.hf_files, log)  # --export-hf
    except UsageError as exc:
        return fail(str(exc), EXIT_BAD_ARGS)
    except JobFailed as exc:
        return fail(str(exc), 1)
    if cfg.env.rank == 0:
        train_log.print_summary(summary)
    return finish(0)


def finish(code: int) -> int:
    """End a job whose process group is up: every rank waits for all, then leaves without tearing gloo down.

    Destroying the groups while a peer's connections are closing can make gloo abort a finished rank
    ("terminate called without an active exception", exit -6; seen in CI), so the process exits directly.
    """
    if not dist.is_initialized():
        return code
    try:
        dist.barrier()
    except Exception:  # noqa: BLE001  (a peer already gone: exit all the same)
        pass
    train_lock.release()  # rank 0: every rank is done with --ckpt-dir; the next job sees no holder
    train_errors.exit_now(code)  # a failing rank != 0 writes its reason for torchrun's report now, after rank 0


if __name__ == "__main__":
    try:
        status = main()
    except SystemExit as exc:  # argparse: --help (0), or a bad flag (2, its line already reported)
        status = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    # Leave without the interpreter's teardown, as a job whose process group is up already does (``finish``): a rank
    # still tearing down when torchrun stops it (another rank left) would show up as killed by SIGTERM.
    train_errors.exit_now(status)
