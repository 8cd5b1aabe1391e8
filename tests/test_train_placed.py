"""``launch/train.py --pack --schedule placed``: the same data on the work-balanced placement trains along the
contiguous (balanced) run's loss curve, and the summary reports the plans' predicted compute idle."""

import json

from test_train import LOSS_RTOL_ACROSS_WORLDS, _records, _torchrun

# The placement changes which rank holds which token, so only the order of fp32 sums (attention merged from other
# chunks, the loss and gradients reduced over other shards) differs from the contiguous run: the same bound as
# across world sizes (test_train: measured ~1e-7, a misplaced token or label moves the loss by 1e-2 or more).
LOSS_RTOL_PLACED = LOSS_RTOL_ACROSS_WORLDS
JOB = ["--device", "cpu", "--model", "tiny", "--seq-len", "768", "--batch-size", "2", "--steps", "3", "--lr", "3e-3",
       "--seed", "0", "--pack"]


def _run(tmp_path, schedule):
    log = tmp_path / f"{schedule}.jsonl"
    rc, out, err = _torchrun(3, *JOB, "--schedule", schedule, "--log-json", str(log))
    assert rc == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1]), [r["loss"] for r in _records(log)]


def test_placed_follows_the_contiguous_loss_curve(tmp_path):
    base, base_losses = _run(tmp_path, "balanced")
    placed, losses = _run(tmp_path, "placed")
    assert len(losses) == len(base_losses) == 3
    for got, want in zip(losses, base_losses):
        assert abs(got - want) <= LOSS_RTOL_PLACED * abs(want), (losses, base_losses)
    assert placed["schedule"] == "placed" and 0 <= placed["predicted_compute_idle_per_step"] < 1
    assert placed["predicted_compute_idle_per_step"] <= base["predicted_compute_idle_per_step"]
    assert placed["pairs_skipped_per_step"] >= 0


def test_placed_needs_pack():
    rc, _, err = _torchrun(1, "--device", "cpu", "--model", "tiny", "--seq-len", "64", "--steps", "1",
                           "--schedule", "placed")
    assert rc != 0 and "--schedule placed places packed documents over a flat group: add --pack" in err
