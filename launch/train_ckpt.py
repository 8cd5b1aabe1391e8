"""Checkpoints of ``launch/train.py``: DCP shards, a JSON progress file, a sha256 manifest written last.

Layout: ``<ckpt-dir>/step_00000040/`` per save, holding

* a ``torch.distributed.checkpoint`` (DCP) checkpoint of the model (FSDP2 shards, DDP or a plain module
  alike, through ``get_state_dict``) and the optimizer: ``__<rank>_0.distcp`` shards and ``.metadata``;
* ``progress.json``: the job's position (step, samples consumed, last loss, seq_len, seed, data) as JSON;
* ``manifest.json``: the sha256 digest and size of every other file, written by rank 0 after every rank's
  shards, the ``.metadata`` and the progress file are on disk. A directory without it is an interrupted save
  and is removed; one whose files do not match it is damaged and skipped.

Loading runs no code from the checkpoint: ``.metadata`` is unpickled by :class:`SafeReader`, whose
unpickler resolves only the DCP metadata classes on :data:`METADATA_CLASSES`; the optimizer's non-tensor
entries (its ``param_groups``) go through ``torch.load(weights_only=True)`` (:class:`SafePlanner`); tensors
were always loaded that way by DCP; the progress is JSON. DCP reshards on load, so a checkpoint can be
resumed at another world size.

Collective calls (``save``, ``find_and_load``) must be made by every rank; the file-system checks
(``preflight``) run before the process group exists.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from train_config import JobFailed, UsageError

PREFIX = "step_"
MANIFEST = "manifest.json"
PROGRESS = "progress.json"
MANIFEST_FORMAT = "distattn-train-checkpoint/1"
# Testing hooks: a full disk and a read-only mount cannot be made without privileges (and root ignores
# permission bits), so the up-front check can be told to see them.
FREE_BYTES_ENV = "DISTATTN_CKPT_FREE_BYTES"  # pretend the checkpoint file system has this many bytes free
READ_ONLY_ENV = "DISTATTN_CKPT_READ_ONLY"  # "1": pretend the checkpoint directory is on a read-only mount
# fp32 parameters + AdamW's two fp32 moments, and 10% for DCP's file format and metadata (measured: 5%
# for the tiny preset, 11.0 MB on disk for 10.5 MB of tensors; less for larger models).
BYTES_PER_PARAM = 12
FORMAT_OVERHEAD = 1.1

_DCP = "torch.distributed.checkpoint"
# Everything a real DCP save of TrainState pickles into .metadata (found by recording ``find_class`` while
# loading one: tests/test_train_ckpt.py checks the list is still sufficient and minimal enough to refuse
# everything else). Classes are resolved only from this list, so a crafted .metadata cannot reach
# os.system, eval, getattr or any other callable.
METADATA_CLASSES: frozenset[tuple[str, str]] = frozenset({
    (f"{_DCP}.metadata", "Metadata"),
    (f"{_DCP}.metadata", "MetadataIndex"),
    (f"{_DCP}.metadata", "StorageMeta"),
    (f"{_DCP}.metadata", "TensorStorageMetadata"),
    (f"{_DCP}.metadata", "BytesStorageMetadata"),
    (f"{_DCP}.metadata", "ChunkStorageMetadata"),
    (f"{_DCP}.metadata", "TensorProperties"),
    (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"),  # an Enum
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a torch.layout up by name, nothing else
    # dtypes are pickled by reference: these resolve to dtype objects, not callables
    ("torch", "float32"), ("torch", "bfloat16"), ("torch", "float16"), ("torch", "float64"),
    ("torch", "int64"), ("torch", "int32"),
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
})


class UnsafeCheckpointError(UsageError):
    """A checkpoint holds something the safe loaders refuse (a class outside the allow-list)."""


class DamagedCheckpointError(Exception):
    """A checkpoint's files do not match its manifest (or it has none): skipped, an older one is tried."""


# ---------------------------------------------------------------------------------------------- safe loading


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in METADATA_CLASSES:
            raise UnsafeCheckpointError(f"its .metadata asks to load {module}.{name}, which is not a DCP metadata "
                                        f"class: refusing to unpickle it (a crafted or foreign file?)")
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """DCP's file-system reader with ``.metadata`` unpickled against :data:`METADATA_CLASSES` only.

    The first ``read_metadata`` reads the file; later calls (DCP's own, inside ``dcp.load``) return the same
    object, so a refusal is raised where ``load`` can report it, not inside DCP's planning step.
    """

    def __init__(self, path: str):
        super().__init__(path)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata is None:
            with open(Path(self.path) / ".metadata", "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if not isinstance(metadata, Metadata):
                raise UnsafeCheckpointError(f"its .metadata holds a {type(metadata).__name__}, not DCP Metadata")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            self._metadata = metadata
        self._metadata.storage_meta.load_id = self.load_id  # what FileSystemReader.read_metadata does too
        return self._metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor entries read by ``torch.load(weights_only=True)``.

    DCP saves every non-tensor value of the state dict (the optimizer's ``param_groups``: floats, tuples,
    parameter names) as a pickle and loads it with ``weights_only=False``; plain containers and numbers are
    all it needs.
    """

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(f"its entry {read_item.dest_index.fqn} is not plain data: refusing to "
                                        f"unpickle it ({str(exc).splitlines()[0]})") from exc
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


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


def read_progress(path: Path) -> dict:
    """``progress.json`` of a checkpoint directory, checked to hold the job's position."""
    try:
        progress = json.loads((path / PROGRESS).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DamagedCheckpointError(f"{PROGRESS} unreadable ({exc})") from exc
    if not (isinstance(progress, dict) and isinstance(progress.get("step"), int)
            and isinstance(progress.get("samples"), int)):
        raise DamagedCheckpointError(f"{PROGRESS} does not hold integer 'step' and 'samples'")
    return progress


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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(path: Path, step: int) -> int:
    """Digest every file of ``path`` into ``manifest.json`` (atomically); returns the checkpoint's bytes."""
    files = {}
    for f in sorted(p for p in path.rglob("*") if p.is_file() and p.name != MANIFEST):
        files[str(f.relative_to(path))] = {"sha256": _sha256(f), "bytes": f.stat().st_size}
    tmp = path / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"format": MANIFEST_FORMAT, "step": step, "files": files}, indent=1))
    os.replace(tmp, path / MANIFEST)  # a reader sees no manifest or a whole one
    return sum(f["bytes"] for f in files.values())


def read_manifest(path: Path) -> dict[str, dict]:
    """The manifest's ``{relative path: {"sha256", "bytes"}}``; ``DamagedCheckpointError`` if unusable."""
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        files = manifest["files"]
        ok = manifest["format"] == MANIFEST_FORMAT and all(
            isinstance(v, dict) and isinstance(v.get("sha256"), str) and isinstance(v.get("bytes"), int)
            for v in files.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DamagedCheckpointError(f"{MANIFEST} unreadable ({type(exc).__name__}: {exc})") from exc
    if not ok:
        raise DamagedCheckpointError(f"{MANIFEST} is not a {MANIFEST_FORMAT} manifest")
    for name in (".metadata", PROGRESS):
        if name not in files:
            raise DamagedCheckpointError(f"{MANIFEST} does not list {name}")
    return files


def check_files(path: Path, files: dict[str, dict]) -> list[str]:
    """What differs between the files on disk and their manifest entries (empty: intact)."""
    problems = []
    for name, want in files.items():
        f = path / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            problems.append(f"{name}: not a path inside the checkpoint")
        elif not f.is_file():
            problems.append(f"{name}: missing")
        elif f.stat().st_size != want["bytes"]:
            problems.append(f"{name}: {f.stat().st_size} bytes, the manifest says {want['bytes']}")
        elif _sha256(f) != want["sha256"]:
            problems.append(f"{name}: sha256 differs from the manifest")
    return problems


def verify(path: Path) -> None:
    """Raise ``DamagedCheckpointError`` naming what failed unless every file matches the manifest (one rank)."""
    problems = check_files(path, read_manifest(path))
    if problems:
        raise DamagedCheckpointError("; ".join(problems))


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
        if os.environ.get(READ_ONLY_ENV) == "1":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(ckpt_dir))
        probe = ckpt_dir / f".write-test-{rank}-{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"--ckpt-dir {ckpt_dir} is not writable ({exc.strerror or exc}); fix its permissions or "
                         f"pass a writable --ckpt-dir") from exc
    one, free = estimated_bytes(num_params), _free_bytes(ckpt_dir)
    if free < copies * one:
        raise UsageError(f"--ckpt-dir {ckpt_dir} has {free / 2**20:.1f} MB free but this run's checkpoints need "
                         f"about {copies * one / 2**20:.1f} MB ({copies} x {one / 2**20:.1f} MB of fp32 parameters "
                         f"and AdamW moments: --keep, plus the one being written); free some space, lower "
                         f"--keep or pass another --ckpt-dir")


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


def remove_incomplete(ckpt_dir: Path, log) -> None:
    """Rank 0 deletes ``step_N`` directories of saves that never finished; warns about manifest-less ones.

    DCP writes ``.metadata`` after every shard, and the manifest comes after it: a directory with neither
    is an interrupted save. One with ``.metadata`` but no manifest was written by a train.py older than the
    manifests (or killed between the two writes): it is kept, never resumed from, and rotated away by
    ``--keep`` like any older checkpoint.
    """
    def remove():
        for _, path in step_dirs(ckpt_dir):
            if (path / MANIFEST).is_file():
                continue
            if (path / ".metadata").is_file():
                log(f"warning: ignoring {path}: it has no {MANIFEST} (saved by an older train.py?), so it "
                    f"cannot be verified and is never resumed from")
                continue
            log(f"removing {path}: an unfinished save (no .metadata, no {MANIFEST})")
            shutil.rmtree(path)

    try:
        _rank0_do(remove)
    except OSError as exc:
        raise UsageError(f"cannot remove an unfinished save in --ckpt-dir {ckpt_dir} ({exc})") from exc


class SaveError(JobFailed):
    """A save failed (disk full, I/O error); its partial directory has been removed."""


def save(state: TrainState, ckpt_dir: Path, step: int, keep: int, skip: set[Path], log) -> Path:
    """Save ``state`` as step ``step``, manifest last; keep the newest ``keep`` finished checkpoints.

    ``skip``: checkpoints found damaged when resuming, never counted among the kept ones. Raises
    ``SaveError`` on every rank if any part of the save failed, after removing the partial directory.
    """
    path, t0 = step_dir(ckpt_dir, step), time.perf_counter()
    size = [0]

    def finish():
        (path / PROGRESS).write_text(json.dumps(state.progress), encoding="utf-8")
        size[0] = write_manifest(path, step)

    try:
        _rank0_do(lambda: shutil.rmtree(path) if path.exists() else None)  # a stale or damaged one
        dcp.save(state_dict={"train": state}, checkpoint_id=str(path))  # ends with a barrier
        _rank0_do(finish)
    except (OSError, CheckpointException) as exc:
        if dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
        free = shutil.disk_usage(ckpt_dir).free if ckpt_dir.is_dir() else 0
        raise SaveError(f"saving checkpoint step {step} to {path} failed ({_first_line(exc)}; "
                        f"{free / 2**20:.1f} MB free there); the partial directory was removed") from exc
    skip.discard(path)
    log(f"saved checkpoint step {step} to {path} ({size[0] / 2**20:.1f} MB, {time.perf_counter() - t0:.1f} s)")
    _rank0_do(lambda: _rotate(ckpt_dir, keep, skip, log))
    return path


def _rotate(ckpt_dir: Path, keep: int, skip: set[Path], log) -> None:
    """Delete finished checkpoints beyond the newest ``keep`` intact ones, and anything older than those."""
    good = [(s, p) for s, p in complete_checkpoints(ckpt_dir) if p not in skip]
    if len(good) <= keep:
        return
    oldest_kept = good[-keep][0]
    for s, p in step_dirs(ckpt_dir):
        if s < oldest_kept:
            shutil.rmtree(p, ignore_errors=True)
            if p in skip:
                log(f"removed damaged checkpoint {p}")
                skip.discard(p)


def _unwrap(exc: BaseException) -> BaseException:
    """A ``CheckpointException`` (DCP's gathered per-rank errors) by its first rank's own error."""
    if isinstance(exc, CheckpointException) and exc.failures:
        inner = next(iter(exc.failures.values()))
        return inner[0] if isinstance(inner, tuple) else inner
    return exc


def _first_line(exc: BaseException) -> str:
    exc = _unwrap(exc)
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _verify_everywhere(path: Path) -> str | None:
    """Check ``path`` against its manifest, files split over the ranks; the first problem or ``None``."""
    try:
        files = read_manifest(path)
    except DamagedCheckpointError as exc:
        return str(exc)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {name: files[name] for name in sorted(files)[rank::world]}  # hash 1/world of the bytes each
    problems = check_files(path, mine)
    return _agree("; ".join(problems) if problems else None)


def find_and_load(state: TrainState, ckpt_dir: Path, log) -> tuple[Path | None, set[Path]]:
    """Load the newest intact checkpoint into ``state``; returns ``(its path or None, damaged ones)``.

    Newer checkpoints that fail verification are skipped with a warning naming what failed. Raises
    ``UsageError`` on every rank if a verified checkpoint cannot be loaded into this model (another model
    shape) or holds something the safe loaders refuse.
    """
    box = [complete_checkpoints(ckpt_dir) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)  # one listing for all ranks
    damaged: set[Path] = set()
    for _, path in reversed(box[0]):
        problem = _verify_everywhere(path)
        if problem is None:
            try:
                progress = read_progress(path)
            except DamagedCheckpointError as exc:
                problem = str(exc)
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
        else:
            error = (f"checkpoint {path} does not fit this model ({_first_line(exc)}); resume with the --model "
                     f"it was trained with, or pass another --ckpt-dir")
    error = _agree(error)
    if error:
        raise UsageError(error)
