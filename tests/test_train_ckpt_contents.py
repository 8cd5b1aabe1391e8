"""What a checkpoint of launch/train.py holds, checked before it is used (issue 35): every field of its
``progress.json`` for type and range, ``samples`` against the batches read, the step against the run's ``--steps``
and the directory's name, ``--seq-len`` against the run's; shards that match their manifest but cannot be read.

In-process tests check the rules on the real progress of a 2-rank job (``test_train_ckpt``'s module fixture);
torchrun jobs, side by side, check what a user sees: one ``train.py: error:`` line from rank 0, exit status 2 on
every rank, before step 1, and never "resumed from".
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from test_train import JOB_TIMEOUT_S, ROOT
from test_train_ckpt import SAVED, _copy, saved  # noqa: F401 - the module fixture: one real 2-rank job
from test_train_cli import assert_one_clean_error, run_side_by_side

sys.path.insert(0, str(ROOT / "launch"))

import train_ckpt  # noqa: E402
import train_export  # noqa: E402
import train_resume  # noqa: E402
from train_ckpt_files import LAYOUT, check_progress  # noqa: E402


def _progress(saved) -> dict:
    return train_ckpt.read_progress(saved[0] / "step_00000004")


def test_a_real_progress_passes_and_records_where_its_layout_began(saved):
    p = _progress(saved)  # 2 ranks, batch 2, sp 2: 2 samples a step, 4 steps
    assert (p["step"], p["samples"], p["layout_from_step"], p["layout_from_samples"]) == (4, 8, 0, 0)
    assert check_progress(p, 4) is None
    assert LAYOUT == train_export.LAYOUT  # the layout's fields, named in two places


BAD = [  # (change to a real progress of step 4, what the refusal says)
    ({"samples": -7}, "holds -7 samples consumed at step 4; every step reads at least one sample"),
    ({"seq_len": "256"}, "holds seq_len '256', not an integer"),
    ({"seq_len": 0}, "holds seq_len 0, not a length"),
    ({"seed": 1.5}, "holds seed 1.5, not an integer"),
    ({"data": ["a"]}, "holds data ['a'], not a string"),
    ({"loss": True}, "holds loss True, not a number"),
    ({"step": 4.0}, "holds step 4.0, not an integer"),
    ({"step": 10**30}, "holds step 1000000000000000000000000000000, but its manifest.json says step 4"),
    ({"step": 0}, "holds step 0; train.py saves after step 1 at the earliest"),
    ({"samples": None}, "holds samples None, not an integer"),
    ({"samples": 9}, "holds 9 samples consumed at step 4, but 4 steps of 2 samples (batch 2 x dp 1) since step 0 "
                     "(0 then) make 8"),
    ({"world_size": 3}, "holds world_size 3, sp_size 2, dp_size 1, ulysses 1: not one layout"),
    ({"dp_size": 0, "world_size": 0}, "holds world_size 0, not a positive integer"),
    ({"layout_from_step": 4}, "holds layout_from_step 4, layout_from_samples 0: not a point before step 4"),
    ({"layout_from_step": 1, "layout_from_samples": 0}, "not a point before step 4"),
    ({"layout_from_samples": -1}, "holds layout_from_samples -1, not a non-negative integer"),
]


@pytest.mark.parametrize("change, message", BAD, ids=[json.dumps(c)[:40] for c, _ in BAD])
def test_bad_progress_is_refused_naming_the_field(saved, change, message):
    assert message in check_progress({**_progress(saved), **change}, 4)


def test_missing_and_partial_fields(saved):
    p = _progress(saved)
    assert check_progress({k: v for k, v in p.items() if k != "samples"}, 4) == "has no 'samples'"
    assert check_progress([p], 4) == "holds a JSON list, not an object"
    assert "holds sp_size, ulysses, dp_size, batch_size without world_size" == check_progress(
        {k: v for k, v in p.items() if k != "world_size" and not k.startswith("layout_from")}, 4)
    older = {k: v for k, v in p.items() if k not in LAYOUT and not k.startswith("layout_from")}
    assert check_progress(older, 4) is None  # saved before the layout was recorded: accepted
    assert check_progress({k: v for k, v in p.items() if not k.startswith("layout_from")}, 4) is None


def test_read_progress_refuses_a_crafted_file_that_matches_its_manifest(saved, tmp_path):
    path = _copy(saved, tmp_path) / "step_00000004"
    p = json.loads((path / "progress.json").read_text())
    (path / "progress.json").write_text(json.dumps({**p, "samples": -7}))
    train_ckpt.write_manifest(path, 4)
    with pytest.raises(train_ckpt.InvalidProgressError, match=rf"checkpoint {path}: its progress.json holds -7 "
                                                              rf"samples .* not damaged on disk"):
        train_ckpt.read_progress(path)


def _run(steps=4, seq_len=256, batch=2, dp=1):
    return SimpleNamespace(args=SimpleNamespace(steps=steps, seq_len=seq_len, batch_size=batch), dp_size=dp)


def test_progress_against_the_run(saved):
    path, p = saved[0] / "step_00000004", _progress(saved)
    assert train_resume.check_against_run(_run(), path, p) is None
    assert (f"checkpoint {path} is at step 4, beyond this run's --steps 3: pass --steps 4 or more"
            in train_resume.check_against_run(_run(steps=3), path, p))
    assert (f"checkpoint {path} was trained with --seq-len 256, this run has --seq-len 512"
            in train_resume.check_against_run(_run(seq_len=512), path, p))
    assert "not the step its name says" in train_resume.check_against_run(_run(), path.parent / "step_00000002", p)


def test_a_new_stretch_of_batches_begins_where_the_samples_per_step_change(saved):
    p = _progress(saved)
    same = dict(p)
    train_resume._continue_layout(_run(), same)  # 2 samples a step before and now: the stretch goes on
    assert (same["layout_from_step"], same["layout_from_samples"]) == (0, 0)
    other = dict(p)
    train_resume._continue_layout(_run(dp=2), other)  # 4 a step from here
    assert (other["layout_from_step"], other["layout_from_samples"]) == (4, 8)
    other.update(step=6, samples=16, dp_size=2, world_size=4)  # two more steps of 4, as the next save holds
    assert check_progress(other, 6) is None


def test_an_interrupted_save_is_kept_and_returned_for_the_caller_to_name(saved, tmp_path, monkeypatch):
    ckpt = _copy(saved, tmp_path)
    (ckpt / "step_00000004" / "manifest.json").unlink()  # killed between .metadata and the manifest
    (ckpt / "step_00000006").mkdir()  # killed before .metadata: removed
    monkeypatch.setattr(train_ckpt, "_rank0_do", lambda fn: fn())  # one process, no process group
    said = []
    assert train_ckpt.remove_incomplete(ckpt, said.append) == [ckpt / "step_00000004"]
    assert said == [f"removing {ckpt / 'step_00000006'}: an unfinished save (no .metadata, no manifest.json)"]
    assert (ckpt / "step_00000004").is_dir() and not (ckpt / "step_00000006").exists()


def _craft(src: Path, dst: Path, step: int | None = None, **change) -> Path:
    """A copy of the checkpoint directory ``src`` whose step 4 progress holds ``change`` (and, with ``step``, that
    step in its name, progress and manifest), the manifest rewritten to match: only the contents are wrong."""
    shutil.copytree(src, dst)
    path = dst / "step_00000004"
    p = json.loads((path / "progress.json").read_text())
    if step is not None:
        path = path.rename(train_ckpt.step_dir(dst, step))
        p.update(step=step, samples=2 * step)
    (path / "progress.json").write_text(json.dumps({**p, **change}))
    train_ckpt.write_manifest(path, p["step"])
    return path


def test_crafted_contents_stop_every_rank_before_step_1(saved, tmp_path):
    """Side by side, each a checkpoint whose files match their manifest: a step of 10^30, -7 samples, a string
    seq_len, another --seq-len than the run's, a truncated shard. Each: one line, exit 2 on every rank."""
    src = saved[0]
    huge = _craft(src, tmp_path / "huge", step=10**30)
    _craft(src, tmp_path / "negative", samples=-7)
    _craft(src, tmp_path / "string", seq_len="256")
    truncated = _craft(src, tmp_path / "truncated")
    shard = truncated / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:4096])
    train_ckpt.write_manifest(truncated, 4)
    resume = [*SAVED, "--resume"]
    resume[resume.index("--steps") + 1] = "6"
    other_len = list(resume)
    other_len[other_len.index("--seq-len") + 1] = "128"
    jobs = {"huge": (huge.parent, resume), "negative": (tmp_path / "negative", resume),
            "string": (tmp_path / "string", resume), "seq_len": (src, other_len),
            "truncated": (tmp_path / "truncated", resume)}
    results = run_side_by_side({name: ([*args, "--ckpt-dir", str(d)], {}) for name, (d, args) in jobs.items()},
                               timeout=JOB_TIMEOUT_S)
    want = {
        "huge": f"checkpoint {huge} is at step {10**30}, beyond this run's --steps 6: pass --steps",
        "negative": f"checkpoint {tmp_path / 'negative' / 'step_00000004'}: its progress.json holds -7 samples "
                    f"consumed at step 4; every step reads at least one sample",
        "string": "its progress.json holds seq_len '256', not an integer",
        "seq_len": f"checkpoint {src / 'step_00000004'} was trained with --seq-len 256, this run has --seq-len 128",
        "truncated": f"checkpoint {truncated}: its shards cannot be read (",
    }
    for name, reason in want.items():
        assert_one_clean_error(name, *results[name], reason, before_init=False)
        assert "resumed from" not in results[name][2], name
    assert "yet they match its manifest.json" in results["truncated"][2]
