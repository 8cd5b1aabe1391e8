"""The formats ``--data`` and ``--eval-data`` read, recognized from their content, and read lazily.

========  =====================================================================================================
text      UTF-8 text, plain or gzip: documents end at a blank line (and a "Book chapter" heading line starts
          one, the shipped corpus's chapters); every line belongs to a document, so the documents' text put
          back together is the file.
jsonl     JSON Lines, plain or gzip: one JSON object a line, the document in its ``--text-field`` (``text``).
parquet   Apache Parquet (``pyarrow``), read one row group's batch at a time; the ``--text-field`` column.
hf        a folder written by ``datasets.Dataset.save_to_disk`` (memory-mapped Arrow, read in batches); the
          ``--text-field`` column. For a ``DatasetDict`` folder, pass one split's folder (``DIR/train``).
tokens    pre-tokenized: a 1-D ``.npy`` of integer token ids (numpy's own format: a header with the dtype, then
          the ids; ``uint16``/``uint32``/``int32``/``int64``), memory-mapped, never loaded. Document boundaries
          come from an index file beside it, ``FILE.npy.idx`` (itself ``.npy``: int64 offsets, 0 first, the
          length of FILE last, non-decreasing), else from the tokenizer's EOS id (a document ends after each
          EOS). The ids are used as they are: no BOS/EOS is added. ``launch/train_tokenize.py`` writes both.
========  =====================================================================================================

The format comes from the first bytes (Parquet's ``PAR1``, numpy's magic, gzip's, a folder's
``state.json``; a text whose first line is a JSON object is JSON Lines), the name only confirms it: a file whose
name says one format and whose content says another (a ``.jsonl`` of plain text, a ``.txt`` of JSON Lines) is
refused, as are binary files of no known format and several files of different formats, each with one line that
says what was found and how to fix it (``--data-format`` overrides the detection). The optional libraries
(``pip install -e ".[data]"``: ``pyarrow``, ``datasets``) are imported only for their formats.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from train_config import UsageError

FORMATS = ("text", "jsonl", "parquet", "hf", "tokens")
_SUFFIX_HINT = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "jsonl", ".json": "jsonl",
                ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet", ".npy": "tokens"}
_SNIFF_BYTES = 1 << 16
_BATCH_ROWS = 1024  # rows per batch read from parquet / datasets: bounded memory whatever the file's size
INDEX_SUFFIX = ".idx"  # FILE.npy's document index: FILE.npy.idx


def expand(patterns: list[str], flag: str = "--data") -> list[Path]:
    """Files and folders named by ``patterns`` (globs expanded, sorted; an index ``.idx`` beside its token file
    is not data of its own)."""
    paths: list[Path] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            found = [Path(p) for p in sorted(glob.glob(pattern)) if not p.endswith(".npy" + INDEX_SUFFIX)]
            if not found:
                raise UsageError(f"{flag} {pattern}: the pattern matches no file")
            paths.extend(found)
        else:
            path = Path(pattern)
            if not path.exists():
                raise UsageError(f"{flag} {pattern}: no such file or folder")
            paths.append(path)
    return paths


def _hint(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return _SUFFIX_HINT.get(suffixes[-1]) if suffixes else None


def _head(path: Path) -> tuple[bytes, bool, bool]:
    """The first bytes (decompressed if gzip), whether it is gzip, whether the head is the whole content."""
    with open(path, "rb") as f:
        raw = f.read(_SNIFF_BYTES)
    if raw[:2] != b"\x1f\x8b":
        return raw, False, len(raw) < _SNIFF_BYTES
    try:
        with gzip.open(path, "rb") as f:
            data = f.read(_SNIFF_BYTES)
    except (OSError, EOFError) as exc:
        raise UsageError(f"{path}: a damaged gzip file ({exc})") from exc
    return data, True, len(data) < _SNIFF_BYTES


def _sniff_file(path: Path) -> str:
    head, gz, whole = _head(path)
    if head[:4] == b"PAR1" and not gz:
        return "parquet"
    if head[:6] == b"\x93NUMPY" and not gz:
        return "tokens"
    if head[:6] == b"ARROW1" or head[:4] == b"\xff\xff\xff\xff":
        raise UsageError(f"{path}: an Arrow file; pass the folder that datasets' save_to_disk wrote, or convert "
                         f"it to Parquet")
    if b"\x00" in head:
        raise UsageError(f"{path}: unreadable: binary data of no known format (not text, JSON Lines, Parquet, a "
                         f"token .npy, nor a datasets folder)")
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=whole)
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: unreadable: not UTF-8 text ({exc.reason} at byte {exc.start}) and no known "
                         f"binary format") from exc
    text = text.removeprefix("\ufeff")  # a UTF-8 byte-order mark is not content
    lines = text.splitlines()
    if not whole:
        lines = lines[:-1]  # the last line may be cut
        if not lines:  # one line longer than the sniffed bytes: its start decides
            return "jsonl" if text.lstrip().startswith("{") else "text"
    lines = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if not lines:
        return "text"
    objects = [(n, _is_object(line)) for n, line in lines]
    if not objects[0][1]:
        return "text"
    bad = next((n for n, ok in objects if not ok), None)
    if bad is not None:
        raise UsageError(f"{path}: mixed content: line {objects[0][0]} is a JSON object but line {bad} is not; "
                         f"JSON Lines needs one object a line (or pass --data-format text to train on it as text)")
    return "jsonl"


def _is_object(line: str) -> bool:
    if not line.lstrip().startswith("{"):
        return False
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def _sniff_folder(path: Path) -> str:
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise UsageError(f"{path}: a datasets DatasetDict; pass one split's folder, e.g. "
                         f"{path / (splits or ['train'])[0]}"
                         f" (splits: {', '.join(splits) or 'none'})")
    if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
        return "hf"
    raise UsageError(f"{path}: a folder, but not one written by datasets' save_to_disk (no state.json and "
                     f"dataset_info.json); pass files, or a glob such as '{path}/*.jsonl'")


def detect(path: Path) -> str:
    """The format of ``path`` from its content, confirmed by its name (``UsageError`` when they disagree)."""
    try:
        found = _sniff_folder(path) if path.is_dir() else _sniff_file(path)
    except PermissionError as exc:
        raise UsageError(f"{path}: unreadable ({exc.strerror})") from exc
    hint = None if path.is_dir() else _hint(path)
    if hint == "jsonl" and found == "text" and _head(path)[0].lstrip()[:1] == b"[":
        raise UsageError(f"{path}: one JSON document (an array), not JSON Lines; write one object a line")
    if hint is not None and hint != found:
        raise UsageError(f"{path}: the name says {hint} but the content is {found}; rename the file, or pass "
                         f"--data-format {found} (or {hint}) to choose")
    return found


def detect_all(paths: list[Path], forced: str | None, flag: str = "--data") -> str:
    """The one format of every path (``forced``: ``--data-format``); several formats at once are refused."""
    if forced is not None:
        return forced
    found = {path: detect(path) for path in paths}
    kinds = sorted(set(found.values()))
    if len(kinds) > 1:
        first = {kind: next(p for p, k in found.items() if k == kind) for kind in kinds}
        raise UsageError(f"{flag}: mixed formats ({', '.join(f'{p} is {k}' for k, p in first.items())}); train on "
                         f"one format at a time")
    return kinds[0]


# -- documents, lazily -------------------------------------------------------------------------------------------
# A line "Book chapter" (e.g. "Genesis 1", "1 Kings 3", "Song of Solomon 2") opens a chapter of the shipped corpus.
HEADING = re.compile(r"^(?:[1-3] )?[A-Z][A-Za-z]*(?: [A-Za-z]+)* \d+$")


def text_documents(path: Path) -> Iterator[str]:
    """The documents of a text file, read line by line: a non-blank line after a blank one, or a heading line,
    starts a document; blank lines stay with the document before them (the documents add up to the file)."""
    opener = gzip.open if _head(path)[1] else open
    current: list[str] = []
    has_text, after_blank = False, False
    with opener(path, "rt", encoding="utf-8-sig", newline="") as f:
        try:
            for line in f:
                stripped = line.strip()
                if stripped and has_text and (after_blank or HEADING.match(stripped)):
                    yield "".join(current)
                    current, has_text = [], False
                current.append(line)
                has_text = has_text or bool(stripped)
                after_blank = not stripped
        except UnicodeDecodeError as exc:
            raise UsageError(f"{path}: not UTF-8 text ({exc.reason}); pass a UTF-8 file") from exc
    if current:
        yield "".join(current)


def jsonl_documents(path: Path, field: str) -> Iterator[str]:
    """The ``field`` of every JSON object of a JSON Lines file, one line at a time."""
    opener = gzip.open if _head(path)[1] else open
    with opener(path, "rt", encoding="utf-8-sig") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise UsageError(f"{path} line {n}: not JSON ({exc.msg}); JSON Lines needs one object a line") from exc
            yield _field(record, field, f"{path} line {n}")


def _field(record, field: str, where: str) -> str:
    if not isinstance(record, dict):
        raise UsageError(f"{where}: a JSON {type(record).__name__}, not an object")
    if field not in record:
        raise UsageError(f"{where}: no text field {field!r} (fields: {', '.join(map(str, record)) or 'none'}); "
                         f"pass --text-field NAME")
    if not isinstance(record[field], str):
        raise UsageError(f"{where}: field {field!r} is {type(record[field]).__name__}, not text")
    return record[field]


def _column_documents(batches, names: list[str], field: str, where: str) -> Iterator[str]:
    if field not in names:
        raise UsageError(f"{where}: no text field {field!r} (columns: {', '.join(names)}); pass --text-field NAME")
    row = 0
    for column in batches:
        for value in column:
            row += 1
            if not isinstance(value, str):
                raise UsageError(f"{where} row {row}: field {field!r} is {type(value).__name__}, not text")
            yield value


def parquet_documents(path: Path, field: str) -> Iterator[str]:
    """The ``field`` column of a Parquet file, one batch of rows at a time (never the whole table)."""
    pq = _import("pyarrow.parquet", "parquet")
    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001  (pyarrow raises ArrowInvalid, OSError, ...: one line each)
        raise UsageError(f"{path}: unreadable Parquet ({str(exc).splitlines()[0]})") from exc
    names = pf.schema_arrow.names
    batches = (b.column(0).to_pylist() for b in pf.iter_batches(batch_size=_BATCH_ROWS, columns=[field])) \
        if field in names else iter(())
    yield from _column_documents(batches, names, field, str(path))


def hf_documents(path: Path, field: str) -> Iterator[str]:
    """The ``field`` column of a ``save_to_disk`` folder: memory-mapped Arrow, read in batches of rows."""
    datasets = _import("datasets", "a datasets folder")
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # noqa: BLE001
        raise UsageError(f"{path}: unreadable datasets folder ({str(exc).splitlines()[0]})") from exc
    names = list(ds.column_names)
    batches = (b[field] for b in ds.select_columns([field]).iter(batch_size=_BATCH_ROWS)) if field in names \
        else iter(())
    yield from _column_documents(batches, names, field, str(path))


def _import(module: str, what: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise UsageError(f"reading {what} needs {module.split('.')[0]}: pip install -e \".[data]\"") from exc


def documents(paths: list[Path], fmt: str, field: str) -> Iterator[str]:
    """Every document of every path, in order, one at a time."""
    for path in paths:
        try:
            if fmt == "text":
                yield from text_documents(path)
            elif fmt == "jsonl":
                yield from jsonl_documents(path, field)
            elif fmt == "parquet":
                yield from parquet_documents(path, field)
            elif fmt == "hf":
                yield from hf_documents(path, field)
            else:
                raise AssertionError(fmt)
        except (OSError, EOFError) as exc:  # a folder given as a file, no permission, a truncated gzip
            raise UsageError(f"{path}: unreadable as {fmt} ({getattr(exc, 'strerror', None) or exc})") from exc


# -- pre-tokenized files -----------------------------------------------------------------------------------------
def load_tokens(path: Path, eos_id: int | None) -> tuple[np.ndarray, np.ndarray]:
    """A token file, memory-mapped: ``(ids (n,), document offsets (docs + 1,) int64)``."""
    try:
        ids = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise UsageError(f"{path}: unreadable token file ({exc}); see --help for the format") from exc
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise UsageError(f"{path}: a token file holds a 1-D integer array, this one is {ids.dtype} of shape "
                         f"{ids.shape}")
    index = Path(str(path) + INDEX_SUFFIX)
    if index.exists():
        return ids, _load_index(index, len(ids))
    if eos_id is None:
        return ids, np.array([0, len(ids)], dtype=np.int64)
    ends = [np.flatnonzero(ids[lo:lo + (1 << 24)] == eos_id) + lo + 1 for lo in range(0, len(ids), 1 << 24)]
    ends = np.concatenate(ends) if ends else np.zeros(0, dtype=np.int64)
    offsets = np.concatenate([[0], ends, [] if len(ends) and ends[-1] == len(ids) else [len(ids)]])
    return ids, offsets.astype(np.int64)


def _load_index(index: Path, n: int) -> np.ndarray:
    try:
        offsets = np.load(index, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise UsageError(f"{index}: unreadable index ({exc}); it must be a .npy of int64 offsets") from exc
    if offsets.ndim != 1 or offsets.dtype.kind not in "iu" or len(offsets) < 2 or offsets[0] != 0 \
            or offsets[-1] != n or np.any(np.diff(offsets) < 0):
        raise UsageError(f"{index}: a document index holds non-decreasing offsets from 0 to the token count ({n})")
    return offsets.astype(np.int64)


def token_range(ids: np.ndarray, chunk: int = 1 << 24) -> tuple[int, int]:
    """``(min, max)`` of a memory-mapped id array, a chunk at a time."""
    lo, hi = None, None
    for start in range(0, len(ids), chunk):
        part = ids[start:start + chunk]
        lo = int(part.min()) if lo is None else min(lo, int(part.min()))
        hi = int(part.max()) if hi is None else max(hi, int(part.max()))
    return (lo or 0), (hi or 0)
