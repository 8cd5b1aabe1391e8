"""``launch/train.py --pack --schedule placed``: the same data on the work-balanced placement trains along the
contiguous (balanced) run's loss curve, each batch's placement after the first solved ahead in a worker
(``launch/train_placement.py``), and the summary reports the plans' predicted compute idle."""

import json
import re

import pytest

from test_train import LOSS_RTOL_ACROSS_WORLDS, _records, _torchrun

# The placement changes which rank holds which token, so only the order of fp32 sums (attention merged from other
# chunks, the loss and gradients reduced over other shards) differs from the contiguous run: the same bound as
# across world sizes (test_train: measured ~1e-7, a misplaced token or label moves the loss by 1e-2 or more).
LOSS_RTOL_PLACED = LOSS_RTOL_ACROSS_WORLDS
JOB = ["--device", "cpu", "--model", "tiny", "--seq-len", "768", "--batch-size", "2", "--steps", "3", "--lr", "3e-3",
       "--seed", "0", "--pack"]


def _run(tmp_path, schedule, world=3, *extra):
    log = tmp_path / f"{schedule}-{world}.jsonl"
    rc, out, err = _torchrun(world, *JOB, "--schedule", schedule, "--log-json", str(log), *extra)
    assert rc == 0, err[-4000:]
    records = _records(log)
    if schedule == "placed":  # each batch's placement solved in a worker while the steps before ran, but the first
        # (batches of this tiny corpus can repeat their documents: then a later one finds its placement solved)
        # (solved inline instead while the workers still import the library: a loaded machine, a short job)
        sources = [r["placement_source"] for r in records]
        assert sources[0] in ("inline", "ahead") and set(sources) <= {"ahead", "cached", "inline"}, sources
        assert all(r["placement_source"] != "inline" or not r["placement_workers_ready"] for r in records[1:])
        assert all(r["placement_wait_s"] >= 0 for r in records)
    else:
        assert all("placement_wait_s" not in r for r in records)
    return json.loads(out.strip().splitlines()[-1]), [r["loss"] for r in records]


def test_placed_follows_the_contiguous_loss_curve(tmp_path):
    """3 ranks placed, and 4 ranks as Ulysses 2 x a placed ring of 2, against 3 ranks balanced: the same stream."""
    base, base_losses = _run(tmp_path, "balanced")
    placed, losses = _run(tmp_path, "placed")
    _, grid_losses = _run(tmp_path, "placed", 4, "--ulysses", "2")
    assert len(losses) == len(grid_losses) == len(base_losses) == 3
    for got, grid, want in zip(losses, grid_losses, base_losses):
        assert abs(got - want) <= LOSS_RTOL_PLACED * abs(want), (losses, base_losses)
        assert abs(grid - want) <= LOSS_RTOL_PLACED * abs(want), (grid_losses, base_losses)
    assert placed["schedule"] == "placed" and 0 <= placed["predicted_compute_idle_per_step"] < 1
    assert 0 <= base["predicted_compute_idle_per_step"] < 1
    # No longer asserted: placed idle <= balanced idle. Since 3626444 the placement minimises the modelled step time
    # on the per-pair timeline (communication included), not the work-only lockstep idle reported here; on this tiny
    # stream (256 tokens per rank) it keeps documents on fewer ranks: idle 0.48 vs balanced 0.31 (issue 39, open).
    # Its balance is held by tests/test_placement.py's property tests.
    assert placed["pairs_skipped_per_step"] >= 0


def test_placed_needs_pack(monkeypatch):
    with pytest.raises(Exception, match="--schedule placed places packed documents: add --pack"):
        _prepare(monkeypatch, ["--model", "tiny", "--seq-len", "64", "--steps", "1", "--schedule", "placed"], world=1)


def _prepare(monkeypatch, argv, world=4, link="nvlink"):
    """``train.prepare`` as rank 0 of a ``world``-rank job, in-process (it runs before any process group exists)."""
    from test_train_cli import ROOT

    for key, value in {"WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(world),
                       "DISTATTN_LINK": link}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.syspath_prepend(str(ROOT / "launch"))
    import train

    return train.prepare(["--device", "cpu", *argv])[0]


def _skewed_documents(path, seq_len):
    """Packed streams whose documents leave contiguous shards unbalanced: one long document, then short ones."""
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(4):
            f.write(json.dumps({"text": "a" * (seq_len - 600)}) + "\n")
            for _ in range(6):
                f.write(json.dumps({"text": "b" * 99}) + "\n")  # + the end-of-document token: 100 tokens


def test_auto_with_pack_weighs_the_placement_on_the_first_batchs_documents(tmp_path, monkeypatch, capsys):
    """``--pack --schedule auto``: the placement is a candidate, judged on the first batch's documents (the same on
    every rank), on a flat group and on a grid; dense streams (no --pack) never get it."""
    data = tmp_path / "docs.jsonl"
    seq = 16384
    _skewed_documents(data, seq)
    common = ["--model", "llama-1b", "--seq-len", str(seq), "--batch-size", "1", "--data", str(data),
              "--schedule", "auto"]
    cfg = _prepare(monkeypatch, [*common, "--pack"])
    out = capsys.readouterr().out
    assert cfg.args.schedule == "placed", out
    assert re.search(r"--schedule auto \(the first batch's \d+ documents\): placed: [\d.]+ ms vs", out), out
    cfg = _prepare(monkeypatch, common)  # no --pack: one dense causal stream, where the balanced plan is optimal
    assert cfg.args.schedule != "placed"
    cfg = _prepare(monkeypatch, [*common, "--pack", "--ulysses", "2"])  # the grid places its ring's shards
    assert cfg.args.schedule == "placed", capsys.readouterr().out
