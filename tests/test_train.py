"""launch/train.py end to end: real torchrun jobs of gloo ranks on the CPU, the tiny preset, a few steps.

Each job is a subprocess (``python -m torch.distributed.run --standalone ...``) in its own session with a
hard timeout, after which the whole process group (torchrun and its workers) is killed: no test can hang.
The per-step losses come from ``--log-json``; the summary from the last line of stdout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "launch" / "train.py"
sys.path.insert(0, str(ROOT / "launch"))

STEPS = 6
# 2 ranks of 128 tokens each; save every 2 steps so that a crash after step 3 loses step 3 only.
JOB = ["--device", "cpu", "--model", "tiny", "--seq-len", "256", "--batch-size", "2", "--steps", str(STEPS),
       "--lr", "3e-3", "--seed", "0", "--save-every", "2"]
JOB_TIMEOUT_S = 150  # a 2-rank job takes ~15 s on a loaded 2-core machine
# World 1 vs 2 changes only the order of fp32 sums (attention merged from chunks, gradients reduced
# across ranks); measured differences are ~1e-7, so 1e-4 relative leaves wide margin and still catches
# any real error (a wrong gradient scale or a misplaced shard moves the loss by 1e-2 or more).
LOSS_RTOL_ACROSS_WORLDS = 1e-4
# A resumed run repeats the same arithmetic on the same ranks: equal to round-off only.
LOSS_RTOL_RESUMED = 1e-6
# From ~5.57 (ln 256: uniform over bytes) the loss falls by ~1.5 in 6 steps; 0.5 is a safe floor.
MIN_LOSS_DROP = 0.5


def _torchrun(nproc: int, *args: str, launcher: tuple[str, ...] = (), timeout: float = JOB_TIMEOUT_S):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *launcher,
           str(TRAIN), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # same threads at every world size; no oversubscription
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every worker it started
        out, err = proc.communicate()
        pytest.fail(f"torchrun {' '.join(args)} did not finish in {timeout} s\nstderr:\n{err[-4000:]}")
    return proc.returncode, out, err


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(path)}


def _assert_close(got: dict[int, float], want: dict[int, float], rtol: float) -> None:
    assert got.keys() == want.keys()
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=rtol), f"step {step}: {got[step]} vs {want[step]}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 2-rank job: (returncode, stdout, stderr, json-log path, checkpoint dir)."""
    tmp = tmp_path_factory.mktemp("reference")
    log, ckpt = tmp / "steps.jsonl", tmp / "ckpt"
    rc, out, err = _torchrun(2, *JOB, "--log-json", str(log), "--ckpt-dir", str(ckpt))
    return rc, out, err, log, ckpt


def test_two_ranks_train_and_loss_falls(reference):
    rc, out, err, log, ckpt = reference
    assert rc == 0, err[-4000:]
    summary = json.loads(out.strip().splitlines()[-1])  # the last line printed is the JSON summary
    assert {"steps", "final_loss", "tokens_per_s", "world_size", "seq_len"} <= summary.keys()
    assert (summary["steps"], summary["world_size"], summary["seq_len"]) == (STEPS, 2, 256)
    assert summary["tokens_per_s"] > 0
    records = _records(log)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert len(records[0]["peak_mem_bytes"]) == 2  # one entry per rank
    assert summary["final_loss"] == pytest.approx(records[-1]["loss"], rel=1e-12)
    assert records[-1]["loss"] < records[0]["loss"] - MIN_LOSS_DROP, [r["loss"] for r in records]
    assert "params fsdp2" in err  # parameters sharded with FSDP2 over the 2 gloo ranks
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000004", "step_00000006"]  # --keep 2


def test_world_one_gives_the_same_losses(reference, tmp_path):
    """Sequence parallelism changes no maths: 1 rank holding the whole sequence trains identically."""
    log = tmp_path / "steps.jsonl"
    rc, _, err = _torchrun(1, *JOB, "--log-json", str(log), "--ckpt-dir", str(tmp_path / "ckpt"))
    assert rc == 0, err[-4000:]
    _assert_close(_losses(log), _losses(reference[3]), LOSS_RTOL_ACROSS_WORLDS)


@pytest.mark.parametrize("shard", ["fsdp", "ddp"])
def test_data_parallel_replicas_step_as_one_batch(reference, tmp_path, shard):
    """4 ranks = 2 replicas x sp 2, one sample each, step as the 2-rank job on both samples: the gradient
    reduction sums over the sp group and averages over the replicas under FSDP2 and DDP alike (the gradient
    norm of a reduction that averaged over all 4 ranks would be half)."""
    log = tmp_path / "steps.jsonl"
    job = [*JOB[:JOB.index("--batch-size")], "--batch-size", "1", *JOB[JOB.index("--batch-size") + 2:]]
    rc, _, err = _torchrun(4, *job, "--sp-size", "2", "--shard", shard, "--log-json", str(log), "--ckpt-dir",
                           str(tmp_path / "ckpt"))
    assert rc == 0, err[-4000:]
    _assert_close(_losses(log), _losses(reference[3]), LOSS_RTOL_ACROSS_WORLDS)
    norms = lambda path: {r["step"]: r["grad_norm"] for r in _records(path)}  # noqa: E731
    _assert_close(norms(log), norms(reference[3]), LOSS_RTOL_ACROSS_WORLDS)


def test_crash_then_resume_reproduces_the_losses(reference, tmp_path):
    """Rank 1 SIGKILLed after step 3 (last save: step 2), restarted with --resume: steps 3.. retrace the losses."""
    ckpt = tmp_path / "ckpt"
    rc, _, err = _torchrun(2, *JOB, "--log-json", str(tmp_path / "a.jsonl"), "--ckpt-dir", str(ckpt),
                           "--crash-at-step", "3")
    assert rc != 0, "the simulated crash must fail the job"
    assert sorted(_losses(tmp_path / "a.jsonl")) == [1, 2, 3]
    rc, out, err = _torchrun(2, *JOB, "--log-json", str(tmp_path / "b.jsonl"), "--ckpt-dir", str(ckpt), "--resume")
    assert rc == 0, err[-4000:]
    assert "resumed from" in err and "step_00000002" in err
    resumed = _losses(tmp_path / "b.jsonl")
    assert sorted(resumed) == [3, 4, 5, 6]  # step 3 was lost with the crash and is redone
    full = _losses(reference[3])
    _assert_close(resumed, {s: full[s] for s in resumed}, LOSS_RTOL_RESUMED)
    assert json.loads(out.strip().splitlines()[-1])["steps"] == STEPS


def test_torchrun_max_restarts_resumes(reference, tmp_path):
    """One torchrun command: attempt 0 crashes after step 3, torchrun restarts the ranks, they resume."""
    log = tmp_path / "steps.jsonl"
    rc, out, err = _torchrun(2, *JOB, "--log-json", str(log), "--ckpt-dir", str(tmp_path / "ckpt"), "--resume",
                             "--crash-at-step", "3", launcher=("--max-restarts", "1"), timeout=2 * JOB_TIMEOUT_S)
    assert rc == 0, err[-4000:]
    steps = [r["step"] for r in _records(log)]
    assert steps == [1, 2, 3, 3, 4, 5, 6]  # the log appends across restarts: step 3 twice
    assert [r.get("redone", False) for r in _records(log)] == [False] * 3 + [True] + [False] * 3
    full = _losses(reference[3])
    for r in _records(log):
        assert r["loss"] == pytest.approx(full[r["step"]], rel=LOSS_RTOL_RESUMED)
    assert json.loads(out.strip().splitlines()[-1])["final_loss"] == pytest.approx(full[STEPS], rel=LOSS_RTOL_RESUMED)


def test_packed_samples_depend_only_on_their_index():
    """The data position is one integer: sample g is the same whatever was read before (resume relies on it)."""
    import train_config
    import train_data

    tokens = train_data.ByteTokenizer().encode(train_data.read_text(train_config.DEFAULT_DATA))
    assert len(tokens) > 4_000_000 and tokens.max() < 256  # the shipped corpus, as bytes
    fresh = train_data.PackedSequences(tokens, seq_len=512, seed=0)
    used = train_data.PackedSequences(tokens, seq_len=512, seed=0)
    used.batch(0, 2)  # this one has read other samples first
    late = len(fresh) + 7  # in the second epoch
    assert torch.equal(fresh.batch(late, 3), used.batch(late, 3))
    assert not torch.equal(fresh.batch(7, 1), fresh.batch(late, 1))  # each epoch has its own order


# -- --pack: padding-free training on documents ---------------------------------------------------------------
def test_pack_trains_on_documents_and_reports_what_masking_skipped(tmp_path):
    """2 ranks on the shipped corpus split into its 1,189 chapters, packed into 512-token streams."""
    log = tmp_path / "pack.jsonl"
    rc, out, err = _torchrun(2, "--device", "cpu", "--model", "tiny", "--seq-len", "512", "--batch-size", "2",
                             "--steps", str(STEPS), "--lr", "3e-3", "--pack", "--log-json", str(log))
    assert rc == 0, err[-4000:]
    assert "1189 documents packed" in err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["pack"] is True and summary["real_tokens_per_s"] == summary["tokens_per_s"] > 0
    assert summary["documents_per_step"] >= 1 and 0 < summary["attention_work_vs_causal"] <= 1
    assert summary["pair_work_skipped"] == pytest.approx(1 - summary["attention_work_vs_causal"])
    records = _records(log)
    assert all("documents" in r for r in records)
    assert records[-1]["loss"] < records[0]["loss"] - MIN_LOSS_DROP, [r["loss"] for r in records]


def test_documents_and_packed_streams():
    import train_config
    import train_data

    docs = train_data.split_documents(train_data.read_text(train_config.DEFAULT_DATA))
    assert len(docs) == 1189 and docs[0].startswith("Genesis 1\n") and docs[-1].startswith("Revelation 22\n")
    assert train_data.split_documents("a\nb\n\nc\n") == ["a\nb\n", "c\n"]  # a blank line ends a document
    tok = train_data.ByteTokenizer()
    stream = train_data.DocumentStream([tok.encode(d) for d in docs], seq_len=512, seed=0)
    ids, positions = stream.batch(3, 2)
    assert ids.shape == positions.shape == (1024,)
    starts = (positions == 0).nonzero().flatten().tolist()
    assert starts[0] == 0 and 512 in starts  # every sample starts a document (piece); samples never merge
    again = train_data.DocumentStream([tok.encode(d) for d in docs], seq_len=512, seed=0)
    assert torch.equal(again.batch(3, 2)[0], ids)  # sample g depends only on (seed, seq_len, g)


# -- --schedule zigzag and --ulysses: other layouts and groups change no maths --------------------------------
def test_zigzag_and_ulysses_give_the_same_losses(reference, tmp_path):
    """The reference job on a two-dimensional 2 x 2 group (4 ranks) whose ring runs the zigzag layout: the same
    losses (one job covers both new layouts; the layouts' maths is tested per call in test_dist_layouts)."""
    nproc, flags = 4, ("--ulysses", "2", "--schedule", "zigzag")
    log = tmp_path / "steps.jsonl"
    rc, out, err = _torchrun(nproc, *JOB, *flags, "--log-json", str(log), "--ckpt-dir", str(tmp_path / "ckpt"),
                             timeout=2 * JOB_TIMEOUT_S)
    assert rc == 0, err[-4000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["world_size"] == nproc and summary["schedule"] == "zigzag" and summary["ulysses"] == 2
    assert "sp 4 (ulysses 2 x ring 2)" in err
    _assert_close(_losses(log), _losses(reference[3]), LOSS_RTOL_ACROSS_WORLDS)


def test_tiled_loss_and_mlp_give_the_same_losses(reference, tmp_path):
    """--tile-loss and --tile-mlp (with --remat, under FSDP2) change only the order of fp32 sums: the reference
    job's losses; the job log names both."""
    log = tmp_path / "steps.jsonl"
    rc, out, err = _torchrun(2, *JOB, "--tile-loss", "48", "--tile-mlp", "40", "--remat", "--log-json", str(log),
                             "--ckpt-dir", str(tmp_path / "ckpt"))
    assert rc == 0, err[-4000:]
    assert "+remat +tile-mlp 40 +tile-loss 48" in err
    _assert_close(_losses(log), _losses(reference[3]), LOSS_RTOL_ACROSS_WORLDS)


def test_packing_stats_reads_the_runs_schedule():
    """``--pack``'s summary counts the chunk pairs that no document reaches in the plan the run executes: its
    schedule, over its ring (``sp / ulysses`` ranks of ``ulysses`` ranks' tokens)."""
    import train

    # documents of 100, 28, 1 and 127 tokens on 4 ranks of 64: chunk 2 and 3 hold only the last two documents
    pos = torch.cat([torch.arange(n) for n in (100, 28, 1, 127)])
    got = {(s, u): train.packing_stats(pos, 4, s, u) for s in ("balanced", "ring", "zigzag") for u in (1, 2)}
    assert {v["attention_work_vs_causal"] for v in got.values()} == {got["ring", 1]["attention_work_vs_causal"]}
    # 10 causal pairs; (2,0), (2,1), (3,0), (3,1) see nothing
    assert got["balanced", 1]["pairs_skipped"] == got["ring", 1]["pairs_skipped"] == 4
    # ring of 2 ranks of 128 tokens: (1, 0) holds keys 0..127 for rows 128..255 of documents that start at 128
    assert got["balanced", 2]["pairs_skipped"] == got["ring", 2]["pairs_skipped"] == 1
    # zigzag: every rank holds an early and a late chunk, so every pair has work
    assert got["zigzag", 1]["pairs_skipped"] == got["zigzag", 2]["pairs_skipped"] == 0
    assert got["balanced", 1]["documents"] == 4
    # placed on a grid: the plan the run executes, its placement solved on the ring's links (U apart)
    from distattn.schedule import MaskSpec, Shapes, layout_of, make_plan, simulate

    spec = MaskSpec(causal=True, cu_seqlens=(0, 100, 128, 129, 256))
    run = layout_of("placed", 2, 2, mask=spec, n=64).ring()  # what distattn.sharding.placement shards by
    assert make_plan(2, True, "placed", mask=spec, chunk=128, stride=2).layout == run
    shapes = Shapes(seq_per_rank=64, heads_q=2, heads_kv=2, head_dim=1)
    placed = train.packing_stats(pos, 4, "placed", 2)
    assert placed["pairs_skipped"] >= 0
    assert placed["predicted_compute_idle"] == simulate(4, True, "placed", shapes, mask=spec,
                                                        ulysses=2).compute_idle_fraction
