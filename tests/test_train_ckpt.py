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
import re
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
import train_lock  # noqa: E402
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
    with pytest.raises(train_ckpt.UnsafeCheckpointError, match="param_groups.0.lr is not plain data") as refused:
        planner.load_bytes(item, buf)
    assert not marker.exists()
    # what the pickle asked for, and never torch's advice to load it with weights_only=False (which runs it)
    assert re.search(r"its pickle asks for \S+; a train.py checkpoint holds only numbers", str(refused.value))
    assert "weights_only" not in str(refused.value) and "trust" not in str(refused.value)
    buf = io.BytesIO()
    torch.save({"lr": 1e-3, "betas": (0.9, 0.95), "params": ["a.weight"], "foreach": None}, buf)
    buf.seek(0)
    planner.load_bytes(item, buf)  # plain data still loads
    assert planner.state_dict[item.dest_index.fqn]["betas"] == (0.9, 0.95)


def test_crafted_progress_is_refused_and_not_run(saved, tmp_path):
    """The progress is JSON: a pickle planted there (the manifest rewritten to match) is unreadable data,
    never unpickled."""
    path = _copy(saved, tmp_path) / "step_00000004"
    marker = tmp_path / "pwned"
    (path / "progress.json").write_bytes(_crafted(marker))
    train_ckpt.write_manifest(path, 4)
    with pytest.raises(train_ckpt.DamagedCheckpointError, match="progress.json unreadable"):
        train_ckpt.read_progress(path)
    (path / "progress.json").write_text(json.dumps({"step": "4"}))
    train_ckpt.write_manifest(path, 4)
    with pytest.raises(train_ckpt.InvalidProgressError, match="its progress.json holds step '4', not an integer"):
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
    with pytest.raises(UsageError, match=r"--ckpt-dir .*afile/ckpt does not exist and cannot be created \(Not a "
                                         r"directory: .*afile is a file, not a directory\)"):
        train_ckpt.preflight(afile / "ckpt", 1000, rank=0)
    # /proc refuses new directories: ENOENT for root, EACCES (mode 555) for other users
    with pytest.raises(UsageError, match=r"--ckpt-dir /proc/x/ckpt does not exist and cannot be created \((No such "
                                         r"file or directory: /proc does not accept new directories|Permission "
                                         r"denied: /proc is not writable by this user)\); pass a --ckpt-dir inside "
                                         r"a directory you can write") as info:
        train_ckpt.preflight(Path("/proc/x/ckpt"), 1000, rank=0)
    assert "permissions" not in str(info.value)
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


def _metadata(path: Path):
    """A checkpoint's .metadata, unpickled without the allow-list (the test's own, trusted files)."""
    with open(path / ".metadata", "rb") as f:
        return pickle.load(f)


def _point_shards(metadata, where) -> None:
    """Rewrite every storage record of ``metadata`` to read its shard file from ``where(name)``."""
    for info in metadata.storage_data.values():
        info.relative_path = where(info.relative_path)


@pytest.mark.parametrize("what", ["progress.json", ".metadata", "__1_0.distcp", "directory", "subdirectory"])
def test_symlinks_are_refused_on_verify_and_load(saved, tmp_path, what):
    """A link anywhere in a checkpoint is refused by name, even one whose target has the right bytes (an
    identical copy outside: every digest matches, the link alone is the fault)."""
    ckpt = _copy(saved, tmp_path)
    path = ckpt / "step_00000004"
    outside = tmp_path / "outside"
    shutil.copytree(path, outside)
    if what == "directory":  # the newest checkpoint is a link to another directory
        link = path = ckpt / "step_00000006"
        link.symlink_to(outside, target_is_directory=True)
        runs = tmp_path / "runs"  # --ckpt-dir itself may be a link (runs -> scratch space): not inside a checkpoint
        runs.symlink_to(ckpt, target_is_directory=True)
        train_ckpt.verify(runs / "step_00000004")
    elif what == "subdirectory":  # an extra directory, unlisted, as a link
        link = path / "extra"
        link.symlink_to(tmp_path, target_is_directory=True)
    else:
        link = path / what
        link.unlink()
        link.symlink_to(outside / what)
    with pytest.raises(train_ckpt.DamagedCheckpointError, match=f"{re.escape(str(link))} is a symbolic link"):
        train_ckpt.verify(path)
    # The loaders refuse it too (verify found nothing wrong yet when the link was planted after it ran).
    if what in ("progress.json", ".metadata", "directory"):
        with pytest.raises(train_ckpt.DamagedCheckpointError, match=f"{re.escape(str(link))} is a symbolic link"):
            if what == "progress.json":
                train_ckpt.read_progress(path)
            else:
                train_ckpt.SafeReader(str(path)).read_metadata()
    if what == "__1_0.distcp":  # DCP opens shards through the reader's file system (what dcp.load calls)
        reader = train_ckpt.SafeReader(str(path))
        reader.read_metadata()
        with pytest.raises(train_ckpt.UnsafeCheckpointError, match=f"{re.escape(str(link))} is a symbolic link"):
            with reader.fs.create_stream(reader.fs.concat_path(reader.path, what), "rb"):
                pass
        with reader.fs.create_stream(reader.fs.concat_path(reader.path, "__0_0.distcp"), "rb") as f:
            assert f.read(1)  # an unlinked shard still opens


def test_metadata_reading_outside_the_checkpoint_is_refused(saved, tmp_path):
    """The issue's crafted checkpoint: no shard files of its own, a ``.metadata`` whose storage paths point at
    another run's shards, a manifest listing what is there. It verified and loaded the other run's weights;
    now every variant is refused, naming the path."""
    victim = tmp_path / "victim"  # another run's checkpoint
    shutil.copytree(saved[0] / "step_00000002", victim)
    evil = tmp_path / "evil" / "step_00000004"
    evil.mkdir(parents=True)
    shutil.copy(saved[0] / "step_00000004" / "progress.json", evil)
    variants = {
        "relative": (lambda n: f"../../victim/{n}", "a path outside the checkpoint"),
        "absolute": (lambda n: str(victim / n), "a path outside the checkpoint"),
        "unlisted": (lambda n: n, "which is not a shard file its manifest.json lists"),
        "bookkeeping": (lambda n: "progress.json", "which is not a shard file its manifest.json lists"),
    }
    for name, (where, why) in variants.items():
        metadata = _metadata(saved[0] / "step_00000004")
        _point_shards(metadata, where)
        (evil / ".metadata").write_bytes(pickle.dumps(metadata))
        for shard in evil.glob("*.distcp"):
            shard.unlink()
        train_ckpt.write_manifest(evil, 4)  # lists .metadata and progress.json only
        if name == "unlisted":  # the shards appear after the manifest was written: present, not listed
            for shard in (saved[0] / "step_00000004").glob("*.distcp"):
                shutil.copy(shard, evil)
        target = where("__0_0.distcp")
        assert (evil / target).is_file(), name  # DCP's own reader would have opened it
        with pytest.raises(train_ckpt.UnsafeCheckpointError, match=f"reads tensors from {re.escape(repr(target))}"
                                                                   f", {why}"):
            train_ckpt.verify(evil)
        with pytest.raises(train_ckpt.UnsafeCheckpointError, match=re.escape(why)):
            train_ckpt.SafeReader(str(evil)).read_metadata()
    # Were .metadata accepted somehow, DCP still could not open a file outside the shards it names.
    reader = train_ckpt.SafeReader(str(saved[0] / "step_00000004"))
    reader.read_metadata()
    for path in (reader.fs.concat_path(reader.path, "../../victim/__0_0.distcp"), victim / "__0_0.distcp"):
        with pytest.raises(train_ckpt.UnsafeCheckpointError, match="not a shard file of the checkpoint"):
            with reader.fs.create_stream(path, "rb"):
                pass


def test_tampered_progress_is_refused(saved, tmp_path):
    """progress.json is in the manifest and hashed as it is read: a same-size edit of the step is caught."""
    path = _copy(saved, tmp_path) / "step_00000004"
    text = (path / "progress.json").read_text()
    assert '"step": 4,' in text
    (path / "progress.json").write_text(text.replace('"step": 4,', '"step": 8,'))
    for check in (train_ckpt.verify, train_ckpt.read_progress):
        with pytest.raises(train_ckpt.DamagedCheckpointError, match="progress.json: sha256 differs"):
            check(path)
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["files"]["progress.json"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(train_ckpt.DamagedCheckpointError, match="manifest.json does not list progress.json"):
        train_ckpt.read_progress(path)


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
    legacy = ckpt / "step_00000001"  # .metadata but no manifest (killed between the two): kept, never resumed
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
    assert f"removing {partial}: an unfinished save" in err
    assert (f"warning: {legacy} is an interrupted save: DCP wrote its shards and .metadata, but the job stopped before "
            f"the manifest.json train.py writes last, so it cannot be verified and is never resumed from; resumed from "
            f"{ckpt / 'step_00000002'} instead") in err
    names = sorted(p.name for p in ckpt.glob("step_*"))
    # --keep 2 counts intact checkpoints only: steps 2 and 3 (the damaged 4 and the unverifiable 1 are not)
    assert names == ["step_00000001", "step_00000002", "step_00000003", "step_00000004"], names
    assert (ckpt / train_lock.LOCK_FILE).read_text() == ""  # beside them: the job's lock, released
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


def test_crafted_checkpoints_end_to_end(saved, tmp_path):
    """Side by side: the newest checkpoint a link to a copy elsewhere (skipped with a warning naming the link,
    resumed from the one before, the link's target never deleted); a checkpoint whose .metadata reads another
    run's shards (one line from rank 0 naming the path, exit status 2 on every rank, nothing trained)."""
    linked = _copy(saved, tmp_path / "linked")
    outside = tmp_path / "outside"
    shutil.copytree(saved[0] / "step_00000004", outside)
    (linked / "step_00000006").symlink_to(outside, target_is_directory=True)
    victim, evil = tmp_path / "victim", tmp_path / "evil" / "step_00000004"
    shutil.copytree(saved[0] / "step_00000002", victim)
    evil.mkdir(parents=True)
    shutil.copy(saved[0] / "step_00000004" / "progress.json", evil)
    metadata = _metadata(saved[0] / "step_00000004")
    _point_shards(metadata, lambda n: f"../../victim/{n}")
    (evil / ".metadata").write_bytes(pickle.dumps(metadata))
    train_ckpt.write_manifest(evil, 4)
    resume = [*SAVED, "--resume"]
    resume[resume.index("--steps") + 1], resume[resume.index("--save-every") + 1] = "5", "5"
    results = run_side_by_side({
        "linked newest": ([*resume, "--ckpt-dir", str(linked)], {}),
        "metadata outside": ([*resume, "--ckpt-dir", str(evil.parent)], {}),
    }, timeout=JOB_TIMEOUT_S)
    rc, _, err = results["linked newest"]
    assert rc == 0, err[-4000:]
    assert (f"warning: skipping damaged checkpoint {linked / 'step_00000006'}: {linked / 'step_00000006'} is a "
            f"symbolic link (to {outside})") in err
    assert f"resumed from {linked / 'step_00000004'} (step 4" in err and "saved checkpoint step 5" in err
    train_ckpt.verify(outside)  # the target was neither read as a checkpoint nor deleted
    assert_one_clean_error("metadata outside", *results["metadata outside"],
                           f"checkpoint {evil}: its .metadata reads tensors from '../../victim/__0_0.distcp', a path "
                           f"outside the checkpoint: refusing to load it", before_init=False)
