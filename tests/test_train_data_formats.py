"""launch/train.py's data formats (``train_formats``, ``train_data``) and held-out evaluation (``train_eval``).

The same documents written as text, gzip text, JSON Lines, Parquet, a datasets ``save_to_disk`` folder and token
files give the same token stream (a tiny BPE tokenizer trained here, in-process: no download); readers are
lazy; every bad input is one ``UsageError`` line (which ``train.py`` prints as ``train.py: error:`` and exits 2
on every rank, see test_train_cli); one 2-rank torchrun job trains on JSON Lines and logs held-out loss.
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from test_train import LOSS_RTOL_ACROSS_WORLDS, _records, _torchrun
from test_train_cli import _prepare_error, assert_one_clean_error, run_side_by_side

import train_config  # noqa: E402  (test_train puts launch/ on sys.path)
import train_data  # noqa: E402
import train_eval  # noqa: E402
import train_formats  # noqa: E402

UsageError = train_config.UsageError
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def _documents(n: int = 40, seed: int = 0) -> list[str]:
    """Documents as the text reader cuts them: lines of words (none a "Book chapter" heading), then a blank
    line, which stays with its document (the last has none: the documents add up to the file)."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        lines = [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 12)))) + "."
                 for _ in range(int(rng.integers(1, 4)))]
        docs.append("\n".join(lines) + ("\n\n" if i < n - 1 else "\n"))
    return docs


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A BPE tokenizer trained on the spot, with BOS/EOS, saved as a Hugging Face tokenizer folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(_documents(200, seed=1), trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    return train_data.make_tokenizer(str(path), None)


def _reference(docs: list[str], tok) -> tuple[np.ndarray, np.ndarray]:
    """BOS + ids + EOS of every document, back to back, and the document offsets."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok.name, local_files_only=True)
    ids = [[hf.bos_token_id, *hf(d, add_special_tokens=False)["input_ids"], hf.eos_token_id] for d in docs]
    return np.concatenate(ids), np.cumsum([0] + [len(i) for i in ids])


def _write_all(tmp: Path, docs: list[str], stream: np.ndarray, offsets: np.ndarray) -> dict[str, list[str]]:
    """The documents in every format: ``{name: --data arguments}``."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp / "docs.txt").write_text("".join(docs), encoding="utf-8")
    with gzip.open(tmp / "docs.txt.gz", "wt", encoding="utf-8") as f:
        f.write("".join(docs))
    lines = [json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)]
    (tmp / "docs.jsonl").write_text("".join(lines), encoding="utf-8")
    with gzip.open(tmp / "docs.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("".join(lines))
    (tmp / "parts").mkdir()
    for k, (lo, hi) in enumerate(((0, 15), (15, 31), (31, len(docs)))):  # a glob over three files, in name order
        (tmp / "parts" / f"part-{k}.jsonl").write_text("".join(lines[lo:hi]), encoding="utf-8")
    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), tmp / "docs.parquet", row_group_size=7)
    datasets.Dataset.from_dict({"text": docs, "id": list(range(len(docs)))}).save_to_disk(str(tmp / "hf"))
    np.save(tmp / "tokens.npy", stream.astype(np.uint16))
    with open(tmp / "tokens.npy.idx", "wb") as f:  # numpy appends .npy to a name; a file object keeps it
        np.save(f, offsets.astype(np.int64))
    np.save(tmp / "eos.npy", stream.astype(np.int32))  # no index: documents end at EOS
    return {"text": ["docs.txt"], "text.gz": ["docs.txt.gz"], "jsonl": ["docs.jsonl"], "jsonl.gz": ["docs.jsonl.gz"],
            "jsonl glob": ["parts/*.jsonl"], "parquet": ["docs.parquet"], "hf": ["hf"], "tokens + idx": ["tokens.npy"],
            "tokens by eos": ["eos.npy"]}


def _spec(tmp: Path, args: list[str], tok, fmt: str | None = None, field: str = "text") -> train_data.DataSpec:
    paths = train_formats.expand([str(tmp / a) for a in args])
    return train_data.DataSpec(paths=tuple(paths), fmt=train_formats.detect_all(paths, fmt), text_field=field,
                               bos=tok.bos_id is not None, eos=tok.eos_id is not None)


def test_every_format_gives_the_same_token_stream(tmp_path, tokenizer):
    docs = _documents()
    stream, offsets = _reference(docs, tokenizer)
    formats = _write_all(tmp_path, docs, stream, offsets)
    assert list(train_formats.text_documents(tmp_path / "docs.txt")) == docs  # the text reader cuts as written
    # A byte-order mark is not content, and a first line longer than what detection reads is still JSON Lines.
    (tmp_path / "bom").mkdir()
    (tmp_path / "bom" / "a.jsonl").write_text("\ufeff" + "".join(json.dumps({"text": d}) + "\n" for d in docs[:3]))
    (tmp_path / "bom" / "b.data").write_text(json.dumps({"text": "x" * 100_000}) + "\n")
    assert train_formats.detect_all(train_formats.expand([str(tmp_path / "bom" / "*")]), None) == "jsonl"
    assert list(train_formats.jsonl_documents(tmp_path / "bom" / "a.jsonl", "text")) == docs[:3]
    for name, args in formats.items():
        store = train_data.token_store(_spec(tmp_path, args, tokenizer), tokenizer)
        assert len(store) == len(stream), name
        np.testing.assert_array_equal(store[0:len(store)], stream, err_msg=name)
        np.testing.assert_array_equal(store.offsets, offsets, err_msg=name)
        np.testing.assert_array_equal(store[5:40], stream[5:40], err_msg=name)  # slices read only what they need
    # train_tokenize.py writes the same stream and documents as a token file and its index.
    import train_tokenize

    assert train_tokenize.main([str(tmp_path / "docs.parquet"), "--tokenizer", tokenizer.name, "--out",
                                str(tmp_path / "cli.npy")]) == 0
    store = train_data.token_store(_spec(tmp_path, ["cli.npy"], tokenizer), tokenizer)
    assert store.parts[0].dtype == np.uint16
    np.testing.assert_array_equal(store[0:len(store)], stream)
    np.testing.assert_array_equal(store.offsets, offsets)
    # Packed, the documents keep their boundaries: every sample's positions restart where a document starts.
    packed = train_data.load_dataset(_spec(tmp_path, ["docs.parquet"], tokenizer), tokenizer, 64, 0, pack=True)
    assert packed.num_documents == len(docs)
    ids, positions = packed.windows(0, 2)
    assert torch.equal(ids, torch.from_numpy(stream[:128].astype(np.int64)))  # file order
    assert torch.equal(positions, torch.from_numpy(np.concatenate([_positions(offsets, 0, 64),
                                                                   _positions(offsets, 64, 128)])))


def _positions(offsets: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Position ids of tokens ``[lo, hi)`` of a packed window: 0 at its start and at every document start."""
    cuts = [lo, *offsets[(offsets > lo) & (offsets < hi)], hi]
    return np.concatenate([np.arange(b - a) for a, b in zip(cuts[:-1], cuts[1:])])


def test_bos_eos_flags_and_the_byte_default(tmp_path, tokenizer):
    (tmp_path / "a.txt").write_text("one two.\n\nthree.\n", encoding="utf-8")
    spec = dict(paths=(tmp_path / "a.txt",), fmt="text")
    none = train_data.token_store(train_data.DataSpec(**spec), tokenizer)
    both = train_data.token_store(train_data.DataSpec(**spec, bos=True, eos=True), tokenizer)
    assert len(both) == len(none) + 4  # two documents, each with BOS and EOS
    assert both[0:1][0] == tokenizer.bos_id and both[len(both) - 1:][0] == tokenizer.eos_id
    assert train_data.resolve_special_tokens(None, None, tokenizer) == (True, True)
    assert train_data.resolve_special_tokens(False, None, tokenizer) == (False, True)
    byte = train_data.ByteTokenizer()
    assert train_data.resolve_special_tokens(None, None, byte) == (False, False)
    with pytest.raises(UsageError, match=r"--bos: the tokenizer \(bytes\) has no BOS token; drop --bos"):
        train_data.resolve_special_tokens(True, None, byte)
    # The shipped corpus as bytes: its 1,189 chapters add up to the file, so the stream is the file's bytes.
    corpus = train_data.read_text(train_config.DEFAULT_DATA)
    chapters = list(train_formats.text_documents(train_config.DEFAULT_DATA))
    assert len(chapters) == 1189 and "".join(chapters) == corpus


def test_readers_are_lazy(tmp_path, monkeypatch, tokenizer):
    """A reader yields its first document before it reads the rest: a fault further on is met only there."""
    # (past the first megabyte: the text layer decodes ahead in chunks of some kilobytes)
    (tmp_path / "t.txt").write_bytes(b"first doc.\n\n" + b"filler line.\n" * 80_000 + b"\n\xff\xfe broken\n")
    text = train_formats.text_documents(tmp_path / "t.txt")
    assert next(text) == "first doc.\n\n"
    (tmp_path / "j.jsonl").write_text('{"text": "first"}\n{"text": "second"}\nnot json\n', encoding="utf-8")
    lines = train_formats.jsonl_documents(tmp_path / "j.jsonl", "text")
    assert [next(lines), next(lines)] == ["first", "second"]
    with pytest.raises(UsageError, match=r"j.jsonl line 3: not JSON"):
        next(lines)
    # Parquet and datasets: one batch of rows pulled per batch of documents, never the whole table.
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [f"document {i}." for i in range(50)]
    pq.write_table(pa.table({"text": docs}), tmp_path / "d.parquet", row_group_size=10)
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "hf"))
    monkeypatch.setattr(train_formats, "_BATCH_ROWS", 10)
    pulled = []
    for cls, name in ((pq.ParquetFile, "iter_batches"), (datasets.Dataset, "iter")):
        def counting(self, *args, _real=getattr(cls, name), **kwargs):
            for batch in _real(self, *args, **kwargs):
                pulled.append(name)
                yield batch
        monkeypatch.setattr(cls, name, counting)
    for reader, path, name in ((train_formats.parquet_documents, "d.parquet", "iter_batches"),
                               (train_formats.hf_documents, "hf", "iter")):
        gen = reader(tmp_path / path, "text")
        assert [next(gen) for _ in range(12)] == docs[:12]
        assert pulled.count(name) == 2, pulled  # rows 0-9, then 10-19
    # Tokens go to a memory-mapped file, and token files are mapped, not loaded.
    store = train_data.token_store(train_data.DataSpec(paths=(tmp_path / "d.parquet",), fmt="parquet"), tokenizer)
    assert all(isinstance(p, np.memmap) for p in store.parts)
    np.save(tmp_path / "ids.npy", np.arange(100, dtype=np.uint32))
    assert isinstance(train_formats.load_tokens(tmp_path / "ids.npy", None)[0], np.memmap)


def _bad_inputs(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """``{case: (--data arguments, the message)}`` for every bad input of one file set."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp / "text.jsonl").write_text("plain text, not JSON\n", encoding="utf-8")
    (tmp / "json.txt").write_text('{"text": "a"}\n', encoding="utf-8")
    (tmp / "mixed.jsonl").write_text('{"text": "a"}\nplain\n', encoding="utf-8")
    (tmp / "blob.bin").write_bytes(b"\x00\x01\x02garbage" * 10)
    (tmp / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    (tmp / "ok.txt").write_text("some text.\n", encoding="utf-8")
    (tmp / "ok.jsonl").write_text('{"text": "a"}\n', encoding="utf-8")
    (tmp / "body.jsonl").write_text('{"body": "a"}\n', encoding="utf-8")
    (tmp / "fake.parquet").write_text("not parquet\n", encoding="utf-8")
    pq.write_table(pa.table({"body": ["a", "b"]}), tmp / "body.parquet")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(str(tmp / "dict"))
    (tmp / "array.json").write_text('[{"text": "a"}, {"text": "b"}]\n', encoding="utf-8")
    (tmp / "cut.txt.gz").write_bytes(gzip.compress(b"some text.\n" * 20_000)[:-12])
    (tmp / "plain_dir").mkdir()
    np.save(tmp / "floats.npy", np.zeros(10, dtype=np.float32))
    return {
        "jsonl name, text content": (["text.jsonl"], "text.jsonl: the name says jsonl but the content is text; rename"),
        "text name, jsonl content": (["json.txt"], "json.txt: the name says text but the content is jsonl"),
        "mixed lines": (["mixed.jsonl"], "mixed.jsonl: mixed content: line 1 is a JSON object but line 2 is not"),
        "binary": (["blob.bin"], "blob.bin: unreadable: binary data of no known format"),
        "not utf-8": (["latin1.txt"], "latin1.txt: unreadable: not UTF-8 text"),
        "mixed files": (["ok.txt", "ok.jsonl"], "mixed formats ("),
        "missing field jsonl": (["body.jsonl"], "body.jsonl line 1: no text field 'text' (fields: body); pass "
                                "--text-field NAME"),
        "missing field parquet": (["body.parquet"], "body.parquet: no text field 'text' (columns: body)"),
        "fake parquet": (["fake.parquet"], "fake.parquet: the name says parquet but the content is text"),
        "dataset dict": (["dict"], "a datasets DatasetDict; pass one split's folder"),
        "json array": (["array.json"], "array.json: one JSON document (an array), not JSON Lines"),
        "truncated gzip": (["cut.txt.gz"], "cut.txt.gz: unreadable as text (Compressed file ended before"),
        "plain folder": (["plain_dir"], "not one written by datasets' save_to_disk"),
        "float tokens": (["floats.npy"], "floats.npy: a token file holds a 1-D integer array, this one is float32"),
        "glob matches nothing": (["none-*.jsonl"], "the pattern matches no file"),
    }


def test_bad_inputs_are_one_clear_line(tmp_path, tokenizer):
    for case, (args, message) in _bad_inputs(tmp_path).items():
        with pytest.raises(UsageError) as err:
            train_data.token_store(_spec(tmp_path, args, tokenizer), tokenizer)
        assert message in str(err.value), f"{case}: {err.value}"
        assert "\n" not in str(err.value), case
    np.save(tmp_path / "big.npy", np.array([1, 2, 999], dtype=np.int32))
    data = train_data.load_dataset(_spec(tmp_path, ["big.npy"], tokenizer), tokenizer, 2, 0)
    with pytest.raises(UsageError, match=r"--data: token id 999 is beyond the model's vocabulary \(300 tokens, ids "
                                         r"0..299\); the data was tokenized with another tokenizer"):
        train_data.check_vocab(data, 300)


def test_bad_data_stops_train_py_before_step_one(tmp_path, monkeypatch):
    """Through ``train.prepare`` (what every rank runs before the process group exists), and one torchrun job:
    one ``train.py: error:`` line, exit status 2, no traceback."""
    (tmp_path / "text.jsonl").write_text("plain text, not JSON\n" * 50, encoding="utf-8")
    np.save(tmp_path / "big.npy", np.full(600, 300, dtype=np.int32))
    assert "the name says jsonl but the content is text" in _prepare_error(
        monkeypatch, ["--data", str(tmp_path / "text.jsonl"), "--seq-len", "64"])
    assert "--data: token id 300 is beyond the model's vocabulary (256 tokens" in _prepare_error(
        monkeypatch, ["--data", str(tmp_path / "big.npy"), "--seq-len", "64"])
    assert "--eval-every needs --eval-data" in _prepare_error(monkeypatch, ["--eval-every", "2"])
    results = run_side_by_side({"jsonl of text": (["--data", str(tmp_path / "text.jsonl")], {})})
    assert_one_clean_error("jsonl of text", *results["jsonl of text"], "the name says jsonl but the content is text")


def test_evaluate_is_the_token_weighted_mean_over_replicas(monkeypatch):
    """``train_eval.evaluate``: each replica its own share of the held-out windows, batches of any size weighted
    by their targets, every rank the same result (a one-process group stands in; the sums are the world's)."""
    import torch.distributed as dist

    tokens = np.arange(7 * 16)
    held_out = train_data.PackedSequences(tokens, seq_len=16, seed=0)
    seen = []

    def loss_of(batch):  # a loss that depends on the batch: its first token, so the weighting shows
        seen.append(batch.shape[0])
        return torch.tensor(float(batch[0, 0]))

    cfg = SimpleNamespace(dp_size=1, sp_size=1, env=SimpleNamespace(rank=0), args=SimpleNamespace(
        batch_size=2, pack=False, eval_samples=5, seq_len=16))
    count = train_eval.eval_sample_count(cfg, held_out)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        got = train_eval.evaluate(torch.nn.Linear(1, 1), held_out, count, cfg, torch.device("cpu"), loss_of)
    finally:
        dist.destroy_process_group()
    assert seen == [2, 2, 1]  # windows 0-1, 2-3, 4
    want = (0 * 2 * 15 + 32 * 2 * 15 + 64 * 1 * 15) / (5 * 15)  # each window has 15 targets
    assert got["eval_loss"] == pytest.approx(want) and got["eval_ppl"] == pytest.approx(math.exp(want))
    with pytest.raises(UsageError, match=r"--eval-samples 9: --eval-data holds only 7 samples of --seq-len 16"):
        train_eval.eval_sample_count(SimpleNamespace(**{**vars(cfg), "args": SimpleNamespace(
            eval_samples=9, seq_len=16)}), held_out)


def test_two_ranks_train_on_jsonl_and_log_held_out_loss(tmp_path):
    """2 gloo ranks, JSON Lines training data and held-out data: eval_loss/eval_ppl in the JSON log every 2 steps
    and after the last, in the progress output and the summary, equal to one rank's; a greedy sample at the end."""
    docs, held_out = _documents(300, seed=2), _documents(40, seed=3)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in held_out), encoding="utf-8")
    job = ["--device", "cpu", "--model", "tiny", "--seq-len", "128", "--batch-size", "2", "--steps", "5", "--lr",
           "3e-3", "--data", str(tmp_path / "train.jsonl"), "--eval-data", str(tmp_path / "eval.jsonl"),
           "--eval-every", "2", "--eval-samples", "8", "--sample-tokens", "6"]
    log = tmp_path / "log.jsonl"
    rc, out, err = _torchrun(2, *job, "--log-json", str(log))
    assert rc == 0, err[-4000:]
    # One rank holds the whole sequence: the same held-out losses (each rank's shard counted once) and the same
    # sample (each new token read at the right position, whichever rank holds it).
    rc, out_one, err_one = _torchrun(1, *job, "--log-json", str(tmp_path / "one.jsonl"))
    assert rc == 0, err_one[-4000:]
    one = {r["step"]: r["eval_loss"] for r in _records(tmp_path / "one.jsonl") if "eval_loss" in r}
    records = _records(log)
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert sorted(evals) == [2, 4, 5], records
    assert evals == pytest.approx(one, rel=LOSS_RTOL_ACROSS_WORLDS)
    assert all(r["eval_ppl"] == pytest.approx(math.exp(r["eval_loss"])) for r in records if "eval_loss" in r)
    assert evals[5] < math.log(256) - 0.5, evals  # from uniform over bytes, the held-out loss falls too
    assert "eval at step 2: held-out loss" in err and " eval " in err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["eval_loss"] == evals[5] and summary["eval_step"] == 5
    assert len(summary["sample"]["token_ids"]) == 6 and all(0 <= t < 256 for t in summary["sample"]["token_ids"])
    assert summary["sample"] == json.loads(out_one.strip().splitlines()[-1])["sample"]
    assert summary["sample"]["prompt"] == "".join(held_out)[:32]  # the first 32 bytes of the held-out data
