"""Hugging Face export of launch/train.py (``--export-hf``, ``launch/export_hf.py``) and its guards.

Two real torchrun jobs (module fixture): 2 ranks with FSDP2 save a sharded checkpoint and export at the end;
1 rank resumes that checkpoint (another world size: the log says so), trains a step, saves and exports. Every
exported folder, ``from_pretrained``, must hold the checkpoint's tensors bit for bit, the reference being read
with DCP's own ``dcp_to_torch_save`` (the test's own trusted files), and the converter must give the same folder
from the checkpoint. The rest runs in-process: the bad inputs, the RoPE guard, the world-change line.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_train import JOB, JOB_TIMEOUT_S, ROOT, _torchrun
from test_train_cli import _prepare_error, _three_head_model, assert_one_clean_error, run_side_by_side

sys.path.insert(0, str(ROOT / "launch"))

import export_hf  # noqa: E402
import train_config  # noqa: E402
import train_ckpt  # noqa: E402
import train_data  # noqa: E402
import train_export  # noqa: E402

# 2 ranks x 128 tokens, 2 steps, a checkpoint at step 2; the resumed 1-rank run adds step 3.
RUN = [a for a in JOB]
RUN[RUN.index("--steps") + 1] = "2"
TEXT = "In the beginning — Ünïcödé, 中文 and 🙂\n\tthe end"  # 1- to 4-byte UTF-8 characters


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{"two": (ckpt_dir, export_dir, stderr), "one": (...)}`` of the 2-rank job and the 1-rank resume."""
    tmp = tmp_path_factory.mktemp("export")
    rc, _, err2 = _torchrun(2, *RUN, "--ckpt-dir", str(tmp / "ckpt2"), "--export-hf", str(tmp / "hf2"))
    assert rc == 0, err2[-4000:]
    shutil.copytree(tmp / "ckpt2", tmp / "ckpt1")
    resume = [*RUN, "--ckpt-dir", str(tmp / "ckpt1"), "--export-hf", str(tmp / "hf1"), "--resume", "must"]
    resume[resume.index("--steps") + 1] = "3"
    rc, _, err1 = _torchrun(1, *resume)
    assert rc == 0, err1[-4000:]
    return {"two": (tmp / "ckpt2", tmp / "hf2", err2), "one": (tmp / "ckpt1", tmp / "hf1", err1)}


def _reference(step_dir: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's model tensors through DCP's own converter (no safety rules: the test's own files)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(step_dir), str(tmp / "ref.pt"))
    return torch.load(tmp / "ref.pt", weights_only=True)["train"]["model"]


def _assert_bitwise(folder: Path, want: dict[str, torch.Tensor]) -> None:
    from transformers import AutoModelForCausalLM

    got = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert got.keys() == want.keys()
    unequal = [k for k in want if not (got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]))]
    assert not unequal, f"{folder}: {unequal}"


@pytest.mark.parametrize("run, step, shards", [("two", 2, 2), ("one", 3, 1)])
def test_export_and_converter_give_the_checkpoint_bit_for_bit(runs, tmp_path, run, step, shards):
    """The end-of-training export and the converter's folder hold the last checkpoint's tensors exactly (the same
    step: the export gathers the in-memory model the save wrote), from FSDP2 shards of 2 ranks or from 1 rank."""
    ckpt, exported, err = runs[run]
    step_dir = train_ckpt.step_dir(ckpt, step)
    assert len(list(step_dir.glob("*.distcp"))) == shards
    assert f"exported the trained model to {exported} (Hugging Face folder" in err
    want = _reference(step_dir, tmp_path)
    _assert_bitwise(exported, want)
    assert export_hf.export(ckpt, tmp_path / "converted", log=lambda line: None) == step_dir
    _assert_bitwise(tmp_path / "converted", want)
    names = {p.name for p in exported.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert names == {p.name for p in (tmp_path / "converted").iterdir()}


def test_exported_tokenizer_is_the_byte_tokenizer(runs):
    from transformers import AutoConfig, AutoTokenizer

    folder = runs["two"][1]
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert ids == train_data.ByteTokenizer().encode(TEXT).tolist() and tok.decode(ids) == TEXT
    config = AutoConfig.from_pretrained(folder)
    assert (config.vocab_size, config.hidden_size, config.use_cache) == (256, 128, True)


def test_resume_on_another_world_size_says_so(runs):
    err = runs["one"][2]
    assert ("resumed on another world: the checkpoint was saved by world 2 = sp 2 x dp 1, batch 2/replica (256 "
            "tokens per rank per step), this run is world 1 = sp 1 x dp 1, batch 2/replica (512 tokens per rank per "
            "step); the parameters and optimizer state were resharded on load, and the data position is global (4 "
            "samples consumed), so step 3 reads samples 4-5 as the original run would") in err
    progress = train_ckpt.read_progress(train_ckpt.step_dir(runs["one"][0], 3))
    assert {k: progress[k] for k in train_export.LAYOUT} == {"world_size": 1, "sp_size": 1, "ulysses": 1,
                                                             "dp_size": 1, "batch_size": 2}


def test_cli_converts_and_refuses_a_non_empty_folder(runs, tmp_path, capsys):
    """``python -m launch.export_hf`` from the repository root writes a folder; the same arguments again are
    refused in one line (in-process: the same ``main``)."""
    cmd = [sys.executable, "-m", "launch.export_hf", str(runs["two"][0]), str(tmp_path / "out")]
    ok = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert ok.returncode == 0, ok.stderr
    assert f"exported {train_ckpt.step_dir(runs['two'][0], 2)} (step 2) to {tmp_path / 'out'}" in ok.stderr
    assert _cli_error(capsys, *cmd[3:]).splitlines() == [
        f"export_hf.py: error: OUT_DIR {tmp_path / 'out'} exists and is not empty (5 entries: config.json, "
        f"generation_config.json, model.safetensors, ...); pass a new or empty directory, or remove it first"]


def _cli_error(capsys, *argv) -> str:
    assert export_hf.main([str(a) for a in argv]) == train_config.EXIT_BAD_ARGS
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("export_hf.py: error: "), lines
    return "\n".join(lines)


def test_cli_refuses_missing_and_damaged_checkpoints(runs, tmp_path, capsys):
    assert f"{tmp_path / 'none'}: no such checkpoint" in _cli_error(capsys, tmp_path / "none", tmp_path / "o")
    (tmp_path / "empty").mkdir()
    assert "holds no finished checkpoint" in _cli_error(capsys, tmp_path / "empty", tmp_path / "o")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(runs["two"][0], ckpt)
    step_dir = train_ckpt.step_dir(ckpt, 2)
    shard = step_dir / "__1_0.distcp"
    with open(shard, "r+b") as f:  # same size, other bytes: only the manifest's digest can tell
        f.seek(4096)
        f.write(b"\0" * 4096)
    assert (f"checkpoint {step_dir} is damaged: __1_0.distcp: sha256 differs from the manifest"
            in _cli_error(capsys, step_dir, tmp_path / "o"))
    err = _cli_error(capsys, ckpt, tmp_path / "o")
    assert f"warning: skipping damaged checkpoint {step_dir}: __1_0.distcp: sha256 differs" in err
    assert f"{ckpt}: every checkpoint is damaged (1 tried" in err
    assert not (tmp_path / "o").exists()
    planted = tmp_path / "planted"  # weights beside the config, listed in a rewritten manifest: refused
    shutil.copytree(train_ckpt.step_dir(runs["two"][0], 2), planted)
    (planted / "hf" / "model.safetensors").write_bytes(b"x")
    train_ckpt.write_manifest(planted, 2)
    assert (f"checkpoint {planted} holds hf/model.safetensors, a weights file where only the config and tokenizer "
            f"belong" in _cli_error(capsys, planted, tmp_path / "o"))


def test_checkpoint_without_its_config_needs_the_model(runs, tmp_path, capsys):
    """A checkpoint saved before train.py stored ``hf/``: refused with the fix, converted with ``--model``."""
    step_dir = tmp_path / "step_00000002"
    shutil.copytree(train_ckpt.step_dir(runs["two"][0], 2), step_dir)
    shutil.rmtree(step_dir / "hf")
    train_ckpt.write_manifest(step_dir, 2)
    assert (f"checkpoint {step_dir} has no hf/config.json (saved by an older train.py); pass --model"
            in _cli_error(capsys, step_dir, tmp_path / "o"))
    assert export_hf.main([str(step_dir), str(tmp_path / "o"), "--model", "tiny"]) == 0
    _assert_bitwise(tmp_path / "o", _reference(step_dir, tmp_path))


@pytest.mark.parametrize("name", ["not empty", "a file", "in ckpt dir", "rope spec", "rope factor"])
def test_train_preflight_refuses_bad_export_and_rope_flags(name, tmp_path, monkeypatch):
    """Before the process group exists (one ``train.py: error:`` line from rank 0, exit 2 on every rank: the path
    of every ``UsageError`` of ``prepare``, test_train_cli)."""
    full = tmp_path / "full"
    full.mkdir()
    (full / "config.json").write_text("{}")
    (tmp_path / "afile").write_text("x")
    argv, reason = {
        "not empty": (["--export-hf", str(full)], f"--export-hf {full} exists and is not empty (1 entries: "
                      f"config.json); pass a new or empty directory, or remove it first"),
        "a file": (["--export-hf", str(tmp_path / "afile")], f"--export-hf {tmp_path / 'afile'} exists and is not a "
                   f"directory"),
        "in ckpt dir": (["--export-hf", str(tmp_path / "c" / "hf"), "--ckpt-dir", str(tmp_path / "c"), "--save-every",
                         "1"], f"--export-hf {tmp_path / 'c' / 'hf'} is inside --ckpt-dir {tmp_path / 'c'}, whose "
                        f"checkpoints train.py manages; pass a directory outside it"),
        "rope spec": (["--rope-scaling", "dynamic:2"], "--rope-scaling 'dynamic:2': expected TYPE:FACTOR with TYPE one "
                      "of linear, yarn and FACTOR >= 1"),
        "rope factor": (["--rope-scaling", "linear:0.5"], "--rope-scaling 'linear:0.5': expected TYPE:FACTOR"),
    }[name]
    assert reason in _prepare_error(monkeypatch, ["--seq-len", "256", *argv])


def test_non_empty_export_folder_stops_every_rank_before_step_1(tmp_path):
    """End to end under torchrun: one ``train.py: error:`` line, exit status 2, nothing trained."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors").write_bytes(b"x")
    rc, out, err = run_side_by_side({"export": (["--export-hf", str(tmp_path / "out")], {})})["export"]
    assert_one_clean_error("export", rc, out, err, f"--export-hf {tmp_path / 'out'} exists and is not empty (1 "
                           f"entries: model.safetensors); pass a new or empty directory, or remove it first")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == b"x"


def _long_model(tmp_path) -> Path:
    """A model directory (config + tokenizer) whose RoPE was trained on 64 positions."""
    from transformers import AutoConfig

    path = _three_head_model(tmp_path)
    config = AutoConfig.from_pretrained(path)
    config.max_position_embeddings = 64
    config.save_pretrained(path)
    return path


def _guard(path: Path, rank: int, *argv):
    from transformers import AutoConfig

    env = train_config.Env(rank=rank, world_size=2, local_rank=rank, local_world_size=2)
    args = train_config.build_parser().parse_args(["--device", "cpu", "--model", str(path), "--data",
                                                   str(path / "text.txt"), *argv])
    config = AutoConfig.from_pretrained(path)
    train_export.rope_guard(train_config.resolve(args, env), config)
    return config


def test_seq_len_beyond_the_positions_warns_once_naming_rope_scaling(tmp_path, capsys):
    path = _long_model(tmp_path)
    _guard(path, 1, "--seq-len", "160")
    assert capsys.readouterr().err == ""  # rank 0 only
    config = _guard(path, 0, "--seq-len", "160")
    assert capsys.readouterr().err.splitlines() == [
        f"[train] warning: --seq-len 160 is beyond the max_position_embeddings 64 of --model {path}: RoPE positions "
        f"past 64 were never trained; its config offers RoPE scaling in rope_parameters (now rope_type 'default'): "
        f"pass --rope-scaling linear:2.5 or yarn:2.5 to apply it (the exported config keeps it)"]
    assert config.max_position_embeddings == 64  # warned, not changed
    _guard(path, 0, "--seq-len", "64")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("kind", ["linear", "yarn"])
def test_rope_scaling_is_applied_to_the_config(tmp_path, capsys, kind):
    path = _long_model(tmp_path)
    config = _guard(path, 0, "--seq-len", "256", "--rope-scaling", f"{kind}:4")
    want = {"rope_type": kind, "factor": 4.0, "rope_theta": 10000.0}
    if kind == "yarn":
        want["original_max_position_embeddings"] = 64
    assert config.to_dict()["rope_parameters"] == want and config.max_position_embeddings == 256
    assert capsys.readouterr().err.splitlines() == [
        f"[train] --rope-scaling {kind}:4: rope_parameters rope_type {kind!r} factor 4, max_position_embeddings 64 "
        f"-> 256"]
    with pytest.raises(train_config.UsageError, match=f"already scales RoPE \\(rope_parameters rope_type '{kind}'\\)"):
        train_export.rope_guard(train_config.resolve(train_config.build_parser().parse_args(
            ["--device", "cpu", "--model", str(path), "--data", str(path / "text.txt"), "--rope-scaling", "linear:2",
             "--seq-len", "256"]), train_config.Env(rank=0, world_size=2, local_rank=0, local_world_size=2)), config)


def test_world_change_line_and_old_checkpoints(tmp_path):
    args = train_config.build_parser().parse_args(["--device", "cpu", "--seq-len", "1024", "--batch-size", "1",
                                                   "--sp-size", "2"])
    cfg = train_config.resolve(args, train_config.Env(rank=0, world_size=4, local_rank=0, local_world_size=4))
    old = {"step": 10, "samples": 40, "seq_len": 1024, "world_size": 8, "sp_size": 8, "ulysses": 2, "dp_size": 1,
           "batch_size": 4}
    assert train_export.world_change(cfg, old) == (
        "resumed on another world: the checkpoint was saved by world 8 = sp 8 (ulysses 2 x ring 4) x dp 1, batch "
        "4/replica (512 tokens per rank per step), this run is world 4 = sp 2 x dp 2, batch 1/replica (512 tokens "
        "per rank per step); the parameters and optimizer state were resharded on load, and the data position is "
        "global (40 samples consumed), so step 11 reads samples 40-41 (2 per step where the original run read 4: "
        "from here on the batches differ from its)")
    assert old["world_size"] == 4 and old["dp_size"] == 2  # the next save records this run's layout
    assert train_export.world_change(cfg, dict(old)) is None  # same layout
    assert train_export.world_change(cfg, {"step": 1, "samples": 2}) is None  # saved before layouts were recorded


def test_export_folder_keeps_the_source_models_generation_config(tmp_path):
    """A model directory's own generation_config.json is exported, not one derived from the config; a tied
    embedding stands for the head."""
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

    src = _three_head_model(tmp_path)
    GenerationConfig(max_new_tokens=7, do_sample=True, temperature=0.5).save_pretrained(src)
    config = LlamaConfig.from_pretrained(src)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    tensors = AutoModelForCausalLM.from_config(config).state_dict()
    tensors.pop("lm_head.weight", None)
    export_hf.write_folder(tensors, export_hf.hf_files(config, None, str(src)), tmp_path / "out")
    assert GenerationConfig.from_pretrained(tmp_path / "out").max_new_tokens == 7
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.equal(loaded.lm_head.weight, tensors["model.embed_tokens.weight"])
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is True


def test_cli_read_errors_are_one_line(runs, tmp_path, capsys, monkeypatch):
    """Files that match their manifest but cannot be used: a truncated shard (was a raw EOFError traceback), a
    progress train.py never writes; and a file the system refuses to read. Each: one line, exit status 2."""
    truncated = tmp_path / "step_00000002"
    shutil.copytree(train_ckpt.step_dir(runs["two"][0], 2), truncated)
    shard = truncated / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 10])
    train_ckpt.write_manifest(truncated, 2)
    assert _cli_error(capsys, truncated, tmp_path / "o").splitlines() == [
        f"export_hf.py: error: checkpoint {truncated}: its shards cannot be read (EOFError: a shard ends before its "
        f"data, truncated), yet they match its manifest.json: the manifest was written over damaged shards, or the "
        f"checkpoint is crafted or foreign; export an older checkpoint (pass its step_N directory)"]
    crafted = tmp_path / "crafted" / "step_00000002"
    shutil.copytree(train_ckpt.step_dir(runs["two"][0], 2), crafted)
    progress = json.loads((crafted / "progress.json").read_text())
    (crafted / "progress.json").write_text(json.dumps({**progress, "seq_len": "256"}))
    train_ckpt.write_manifest(crafted, 2)
    assert (f"export_hf.py: error: checkpoint {crafted}: its progress.json holds seq_len '256', not an integer"
            in _cli_error(capsys, crafted.parent, tmp_path / "o"))

    def unreadable(path):
        raise PermissionError(13, "Permission denied", str(path / "hf" / "config.json"))

    monkeypatch.setattr(export_hf, "checkpoint_files", unreadable)  # root reads any file: the refusal, simulated
    assert _cli_error(capsys, runs["two"][0], tmp_path / "o").splitlines()[-1] == (
        f"export_hf.py: error: {train_ckpt.step_dir(runs['two'][0], 2) / 'hf' / 'config.json'}: Permission denied "
        f"(check the files' permissions and the disk)")
    assert not (tmp_path / "o").exists()
