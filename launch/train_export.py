"""Outputs and guards of ``launch/train.py``: ``--export-hf``, ``--rope-scaling``, resuming on another world.

* ``--export-hf DIR``: after the last step every rank gathers the model's whole fp32 parameters onto rank 0
  (``get_model_state_dict``, a collective), which writes a Hugging Face folder (``export_hf.write_folder``:
  safetensors, config, generation config, tokenizer). DIR must be new or empty: checked on every rank before the
  process group exists. The same config and tokenizer files are stored in every checkpoint (``hf/``), so
  ``launch/export_hf.py`` converts any checkpoint later.
* ``--seq-len`` beyond the model's ``max_position_embeddings`` warns (rank 0, one line) naming the RoPE scaling
  its config offers; ``--rope-scaling TYPE:FACTOR`` applies one (``linear`` or ``yarn``: both fixed per position,
  so every sequence-parallel rank rotates alike; ``dynamic`` scaling depends on the longest position a rank
  sees, which differs between ranks, and is not offered).
* Resuming at another world size (DCP reshards the model and optimizer): rank 0 logs the old and new layout
  and which samples the next step reads.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

from train_config import JobFailed, RunConfig, UsageError

ROPE_TYPES = ("linear", "yarn")
PROBE = ".write-test-"  # train_ckpt.preflight's probe files: another rank's may be there for a moment
LAYOUT = ("world_size", "sp_size", "ulysses", "dp_size", "batch_size")  # stored in the checkpoint's progress


def say(cfg: RunConfig, line: str) -> None:
    """A line on rank 0's stderr (before the process group exists every rank runs the same checks)."""
    if cfg.env.rank == 0:
        print(f"[train] {line}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------- before step 1


def preflight(cfg: RunConfig, config) -> None:
    """``--rope-scaling`` parses; ``--export-hf`` is a new or empty directory that can be written, with room for
    the fp32 weights. Every rank, before the process group exists; raises ``UsageError``."""
    from export_hf import check_destination

    parse_rope_scaling(cfg.args.rope_scaling)
    if cfg.args.export_hf is None:
        return
    out = Path(cfg.args.export_hf)
    ckpt = Path(cfg.args.ckpt_dir)
    if (cfg.args.save_every or cfg.args.resume) and (out.resolve() == ckpt.resolve()
                                                      or ckpt.resolve() in out.resolve().parents):
        raise UsageError(f"--export-hf {out} is inside --ckpt-dir {ckpt}, whose checkpoints train.py manages; pass "
                         f"a directory outside it")
    check_destination(out, "--export-hf", ignore=PROBE)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f"{PROBE}{cfg.env.rank}-{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"--export-hf {out} is not writable ({exc.strerror or exc}); pass a writable "
                         f"directory") from exc
    import shutil

    import train_model

    need = 4 * train_model.count_params(config)  # fp32 safetensors; config and tokenizer are small
    free = shutil.disk_usage(out).free
    if free < need:
        raise UsageError(f"--export-hf {out} has {free / 2**20:.1f} MB free but the model's fp32 weights need "
                         f"about {need / 2**20:.1f} MB; free some space or pass another directory")


def parse_rope_scaling(text: str | None) -> tuple[str, float] | None:
    """``--rope-scaling TYPE:FACTOR`` as ``(type, factor)``; ``UsageError`` unless TYPE is one of
    :data:`ROPE_TYPES` and FACTOR a number >= 1."""
    if text is None:
        return None
    kind, _, factor_text = text.partition(":")
    try:
        factor = float(factor_text)
    except ValueError:
        factor = math.nan
    if kind not in ROPE_TYPES or not 1 <= factor < math.inf:
        raise UsageError(f"--rope-scaling {text!r}: expected TYPE:FACTOR with TYPE one of {', '.join(ROPE_TYPES)} "
                         f"and FACTOR >= 1, e.g. linear:4 (positions up to 4x max_position_embeddings)")
    return kind, factor


def _rope_field(config) -> str:
    """The config attribute holding RoPE's type and parameters: ``rope_parameters`` in transformers 5.x (which
    reads a 4.x ``config.json``'s ``rope_scaling`` into it), ``rope_scaling`` before."""
    return "rope_parameters" if hasattr(config, "rope_parameters") else "rope_scaling"


def rope_guard(cfg: RunConfig, config) -> None:
    """Apply ``--rope-scaling`` to ``config`` (before the model is built), or warn when ``--seq-len`` exceeds its
    ``max_position_embeddings`` (rank 0, one line)."""
    field, seq = _rope_field(config), cfg.args.seq_len
    current = dict(getattr(config, field, None) or {})
    kind_now = current.get("rope_type", current.get("type", "default"))
    max_pos = config.max_position_embeddings
    scaling = parse_rope_scaling(cfg.args.rope_scaling)
    if scaling is None:
        if seq > max_pos:
            factor = f"{seq / max_pos:.3g}"
            say(cfg, f"warning: --seq-len {seq} is beyond the max_position_embeddings {max_pos} of --model "
                     f"{cfg.args.model}: RoPE positions past {max_pos} were never trained; its config offers RoPE "
                     f"scaling in {field} (now rope_type {kind_now!r}): pass --rope-scaling linear:{factor} or "
                     f"yarn:{factor} to apply it (the exported config keeps it)")
        return
    kind, factor = scaling
    if kind_now != "default":
        raise UsageError(f"--rope-scaling {cfg.args.rope_scaling}: --model {cfg.args.model} already scales RoPE "
                         f"({field} rope_type {kind_now!r}); drop --rope-scaling or start from an unscaled model")
    params = {**current, "rope_type": kind, "factor": factor}  # rope_theta and the rest stay
    if kind == "yarn":
        params["original_max_position_embeddings"] = max_pos
    setattr(config, field, params)
    config.max_position_embeddings = int(max_pos * factor)
    if hasattr(config, "validate_rope"):
        config.validate_rope()
    short = (f"; still short of --seq-len {seq}: a factor of {seq / max_pos:.3g} covers it"
             if seq > config.max_position_embeddings else "")
    say(cfg, f"{'warning: ' if short else ''}--rope-scaling {kind}:{factor:g}: {field} rope_type {kind!r} factor "
             f"{factor:g}, max_position_embeddings {max_pos} -> {config.max_position_embeddings}{short}")


# -------------------------------------------------------------------------------------- resuming elsewhere


def layout(cfg: RunConfig) -> dict:
    """The job's place in the world, stored in each checkpoint's progress."""
    return {"world_size": cfg.env.world_size, "sp_size": cfg.sp_size, "ulysses": cfg.ulysses,
            "dp_size": cfg.dp_size, "batch_size": cfg.args.batch_size}


def _describe(lay: dict, seq_len: int) -> str:
    ul = f" (ulysses {lay['ulysses']} x ring {lay['sp_size'] // lay['ulysses']})" if lay["ulysses"] > 1 else ""
    return (f"world {lay['world_size']} = sp {lay['sp_size']}{ul} x dp {lay['dp_size']}, batch "
            f"{lay['batch_size']}/replica ({lay['batch_size'] * seq_len // lay['sp_size']} tokens per rank per step)")


def world_change(cfg: RunConfig, progress: dict) -> str | None:
    """What changed since the checkpoint ``progress`` (just loaded) was saved, and which samples the next step
    reads; ``None`` if nothing did (or the checkpoint predates the record). ``progress`` then holds this run's
    layout, for the next save."""
    old, new = {k: progress.get(k) for k in LAYOUT}, layout(cfg)
    progress.update(new)
    if any(not isinstance(v, int) for v in old.values()) or old == new:
        return None
    seq_old = progress.get("seq_len") if isinstance(progress.get("seq_len"), int) else cfg.args.seq_len
    samples, step = progress["samples"], progress["step"]
    per_step, per_step_old = new["batch_size"] * new["dp_size"], old["batch_size"] * old["dp_size"]
    same = ("as the original run would" if per_step == per_step_old else
            f"({per_step} per step where the original run read {per_step_old}: from here on the batches differ "
            f"from its)")
    return (f"resumed on another world: the checkpoint was saved by {_describe(old, seq_old)}, this run is "
            f"{_describe(new, cfg.args.seq_len)}; the parameters and optimizer state were resharded on load, and the "
            f"data position is global ({samples} samples consumed), so step {step + 1} reads samples "
            f"{samples}-{samples + per_step - 1} {same}")


# -------------------------------------------------------------------------------------------- after the end


def files(cfg: RunConfig, config) -> dict[str, bytes]:
    """The config and tokenizer files of the model as trained (``export_hf.hf_files``); rank 0 builds them for the
    checkpoints (under ``hf/``) and ``--export-hf``, the other ranks get none. Every rank calls it (the process
    group is up): a failure on rank 0 is a ``UsageError`` on every rank."""
    from export_hf import hf_files
    from train_ckpt import _agree

    if not (cfg.args.export_hf or cfg.args.save_every):
        return {}
    found, error = {}, None
    if cfg.env.rank == 0:
        try:
            found = hf_files(config, cfg.args.tokenizer, cfg.args.model if cfg.preset is None else None)
        except (OSError, ValueError) as exc:
            error = f"cannot write the model's config and tokenizer files ({type(exc).__name__}: {exc})"
    error = _agree(error)
    if error:
        raise UsageError(error)
    return found


def export_at_end(cfg: RunConfig, model, hf_files: dict[str, bytes], log) -> None:
    """``--export-hf``: gather the whole parameters on rank 0 (every rank calls this) and write the folder there;
    ``JobFailed`` on every rank if the write failed."""
    if not cfg.args.export_hf:
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import export_hf
    from train_ckpt import _agree

    out, t0, error, size = Path(cfg.args.export_hf), time.perf_counter(), None, 0
    # FSDP2 shards -> whole CPU tensors on rank 0 only (the others get an empty dict); DDP unwrapped by name
    tensors = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if cfg.env.rank == 0:
        try:
            size = export_hf.write_folder(tensors, hf_files, out)
        except (OSError, UsageError) as exc:
            error = f"--export-hf {out}: writing the model failed ({type(exc).__name__}: {exc})"
    error = _agree(error)
    if error:
        raise JobFailed(f"{error}; the checkpoints (if any) hold the trained weights: launch/export_hf.py "
                        f"converts one")
    log(f"exported the trained model to {out} (Hugging Face folder, {size / 2**20:.1f} MB, "
        f"{time.perf_counter() - t0:.1f} s)")
