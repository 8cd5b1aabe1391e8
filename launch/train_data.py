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


def load_dataset(data_path: Path, tokenizer, seq_len: int, seed: int) -> PackedSequences:
    """Read, tokenize and pack the training text (the same on every rank)."""
    return PackedSequences(tokenizer.encode(read_text(data_path)), seq_len, seed)
