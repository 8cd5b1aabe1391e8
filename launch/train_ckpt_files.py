"""What a checkpoint directory of ``launch/train.py`` may hold, and how its files are read (see ``train_ckpt``).

A checkpoint ``step_N/`` is trusted only as far as its own files go:

* no symbolic link anywhere in it (the directory itself, a file, a subdirectory): a link would make a checkpoint
  read another run's files, or any file of the machine. Files are opened with ``O_NOFOLLOW`` after their
  parents are checked, so a link planted after the check is refused too;
* ``manifest.json`` lists the sha256 digest and size of every other file, ``.metadata`` and ``progress.json``
  among them; the progress is hashed as it is read (the bytes parsed are the bytes checked);
* every storage file that ``.metadata`` names (DCP's relative path of each tensor's shard file) is a plain path
  inside the checkpoint and listed in the manifest, and DCP may open no other file: otherwise a crafted
  ``.metadata`` points DCP at another checkpoint's shards, and a checkpoint without shards of its own verifies
  and loads another run's weights;
* nothing runs code: ``.metadata`` is unpickled against :data:`METADATA_CLASSES` only (:class:`SafeReader`), the
  optimizer's non-tensor entries go through ``torch.load(weights_only=True)`` (:class:`SafePlanner`), tensors
  always did, and the progress is JSON.

The progress is checked for what train.py writes (:func:`check_progress`): every field of the right type and
range, ``samples`` consistent with ``step`` and the batches read per step, ``step`` the manifest's.

Refusals: :class:`DamagedCheckpointError` (files differ from the manifest, a link: the checkpoint is skipped and
an older one tried), :class:`UnsafeCheckpointError` (a ``.metadata`` that asks for a foreign class or names
a file outside the checkpoint or its manifest: the job stops) and :class:`InvalidProgressError` (files that match
the manifest but a progress train.py never writes: the job stops).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import re
import stat
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from train_config import UsageError

MANIFEST = "manifest.json"
PROGRESS = "progress.json"
METADATA = ".metadata"
MANIFEST_FORMAT = "distattn-train-checkpoint/1"

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
    """A checkpoint holds something the safe loaders refuse (a class outside the allow-list, a file outside
    the checkpoint or its manifest)."""


class InvalidProgressError(UsageError):
    """A checkpoint whose ``progress.json`` matches its manifest but holds values train.py never writes (a
    crafted or foreign file): not damage in transit, so no older checkpoint is tried in its place."""


class DamagedCheckpointError(Exception):
    """A checkpoint's files do not match its manifest (or it has none, or holds a link): skipped, an older one
    is tried."""


# ------------------------------------------------------------------------------------- files inside, no links


def plain_relative(name: str) -> bool:
    """``name`` is a path below a directory: relative, no ``..``, ``.`` or empty parts (``a/b``, not ``../b``)."""
    return (isinstance(name, str) and "\0" not in name and not name.startswith("/")
            and all(part not in ("", ".", "..") for part in name.split("/")))


def _link(path: Path) -> str:
    return f"{path} is a symbolic link (to {os.readlink(path)}); a checkpoint must hold its own files, not links"


def refuse_links(path: Path) -> None:
    """``DamagedCheckpointError`` naming the first symbolic link at or below ``path`` (the directory included)."""
    if path.is_symlink():
        raise DamagedCheckpointError(_link(path))
    for root, dirs, names in os.walk(path):  # never follows a link: a linked directory is listed, not entered
        for name in sorted(dirs + names):
            if (Path(root) / name).is_symlink():
                raise DamagedCheckpointError(_link(Path(root) / name))


def open_inside(root: Path, name: str):
    """``root/name`` opened for reading; ``DamagedCheckpointError`` if ``name`` leaves ``root`` or any part of
    the way (``root`` included) is a symbolic link. ``FileNotFoundError`` if it is missing."""
    if not plain_relative(name):
        raise DamagedCheckpointError(f"{name!r} is not a path inside the checkpoint {root}")
    parts = name.split("/")
    for depth in range(len(parts)):  # root and the directories on the way; the file itself: O_NOFOLLOW
        if root.joinpath(*parts[:depth]).is_symlink():
            raise DamagedCheckpointError(_link(root.joinpath(*parts[:depth])))
    try:
        fd = os.open(root / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if (root / name).is_symlink():  # ELOOP (Linux), EMLINK (FreeBSD), EFTYPE (NetBSD)
            raise DamagedCheckpointError(_link(root / name)) from exc
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DamagedCheckpointError(f"{root / name} is not a regular file")
    return os.fdopen(fd, "rb")


def read_inside(root: Path, name: str) -> bytes:
    with open_inside(root, name) as f:
        return f.read()


def _sha256(root: Path, name: str) -> str:
    digest = hashlib.sha256()
    with open_inside(root, name) as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------- the manifest


def write_manifest(path: Path, step: int) -> int:
    """Digest every file of ``path`` into ``manifest.json`` (atomically); returns the checkpoint's bytes.

    Raises ``OSError`` if the directory holds a symbolic link (no save makes one)."""
    files = {}
    for root, dirs, names in os.walk(path):
        for name in sorted(dirs + names):
            f = Path(root) / name
            if f.is_symlink():
                raise OSError(f"{f} is a symbolic link; a checkpoint must hold its own files")
            rel = str(f.relative_to(path))
            if f.is_file() and rel != MANIFEST:
                files[rel] = {"sha256": _sha256(path, rel), "bytes": f.stat().st_size}
    tmp = path / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"format": MANIFEST_FORMAT, "step": step, "files": dict(sorted(files.items()))},
                              indent=1))
    os.replace(tmp, path / MANIFEST)  # a reader sees no manifest or a whole one
    return sum(f["bytes"] for f in files.values())


def read_manifest(path: Path) -> dict[str, dict]:
    """The manifest's ``{relative path: {"sha256", "bytes"}}``; ``DamagedCheckpointError`` if unusable."""
    return _manifest(path)["files"]


def _manifest(path: Path) -> dict:
    """The whole manifest (format, step, files), checked; ``DamagedCheckpointError`` if unusable."""
    try:
        manifest = json.loads(read_inside(path, MANIFEST).decode("utf-8"))
        files = manifest["files"]
        ok = manifest["format"] == MANIFEST_FORMAT and _is_int(manifest.get("step")) and all(
            isinstance(v, dict) and isinstance(v.get("sha256"), str) and isinstance(v.get("bytes"), int)
            for v in files.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DamagedCheckpointError(f"{MANIFEST} unreadable ({type(exc).__name__}: {exc})") from exc
    if not ok:
        raise DamagedCheckpointError(f"{MANIFEST} is not a {MANIFEST_FORMAT} manifest")
    for name in (METADATA, PROGRESS):
        if name not in files:
            raise DamagedCheckpointError(f"{MANIFEST} does not list {name}")
    return manifest


def check_files(path: Path, files: dict[str, dict]) -> list[str]:
    """What differs between the files on disk and their manifest entries (empty: intact)."""
    problems = []
    for name, want in files.items():
        f = path / name
        try:
            if not plain_relative(name):
                problems.append(f"{name}: not a path inside the checkpoint")
            elif f.is_symlink():
                problems.append(_link(f))
            elif not f.is_file():
                problems.append(f"{name}: missing")
            elif f.stat().st_size != want["bytes"]:
                problems.append(f"{name}: {f.stat().st_size} bytes, the manifest says {want['bytes']}")
            elif _sha256(path, name) != want["sha256"]:
                problems.append(f"{name}: sha256 differs from the manifest")
        except (DamagedCheckpointError, OSError) as exc:  # a linked directory on the way; a file gone meanwhile
            problems.append(str(exc))
    return problems


def _matches(data: bytes, files: dict[str, dict], name: str) -> None:
    if hashlib.sha256(data).hexdigest() != files[name]["sha256"]:
        raise DamagedCheckpointError(f"{name}: sha256 differs from the manifest")


def read_progress(path: Path) -> dict:
    """``progress.json`` of a checkpoint, its bytes checked against the manifest and parsed as the job's position
    (:func:`check_progress`). Raises ``DamagedCheckpointError`` (unreadable, differs from the manifest) or
    ``InvalidProgressError`` (matches it, but holds values train.py never writes)."""
    manifest = _manifest(path)
    files = manifest["files"]
    try:
        data = read_inside(path, PROGRESS)
    except OSError as exc:
        raise DamagedCheckpointError(f"{PROGRESS} unreadable ({exc})") from exc
    _matches(data, files, PROGRESS)
    try:
        progress = json.loads(data.decode("utf-8"))
    except ValueError as exc:
        raise DamagedCheckpointError(f"{PROGRESS} unreadable ({exc})") from exc
    problem = check_progress(progress, manifest["step"])
    if problem:
        raise InvalidProgressError(f"checkpoint {path}: its {PROGRESS} {problem}; its files match its {MANIFEST}, so "
                                   f"it was saved like this, not damaged on disk (a crafted or foreign file?): remove "
                                   f"{path.name} or pass another checkpoint")
    return progress


# What train.py writes in progress.json: name -> what it must be. The layout (train_export.LAYOUT) came later
# and the start of the layout's stretch (LAYOUT_FROM) later still: both all or none, older checkpoints lack them.
LAYOUT = ("world_size", "sp_size", "ulysses", "dp_size", "batch_size")  # train_export.LAYOUT (a test: equal)
LAYOUT_FROM = ("layout_from_step", "layout_from_samples")  # where the batches of this layout began


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_progress(progress, manifest_step: int) -> str | None:
    """What is wrong with a parsed ``progress.json`` (``None``: nothing), whatever the run resuming it.

    ``step`` >= 1 and the manifest's; ``samples`` >= ``step`` (every step reads at least one sample); ``loss`` a
    number; ``seq_len`` >= 1, ``seed`` an integer, ``data`` a string; the layout positive integers with
    ``world_size = sp_size * dp_size`` and ``ulysses`` dividing ``sp_size``; with ``LAYOUT_FROM``, ``samples``
    exactly ``layout_from_samples + (step - layout_from_step) * batch_size * dp_size``.
    """
    if not isinstance(progress, dict):
        return f"holds a JSON {type(progress).__name__}, not an object"
    for name, ok, want in (("step", _is_int, "an integer"), ("samples", _is_int, "an integer"),
                           ("loss", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
                           ("seq_len", _is_int, "an integer"), ("seed", _is_int, "an integer"),
                           ("data", lambda v: isinstance(v, str), "a string")):
        if name not in progress:
            return f"has no {name!r}"
        if not ok(progress[name]):
            return f"holds {name} {_show(progress[name])}, not {want}"
    step, samples = progress["step"], progress["samples"]
    if step < 1:
        return f"holds step {step}; train.py saves after step 1 at the earliest"
    if step != manifest_step:
        return f"holds step {step}, but its {MANIFEST} says step {manifest_step}"
    if samples < step:
        return f"holds {samples} samples consumed at step {step}; every step reads at least one sample"
    if progress["seq_len"] < 1:
        return f"holds seq_len {progress['seq_len']}, not a length"
    return _check_layout(progress)


def _check_layout(progress: dict) -> str | None:
    """The layout fields (if any) of ``progress`` and, with them, ``samples`` against the batches read."""
    for group in (LAYOUT, LAYOUT_FROM):
        there = [k for k in group if k in progress]
        if there and len(there) < len(group):
            return f"holds {', '.join(there)} without {', '.join(k for k in group if k not in there)}"
    if LAYOUT[0] not in progress:
        return "holds layout_from_* without the layout" if LAYOUT_FROM[0] in progress else None
    for k in LAYOUT + LAYOUT_FROM:
        if k in progress and not (_is_int(progress[k]) and progress[k] >= (1 if k in LAYOUT else 0)):
            return f"holds {k} {_show(progress[k])}, not a {'positive' if k in LAYOUT else 'non-negative'} integer"
    world, sp, ulysses, dp, batch = (progress[k] for k in LAYOUT)
    if world != sp * dp or sp % ulysses:
        return f"holds world_size {world}, sp_size {sp}, dp_size {dp}, ulysses {ulysses}: not one layout"
    if LAYOUT_FROM[0] not in progress:
        return None
    step, samples = progress["step"], progress["samples"]
    since, since_samples = progress["layout_from_step"], progress["layout_from_samples"]
    if not (since < step and since <= since_samples and (since > 0 or since_samples == 0)):
        return (f"holds layout_from_step {since}, layout_from_samples {since_samples}: not a point before step "
                f"{step} (at least one sample a step before it, none at step 0)")
    want = since_samples + (step - since) * batch * dp
    if samples != want:
        return (f"holds {samples} samples consumed at step {step}, but {step - since} steps of {batch * dp} "
                f"samples (batch {batch} x dp {dp}) since step {since} ({since_samples} then) make {want}")
    return None


def storage_files(metadata: Metadata, files: dict[str, dict]) -> set[str]:
    """The shard files ``metadata`` reads tensors from; ``UnsafeCheckpointError`` unless every one is a plain
    path inside the checkpoint, listed in its manifest (``files``), and not one of its bookkeeping files."""
    table = getattr(metadata, "storage_data", None)
    names = {getattr(info, "relative_path", None) for info in table.values()} if isinstance(table, dict) else {None}
    if not all(isinstance(n, str) for n in names):
        raise UnsafeCheckpointError(f"its {METADATA} has a storage table without a file name per entry")
    for name in sorted(names):
        if not plain_relative(name):
            raise UnsafeCheckpointError(f"its {METADATA} reads tensors from {name!r}, a path outside the checkpoint: "
                                        f"refusing to load it (a crafted file?)")
        if name in (METADATA, PROGRESS, MANIFEST) or name not in files:
            raise UnsafeCheckpointError(f"its {METADATA} reads tensors from {name!r}, which is not a shard file its "
                                        f"{MANIFEST} lists: refusing to load it (a crafted file?)")
    return names


def verify(path: Path, share: tuple[int, int] = (0, 1)) -> None:
    """Check ``path`` is a checkpoint this job may trust: no link anywhere in it, a usable manifest, a safe
    ``.metadata`` whose shard files all lie inside and are listed, and files matching the manifest.

    ``share = (rank, world)``: digest only this rank's share of the files (the rest is checked alike by every
    rank, so every rank raises the same error for it). Raises:
        DamagedCheckpointError: a link, a missing or changed file, an unusable manifest.
        UnsafeCheckpointError: a ``.metadata`` with a class outside the allow-list or a foreign shard file.
    """
    refuse_links(path)
    files = read_manifest(path)
    problems = check_files(path, {METADATA: files[METADATA]})  # every rank: digest before unpickling
    if not problems:
        try:
            SafeReader(str(path), files).read_metadata()
        except (UnsafeCheckpointError, DamagedCheckpointError):
            raise
        except Exception as exc:  # noqa: BLE001 - what the unpickler met in a file matching its manifest
            raise DamagedCheckpointError(f"{METADATA} unreadable ({type(exc).__name__}: {exc})") from exc
        rank, world = share
        problems = check_files(path, {name: files[name] for name in sorted(files)[rank::world]})
    if problems:
        raise DamagedCheckpointError("; ".join(problems))


# ---------------------------------------------------------------------------------------------- safe loading


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in METADATA_CLASSES:
            raise UnsafeCheckpointError(f"its .metadata asks to load {module}.{name}, which is not a DCP metadata "
                                        f"class: refusing to unpickle it (a crafted or foreign file?)")
        return super().find_class(module, name)


class _CheckpointFiles(FileSystem):
    """DCP's file access while loading one checkpoint: only the shard files its verified ``.metadata`` names
    (``allowed``), opened read-only without following a link."""

    def __init__(self, root: Path):
        super().__init__()
        self.root, self.allowed = root, set()

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        rel = Path(path).relative_to(self.root).as_posix() if Path(path).is_relative_to(self.root) else None
        if mode != "rb" or rel not in self.allowed:
            raise UnsafeCheckpointError(f"DCP asked to open {path} ({mode}), which is not a shard file of the "
                                        f"checkpoint's verified .metadata: refused")
        try:
            with open_inside(self.root, rel) as stream:
                yield stream
        except DamagedCheckpointError as exc:
            raise UnsafeCheckpointError(str(exc)) from exc


class SafeReader(FileSystemReader):
    """DCP's file-system reader with ``.metadata`` unpickled against :data:`METADATA_CLASSES` only, checked
    against the manifest (its digest; its shard files inside and listed), and DCP's reads confined to those
    shard files (:class:`_CheckpointFiles`).

    ``files``: the manifest's entries (read from the checkpoint if not given). The first ``read_metadata``
    reads the file; later calls (DCP's own, inside ``dcp.load``) return the same object, so a refusal is
    raised where ``load`` can report it, not inside DCP's planning step.
    """

    def __init__(self, path: str, files: dict[str, dict] | None = None):
        super().__init__(path)
        self.fs = _CheckpointFiles(Path(path))
        self._files = files
        self._metadata: Metadata | None = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata is None:
            root = Path(self.path)
            data = read_inside(root, METADATA)
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
            if not isinstance(metadata, Metadata):
                raise UnsafeCheckpointError(f"its .metadata holds a {type(metadata).__name__}, not DCP Metadata")
            files = read_manifest(root) if self._files is None else self._files
            _matches(data, files, METADATA)
            self.fs.allowed = storage_files(metadata, files)
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
            # torch's own message advises weights_only=False, which would run the payload: say what it asked for
            asked = re.search(r"Unsupported (?:global: GLOBAL|operand) (\S+)", str(exc))
            what = f"its pickle asks for {asked.group(1)}; " if asked else ""
            raise UnsafeCheckpointError(f"its entry {read_item.dest_index.fqn} is not plain data ({what}a train.py "
                                        f"checkpoint holds only numbers, strings and containers there): refusing to "
                                        f"unpickle it (a crafted or foreign file?); it is never loaded, and this "
                                        f"checkpoint cannot be used") from exc
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
