"""Training data of ``launch/train.py``: documents read lazily (``train_formats``), tokenized once into a
memory-mapped token store, cut or packed into fixed-length samples.

The token stream is cut into non-overlapping windows of ``seq_len`` tokens; each epoch visits them in a
seeded random order. Sample ``g`` (counting from the start of training, across epochs) is a pure function
of ``(seed, seq_len, g)``, so the job's whole data position is one integer, the number of samples consumed,
which the checkpoint stores: a resumed run reads exactly the samples the uninterrupted run would have.

Nothing holds the data set in memory: documents are read and tokenized a batch at a time and their ids are
written to an unnamed temporary file (``TMPDIR``; 4 bytes a token, removed when the job ends) that is
memory-mapped, as token files (``.npy``) are directly; what stays in memory is 8 bytes per document (its offset)
and per sample (the epoch's order). Each rank tokenizes the same files alike, before the process group exists.

Every rank of a sequence-parallel group builds the same full-length batch and keeps its own slice of it
(``shard_batch``); data-parallel replicas take consecutive, disjoint samples.
"""

from __future__ import annotations

import gzip
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import train_formats
from train_config import UsageError


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to download, works on any text."""

    name = "bytes"
    vocab_size = 256
    bos_id = None  # every id is a byte: there is no room for special tokens
    eos_id = None

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local Hugging Face tokenizer directory (never downloads)."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self.name = str(path)
        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot load a Hugging Face tokenizer from {path}: {str(exc).splitlines()[0]}") from exc
        self._tok.model_max_length = 1 << 62  # we pack the stream ourselves; silence the too-long warning
        self.vocab_size = len(self._tok)
        self.bos_id, self.eos_id = self._tok.bos_token_id, self._tok.eos_token_id

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Short documents in one call of the fast tokenizer; a long one alone (:meth:`encode`)."""
        short = [t for t in texts if len(t) <= self.LONG_CHARS]
        ids = iter(self._tok(short, add_special_tokens=False)["input_ids"] if short else [])
        return [np.asarray(next(ids), dtype=np.int32) if len(t) <= self.LONG_CHARS else self.encode(t)
                for t in texts]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])

    LONG_CHARS = 1 << 20

    def encode(self, text: str) -> np.ndarray:
        # Line by line batches keep the fast tokenizer's memory flat on a multi-MB text.
        lines = text.splitlines(keepends=True)
        ids: list[int] = []
        for i in range(0, len(lines), 4096):
            ids.extend(self._tok("".join(lines[i:i + 4096]), add_special_tokens=False)["input_ids"])
        return np.asarray(ids, dtype=np.int32)


def read_text(path: Path) -> str:
    """The file's text; gzip is recognized by its magic bytes, not its name."""
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    opener = gzip.open if gz else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            return f.read()
    except (UnicodeDecodeError, OSError) as exc:
        raise UsageError(f"--data {path}: not a UTF-8 text file ({exc})") from exc


def make_tokenizer(tokenizer_dir: str | None, model_dir: str | None):
    """The byte tokenizer, or a local HF tokenizer (``--tokenizer``, else the checkpoint's own)."""
    path = tokenizer_dir or model_dir
    return HFTokenizer(path) if path is not None else ByteTokenizer()


class TokenStore:
    """Token ids of one or more (memory-mapped) arrays read as one sequence, and where its documents start.

    ``offsets``: int64 ``(documents + 1,)``, the first token of each document in the joined sequence, then its
    length. ``len(store)``, ``store[a:b]`` (an ndarray) and ``store.max()`` read no more than they need.
    """

    def __init__(self, parts: list[np.ndarray], offsets: np.ndarray, max_id: int | None = None):
        self.parts = [p for p in parts if len(p)]
        self.starts = np.cumsum([0] + [len(p) for p in self.parts])
        self.offsets = offsets
        self._max = max_id

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, key: slice) -> np.ndarray:
        lo, hi, _ = key.indices(len(self))
        if hi <= lo:
            return np.zeros(0, dtype=np.int64)
        first = int(np.searchsorted(self.starts, lo, side="right")) - 1
        pieces = []
        for i in range(max(first, 0), len(self.parts)):
            if self.starts[i] >= hi:
                break
            a, b = max(lo, self.starts[i]) - self.starts[i], min(hi, self.starts[i + 1]) - self.starts[i]
            pieces.append(self.parts[i][a:b])
        return np.concatenate(pieces) if len(pieces) != 1 else np.asarray(pieces[0])

    def max(self) -> int:
        if self._max is None:
            self._max = max((train_formats.token_range(p)[1] for p in self.parts), default=0)
        return self._max

    def min(self) -> int:
        return min((train_formats.token_range(p)[0] for p in self.parts), default=0)

    @property
    def num_documents(self) -> int:
        return int(np.count_nonzero(np.diff(self.offsets)))


def _enough(store_len: int, seq_len: int, what: str) -> None:
    if store_len < seq_len:
        raise UsageError(f"{what}: the data holds {store_len} tokens, fewer than one sample of --seq-len {seq_len}; "
                         f"use a shorter --seq-len or longer data")


class PackedSequences:
    """Fixed-length samples cut from one token stream, in a seeded order that depends only on the index."""

    def __init__(self, tokens, seq_len: int, seed: int, what: str = "--data"):
        _enough(len(tokens), seq_len, what)
        self.eval_set, self.tokenizer = None, None  # set by train.load_data: the held-out set, the tokenizer
        self.tokens = tokens  # an ndarray or a TokenStore
        self.num_documents = tokens.num_documents if isinstance(tokens, TokenStore) else 1
        self.seq_len = seq_len
        self.seed = seed
        self.num_windows = len(tokens) // seq_len
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, permutation) of the last epoch used

    def __len__(self) -> int:
        return self.num_windows

    def _window(self, epoch: int, i: int) -> int:
        if self._order is None or self._order[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order = (epoch, rng.permutation(self.num_windows))
        return int(self._order[1][i])

    def sample(self, index: int) -> np.ndarray:
        """Sample ``index`` (0-based over the whole run): ``(seq_len,)`` token ids."""
        epoch, i = divmod(index, self.num_windows)
        start = self._window(epoch, i) * self.seq_len
        return self.tokens[start:start + self.seq_len]

    def window(self, i: int) -> np.ndarray:
        """Window ``i`` in file order (held-out data: the same samples at every evaluation)."""
        return self.tokens[i * self.seq_len:(i + 1) * self.seq_len]

    def batch(self, first: int, size: int) -> torch.Tensor:
        """Samples ``first .. first + size - 1`` stacked: ``(size, seq_len)`` int64."""
        return torch.from_numpy(np.stack([self.sample(first + j) for j in range(size)]).astype(np.int64))

    def windows(self, first: int, size: int) -> torch.Tensor:
        """Windows ``first .. first + size - 1`` in file order, as :meth:`batch` stacks samples."""
        return torch.from_numpy(np.stack([self.window(first + j) for j in range(size)]).astype(np.int64))

def split_documents(text: str) -> list[str]:
    """Documents of a text: a blank line ends one, and a "Book chapter" heading line (the shipped corpus: one
    document per chapter, 1,189 of 200 B to 20 KB) starts one."""
    docs, current = [], []
    for line in text.splitlines(keepends=True):
        starts_new = not line.strip() or train_formats.HEADING.match(line.strip())
        if starts_new and "".join(current).strip():
            docs.append("".join(current))
            current = []
        if line.strip():
            current.append(line)
    if "".join(current).strip():
        docs.append("".join(current))
    return docs


class DocumentStream:
    """``--pack``: documents of varied length, in a seeded order per epoch, packed back to back into
    fixed-length streams (no padding); a document that does not fit is cut, and each piece is a document of
    its own. Sample ``g`` is a pure function of ``(seed, seq_len, g)``, as in :class:`PackedSequences`.

    Built from a list of token arrays, or (:meth:`from_store`) from a :class:`TokenStore`'s offsets: an
    epoch's order costs 16 bytes per document, and a sample reads only its own documents' tokens.
    """

    def __init__(self, documents: list[np.ndarray], seq_len: int, seed: int):
        docs = [np.asarray(d) for d in documents if len(d)]
        offsets = np.cumsum([0] + [len(d) for d in docs]).astype(np.int64)
        self._init(TokenStore(docs, offsets), seq_len, seed)

    @classmethod
    def from_store(cls, store: TokenStore, seq_len: int, seed: int, what: str = "--data") -> "DocumentStream":
        self = cls.__new__(cls)
        self._init(store, seq_len, seed, what)
        return self

    def _init(self, store: TokenStore, seq_len: int, seed: int, what: str = "--data") -> None:
        _enough(len(store), seq_len, what)
        self.eval_set, self.tokenizer = None, None  # set by train.load_data: the held-out set, the tokenizer
        lengths = np.diff(store.offsets)
        self.tokens, self.seq_len, self.seed = store, seq_len, seed
        self.doc_starts, self.doc_lengths = store.offsets[:-1][lengths > 0], lengths[lengths > 0]
        self.num_documents = len(self.doc_starts)
        self.num_windows = len(store) // seq_len
        self._epoch: tuple[int, np.ndarray, np.ndarray] | None = None  # (epoch, doc order, stream starts)
        self._file_order: tuple[np.ndarray, np.ndarray] | None = None  # the same for the documents as stored

    def __len__(self) -> int:
        return self.num_windows

    def _order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        if self._epoch is None or self._epoch[0] != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_documents)
            self._epoch = (epoch, perm, np.concatenate([[0], np.cumsum(self.doc_lengths[perm])]))
        return self._epoch[1], self._epoch[2]

    def _stream(self, order: np.ndarray, starts: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """Tokens ``[lo, hi)`` of the documents laid out in ``order`` (``starts``: where each begins)."""
        pieces, j = [], int(np.searchsorted(starts, lo, side="right")) - 1
        while j < len(order) and starts[j] < hi:
            a, b = max(lo, starts[j]) - starts[j], min(hi, starts[j + 1]) - starts[j]
            src = self.doc_starts[order[j]]
            pieces.append(self.tokens[src + a:src + b])
            j += 1
        return np.concatenate(pieces)

    def _sample(self, order: np.ndarray, starts: np.ndarray, i: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = i * self.seq_len, (i + 1) * self.seq_len
        inside = starts[(starts > lo) & (starts < hi)] - lo
        cuts = np.concatenate([[0], inside, [self.seq_len]])
        positions = np.concatenate([np.arange(b - a) for a, b in zip(cuts[:-1], cuts[1:])])
        return self._stream(order, starts, lo, hi), positions

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens (seq_len,), positions (seq_len,))``: positions restart at 0 at every document (piece)."""
        epoch, i = divmod(index, self.num_windows)
        return self._sample(*self._order(epoch), i)

    def window(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Window ``i`` of the documents in file order (held-out data: the same samples at every evaluation)."""
        if self._file_order is None:
            self._file_order = (np.arange(self.num_documents), np.concatenate([[0], np.cumsum(self.doc_lengths)]))
        return self._sample(*self._file_order, i)

    def batch(self, first: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``first .. first + size - 1`` as ONE stream: ``(ids (size*seq_len,), positions)`` int64."""
        return _one_stream([self.sample(first + j) for j in range(size)])

    def windows(self, first: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows ``first .. first + size - 1`` in file order, as :meth:`batch` packs samples."""
        return _one_stream([self.window(first + j) for j in range(size)])


def _one_stream(parts) -> tuple[torch.Tensor, torch.Tensor]:
    ids = np.concatenate([p[0] for p in parts]).astype(np.int64)
    return torch.from_numpy(ids), torch.from_numpy(np.concatenate([p[1] for p in parts]).astype(np.int64))


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """Where the documents are and how they become tokens (``--data``/``--eval-data`` and the format flags)."""

    paths: tuple[Path, ...]
    """The files or folders, globs expanded."""
    fmt: str
    """One of ``train_formats.FORMATS``."""
    text_field: str = "text"
    """The field of a JSON object / the column of a table that holds the document."""
    bos: bool = False
    """Prepend the tokenizer's BOS id to every document (not to token files)."""
    eos: bool = False
    """Append the tokenizer's EOS id to every document (not to token files)."""


_DOCS_PER_BATCH = 256


def _batches(docs: Iterator[str], chars: int = 1 << 22) -> Iterator[list[str]]:
    """Documents in batches of at most ``_DOCS_PER_BATCH`` documents and about ``chars`` characters."""
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if len(batch) >= _DOCS_PER_BATCH or size >= chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def tokenize_to_store(docs: Iterable[str], tokenizer, bos: bool, eos: bool) -> TokenStore:
    """Tokenize ``docs`` a batch at a time into an unnamed, memory-mapped temporary file of uint32 ids."""
    f = tempfile.TemporaryFile(prefix="distattn-tokens-")  # unlinked at once: gone when the process ends
    offsets, total, max_id = [0], 0, 0
    head = np.asarray([tokenizer.bos_id] if bos else [], dtype=np.int64)
    tail = np.asarray([tokenizer.eos_id] if eos else [], dtype=np.int64)
    for batch in _batches(iter(docs)):
        for ids in tokenizer.encode_batch(batch):
            ids = np.concatenate([head, ids, tail]).astype(np.uint32)
            if not len(ids):
                continue
            f.write(ids.tobytes())
            total += len(ids)
            offsets.append(total)
            max_id = max(max_id, int(ids.max()))
    f.flush()
    parts = [np.memmap(f, dtype=np.uint32, mode="r", shape=(total,))] if total else []
    return TokenStore(parts, np.asarray(offsets, dtype=np.int64), max_id)


def token_store(spec: DataSpec, tokenizer) -> TokenStore:
    """The tokens of ``spec``: token files memory-mapped as they are, other formats tokenized on the way."""
    if spec.fmt != "tokens":
        return tokenize_to_store(train_formats.documents(list(spec.paths), spec.fmt, spec.text_field), tokenizer,
                                 spec.bos, spec.eos)
    parts, offsets, base = [], [np.zeros(1, dtype=np.int64)], 0
    for path in spec.paths:
        ids, doc_offsets = train_formats.load_tokens(path, tokenizer.eos_id)
        if ids.dtype.kind == "i" and len(ids) and train_formats.token_range(ids)[0] < 0:
            raise UsageError(f"{path}: negative token id {train_formats.token_range(ids)[0]}; token ids are >= 0")
        parts.append(ids)
        offsets.append(doc_offsets[1:] + base)
        base += len(ids)
    return TokenStore(parts, np.concatenate(offsets))


def load_dataset(spec: DataSpec | Path, tokenizer, seq_len: int, seed: int, pack: bool = False,
                 what: str = "--data"):
    """Read and tokenize ``spec`` (a path: text), then cut it into samples (``pack``: pack its documents)."""
    if isinstance(spec, Path):
        spec = DataSpec(paths=(spec,), fmt="text")
    store = token_store(spec, tokenizer)
    if pack:
        return DocumentStream.from_store(store, seq_len, seed, what)
    return PackedSequences(store, seq_len, seed, what)


def check_vocab(dataset, vocab_size: int, what: str = "--data") -> None:
    """Every token id must index the model's embedding (a token file of another tokenizer does not)."""
    top = dataset.tokens.max() if isinstance(dataset.tokens, TokenStore) else int(dataset.tokens.max())
    if top >= vocab_size:
        raise UsageError(f"{what}: token id {top} is beyond the model's vocabulary ({vocab_size} tokens, ids 0.."
                         f"{vocab_size - 1}); the data was tokenized with another tokenizer: pass that one with "
                         f"--tokenizer DIR (or the --model it belongs to)")


def resolve_special_tokens(flag_bos: bool | None, flag_eos: bool | None, tokenizer) -> tuple[bool, bool]:
    """``--bos``/``--eos``: default, the tokenizer's own tokens when it has them; asked for, they must exist."""
    chosen = []
    for name, flag, token in (("bos", flag_bos, tokenizer.bos_id), ("eos", flag_eos, tokenizer.eos_id)):
        if flag and token is None:
            raise UsageError(f"--{name}: the tokenizer ({tokenizer.name}) has no {name.upper()} token; drop --{name} "
                             f"or pass --tokenizer DIR with one")
        chosen.append(token is not None if flag is None else flag)
    return chosen[0], chosen[1]


def load(cfg, tokenizer):
    """The training samples of ``cfg`` (a ``RunConfig``: ``--data``, formats detected, documents read lazily and
    tokenized), with the held-out samples (``--eval-data``, same flags; ``None`` without) and the tokenizer
    attached as ``.eval_set`` and ``.tokenizer``."""
    a = cfg.args
    bos, eos = resolve_special_tokens(a.bos, a.eos, tokenizer)
    forced = None if a.data_format == "auto" else a.data_format
    sets = []
    for flag, paths in (("--data", list(cfg.data_paths)), ("--eval-data", a.eval_data)):
        if paths is None:
            sets.append(None)
            continue
        paths = paths if flag == "--data" else train_formats.expand(paths, flag)
        spec = DataSpec(paths=tuple(paths), fmt=train_formats.detect_all(paths, forced, flag), text_field=a.text_field,
                        bos=bos, eos=eos)
        sets.append(load_dataset(spec, tokenizer, a.seq_len, a.seed, pack=a.pack, what=flag))
    dataset, dataset.eval_set, dataset.tokenizer = sets[0], sets[1], tokenizer
    return dataset
