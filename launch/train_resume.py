"""``launch/train.py``'s checkpoint directory before step 1: the up-front checks, and ``--resume``.

* Before the process group exists (:func:`check_checkpoint_dir`): ``--ckpt-dir`` writable with room for the
  run's checkpoints, ``--resume must`` with one to resume.
* Once it exists (:func:`maybe_resume`, every rank): interrupted saves removed or named, the newest intact
  checkpoint loaded, its progress checked against this run first (:func:`check_against_run`). A checkpoint's
  ``progress.json`` is read back only if it holds what train.py writes (``train_ckpt_files.check_progress``:
  every field's type and range, ``samples`` equal to the batches read since the layout began); this module adds
  what depends on the run: the step within ``--steps``, the ``--seq-len`` the data position was counted in, the
  directory's own step. A value that fails is one ``UsageError`` on every rank, before step 1.
* The progress it leaves records where this layout's stretch of batches began (``layout_from_step``,
  ``layout_from_samples``), so the next save's ``samples`` can be checked exactly however often the world changed.
"""

from __future__ import annotations

from pathlib import Path

import train_config
import train_export
import train_model
from train_config import RunConfig, UsageError


def check_checkpoint_dir(cfg: RunConfig, config, log) -> None:
    """Before any step: ``--ckpt-dir`` is writable with room for a checkpoint; ``--resume must`` has one."""
    import train_ckpt  # torch.distributed.checkpoint: ~1 s of imports that a bad argument should not wait for

    ckpt_dir = Path(cfg.args.ckpt_dir)
    args = cfg.args
    if not args.save_every and args.ckpt_dir != train_config.DEFAULT_CKPT_DIR and cfg.env.rank == 0:
        # A warning, not an error: the run itself is valid (and --resume alone reads the directory), but a
        # --ckpt-dir given without --save-every usually means the user expects checkpoints that never come.
        read = "is read (--resume) but" if args.resume else "is given but"
        log(f"warning: --ckpt-dir {ckpt_dir} {read} this run saves no checkpoint there: add --save-every N "
            f"(a checkpoint every N steps and at the last step)")
    if args.save_every:
        saves = args.steps // args.save_every + (args.steps % args.save_every > 0)  # the last step saves too
        copies = train_ckpt.new_copies(ckpt_dir, args.keep, saves)
        train_ckpt.preflight(ckpt_dir, train_model.count_params(config), cfg.env.rank, copies)
    if cfg.args.resume == "must" and not train_ckpt.complete_checkpoints(ckpt_dir):
        why = "the directory does not exist" if not ckpt_dir.is_dir() else "it holds no finished checkpoint"
        raise UsageError(f"--resume must: nothing to resume in --ckpt-dir {ckpt_dir} ({why})")


def check_against_run(cfg: RunConfig, path: Path, progress: dict) -> str | None:
    """What stops this run from resuming the checkpoint ``path`` whose (well-formed) ``progress`` it read; ``None``
    if nothing. Every rank asks, with the same arguments and file: the same answer."""
    step, steps, seq = progress["step"], cfg.args.steps, cfg.args.seq_len
    named = path.name[len("step_"):]
    if not named.isdigit() or int(named) != step:
        return (f"checkpoint {path} holds step {step} in its progress.json, not the step its name says: a directory "
                f"renamed or copied in from elsewhere; remove it or pass another --ckpt-dir")
    if step > steps:
        return (f"checkpoint {path} is at step {step}, beyond this run's --steps {steps}: pass --steps {step} or "
                f"more to train on from it, or another --ckpt-dir to start over")
    if progress["seq_len"] != seq:
        return (f"checkpoint {path} was trained with --seq-len {progress['seq_len']}, this run has --seq-len {seq}: "
                f"its data position ({progress['samples']} samples of {progress['seq_len']} tokens) means other "
                f"tokens at another length; resume with --seq-len {progress['seq_len']}, or export it "
                f"(launch/export_hf.py) and start a new run from it with --model DIR")
    return None


def maybe_resume(cfg: RunConfig, state, log) -> set[Path]:
    """``--resume``: load the newest intact checkpoint into ``state``; returns the damaged ones it skipped.

    Also removes the directories of saves that never finished (``--resume`` or ``--save-every``) and names the
    interrupted ones it keeps, with the checkpoint used instead. Every rank calls it (collectives).
    """
    import train_ckpt

    ckpt_dir, progress = Path(cfg.args.ckpt_dir), state.progress
    interrupted = train_ckpt.remove_incomplete(ckpt_dir, log) if cfg.args.resume or cfg.args.save_every else []
    path, damaged = None, set()
    if cfg.args.resume:
        path, damaged = train_ckpt.find_and_load(state, ckpt_dir, log,
                                                 check=lambda p, got: check_against_run(cfg, p, got))
    for kept in interrupted:
        log(f"warning: {kept} is an interrupted save: DCP wrote its shards and .metadata, but the job stopped "
            f"before the {train_ckpt.MANIFEST} train.py writes last, so it cannot be verified and is never resumed "
            f"from; {_instead(cfg, path)}; --keep rotates it away (or delete it)")
    if path is None:
        progress.update(layout_from_step=0, layout_from_samples=0)
        if cfg.args.resume:
            why = ("the directory does not exist" if not ckpt_dir.is_dir() else
                   f"{len(damaged)} damaged, none intact" if damaged else "it holds no finished checkpoint")
            if cfg.args.resume == "must":
                raise UsageError(f"--resume must: nothing to resume in --ckpt-dir {ckpt_dir} ({why})")
            log(f"warning: --resume: no checkpoint to resume in --ckpt-dir {ckpt_dir} ({why}); starting from step 0")
        return damaged
    log(f"resumed from {path} (step {progress['step']}, {progress['samples']} samples consumed)")
    _continue_layout(cfg, progress)
    moved = train_export.world_change(cfg, progress)  # another world size: what changed, where the data continues
    if moved:
        log(moved)
    data = " ".join(map(str, cfg.data_paths))
    for key, now in (("seed", cfg.args.seed), ("data", data)):
        if progress.get(key) != now:
            log(f"warning: the checkpoint was trained with {key}={progress.get(key)!r}, this run uses {now!r}: the "
                f"samples will not be the ones the original run would have read")
    return damaged


def _instead(cfg: RunConfig, path: Path | None) -> str:
    if path is not None:
        return f"resumed from {path} instead"
    if cfg.args.resume:
        return "there is no intact checkpoint to resume instead, so this run starts at step 0"
    return "this run starts at step 0 (no --resume; pass --resume to continue from the newest intact checkpoint)"


def _continue_layout(cfg: RunConfig, progress: dict) -> None:
    """The loaded ``progress``'s stretch of batches goes on if this run reads as many samples per step and the
    checkpoint recorded where it began; otherwise a new one begins at the checkpoint (before ``world_change``
    replaces the checkpoint's layout with this run's)."""
    before = progress.get("batch_size", 0) * progress.get("dp_size", 0)
    if before != cfg.args.batch_size * cfg.dp_size or "layout_from_step" not in progress:
        progress.update(layout_from_step=progress["step"], layout_from_samples=progress["samples"])
