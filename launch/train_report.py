"""What ``launch/train.py`` reports: the job in one line, each step's job-wide loss and peak memory, what document
masking saves on a packed step, and the JSON summary at the end."""

from __future__ import annotations

import torch
import torch.distributed as dist

import train_log
import train_model
from train_config import RunConfig


def describe(cfg: RunConfig, config, dataset, tokenizer_name: str, mode: str) -> str:
    """The job in one line (rank 0 logs it before the first step)."""
    a = cfg.args
    return (f"model {a.model}: {train_model.count_params(config) / 1e6:.1f}M params, {config.num_hidden_layers} "
            f"layers, heads {config.num_attention_heads}/{config.num_key_value_heads} kv, vocab {config.vocab_size} "
            f"({tokenizer_name}) | world {cfg.env.world_size} = sp {cfg.sp_size}"
            f"{f' (ulysses {cfg.ulysses} x ring {cfg.sp_size // cfg.ulysses})' if cfg.ulysses > 1 else ''} x dp "
            f"{cfg.dp_size}, seq "
            f"{a.seq_len} ({a.seq_len // cfg.sp_size} per rank), batch {a.batch_size}/replica | {cfg.device_type} "
            f"{cfg.dist_backend}, attention {cfg.attn_backend}/{a.schedule}{' +remat' if a.remat else ''}"
            f"{f' +tile-mlp {a.tile_mlp}' if a.tile_mlp else ''}{f' +tile-loss {a.tile_loss}' if a.tile_loss else ''}"
            f"{' +offload-ckpt' if a.offload_checkpoints else ''}, params "
            f"{mode}, {str(cfg.dtype).removeprefix('torch.')} | data {cfg.data_path.name}"
            f"{f' +{len(cfg.data_paths) - 1} more' if len(cfg.data_paths) > 1 else ''} "
            f"({len(dataset.tokens) / 1e6:.2f}M tokens, {len(dataset)} samples/epoch"
            f"{', ' + str(dataset.num_documents) + ' documents packed' if a.pack else ''})")


def gather_stats(loss: torch.Tensor, device_type: str, device) -> tuple[float, list[int]]:
    """Job-wide loss (mean over data-parallel replicas) and every rank's peak memory, in one collective."""
    mine = torch.tensor([float(loss), float(train_log.peak_memory_bytes(device_type))], dtype=torch.float64,
                        device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    # Ranks of one sp group report the same loss and every dp replica has as many tokens: the plain mean is right.
    return sum(float(t[0]) for t in every) / len(every), [int(t[1]) for t in every]


def packing_stats(positions: torch.Tensor, sp: int, schedule: str = "balanced", ulysses: int = 1) -> dict:
    """What document masking saves on this step's stream, read off the plan the executor runs: the run's
    schedule (already resolved from "auto") over its ring of ``sp / ulysses`` ranks, each holding ``ulysses``
    ranks' tokens. ``pairs_skipped``: chunk pairs of that schedule's causal plan that no document reaches.

    Every token of a packed stream is real (documents are cut, never padded), so tokens/s counts real tokens.
    """
    from distattn.schedule import MaskSpec, Shapes, make_plan, pair_work, simulate

    starts = (positions == 0).nonzero().flatten().tolist()
    total = positions.numel()
    spec = MaskSpec(causal=True, cu_seqlens=tuple(starts) + (total,))
    visible = sum(map(sum, pair_work(spec, sp, total // sp)))
    ring = sp // ulysses
    plan = make_plan(ring, True, schedule, mask=spec, chunk=total // ring, stride=ulysses)  # a grid's ring: U apart
    # pairs the layout could need without documents: causal contiguous P(P+1)/2; zigzag and a placement, every pair
    dense = ring * ring if schedule == "placed" else len(
        make_plan(ring, True, schedule, mask=MaskSpec(causal=True), chunk=total // ring).pairs())
    idle = simulate(sp, True, schedule, Shapes(seq_per_rank=total // sp, heads_q=ulysses, heads_kv=ulysses, head_dim=1),
                    mask=spec, ulysses=ulysses).compute_idle_fraction  # the same plan's compute idle (work only)
    return {"documents": len(starts), "attention_work_vs_causal": visible / (total * (total + 1) / 2),
            "pairs_skipped": dense - len(plan.pairs()), "predicted_compute_idle": idle}



def summary(job, progress: dict, tokens_per_s: float | None, peak: list[int], saved_bytes, evals: list[dict],
            packed: list[dict]) -> dict:
    """The job's JSON summary (stdout's last line): the run, its speed and memory, the last held-out evaluation,
    and with ``--pack`` what document masking skipped (``packed``: the packed steps' records)."""
    cfg, args = job.cfg, job.cfg.args
    out = {"steps": progress["step"], "final_loss": progress["loss"], "tokens_per_s": tokens_per_s,
           "world_size": cfg.env.world_size, "seq_len": args.seq_len, "sp_size": cfg.sp_size, "ulysses": cfg.ulysses,
           "schedule": args.schedule, "model": args.model, "device": cfg.device_type, "params": job.mode,
           "peak_mem_bytes": peak, "pack": bool(args.pack), "predicted_peak_bytes": job.predicted_peak,
           "predicted_activation_bytes": job.predicted_activations, "saved_activation_bytes": saved_bytes,
           **job.step_memory}  # the step's predicted and measured peaks, device and host (train_memory.StepMeasure)
    if evals:  # the last held-out evaluation (the last step's)
        out.update(eval_loss=evals[-1]["eval_loss"], eval_ppl=evals[-1]["eval_ppl"], eval_step=evals[-1]["step"])
    if args.pack and packed:  # real tokens only (no padding exists), and what document masking skipped
        mean = {key: sum(r[key] for r in packed) / len(packed) for key in
                ("documents", "attention_work_vs_causal", "pairs_skipped", "predicted_compute_idle")}
        out.update(real_tokens_per_s=tokens_per_s, documents_per_step=mean["documents"],
                   attention_work_vs_causal=mean["attention_work_vs_causal"],
                   pair_work_skipped=1 - mean["attention_work_vs_causal"],
                   pairs_skipped_per_step=mean["pairs_skipped"],
                   predicted_compute_idle_per_step=mean["predicted_compute_idle"])
    return out
