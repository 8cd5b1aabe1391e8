"""Held-out loss and a greedy sample for ``launch/train.py`` (``--eval-data``, ``--eval-every``,
``--sample-tokens``).

Evaluation runs the training step's own forward and loss (the same ``shard_batch`` layout, packing and
sequence-parallel attention; the function ``train.batch_loss``) without gradients, over the first
``--eval-samples`` windows of ``--eval-data`` in file order (all of them by default, a whole multiple of the
data-parallel replicas: replica ``d`` reads its own consecutive share), so every evaluation sees the same tokens.
The result is the token-weighted mean cross-entropy over every target of those windows and its exponential.

The sample is greedy decoding through the same sequence-parallel path: the parameters are sharded over every
rank, so every rank runs each forward; a prompt (the first tokens of the first held-out window, else of the
first training window) is padded to ``--seq-len`` and each new token is the argmax of the logits at the last
real position (causal attention: the padding after it changes nothing), found on the rank that holds that
position. ``--sample-tokens N`` costs N forwards of ``--seq-len`` tokens.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist

from train_config import RunConfig, UsageError

PROMPT_TOKENS = 32  # at most; fewer when --seq-len leaves no room for the sample after them


def eval_sample_count(cfg: RunConfig, eval_set) -> int:
    """``--eval-samples`` (0: every window), rounded down to a whole multiple of the data-parallel replicas."""
    wanted = cfg.args.eval_samples or len(eval_set)
    if wanted > len(eval_set):
        raise UsageError(f"--eval-samples {wanted}: --eval-data holds only {len(eval_set)} samples of --seq-len "
                         f"{cfg.args.seq_len}; use at most {len(eval_set)}")
    count = wanted // cfg.dp_size * cfg.dp_size
    if count == 0:
        raise UsageError(f"--eval-data holds {len(eval_set)} samples of --seq-len {cfg.args.seq_len}, fewer than "
                         f"the {cfg.dp_size} data-parallel replicas; use more held-out data or a shorter --seq-len")
    return count


def targets(batch, pack: bool) -> int:
    """Target tokens of a batch: every token but each sequence's (packed: each document piece's) last."""
    if pack:
        ids, positions = batch
        return int(ids.numel() - (positions == 0).sum())
    return int(batch.numel() - batch.shape[0])


def evaluate(model, eval_set, count: int, cfg: RunConfig, device, loss_of) -> dict:
    """``{"eval_loss", "eval_ppl"}`` over windows ``0 .. count - 1`` of ``eval_set``, the same on every rank.

    ``loss_of(batch)``: the sequence-parallel group's mean loss of a batch on ``device`` (``train.batch_loss``).
    Every replica runs as many forwards (FSDP2 gathers parameters from all ranks at each one).
    """
    per_replica, size = count // cfg.dp_size, cfg.args.batch_size
    first = (cfg.env.rank // cfg.sp_size) * per_replica
    total, tokens = 0.0, 0
    model.eval()
    try:
        with torch.no_grad():
            for start in range(first, first + per_replica, size):
                batch = eval_set.windows(start, min(size, first + per_replica - start))
                n = targets(batch, cfg.args.pack)
                batch = tuple(t.to(device) for t in batch) if cfg.args.pack else batch.to(device)
                total += float(loss_of(batch)) * n
                tokens += n
    finally:
        model.train()
    # Ranks of one sequence-parallel group hold the same numbers: the world's sums keep the ratio.
    sums = torch.tensor([total, float(tokens)], dtype=torch.float64, device=device)
    dist.all_reduce(sums)
    loss = float(sums[0] / sums[1])
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0))}


def prompt_of(dataset, seq_len: int, new_tokens: int) -> np.ndarray:
    """The first tokens of ``dataset``'s first window, leaving room for ``new_tokens``."""
    window = dataset.window(0)
    window = window[0] if isinstance(window, tuple) else window
    return np.asarray(window[:max(1, min(PROMPT_TOKENS, seq_len - new_tokens))], dtype=np.int64)


def greedy_sample(model, prompt: np.ndarray, new_tokens: int, cfg: RunConfig, group, device) -> list[int]:
    """``new_tokens`` greedy tokens after ``prompt``, every rank taking part; the same list on every rank."""
    from distattn.integrations.hf import shard_batch

    seq = torch.zeros(1, cfg.args.seq_len, dtype=torch.int64)
    seq[0, :len(prompt)] = torch.from_numpy(prompt)
    out: list[int] = []
    model.eval()
    try:
        with torch.no_grad():
            for last in range(len(prompt) - 1, len(prompt) - 1 + new_tokens):
                inputs = shard_batch(seq, group=group, schedule=cfg.args.schedule)
                logits = model(input_ids=inputs["input_ids"].to(device),
                               position_ids=inputs["position_ids"].to(device)).logits
                here = (inputs["position_ids"][0] == last).nonzero().flatten()
                mine = int(logits[0, int(here[0])].argmax()) if len(here) else -1
                token = torch.tensor([mine], dtype=torch.int64, device=device)
                dist.all_reduce(token, op=dist.ReduceOp.MAX)  # only the holder's token is >= 0
                out.append(int(token))
                seq[0, last + 1] = int(token)
    finally:
        model.train()
    return out


def due(cfg: RunConfig, step: int) -> bool:
    """``--eval-data``: evaluate every ``--eval-every`` steps and after the last one."""
    every = cfg.args.eval_every
    return bool(cfg.args.eval_data) and (step == cfg.args.steps or bool(every) and step % every == 0)


def run(job, eval_set, batch_loss) -> dict:
    """Held-out loss and perplexity of ``job``'s model now (a ``train.Job``; ``batch_loss``: ``train.batch_loss``),
    the same on every rank."""
    return evaluate(job.model, eval_set, eval_sample_count(job.cfg, eval_set), job.cfg, job.device,
                    lambda batch: batch_loss(job.model, batch, job.cfg, job.group, job.mode))


def sample(job, dataset, log) -> dict:
    """``--sample-tokens``: greedy text after a prompt from the held-out (else training) data; ``log``ged on rank 0."""
    cfg, tokenizer = job.cfg, dataset.tokenizer
    prompt = prompt_of(dataset.eval_set or dataset, cfg.args.seq_len, cfg.args.sample_tokens)
    ids = greedy_sample(job.model, prompt, cfg.args.sample_tokens, cfg, job.group, job.device)
    out = {"prompt": tokenizer.decode(prompt), "text": tokenizer.decode(ids), "token_ids": ids}
    log(f"sample (greedy, {len(ids)} tokens): {out['prompt']!r} -> {out['text']!r}")
    return out


def check(cfg: RunConfig) -> None:
    """The evaluation flags alone (before any file is read)."""
    a = cfg.args
    if (a.eval_every or a.eval_samples) and not a.eval_data:
        raise UsageError(f"--{'eval-every' if a.eval_every else 'eval-samples'} needs --eval-data FILE (held-out data)")
    if a.sample_tokens >= a.seq_len:
        raise UsageError(f"--sample-tokens {a.sample_tokens} must be below --seq-len {a.seq_len} (the prompt and the "
                         f"sample share one sequence)")
