"""Checkpoints of ``launch/train.py``: DCP shards, a JSON progress file, a sha256 manifest written last.

Layout: ``<ckpt-dir>/step_00000040/`` per save, holding

* a ``torch.distributed.checkpoint`` (DCP) checkpoint of the model (FSDP2 shards, DDP or a plain module
  alike, through ``get_state_dict``) and the optimizer: ``__<rank>_0.distcp`` shards and ``.metadata``;
* ``progress.json``: the job's position (step, samples consumed, last loss, seq_len, seed, data, the layout and
  where its stretch of batches began) as JSON, every field checked when read (``train_ckpt_files.check_progress``,
  and against the resuming run by ``train_resume``);
* ``manifest.json``: the sha256 digest and size of every other file, written by rank 0 after every rank's
  shards, the ``.metadata`` and the progress file are on disk. A directory without it is an interrupted save
  (removed if DCP had not written its ``.metadata`` yet, else kept and never resumed from); one whose files do
  not match it is damaged and skipped.

and ``<ckpt-dir>/.lock``, the running job's lock (never deleted; empty when no job holds it).

Loading trusts nothing outside the checkpoint and runs no code from it (``train_ckpt_files``): no symbolic
link anywhere in it, ``.metadata`` unpickled against an allow-list of DCP classes and naming only shard files
that lie inside and are listed in the manifest (DCP may open no other file), ``progress.json`` hashed as it is
read, non-tensor entries loaded weights-only. DCP reshards on load, so a checkpoint can be resumed at another
world size.

One job per ``--ckpt-dir``: rank 0 holds the directory's lock (``train_lock``) for the job's life, from before
anything there is read or deleted; a second job stops on every rank with one error naming the holder.

Collective calls (``lock``, ``save``, ``find_and_load``) must be made by every rank; the file-system checks
(``preflight``) run before the process group exists.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata  # noqa: F401 - re-exported for the tests
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

import train_lock
from train_ckpt_files import (  # noqa: F401 - the checkpoint's files: re-exported as train_ckpt's own
    MANIFEST, MANIFEST_FORMAT, METADATA, METADATA_CLASSES, PROGRESS, DamagedCheckpointError, InvalidProgressError,
    SafePlanner, SafeReader, UnsafeCheckpointError, check_files, read_manifest, read_progress, verify,
    write_manifest)
from train_config import JobFailed, UsageError

PREFIX = "step_"
# Testing hooks: a full disk and a read-only mount cannot be made without privileges (and root ignores
# permission bits), so the up-front check can be told to see them.
FREE_BYTES_ENV = "DISTATTN_CKPT_FREE_BYTES"  # pretend the checkpoint file system has this many bytes free
READ_ONLY_ENV = "DISTATTN_CKPT_READ_ONLY"  # "1": pretend the checkpoint directory is on a read-only mount
# fp32 parameters + AdamW's two fp32 moments, and 10% for DCP's file format and metadata (measured: 5%
# for the tiny preset, 11.0 MB on disk for 10.5 MB of tensors; less for larger models).
BYTES_PER_PARAM = 12
FORMAT_OVERHEAD = 1.1


class TrainState(Stateful):
    """Model + optimizer as one DCP ``Stateful`` (the progress travels as JSON beside it)."""

    def __init__(self, model, optimizer, progress: dict):
        self.model = model
        self.optimizer = optimizer
        self.progress = progress  # plain Python values; updated in place by load

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


# ------------------------------------------------------------------------------------------ manifest, listing


def step_dir(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"{PREFIX}{step:08d}"


def step_dirs(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step_N`` directory, finished or not, oldest first."""
    found = []
    for path in ckpt_dir.glob(f"{PREFIX}*") if ckpt_dir.is_dir() else ():
        suffix = path.name[len(PREFIX):]
        if suffix.isdigit() and path.is_dir():
            found.append((int(suffix), path))
    return sorted(found)


def complete_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Checkpoints whose save finished (a manifest exists; its digests are checked by ``verify``)."""
    return [(s, p) for s, p in step_dirs(ckpt_dir) if (p / MANIFEST).is_file()]


# ---------------------------------------------------------------------------------------- up-front checks


def estimated_bytes(num_params: int) -> int:
    """One checkpoint of a model with ``num_params`` parameters: fp32 weights and AdamW moments."""
    return int(BYTES_PER_PARAM * num_params * FORMAT_OVERHEAD)


def _free_bytes(path: Path) -> int:
    fake = os.environ.get(FREE_BYTES_ENV)
    return int(fake) if fake else shutil.disk_usage(path).free


def new_copies(ckpt_dir: Path, keep: int, saves: int) -> int:
    """Checkpoints this run adds to the disk at its peak: ``--keep`` plus the one being written (old ones
    are deleted only after a save succeeds), less those already there, at most one per save."""
    existing = min(len(complete_checkpoints(ckpt_dir)), keep)
    return max(1, min(keep + 1 - existing, saves))


def preflight(ckpt_dir: Path, num_params: int, rank: int, copies: int = 1) -> None:
    """Before the first step: the checkpoint directory can be created and written, with room for ``copies``
    more checkpoints (:func:`new_copies`).

    Every rank runs it (each writes its own probe file) and sees the same file system, so all raise the
    same ``UsageError`` together. Raises:
        UsageError: not creatable, not writable, or less free space than the checkpoints need.
    """
    try:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(_cannot_create(ckpt_dir, exc)) from exc
    try:
        if os.environ.get(READ_ONLY_ENV) == "1":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(ckpt_dir))
        probe = ckpt_dir / f".write-test-{rank}-{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as exc:
        fix = "fix its permissions or " if exc.errno in (errno.EACCES, errno.EPERM) else ""
        raise UsageError(f"--ckpt-dir {ckpt_dir} is not writable ({exc.strerror or exc}); {fix}pass a writable "
                         f"--ckpt-dir") from exc
    one, free = estimated_bytes(num_params), _free_bytes(ckpt_dir)
    if free < copies * one:
        raise UsageError(f"--ckpt-dir {ckpt_dir} has {free / 2**20:.1f} MB free but this run's checkpoints need "
                         f"about {copies * one / 2**20:.1f} MB ({copies} x {one / 2**20:.1f} MB of fp32 parameters "
                         f"and AdamW moments: --keep, plus the one being written); free some space, lower "
                         f"--keep or pass another --ckpt-dir")


def _cannot_create(ckpt_dir: Path, exc: OSError) -> str:
    """Why ``ckpt_dir`` (which does not exist) cannot be created, read off its nearest existing ancestor."""
    base = next((p for p in ckpt_dir.absolute().parents if p.exists()), Path("/"))
    if not base.is_dir():
        why = f"{base} is a file, not a directory"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        why = f"{base} is not writable by this user"
    elif exc.errno == errno.EROFS:
        why = f"{base} is on a read-only file system"
    else:  # e.g. ENOENT under /proc or /sys: a virtual file system that holds no user directories
        why = f"{base} does not accept new directories"
    return (f"--ckpt-dir {ckpt_dir} does not exist and cannot be created ({exc.strerror or exc}: {why}); pass a "
            f"--ckpt-dir inside a directory you can write")


# ------------------------------------------------------------------------------------------- collectives


def _agree(error: str | None) -> str | None:
    """Every rank's ``error`` gathered: the first one (by rank), or ``None`` if all ranks are fine."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, error)
    return next((e for e in every if e), None)


def _rank0_do(fn) -> None:
    """``fn()`` on rank 0 only; every rank raises ``OSError`` with rank 0's reason if it failed."""
    error = None
    if dist.get_rank() == 0:
        try:
            fn()
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
    error = _agree(error)
    if error:
        raise OSError(error)


def lock(ckpt_dir: Path, log) -> None:
    """Rank 0 takes ``ckpt_dir``'s lock for the job's life (``train_lock``); every rank raises the same
    ``UsageError`` if another job holds it. A directory that does not exist yet has nothing to protect (a
    saving job's ``preflight`` has created it by now)."""
    error = None
    if dist.get_rank() == 0 and ckpt_dir.is_dir():
        try:
            train_lock.acquire(ckpt_dir, log)
        except UsageError as exc:
            error = str(exc)
        except OSError as exc:
            error = f"cannot lock --ckpt-dir {ckpt_dir} ({exc.strerror or exc}: {exc.filename})"
    error = _agree(error)
    if error:
        raise UsageError(error)


def remove_incomplete(ckpt_dir: Path, log) -> list[Path]:
    """Rank 0 deletes ``step_N`` directories of saves that never finished; returns the interrupted saves kept.

    DCP writes ``.metadata`` after every shard, and the manifest comes after it: a directory with neither is a
    save interrupted while the shards were written, and is removed. One with ``.metadata`` but no manifest is a
    save interrupted between the two writes (or one of the first train.py, before manifests): its files cannot
    be verified, so it is never resumed from; it is kept (its shards may be all there is of that step), returned
    for the caller to say which checkpoint is used instead (``train_resume``), and rotated away by ``--keep`` like
    any older checkpoint (a new save of its step replaces it). The other ranks return ``[]``.
    """
    kept: list[Path] = []

    def remove():
        for _, path in step_dirs(ckpt_dir):
            if path.is_symlink():  # never resumed from (verify refuses it); never deleted through
                log(f"warning: ignoring {path}: a symbolic link (to {os.readlink(path)}), never resumed from")
                continue
            if (path / MANIFEST).is_file():
                continue
            if (path / METADATA).is_file():
                kept.append(path)
                continue
            log(f"removing {path}: an unfinished save (no .metadata, no {MANIFEST})")
            shutil.rmtree(path)

    try:
        _rank0_do(remove)
    except OSError as exc:
        raise UsageError(f"cannot remove an unfinished save in --ckpt-dir {ckpt_dir} ({exc})") from exc
    return kept


class SaveError(JobFailed):
    """A save failed (disk full, I/O error); its partial directory has been removed."""


def save(state: TrainState, ckpt_dir: Path, step: int, keep: int, skip: set[Path], log,
         extra: dict[str, bytes] | None = None) -> Path:
    """Save ``state`` as step ``step``, manifest last; keep the newest ``keep`` finished checkpoints.

    ``skip``: checkpoints found damaged when resuming, never counted among the kept ones. ``extra``: more files
    (relative path: bytes) that rank 0 writes into the checkpoint before the manifest, which lists them (the
    model's config and tokenizer, ``train_export``). Raises ``SaveError`` on every rank if any part of the save
    failed, after removing the partial directory.
    """
    path, t0 = step_dir(ckpt_dir, step), time.perf_counter()
    size = [0]

    def finish():
        for name, data in (extra or {}).items():
            (path / name).parent.mkdir(parents=True, exist_ok=True)
            (path / name).write_bytes(data)
        (path / PROGRESS).write_text(json.dumps(state.progress), encoding="utf-8")
        size[0] = write_manifest(path, step)

    try:
        _rank0_do(lambda: _remove(path))  # a stale or damaged one
        dcp.save(state_dict={"train": state}, checkpoint_id=str(path))  # ends with a barrier
        _rank0_do(finish)
    except (OSError, CheckpointException) as exc:
        if dist.get_rank() == 0:
            _remove(path, ignore_errors=True)
        free = shutil.disk_usage(ckpt_dir).free if ckpt_dir.is_dir() else 0
        raise SaveError(f"saving checkpoint step {step} to {path} failed ({_first_line(exc)}; "
                        f"{free / 2**20:.1f} MB free there); the partial directory was removed") from exc
    skip.discard(path)
    log(f"saved checkpoint step {step} to {path} ({size[0] / 2**20:.1f} MB, {time.perf_counter() - t0:.1f} s)")
    _rank0_do(lambda: _rotate(ckpt_dir, keep, skip, log))
    return path


def _remove(path: Path, ignore_errors: bool = False) -> None:
    """Delete a checkpoint directory; a symbolic link in its place loses the link only, never its target."""
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path, ignore_errors=ignore_errors)


def _rotate(ckpt_dir: Path, keep: int, skip: set[Path], log) -> None:
    """Delete finished checkpoints beyond the newest ``keep`` intact ones, and anything older than those."""
    good = [(s, p) for s, p in complete_checkpoints(ckpt_dir) if p not in skip and not p.is_symlink()]
    if len(good) <= keep:
        return
    oldest_kept = good[-keep][0]
    for s, p in step_dirs(ckpt_dir):
        if s < oldest_kept:
            _remove(p, ignore_errors=True)
            if p in skip:
                log(f"removed damaged checkpoint {p}")
                skip.discard(p)


def _unwrap(exc: BaseException) -> BaseException:
    """A ``CheckpointException`` (DCP's gathered per-rank errors) by its first rank's own error."""
    if isinstance(exc, CheckpointException) and exc.failures:
        inner = next(iter(exc.failures.values()))
        return inner[0] if isinstance(inner, tuple) else inner
    return exc


def _misfit(exc: BaseException) -> bool:
    """DCP's refusal of a checkpoint for another model: a tensor of another size, or a key one side lacks."""
    text = str(exc).lower()
    return isinstance(exc, KeyError) or isinstance(exc, (ValueError, RuntimeError)) and (
        "size mismatch" in text or "missing key" in text or "unexpected key" in text)


def unreadable(exc: BaseException) -> str:
    """Why a verified checkpoint's tensors could not be read, in one line (``export_hf`` says it too)."""
    inner = _unwrap(exc)
    what = "EOFError: a shard ends before its data, truncated" if isinstance(inner, EOFError) else _first_line(exc)
    return (f"its shards cannot be read ({what}), yet they match its {MANIFEST}: the manifest was written over "
            f"damaged shards, or the checkpoint is crafted or foreign")


def _first_line(exc: BaseException) -> str:
    exc = _unwrap(exc)
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _verify_everywhere(path: Path) -> str | None:
    """``verify`` with the files' digests split over the ranks; the first problem, ``None`` if intact.

    Raises ``UnsafeCheckpointError`` on every rank if ``.metadata`` is refused (a foreign class or shard file).
    """
    unsafe = damaged = None
    try:
        verify(path, share=(dist.get_rank(), dist.get_world_size()))  # digest 1/world of the bytes each
    except UnsafeCheckpointError as exc:
        unsafe = f"checkpoint {path}: {exc}"
    except DamagedCheckpointError as exc:
        damaged = str(exc)
    unsafe = _agree(unsafe)
    if unsafe:
        raise UnsafeCheckpointError(unsafe)
    return _agree(damaged)


def find_and_load(state: TrainState, ckpt_dir: Path, log, check=None) -> tuple[Path | None, set[Path]]:
    """Load the newest intact checkpoint into ``state``; returns ``(its path or None, damaged ones)``.

    Newer checkpoints that fail verification are skipped with a warning naming what failed. ``check(path,
    progress)``: what is wrong with a verified checkpoint's progress for this run (a message, or ``None``), asked
    before its tensors are loaded. Raises ``UsageError`` on every rank if a verified checkpoint holds a progress
    train.py never writes or that ``check`` refuses, cannot be loaded into this model (another model shape) or
    holds something the safe loaders refuse.
    """
    box = [complete_checkpoints(ckpt_dir) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)  # one listing for all ranks
    damaged: set[Path] = set()
    for _, path in reversed(box[0]):
        problem = _verify_everywhere(path)  # agreed: every rank takes the same branch
        if problem is None:
            invalid = progress = None
            try:
                progress = read_progress(path)
                invalid = check(path, progress) if check else None
            except DamagedCheckpointError as exc:
                problem = str(exc)
            except InvalidProgressError as exc:
                invalid = str(exc)
            problem, invalid = _agree(problem), _agree(invalid)
            if invalid:
                raise InvalidProgressError(invalid)
        if problem is not None:
            log(f"warning: skipping damaged checkpoint {path}: {problem}")
            damaged.add(path)
            continue
        _load(state, path)
        state.progress.update(progress)
        return path, damaged
    return None, damaged


def _load(state: TrainState, path: Path) -> None:
    """``dcp.load`` through the safe reader and planner; ``UsageError`` on every rank if it cannot."""
    reader, error = SafeReader(str(path)), None
    try:
        reader.read_metadata()
    except Exception as exc:  # noqa: BLE001 - whatever the unpickler met, the file is refused
        error = str(exc) if isinstance(exc, UnsafeCheckpointError) else f"unreadable .metadata ({_first_line(exc)})"
    error = _agree(error)
    if error:
        raise UnsafeCheckpointError(f"checkpoint {path}: {error}")
    try:
        dcp.load(state_dict={"train": state}, storage_reader=reader, planner=SafePlanner())
    # CheckpointException is a BaseException; DCP gathers every rank's error into it, so all ranks are here
    except (Exception, CheckpointException) as exc:  # noqa: BLE001
        inner = _unwrap(exc)
        if isinstance(inner, UnsafeCheckpointError):
            error = f"checkpoint {path}: {inner}"
        elif _misfit(inner):
            error = (f"checkpoint {path} does not fit this model ({_first_line(exc)}); resume with the --model "
                     f"it was trained with, or pass another --ckpt-dir")
        else:
            error = f"checkpoint {path}: {unreadable(exc)}; remove it or pass another --ckpt-dir"
    error = _agree(error)
    if error:
        raise UsageError(error)
