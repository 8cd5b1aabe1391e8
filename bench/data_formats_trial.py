"""Every ``--data`` format of ``launch/train.py`` on one corpus, then the Hugging Face export round trip.

Nothing is downloaded. The script makes, on the spot, a small generated corpus (a few hundred short documents), a
BPE tokenizer trained on it in-process (``tokenizers``, saved as a ``PreTrainedTokenizerFast`` with ``<s>``/``</s>``)
and a tiny randomly initialized LLaMA saved beside it with ``save_pretrained`` (safetensors), so every run uses
``--model DIR``: a local Hugging Face model and its tokenizer. It writes the same training and held-out documents as
text, text.gz, JSON Lines, Parquet, a ``datasets`` ``save_to_disk`` folder, and pre-tokenized ``.npy`` token files
(``launch/train_tokenize.py``; once with the ``.idx`` document index, once without it, documents then ending at
each EOS), trains each for a few ``--pack`` steps on 2 gloo ranks with ``--eval-data``/``--eval-every``, and
checks that every format gives the same per-step losses and held-out losses (bit for bit: the same token stream).
The JSON Lines run also saves a checkpoint and ``--export-hf``; ``launch/export_hf.py`` converts the checkpoint,
and both folders' ``AutoModelForCausalLM.from_pretrained`` weights are compared with the checkpoint's tensors
(read with DCP's own ``dcp_to_torch_save``) bit for bit.

    python bench/data_formats_trial.py --out bench/results/data-formats

Writes ``results.csv`` and ``table.md`` to ``--out``; exits 1 if any check fails. The whitespace pre-tokenizer
makes the text format's blank lines between documents token-free, so all formats hold the same token stream.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
SUBJECTS = ("the cat", "a dog", "the old miller", "my sister", "the river", "a small bird", "the king", "our teacher")
VERBS = ("sees", "follows", "carries", "finds", "watches", "remembers", "paints", "calls")
OBJECTS = ("the red ball", "a quiet house", "the long road", "an apple", "the morning light", "a broken cart")
PLACES = ("near the hill", "in the garden", "after the rain", "by the sea", "at night", "before dinner")


def documents(n: int, seed: int) -> list[str]:
    """``n`` one-paragraph documents of 1-5 templated sentences (learnable: the loss falls within a few steps)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        sentences = [f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(PLACES)}."
                     for _ in range(rng.randint(1, 5))]
        docs.append(" ".join(s[0].upper() + s[1:] for s in sentences))
    return docs


def make_model(docs: list[str], out: Path) -> None:
    """A BPE tokenizer trained on ``docs`` and a tiny LLaMA, both saved in ``out`` (a ``--model DIR``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.decoder = decoders.BPEDecoder()
    bpe.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.save_pretrained(out)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)  # safetensors by default


def write_formats(docs: list[str], stem: Path, model: Path) -> dict[str, list[str]]:
    """``docs`` in every format; ``{name: the --data arguments}``."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = "\n\n".join(docs) + "\n"
    stem.with_suffix(".txt").write_text(text, encoding="utf-8")
    with gzip.open(stem.with_suffix(".txt.gz"), "wt", encoding="utf-8") as f:
        f.write(text)
    with open(stem.with_suffix(".jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs))
    pq.write_table(pa.table({"text": docs}), stem.with_suffix(".parquet"), row_group_size=64)
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(stem) + "-hf")
    npy = stem.with_suffix(".npy")
    run([sys.executable, "launch/train_tokenize.py", "--tokenizer", str(model), "--out", str(npy),
         str(stem.with_suffix(".jsonl"))])
    eos_dir = stem.parent / "eos-only"
    eos_dir.mkdir(exist_ok=True)
    shutil.copy(npy, eos_dir / npy.name)  # no .idx beside it: documents end after each EOS
    return {"text": [str(stem.with_suffix(".txt"))], "text.gz": [str(stem.with_suffix(".txt.gz"))],
            "jsonl": [str(stem.with_suffix(".jsonl"))], "parquet": [str(stem.with_suffix(".parquet"))],
            "hf (save_to_disk)": [str(stem) + "-hf"], "tokens (.npy + .idx)": [str(npy)],
            "tokens (.npy, EOS)": [str(eos_dir / npy.name)]}


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run ``cmd`` in the repository root; exit with its output on failure."""
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def train(args, model: Path, data: list[str], held: list[str], work: Path, extra: list[str]) -> dict:
    """One 2-rank ``--pack`` run; the summary plus its per-step losses and wall seconds."""
    log = work / "log.jsonl"
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", str(args.ranks),
           "launch/train.py", "--model", str(model), "--data", *data, "--eval-data", *held,
           "--eval-every", str(args.eval_every), "--steps", str(args.steps), "--seq-len", str(args.seq_len),
           "--batch-size", "2", "--pack", "--lr", "3e-3", "--no-progress", "--log-json", str(log),
           "--ckpt-dir", str(work / "ckpt"), *extra]
    t0 = time.perf_counter()
    proc = run(cmd)
    wall = time.perf_counter() - t0
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    docs = re.search(r"(\d+) documents packed", proc.stderr)  # rank 0's start line: what --pack read
    summary["documents"] = int(docs.group(1)) if docs else None
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    summary["losses"] = [r["loss"] for r in records if "loss" in r]
    summary["evals"] = [r["eval_loss"] for r in records if "eval_loss" in r]
    summary["wall_s"], summary["cmd"] = wall, cmd
    return summary


def checkpoint_tensors(step_dir: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a DCP checkpoint, read with DCP's own converter (independent of export_hf.py)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(step_dir), str(scratch))
    state = torch.load(scratch, weights_only=False)  # our own file, just written

    def flat(d, prefix=""):
        for k, v in d.items():
            yield from flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [(prefix + k, v)]
    return {k[len("train.model."):]: v for k, v in flat(state) if k.startswith("train.model.")}


def same_weights(folder: Path, ref: dict[str, torch.Tensor]) -> tuple[bool, str]:
    """``from_pretrained(folder)`` against the checkpoint's tensors: same names, dtypes, values (bitwise)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sd = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).state_dict()
    names = set(ref)
    if set(sd) != names:
        return False, f"names differ: {sorted(set(sd) ^ names)[:5]}"
    bad = [k for k in names if sd[k].dtype != ref[k].dtype or not torch.equal(sd[k], ref[k])]
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    msg = (f"{len(names)} tensors, {sum(t.numel() for t in ref.values())} values, dtype "
           f"{ {str(t.dtype) for t in ref.values()} }, {len(bad)} differ; tokenizer {len(tok)} tokens, "
           f"bos {tok.bos_token!r}, eos {tok.eos_token!r}")
    return not bad, msg


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for results.csv and table.md")
    p.add_argument("--work", default=None, help="scratch folder (default: a temporary one, removed at the end)")
    p.add_argument("--docs", type=int, default=400, help="training documents (held-out: a quarter as many)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--ranks", type=int, default=2)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="data-formats-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return trial(args, out, work)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


def trial(args, out: Path, work: Path) -> int:
    train_docs, held_docs = documents(args.docs, seed=1), documents(args.docs // 4, seed=2)
    model = work / "tiny-llama"
    make_model(train_docs, model)
    (work / "train").mkdir()
    (work / "held").mkdir()
    train_sets = write_formats(train_docs, work / "train" / "corpus", model)
    held_sets = write_formats(held_docs, work / "held" / "corpus", model)
    rows, ok, first = [], True, None
    for i, name in enumerate(train_sets):
        run_dir = work / f"run{i}"
        extra = ["--save-every", str(args.steps), "--export-hf", str(work / "hf-end")] if name == "jsonl" else []
        s = train(args, model, train_sets[name], held_sets[name], run_dir, extra)
        first = first or s
        same = (s["losses"], s["evals"], s["documents"]) == (first["losses"], first["evals"], first["documents"])
        ok &= same
        rows.append({"format": name, "documents": s["documents"], "steps": s["steps"],
                     "first_loss": f"{s['losses'][0]:.6f}",
                     "final_loss": f"{s['final_loss']:.6f}", "eval_loss": f"{s['eval_loss']:.6f}",
                     "eval_ppl": f"{s['eval_ppl']:.3f}", "wall_s": f"{s['wall_s']:.1f}",
                     "same_as_first": "yes" if same else "NO"})
        print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
        if name == "jsonl":
            export_run = run_dir
    ckpt = export_run / "ckpt"
    step_dir = sorted(ckpt.glob("step_*"))[-1]
    run([sys.executable, "launch/export_hf.py", str(ckpt), str(work / "hf-ckpt")])
    ref = checkpoint_tensors(step_dir, work / "ckpt.pt")
    checks = []
    for label, folder in (("--export-hf (end of training)", work / "hf-end"),
                          ("launch/export_hf.py CKPT", work / "hf-ckpt")):
        same, msg = same_weights(folder, ref)
        ok &= same
        checks.append(f"| {label} | {step_dir.name} | {'bit for bit' if same else 'DIFFERENT'} | {msg} |")
    initial, _ = same_weights(model, ref)
    ok &= not initial
    checks.append(f"| initial --model weights | {step_dir.name} | {'SAME (untrained?)' if initial else 'differ'} "
                  f"| training changed the weights |")
    write_results(out, rows, checks, ok)
    return 0 if ok else 1


def write_results(out: Path, rows: list[dict], checks: list[str], ok: bool) -> None:
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(str(v) for v in r.values()) + " |" for r in rows]
    lines += ["", "| export | checkpoint | weights vs checkpoint | detail |", "|---|---|---|---|", *checks, "",
              f"all checks: {'passed' if ok else 'FAILED'}"]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
