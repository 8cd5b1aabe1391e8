"""Tokenize data once into the token files ``launch/train.py --data`` memory-maps (``train_formats``' ``tokens``).

A corpus larger than ``TMPDIR`` (where each rank of a job otherwise writes its own tokenized copy), or one that
many jobs read, is best tokenized once::

    python launch/train_tokenize.py --tokenizer tok/ --out corpus.npy 'corpus/*.parquet'
    torchrun --standalone --nproc-per-node 8 launch/train.py --tokenizer tok/ --data corpus.npy

It reads any format ``--data`` reads, with the same flags (``--data-format``, ``--text-field``, ``--bos``/``--eos``),
and writes ``OUT`` (a 1-D ``.npy``: uint16 ids when the vocabulary fits, uint32 otherwise) and ``OUT.idx`` (the
documents' int64 offsets, ``.npy``), streaming: memory holds a batch of documents and the offsets.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

import train_data
import train_formats
from train_config import UsageError

_CHUNK = 1 << 24  # tokens copied at a time


def write_tokens(store: train_data.TokenStore, out: Path, vocab_size: int) -> None:
    """``store``'s ids into ``out`` (``.npy``) and its document offsets into ``out.idx``."""
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    ids = np.lib.format.open_memmap(out, mode="w+", dtype=dtype, shape=(len(store),))
    for start in range(0, len(store), _CHUNK):
        part = store[start:start + _CHUNK]
        ids[start:start + len(part)] = part
    ids.flush()
    with open(str(out) + train_formats.INDEX_SUFFIX, "wb") as f:  # a file object: numpy adds no .npy to the name
        np.save(f, store.offsets.astype(np.int64))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="train_tokenize.py", description=__doc__.split("\n\n")[0])
    p.add_argument("data", nargs="+", help="files, folders or globs of one format (as train.py --data)")
    p.add_argument("--out", required=True, help="the token file to write (.npy); its index goes to OUT.idx")
    p.add_argument("--tokenizer", default=None, help="a local Hugging Face tokenizer directory (default: bytes)")
    p.add_argument("--data-format", default="auto", choices=("auto", *train_formats.FORMATS[:-1]))
    p.add_argument("--text-field", default="text")
    p.add_argument("--bos", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--eos", action=argparse.BooleanOptionalAction, default=None)
    args = p.parse_args(argv)
    try:
        tokenizer = train_data.make_tokenizer(args.tokenizer, None)
        bos, eos = train_data.resolve_special_tokens(args.bos, args.eos, tokenizer)
        paths = train_formats.expand(args.data, "data")
        fmt = train_formats.detect_all(paths, None if args.data_format == "auto" else args.data_format, "data")
        if fmt == "tokens":
            raise UsageError("the data is already tokenized")
        spec = train_data.DataSpec(paths=tuple(paths), fmt=fmt, text_field=args.text_field, bos=bos, eos=eos)
        store = train_data.token_store(spec, tokenizer)
        if not len(store):
            raise UsageError(f"{args.data[0]}: no tokens (no documents, or only empty ones)")
        write_tokens(store, Path(args.out), tokenizer.vocab_size)
    except UsageError as exc:
        print(f"train_tokenize.py: error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.out}: {len(store)} tokens, {len(store.offsets) - 1} documents ({fmt}, tokenizer {tokenizer.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
