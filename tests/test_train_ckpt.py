"""launch/train_ckpt.py: checkpoints that run no code from disk, are verified before loading, fail early.

In-process tests check the pieces (the metadata unpickler, the weights-only planner, the manifest, the
up-front directory checks, the JSON log's redone marks) on a checkpoint written by one real 2-rank torchrun
job (module fixture); end-to-end torchrun jobs check what a user sees: a damaged newest checkpoint is
skipped and the job resumes bit-identically from the previous one, a crafted ``.metadata`` is refused on
every rank with one line and exit status 2, and nothing it asks for is executed.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from test_train import JOB, JOB_TIMEOUT_S, LOSS_RTOL_RESUMED, ROOT, _losses, _torchrun
from test_train_cli import assert_one_clean_error, run_side_by_side

sys.path.insert(0, str(ROOT / "launch"))

import train_ckpt  # noqa: E402
import train_log  # noqa: E402
from train_config import UsageError  # noqa: E402

# The saved job: 2 ranks, 4 steps, a checkpoint every 2 (steps 2 and 4 kept).
SAVED = list(JOB)
SAVED[SAVED.index("--steps") + 1] = "4"


class _Payload:
    """Unpickling this creates ``path``: the stand-in for "runs a command" (os.system would do the same)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def _crafted(marker: Path) -> bytes:
    return pickle.dumps(_Payload(marker))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One real 2-rank job's checkpoint directory and per-step losses (steps 1-4, saves at 2 and 4)."""
    tmp = tmp_path_factory.mktemp("saved")
    rc, _, err = _torchrun(2, *SAVED, "--log-json", str(tmp / "steps.jsonl"), "--ckpt-dir", str(tmp / "ckpt"),
                           "--keep", "3")
    assert rc == 0, err[-4000:]
    assert "saved checkpoint step 2 to" in err and "saved checkpoint step 4 to" in err  # every save is logged
    return tmp / "ckpt", _losses(tmp / "steps.jsonl")


def _copy(saved, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(saved[0], dst)
    return dst


# ------------------------------------------------------------------------------------- in-process pieces


def test_layout_and_manifest(saved):
    ckpt = saved[0]
    assert [p.name for _, p in train_ckpt.complete_checkpoints(ckpt)] == ["step_00000002", "step_00000004"]
    step4 = ckpt / "step_00000004"
    listed = train_ckpt.read_manifest(step4)
    on_disk = {str(p.relative_to(step4)) for p in step4.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(listed) == on_disk and {".metadata", "progress.json", "__0_0.distcp", "__1_0.distcp"} <= on_disk
    train_ckpt.verify(step4)  # intact
    progress = train_ckpt.read_progress(step4)
    assert (progress["step"], progress["samples"]) == (4, 8)


def test_real_metadata_needs_only_the_allow_list(saved):
    """The allow-list is enough for a real save, and every entry is used (minimal)."""
    used = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            used.add((module, name))
            return super().find_class(module, name)

    path = saved[0] / "step_00000004"
    Recorder(open(path / ".metadata", "rb")).load()
    assert used <= train_ckpt.METADATA_CLASSES
    dtypes = {c for c in train_ckpt.METADATA_CLASSES
              if c[0] == "torch" and isinstance(getattr(torch, c[1]), torch.dtype)}
    assert train_ckpt.METADATA_CLASSES - used <= dtypes  # unused entries: only dtypes a bf16/int run may need
    assert isinstance(train_ckpt.SafeReader(str(path)).read_metadata(), train_ckpt.Metadata)


def test_crafted_metadata_is_refused_and_not_run(saved, tmp_path):
    path = _copy(saved, tmp_path) / "step_00000004"
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(_crafted(marker))
    with pytest.raises(train_ckpt.UnsafeCheckpointError, match=r"pathlib\.Path\.touch|not a DCP metadata class"):
        train_ckpt.SafeReader(str(path)).read_metadata()
    assert not marker.exists()
    (path / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))  # allowed types, wrong object
    with pytest.raises(train_ckpt.UnsafeCheckpointError, match="not DCP Metadata"):
        train_ckpt.SafeReader(str(path)).read_metadata()


def test_crafted_bytes_entry_is_refused_and_not_run(tmp_path):
    """Non-tensor entries (optimizer param_groups) load weights-only: a pickled payload does not run."""
    marker = tmp_path / "pwned"
    planner = train_ckpt.SafePlanner()
    planner.flatten_state_dict, planner.state_dict = False, {}
    item = SimpleNamespace(dest_index=SimpleNamespace(fqn="train.optim.param_groups.0.lr"))
    buf = io.BytesIO()
    torch.save(_Payload(marker), buf)
    buf.seek(0)
    with pytest.raises(train_ckpt.UnsafeCheckpointError, match="param_groups.0.lr is not plain data"):
        planner.load_bytes(item, buf)
    assert not marker.exists()
    buf = io.BytesIO()
    torch.save({"lr": 1e-3, "betas": (0.9, 0.95), "params": ["a.weight"], "foreach": None}, buf)
    buf.seek(0)
    planner.load_bytes(item, buf)  # plain data still loads
    assert planner.state_dict[item.dest_index.fqn]["betas"] == (0.9, 0.95)


def test_crafted_progress_is_refused_and_not_run(saved, tmp_path):
    """The progress is JSON: a pickle planted there is unreadable data, never unpickled."""
    path = _copy(saved, tmp_path) / "step_00000004"
    marker = tmp_path / "pwned"
    (path / "progress.json").write_bytes(_crafted(marker))
    with pytest.raises(train_ckpt.DamagedCheckpointError, match="progress.json unreadable"):
        train_ckpt.read_progress(path)
    (path / "progress.json").write_text(json.dumps({"step": "4"}))
    with pytest.raises(train_ckpt.DamagedCheckpointError, match="integer 'step' and 'samples'"):
        train_ckpt.read_progress(path)
    assert not marker.exists()


def test_overwritten_4k_of_a_shard_is_detected(saved, tmp_path):
    path = _copy(saved, tmp_path) / "step_00000004"
    shard = path / "__1_0.distcp"
    with open(shard, "r+b") as f:  # 4 KiB in the middle, same size: only the digest can tell
        f.seek(shard.stat().st_size // 2)
        f.write(os.urandom(4096))
    with pytest.raises(train_ckpt.DamagedCheckpointError, match=r"__1_0\.distcp: sha256 differs"):
        train_ckpt.verify(path)
    shard.write_bytes(shard.read_bytes()[:-1])  # truncated
    with pytest.raises(train_ckpt.DamagedCheckpointError, match=r"__1_0\.distcp: \d+ bytes, the manifest says"):
        train_ckpt.verify(path)
    shard.unlink()
    with pytest.raises(train_ckpt.DamagedCheckpointError, match=r"__1_0\.distcp: missing"):
        train_ckpt.verify(path)
    (path / "manifest.json").write_text("{")
    with pytest.raises(train_ckpt.DamagedCheckpointError, match="manifest.json unreadable"):
        train_ckpt.verify(path)


def test_preflight_refuses_unusable_directories(tmp_path, monkeypatch):
    """Before step 1: not creatable, read-only, not enough space for fp32 params + AdamW moments."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(UsageError, match=r"--ckpt-dir .*afile/ckpt is not writable \(Not a directory\)"):
        train_ckpt.preflight(afile / "ckpt", 1000, rank=0)
    monkeypatch.setenv(train_ckpt.READ_ONLY_ENV, "1")  # root ignores permission bits: simulate the mount
    with pytest.raises(UsageError, match="is not writable .*Read-only file system"):
        train_ckpt.preflight(tmp_path / "ro", 1000, rank=0)
    monkeypatch.delenv(train_ckpt.READ_ONLY_ENV)
    mb = int(2**20 / train_ckpt.BYTES_PER_PARAM / train_ckpt.FORMAT_OVERHEAD)  # parameters of a 1 MB checkpoint
    monkeypatch.setenv(train_ckpt.FREE_BYTES_ENV, str(3 * train_ckpt.estimated_bytes(mb) - 1))
    with pytest.raises(UsageError, match=r"has 3\.0 MB free but this run's checkpoints need about 3\.0 MB "
                                         r"\(3 x 1\.0 MB of fp32 parameters and AdamW moments"):
        train_ckpt.preflight(tmp_path / "full", mb, rank=0, copies=3)
    monkeypatch.setenv(train_ckpt.FREE_BYTES_ENV, str(3 * train_ckpt.estimated_bytes(mb)))
    train_ckpt.preflight(tmp_path / "full", mb, rank=0, copies=3)
    assert list((tmp_path / "full").iterdir()) == []  # the probe file is gone


def test_peak_copies_count_keep_plus_one_less_existing(saved, tmp_path):
    assert train_ckpt.new_copies(tmp_path / "none", keep=2, saves=10) == 3  # 2 kept + the one being written
    assert train_ckpt.new_copies(tmp_path / "none", keep=2, saves=1) == 1
    assert train_ckpt.new_copies(saved[0], keep=2, saves=10) == 1  # two are there already
    assert train_ckpt.new_copies(saved[0], keep=1, saves=10) == 1


def test_json_log_marks_redone_steps(tmp_path):
    path = str(tmp_path / "steps.jsonl")
    log = train_log.JsonLog(path, append=False)
    for step in (1, 2, 3):
        log.write({"step": step})
    log.close()
    with open(path, "a") as f:
        f.write('{"step": 4, "lo')  # torn by the crash
    log = train_log.JsonLog(path, append=True)
    for step in (3, 4, 5):
        log.write({"step": step})
    log.close()
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.endswith("}")]
    assert [(r["step"], r.get("redone", False)) for r in records] == [
        (1, False), (2, False), (3, False), (3, True), (4, False), (5, False)]


# ------------------------------------------------------------------------------------------ torchrun jobs


def test_damaged_newest_is_skipped_and_resume_is_bit_identical(saved, tmp_path):
    """4 KiB of step 4's shard overwritten: warn, resume from step 2, retrace step 3 exactly; the damaged
    checkpoint is not counted by --keep (step 2 and the new step 3 both stay); a partial save is removed."""
    ckpt = _copy(saved, tmp_path)
    shard = ckpt / "step_00000004" / "__0_0.distcp"
    with open(shard, "r+b") as f:
        f.seek(4096)
        f.write(b"\0" * 4096)
    partial = ckpt / "step_00000006"  # a save killed before DCP's .metadata: removed
    partial.mkdir()
    shutil.copy(shard, partial / "__0_0.distcp")
    legacy = ckpt / "step_00000001"  # .metadata but no manifest (an older train.py): kept, never resumed
    shutil.copytree(ckpt / "step_00000002", legacy)
    (legacy / "manifest.json").unlink()
    log = tmp_path / "steps.jsonl"
    args = [*SAVED, "--ckpt-dir", str(ckpt), "--log-json", str(log), "--resume", "must", "--keep", "2"]
    args[args.index("--steps") + 1], args[args.index("--save-every") + 1] = "3", "3"
    rc, _, err = _torchrun(2, *args)
    assert rc == 0, err[-4000:]
    assert f"warning: skipping damaged checkpoint {ckpt / 'step_00000004'}: __0_0.distcp: sha256 differs" in err
    assert f"resumed from {ckpt / 'step_00000002'} (step 2" in err
    got, want = _losses(log), saved[1]
    assert sorted(got) == [3]
    assert got[3] == pytest.approx(want[3], rel=LOSS_RTOL_RESUMED)
    assert f"removing {partial}: an unfinished save" in err and f"warning: ignoring {legacy}: it has no" in err
    names = sorted(p.name for p in ckpt.iterdir())
    # --keep 2 counts intact checkpoints only: steps 2 and 3 (the damaged 4 and the unverifiable 1 are not)
    assert names == ["step_00000001", "step_00000002", "step_00000003", "step_00000004"], names
    train_ckpt.verify(ckpt / "step_00000003")


def test_refusals_after_init_are_one_line_and_exit_2(saved, tmp_path):
    """Two faults found only once the process group exists, side by side: a crafted ``.metadata`` whose
    manifest the attacker rewrote too (the unpickler still refuses, nothing runs), and a checkpoint of
    another model (DCP's size mismatch). Each: one line from rank 0, exit status 2, no rank's traceback."""
    crafted = _copy(saved, tmp_path / "crafted")
    marker = tmp_path / "pwned"
    (crafted / "step_00000004" / ".metadata").write_bytes(_crafted(marker))
    train_ckpt.write_manifest(crafted / "step_00000004", 4)
    other = _copy(saved, tmp_path / "other")
    results = run_side_by_side({
        "crafted .metadata": ([*SAVED, "--ckpt-dir", str(crafted), "--resume"], {}),
        "another model": ([*SAVED, "--ckpt-dir", str(other), "--resume", "--model", "tiny-gqa"], {}),
    }, timeout=JOB_TIMEOUT_S)
    assert_one_clean_error("crafted .metadata", *results["crafted .metadata"],
                           f"checkpoint {crafted / 'step_00000004'}: its .metadata asks to load pathlib.Path.touch, "
                           f"which is not a DCP metadata class: refusing to unpickle it", before_init=False)
    assert not marker.exists()
    assert_one_clean_error("another model", *results["another model"],
                           f"checkpoint {other / 'step_00000004'} does not fit this model (ValueError: Size "
                           f"mismatch", before_init=False)
    assert "resume with the --model it was trained with" in results["another model"][2]
