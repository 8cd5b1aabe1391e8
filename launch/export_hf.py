"""Convert a checkpoint of ``launch/train.py`` into a Hugging Face model folder.

    python launch/export_hf.py CKPT OUT_DIR        # or, from the repository root: python -m launch.export_hf

``CKPT``: a ``--ckpt-dir`` (its newest intact checkpoint is used, damaged newer ones skipped with a warning) or one
``step_N`` directory in it, written at any world size (FSDP2 shards of several ranks, DDP, one rank: DCP reads the
shards into whole tensors). ``OUT_DIR`` (new, or an empty directory) receives ``config.json``,
``model.safetensors`` (or safetensors shards and their index, for a large model), ``generation_config.json`` and
the tokenizer: ``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` gives the checkpoint's fp32 weights bit for bit,
``AutoTokenizer.from_pretrained(OUT_DIR)`` the tokenizer the model was trained with. The folder is written beside
``OUT_DIR`` and renamed into place at the end, so ``OUT_DIR`` never holds half a model.

The model's config and tokenizer travel in every checkpoint (``hf/``, listed in its manifest). A checkpoint saved
by a train.py older than that has only the weights: pass ``--model`` (the preset or model directory it was trained
with) and, for a model directory without one or a ``--tokenizer`` run, ``--tokenizer``.

The checkpoint is read as train.py resumes one (``train_ckpt_files``): the manifest verified first, no symbolic
link followed, ``.metadata`` unpickled against DCP's own classes only, DCP confined to the shard files it names,
nothing else unpickled. It lives beside train.py rather than in the installed ``distattn`` package because the
checkpoint format and its safe reader are the training job's (the package never imports ``launch/``), and a
checkpoint exists only where train.py, a checkout's script, ran.

Errors (a missing, damaged or unsafe checkpoint, a progress train.py never writes, shards that match the manifest
but cannot be read, an unreadable file, an ``OUT_DIR`` that is not empty) are one line, ``export_hf.py: error:
...``, and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import warnings
from pathlib import Path

if __package__:  # python -m launch.export_hf: the launch/ modules import each other by plain names, as train.py
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from train_config import EXIT_BAD_ARGS, UsageError
from train_ckpt_files import (MANIFEST, METADATA, DamagedCheckpointError, SafePlanner, SafeReader, read_inside,
                              read_manifest, read_progress, verify)

HF_DIR = "hf"  # the checkpoint's subdirectory holding config.json, generation_config.json and the tokenizer
MODEL_PREFIX = "train.model."  # the model's entries in a checkpoint (train_ckpt.TrainState under "train")
PARTIAL = ".partial-"  # the folder being written, beside its destination
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")  # never among a checkpoint's hf/ files


class ExportError(UsageError):
    """A checkpoint that cannot be exported, or a destination that cannot take it; one line."""


# ------------------------------------------------------------------------------------- the destination


def check_destination(out: Path, flag: str = "OUT_DIR", ignore: str = "\0") -> None:
    """``out`` is a new or empty directory (entries named ``ignore*`` aside); ``ExportError`` naming what is there."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"{flag} {out} exists and is not a directory; pass a new or empty directory")
    if out.is_dir():
        found = sorted(p.name for p in out.iterdir() if not p.name.startswith(ignore))
        if found:
            more = ", ..." if len(found) > 3 else ""
            raise ExportError(f"{flag} {out} exists and is not empty ({len(found)} entries: "
                              f"{', '.join(found[:3])}{more}); pass a new or empty directory, or remove it first")


def write_folder(tensors: dict[str, torch.Tensor], files: dict[str, bytes], out: Path) -> int:
    """Write the Hugging Face folder ``out`` from the model's tensors (its state-dict names) and the ``files``
    of :func:`hf_files` (``config.json``, tokenizer, ...); returns the folder's bytes.

    The model is built on the ``meta`` device from the config and the tensors assigned to it by name (every
    parameter must be there, nothing else), then ``save_pretrained`` writes them, unconverted, as safetensors.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    check_destination(out)
    stage = out.parent / f".{out.name}{PARTIAL}{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        for name, data in files.items():
            (stage / name).parent.mkdir(parents=True, exist_ok=True)
            (stage / name).write_bytes(data)
        try:
            config = AutoConfig.from_pretrained(stage, local_files_only=True)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            _assign(model, tensors)
            if "generation_config.json" in files:  # the source model's own, not one derived from its config
                model.generation_config = GenerationConfig.from_pretrained(stage, local_files_only=True)
        except (ValueError, RuntimeError, KeyError, TypeError, OSError) as exc:  # a corrupt config, tensors of
            # other shapes than it says: transformers' errors, in one line
            text = str(exc).strip().splitlines()
            raise ExportError(f"the config files ({', '.join(sorted(files))}) do not build a model of these tensors "
                              f"({type(exc).__name__}: {text[0] if text else ''})") from exc
        with _quiet_progress():
            model.save_pretrained(stage)
        if out.is_dir():
            out.rmdir()  # empty (checked above): the finished folder takes its place
        os.replace(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file())


@contextlib.contextmanager
def _quiet_progress():
    """No "Writing model shards" bar (a log line says what was written)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _assign(model, tensors: dict[str, torch.Tensor]) -> None:
    want = set(model.state_dict())
    tied = {k for k in want - set(tensors) if _tied(model, k)}  # the input embedding stands for its tied head
    missing, extra = sorted(want - set(tensors) - tied), sorted(set(tensors) - want)
    if missing or extra:
        raise ExportError(f"the checkpoint's tensors do not match a {type(model).__name__} of its config: missing "
                          f"{missing[:3]}{' ...' if len(missing) > 3 else ''}, unexpected {extra[:3]}"
                          f"{' ...' if len(extra) > 3 else ''}; pass the --model it was trained with")
    model.load_state_dict({k: v for k, v in tensors.items() if k in want}, strict=False, assign=True)
    if tied:
        model.tie_weights()


def _tied(model, name: str) -> bool:
    return bool(getattr(model.config, "tie_word_embeddings", False)) and name == "lm_head.weight"


# ----------------------------------------------------------------------------------- reading a checkpoint


def find_checkpoint(path: Path, warn) -> Path:
    """The checkpoint to export: ``path`` itself (a ``step_N`` directory) or the newest intact one of the
    ``--ckpt-dir`` ``path``; damaged ones are skipped with ``warn(line)``. ``ExportError`` if there is none."""
    from train_ckpt import complete_checkpoints

    if not path.is_dir():
        raise ExportError(f"{path}: no such checkpoint (pass a --ckpt-dir of train.py or a step_N directory in it)")
    single = (path / MANIFEST).exists() or (path / METADATA).exists()
    candidates = [path] if single else [p for _, p in reversed(complete_checkpoints(path))]
    if not candidates:
        raise ExportError(f"{path} holds no finished checkpoint (no step_N directory with a {MANIFEST}); pass the "
                          f"--ckpt-dir a train.py run with --save-every wrote")
    for candidate in candidates:
        try:
            verify(candidate)
            read_progress(candidate)
            return candidate
        except DamagedCheckpointError as exc:
            if single:
                raise ExportError(f"checkpoint {candidate} is damaged: {exc}") from exc
            warn(f"warning: skipping damaged checkpoint {candidate}: {exc}")
    raise ExportError(f"{path}: every checkpoint is damaged ({len(candidates)} tried, the warnings above say why)")


def load_model_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The model's whole tensors from a verified checkpoint, by state-dict name, as saved (fp32).

    DCP assembles each tensor from the shard files of every rank that held a piece of it (FSDP2), in this one
    process: tensors of the sizes ``.metadata`` records are the load's destination, so nothing but the safe
    reader's shard files is read and no process group is needed.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = SafeReader(str(path))
    metadata = reader.read_metadata()
    tensors = {fqn: torch.empty(meta.size, dtype=meta.properties.dtype)
               for fqn, meta in metadata.state_dict_metadata.items()
               if fqn.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata)}
    if not tensors:
        raise ExportError(f"checkpoint {path} holds no model tensors ({MODEL_PREFIX}*): not a train.py checkpoint")
    from torch.distributed.checkpoint.api import CheckpointException

    from train_ckpt import _unwrap, unreadable

    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(tensors, storage_reader=reader, planner=SafePlanner())
    # a truncated or corrupt shard that matches its manifest (EOFError, a zip or pickle error...); DCP may gather
    # the error into a CheckpointException, a BaseException
    except (Exception, CheckpointException) as exc:  # noqa: BLE001
        inner = _unwrap(exc)
        why = inner if isinstance(inner, UsageError) else f"{unreadable(exc)}; export an older checkpoint (pass its " \
                                                         f"step_N directory)"
        raise ExportError(f"checkpoint {path}: {why}") from exc
    return {fqn[len(MODEL_PREFIX):]: t for fqn, t in tensors.items()}


def checkpoint_files(path: Path) -> dict[str, bytes]:
    """The checkpoint's ``hf/`` files (config, tokenizer), each read without following a link and checked
    against the manifest; empty for a checkpoint saved before train.py stored them."""
    import hashlib

    listed = read_manifest(path)
    files = {}
    for name in sorted(n for n in listed if n.startswith(HF_DIR + "/")):
        if name.endswith(WEIGHT_SUFFIXES):  # weights come from the DCP shards only, never from beside them
            raise ExportError(f"checkpoint {path} holds {name}, a weights file where only the config and tokenizer "
                              f"belong: refusing it (a crafted checkpoint?)")
        data = read_inside(path, name)
        if hashlib.sha256(data).hexdigest() != listed[name]["sha256"]:
            raise ExportError(f"checkpoint {path} is damaged: {name}: sha256 differs from the manifest")
        files[name[len(HF_DIR) + 1:]] = data
    return files


# ------------------------------------------------------------------------------- config and tokenizer files


def hf_files(config, tokenizer_dir: str | None, model_dir: str | None) -> dict[str, bytes]:
    """``config.json`` (with ``use_cache`` on: the training job turns it off), the model directory's
    ``generation_config.json`` if it has one, and the tokenizer's files: a local Hugging Face tokenizer
    (``tokenizer_dir``, else ``model_dir``'s) as ``save_pretrained`` writes it, or the byte tokenizer as an
    equivalent Hugging Face one (:func:`byte_tokenizer`)."""
    import copy
    import tempfile

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        config = copy.deepcopy(config)
        config.use_cache = True
        config.save_pretrained(out)
        if model_dir is not None and (Path(model_dir) / "generation_config.json").is_file():
            shutil.copyfile(Path(model_dir) / "generation_config.json", out / "generation_config.json")
        source = tokenizer_dir or model_dir
        tokenizer = (AutoTokenizer.from_pretrained(source, local_files_only=True) if source is not None
                     else byte_tokenizer())
        tokenizer.save_pretrained(out)
        return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def _byte_alphabet() -> list[str]:
    """The printable character standing for each byte 0..255 in byte-level BPE vocabularies: a byte that is
    a printable Latin-1 character stands for itself, the others (controls, space, ...) take the code points
    from 256 up, in byte order. Byte-level tokenizers hold these characters, not raw bytes, in their vocab."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def byte_tokenizer():
    """train.py's byte tokenizer (token id = UTF-8 byte) as a Hugging Face fast tokenizer: byte-level
    pre-tokenization, a BPE model with the 256 byte characters and no merges, the byte-level decoder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in enumerate(_byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def files_for_old_checkpoint(model: str, tokenizer: str | None, tensors: dict, path: Path) -> dict[str, bytes]:
    """``hf_files`` for a checkpoint without ``hf/``: the config train.py builds for ``model`` (a preset: the
    vocabulary from the embedding's rows, ``max_position_embeddings`` from the run's ``--seq-len``)."""
    from types import SimpleNamespace

    import train_model
    from train_config import PRESETS

    if model not in PRESETS and not (Path(model) / "config.json").is_file():
        raise ExportError(f"--model {model!r}: not a preset ({', '.join(PRESETS)}) nor a directory holding a "
                          f"Hugging Face config.json")
    embed = tensors.get("model.embed_tokens.weight")
    run = SimpleNamespace(preset=PRESETS.get(model), args=SimpleNamespace(
        model=model, seq_len=int(read_progress(path).get("seq_len") or 0)))
    config = train_model.hf_config(run, embed.shape[0] if embed is not None else 0)
    return hf_files(config, tokenizer, None if model in PRESETS else model)


# ------------------------------------------------------------------------------------------------ the CLI


def export(ckpt: Path, out: Path, model: str | None = None, tokenizer: str | None = None, log=print) -> Path:
    """Convert the checkpoint ``ckpt`` (a ``--ckpt-dir`` or a step directory) into the folder ``out``; returns
    the checkpoint used. ``model``/``tokenizer``: for a checkpoint without its ``hf/`` files (older train.py)."""
    check_destination(out)
    path = find_checkpoint(ckpt, log)
    files = checkpoint_files(path)
    if model is None and "config.json" not in files:
        raise ExportError(f"checkpoint {path} has no {HF_DIR}/config.json (saved by an older train.py); pass "
                          f"--model with the preset or model directory it was trained with (and --tokenizer DIR "
                          f"if the run used one)")
    tensors = load_model_tensors(path)
    if model is not None:
        files = files_for_old_checkpoint(model, tokenizer, tensors, path)
    size = write_folder(tensors, files, out)
    log(f"exported {path} (step {read_progress(path)['step']}) to {out} ({size / 2**20:.1f} MB)")
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="export_hf.py", description="Convert a launch/train.py checkpoint into a "
                                "Hugging Face model folder (safetensors, config, tokenizer).")
    p.add_argument("ckpt", metavar="CKPT", help="a --ckpt-dir (its newest intact checkpoint) or a step_N directory")
    p.add_argument("out", metavar="OUT_DIR", help="the folder to write: new, or an empty directory")
    p.add_argument("--model", default=None, help="only for a checkpoint saved without its config (an older "
                   "train.py): the preset or model directory it was trained with")
    p.add_argument("--tokenizer", default=None, help="with --model: the tokenizer directory the run used")
    args = p.parse_args(argv)
    try:
        export(Path(args.ckpt), Path(args.out), args.model, args.tokenizer,
               log=lambda line: print(line, file=sys.stderr, flush=True))
    except (UsageError, DamagedCheckpointError) as exc:
        print(f"export_hf.py: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_ARGS
    except OSError as exc:  # an unreadable file of the checkpoint, an unwritable destination
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"export_hf.py: error: {where}{exc.strerror or exc} (check the files' permissions and the disk)",
              file=sys.stderr, flush=True)
        return EXIT_BAD_ARGS
    return 0


if __name__ == "__main__":
    sys.exit(main())
