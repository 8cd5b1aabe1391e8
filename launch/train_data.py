"""Training data of ``launch/train.py``: a text file, tokenized once, packed into fixed-length samples.

The token stream is cut into non-overlapping windows of ``seq_len`` tokens; each epoch visits them in a
seeded random order. Sample ``g`` (counting from the start of training, across epochs) is a pure function
of ``(seed, seq_len, g)``, so the job's whole data position is one integer, the number of samples consumed,
which the checkpoint stores: a resumed run reads exactly the samples the uninterrupted run would have.

Every rank of a sequence-parallel group builds the same full-length batch and keeps its own slice of it
(``shard_batch``); data-parallel replicas take consecutive, disjoint samples.
"""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import numpy as np
import torch

from train_config import UsageError


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to download, works on any text."""

    name = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


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


class PackedSequences:
    """Fixed-length samples cut from one token stream, in a seeded order that depends only on the index."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int):
        if len(tokens) < seq_len:
            raise UsageError(f"the data holds {len(tokens)} tokens, fewer than one sample of --seq-len {seq_len}; "
                             f"use a shorter --seq-len or a longer --data file")
        self.tokens = tokens
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

    def batch(self, first: int, size: int) -> torch.Tensor:
        """Samples ``first .. first + size - 1`` stacked: ``(size, seq_len)`` int64."""
        return torch.from_numpy(np.stack([self.sample(first + j) for j in range(size)]).astype(np.int64))


# A line "Book chapter" (e.g. "Genesis 1", "1 Kings 3", "Song of Solomon 2") opens a chapter of the shipped corpus.
_HEADING = re.compile(r"^(?:[1-3] )?[A-Z][A-Za-z]*(?: [A-Za-z]+)* \d+$")


def split_documents(text: str) -> list[str]:
    """Documents of a text: a blank line ends one, and a "Book chapter" heading line (the shipped corpus: one
    document per chapter, 1,189 of 200 B to 20 KB) starts one."""
    docs, current = [], []
    for line in text.splitlines(keepends=True):
        starts_new = not line.strip() or _HEADING.match(line.strip())
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
    """

    def __init__(self, documents: list[np.ndarray], seq_len: int, seed: int):
        self.docs = [d for d in documents if len(d)]
        self.tokens = np.concatenate(self.docs) if self.docs else np.zeros(0, dtype=np.int32)
        if len(self.tokens) < seq_len:
            raise UsageError(f"the data holds {len(self.tokens)} tokens, fewer than one sample of --seq-len "
                             f"{seq_len}; use a shorter --seq-len or a longer --data file")
        self.seq_len, self.seed = seq_len, seed
        self.num_windows = len(self.tokens) // seq_len
        self._epoch: tuple[int, np.ndarray, np.ndarray] | None = None  # (epoch, tokens in order, doc starts)

    def __len__(self) -> int:
        return self.num_windows

    def _order(self, epoch: int):
        if self._epoch is None or self._epoch[0] != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.docs))
            ordered = [self.docs[i] for i in perm]
            starts = np.cumsum([0] + [len(d) for d in ordered])
            self._epoch = (epoch, np.concatenate(ordered), starts)
        return self._epoch[1], self._epoch[2]

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens (seq_len,), positions (seq_len,))``: positions restart at 0 at every document (piece)."""
        epoch, i = divmod(index, self.num_windows)
        tokens, starts = self._order(epoch)
        lo, hi = i * self.seq_len, (i + 1) * self.seq_len
        inside = starts[(starts > lo) & (starts < hi)] - lo
        cuts = np.concatenate([[0], inside, [self.seq_len]])
        positions = np.concatenate([np.arange(b - a) for a, b in zip(cuts[:-1], cuts[1:])])
        return tokens[lo:hi], positions

    def batch(self, first: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``first .. first + size - 1`` as ONE stream: ``(ids (size*seq_len,), positions)`` int64."""
        parts = [self.sample(first + j) for j in range(size)]
        ids = np.concatenate([p[0] for p in parts]).astype(np.int64)
        return torch.from_numpy(ids), torch.from_numpy(np.concatenate([p[1] for p in parts]).astype(np.int64))


def load_dataset(data_path: Path, tokenizer, seq_len: int, seed: int, pack: bool = False):
    """Read, tokenize and cut (or, ``pack``, split into documents and pack) the training text, alike on every rank."""
    text = read_text(data_path)
    if pack:
        return DocumentStream([tokenizer.encode(doc) for doc in split_documents(text)], seq_len, seed)
    return PackedSequences(tokenizer.encode(text), seq_len, seed)
