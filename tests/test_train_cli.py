"""launch/train.py's command line as a user meets it under torchrun: help once, errors in one line.

Every failure a user can cause (a bad flag, a missing file, an unusable --ckpt-dir, --resume must with
nothing to resume, a checkpoint of another model) ends every rank with exit status 2 and one
``train.py: error:`` line from rank 0, and no rank prints a traceback. torchrun still prints its own
failure report (~40 lines for 2 ranks; a worker cannot switch it off), whose root cause then names the
reason too. Jobs that fail before the process group exists run side by side (a few seconds each).
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from test_train import JOB, ROOT, TRAIN

# One reason line + torchrun's report (~40 lines at 2 ranks); any rank's traceback would add 50+.
MAX_ERROR_LINES = 60
PREFLIGHT_TIMEOUT_S = 120  # ~5 s each when the machine is idle; six run at once on 2 cores


def _root_cause_exit_2(err: str) -> bool:
    """torchrun's report says the first worker to fail exited with status 2, and quotes our reason."""
    parts = err.split("Root Cause (first observed failure):", 1)
    return len(parts) == 2 and re.search(r"exitcode\s*: 2 ", parts[1]) is not None \
        and "traceback : train.py: error:" in parts[1]


def _start(args, env_extra=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(TRAIN),
           "--device", "cpu", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def run_side_by_side(jobs: dict[str, tuple[list[str], dict]], timeout: float = PREFLIGHT_TIMEOUT_S) -> dict:
    """Start every 2-rank job at once; ``{name: (returncode, stdout, stderr)}`` (all killed on timeout)."""
    procs = {name: _start(args, env) for name, (args, env) in jobs.items()}
    results = {}
    try:
        for name, proc in procs.items():
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name}: torchrun did not finish in {timeout} s")
            results[name] = (proc.returncode, out, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every worker it started
                proc.communicate()
    return results


def assert_one_clean_error(name, rc, out, err, reason, before_init=True):
    lines = (out + err).splitlines()
    reasons = [line for line in lines if line.startswith("train.py: error:")]
    assert rc != 0, name
    assert len(reasons) == 1, f"{name}: expected one reason line (rank 0's), got {reasons}\n{err[-3000:]}"
    assert reason in reasons[0], f"{name}: {reasons[0]}"
    assert _root_cause_exit_2(err), f"{name}: root cause not exit status 2\n{err[-3000:]}"
    # Every rank exits 2 (also those torchrun stops), and the report shows each rank's real time (issue 24: the
    # other ranks showed up as SIGTERM, dated 60 s in the future).
    report = err.split("Failures:", 1)[-1]
    codes = re.findall(r"exitcode\s*: (-?\d+)", report)
    assert codes and set(codes) == {"2"}, f"{name}: exit codes {codes}\n{err[-3000:]}"
    times = re.findall(r"time\s*: (\S+)", report)
    latest = max(datetime.datetime.strptime(t, "%Y-%m-%d_%H:%M:%S") for t in times)
    assert latest <= datetime.datetime.now(), f"{name}: a failure dated in the future\n{err[-3000:]}"
    assert "[rank" not in err and err.count("Traceback") <= 1, f"{name}: a rank printed a traceback\n{err}"
    assert len(lines) <= MAX_ERROR_LINES, f"{name}: {len(lines)} lines\n{err}"
    if before_init:
        assert "[train] model" not in err, f"{name}: should fail before the model is built"


def test_preflight_errors_are_one_line_and_exit_2(tmp_path):
    """The output contract end to end, side by side: a fault fails before step 1 (before the process group even
    exists) with one reason line and exit status 2; plain --resume with nothing to resume warns and trains.
    Every other preflight fault goes through the same path (``prepare`` raising ``UsageError``): checked
    in-process below, without a torchrun job each."""
    save = ["--steps", "2", "--save-every", "1", "--seq-len", "256"]
    cases = {
        "bad flag": (["--bogus"], {}, "unrecognized arguments: --bogus (see --help)"),
        "full ckpt dir": ([*save, "--ckpt-dir", str(tmp_path / "full")], {"DISTATTN_CKPT_FREE_BYTES": "1000000"},
                          "has 1.0 MB free but this run's checkpoints need about 23.1 MB (2 x 11.6 MB"),
        "ulysses heads": (["--ulysses", "2", "--seq-len", "64", "--model", str(_three_head_model(tmp_path)),
                           "--data", str(tmp_path / "three" / "text.txt")], {},
                          "--ulysses 2 with --model {} (3 query heads, 3 key/value heads): 3 query heads cannot be "
                          "split over ulysses=2 ranks".format(tmp_path / "three")),
    }
    fresh = [*JOB, "--ckpt-dir", str(tmp_path / "empty"), "--resume"]
    fresh[fresh.index("--steps") + 1] = "1"
    jobs = {name: (args, env) for name, (args, env, _) in cases.items()}
    results = run_side_by_side({**jobs, "resume, nothing": (fresh, {})})
    for name, (_, _, reason) in cases.items():
        assert_one_clean_error(name, *results[name], reason)
    assert not any((tmp_path / "full").iterdir())  # the probe file is gone
    rc, _, err = results["resume, nothing"]
    assert rc == 0, err[-4000:]
    assert (f"warning: --resume: no checkpoint to resume in --ckpt-dir {tmp_path / 'empty'} "
            f"(it holds no finished checkpoint); starting from step 0") in err


_LAGGING_RANK = """
import atexit, sys, train_errors
train_errors._DEFER_S = float(sys.argv[1])
atexit.register(lambda: print("teardown", flush=True))
print("ready", flush=True)
train_errors.report_error("boom")
print("returned", flush=True)
"""


@pytest.mark.parametrize("way_out", ["after the wait", "stopped while waiting"])
def test_a_failing_rank_other_than_0_leaves_with_status_2_both_ways(way_out, tmp_path):
    """Rank 1 reports a fault before the process group exists: it leaves with status 2 and its reason in its error
    file whether torchrun stops it (SIGTERM during the wait for rank 0) or the wait ends. After the wait it leaves at
    once, without the interpreter's teardown (no atexit output): that teardown resets the SIGTERM handler and takes
    seconds on a loaded machine, and a SIGTERM landing in it showed the rank as killed (exit -15, seen in CI)."""
    error_file = tmp_path / "error.json"
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
               TORCHELASTIC_ERROR_FILE=str(error_file), PYTHONPATH=str(ROOT / "launch"))
    wait_s = "0.1" if way_out == "after the wait" else "60"
    proc = subprocess.Popen([sys.executable, "-c", _LAGGING_RANK, wait_s], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        if way_out == "stopped while waiting":
            time.sleep(0.5)  # inside the wait: the handler is set before it starts
            proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, (proc.returncode, out, err)
    assert "returned" not in out and "teardown" not in out, out
    assert "train.py: error: boom" in error_file.read_text()
    assert "train.py: error:" not in err  # rank 0 alone prints the line


def test_rank_0_leaves_a_bad_flag_at_once_without_teardown(tmp_path):
    """train.py's entry leaves through ``exit_now`` on every path, argparse's too: rank 0 prints its one line, writes
    it to its error file and exits 2 without the interpreter's teardown (no atexit output). In CI rank 0 was still
    tearing down when rank 1 left after its wait, and torchrun reported rank 0 as killed by SIGTERM."""
    error_file = tmp_path / "error.json"
    run = ("import atexit, runpy, sys; atexit.register(lambda: print('teardown', flush=True)); "
           f"sys.argv = ['train.py', '--bogus']; runpy.run_path({str(TRAIN)!r}, run_name='__main__')")
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
               TORCHELASTIC_ERROR_FILE=str(error_file), PYTHONPATH=str(ROOT / "launch"))
    proc = subprocess.run([sys.executable, "-c", run], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "teardown" not in proc.stdout, proc.stdout
    assert [line for line in proc.stderr.splitlines() if line.startswith("train.py: error:")] == [
        "train.py: error: unrecognized arguments: --bogus (see --help)"], proc.stderr[-2000:]
    assert "unrecognized arguments: --bogus" in error_file.read_text()


def _prepare_error(monkeypatch, argv, env=None) -> str:
    """The ``UsageError`` that rank 0 of a 2-rank job would print for ``argv`` (``train.prepare``, in-process:
    it runs before any process group exists, so it needs no torchrun)."""
    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                       **(env or {})}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.syspath_prepend(str(ROOT / "launch"))
    import train
    import train_config

    with pytest.raises(train_config.UsageError) as err:
        train.prepare(["--device", "cpu", *argv])
    return str(err.value)


@pytest.mark.parametrize("name", ["seq-len", "preset", "missing data", "unwritable ckpt dir", "read-only ckpt dir",
                                  "resume must, nothing", "ulysses", "zigzag seq-len", "autotune env",
                                  "tile-loss", "tile-mlp", "unwritable log-json"])
def test_preflight_errors_in_process(name, tmp_path, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("x")
    save = ["--steps", "2", "--save-every", "1", "--seq-len", "256"]
    argv, env, reason = {
        "seq-len": (["--seq-len", "255"], {}, "--seq-len 255 is not divisible by the sequence-parallel size 2"),
        "preset": (["--model", "llama-99b"], {}, "unknown --model 'llama-99b'"),
        "missing data": (["--data", str(tmp_path / "none.txt")], {}, f"--data {tmp_path / 'none.txt'}: no such file"),
        "unwritable ckpt dir": ([*save, "--ckpt-dir", str(afile / "ckpt")], {},
                                f"--ckpt-dir {afile / 'ckpt'} does not exist and cannot be created (Not a directory"),
        "read-only ckpt dir": ([*save, "--ckpt-dir", str(tmp_path / "ro")], {"DISTATTN_CKPT_READ_ONLY": "1"},
                               "is not writable (Read-only file system)"),
        "resume must, nothing": (["--resume=must", "--ckpt-dir", str(tmp_path / "typo")], {},
                                 f"--resume must: nothing to resume in --ckpt-dir {tmp_path / 'typo'} "
                                 f"(the directory does not exist)"),
        "ulysses": (["--ulysses", "3"], {}, "--ulysses 3 does not divide the sequence-parallel size 2 (world 2)"),
        "zigzag seq-len": (["--schedule", "zigzag", "--seq-len", "258"], {},
                           "--seq-len 258 is not divisible by twice the sequence-parallel size 2 (--schedule zigzag"),
        "autotune env": ([], {"DISTATTN_AUTOTUNE": "yes"}, "DISTATTN_AUTOTUNE='yes' must be 0 or 1"),
        "tile-loss": (["--tile-loss", "0"], {}, "--tile-loss must be a positive number of tokens per tile, got 0"),
        "tile-mlp": (["--tile-mlp", "-8"], {}, "--tile-mlp must be a positive number of tokens per tile, got -8"),
        "unwritable log-json": (["--log-json", str(afile / "log.jsonl")], {},
                                f"--log-json {afile / 'log.jsonl'} cannot be written ({afile} is not a folder)"),
    }[name]
    assert reason in _prepare_error(monkeypatch, argv, env)


def test_tile_size_that_is_not_an_int_is_one_line(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "launch"))
    import train_config

    with pytest.raises(SystemExit) as exit_:
        train_config.build_parser().parse_args(["--tile-mlp", "1.5"])
    assert exit_.value.code == train_config.EXIT_BAD_ARGS
    assert "train.py: error: argument --tile-mlp: invalid int value: '1.5'" in capsys.readouterr().err


def _write_weights(path, kind):
    """Weight files of ``kind`` in the model directory ``path`` (their content is never read by the preflight)."""
    import json

    from safetensors.torch import save_file

    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    if kind in ("pickle", "pickle and safetensors"):
        torch.save({"lm_head.weight": torch.zeros(8, 24)}, path / "pytorch_model.bin")
    if kind == "pickle index":
        (path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"a": "pytorch_model-1.bin"}}))
    if kind in ("safetensors", "pickle and safetensors"):
        save_file({"lm_head.weight": torch.zeros(8, 24)}, path / "model.safetensors")
    if kind in ("shards", "shard missing"):
        index = {"metadata": {}, "weight_map": {"a": shards[0], "b": shards[1], "c": shards[1]}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
        for name in shards[:2 if kind == "shards" else 1]:
            save_file({"x": torch.zeros(1)}, path / name)
    if kind == "bad index":
        (path / "model.safetensors.index.json").write_text("{not json")


@pytest.mark.parametrize("kind", ["none", "pickle", "pickle index", "shard missing", "bad index"])
def test_model_dir_without_safetensors_weights_is_one_clear_error(kind, tmp_path, monkeypatch):
    """``--model DIR`` with a config but no weights, or only a pickle: a ``UsageError`` (one ``train.py: error:``
    line, exit 2) that says what was found and what is accepted, before the process group exists."""
    path = _three_head_model(tmp_path)
    _write_weights(path, kind)
    reason = {
        "none": f"--model {path} has a config.json but no weights: found neither model.safetensors nor "
                f"model.safetensors.index.json (train.py loads safetensors weights)",
        "pickle": f"--model {path} has its weights only as pytorch_model.bin, a pickle file, and train.py loads "
                  f"safetensors weights only (a pickle can run code when loaded); if you trust the file, convert it "
                  f"once: python -c \"from transformers import AutoModelForCausalLM as M; "
                  f"M.from_pretrained('{path}').save_pretrained('{path}')\"",
        "pickle index": f"--model {path} has its weights only as pytorch_model.bin.index.json, a pickle file",
        "shard missing": f"--model {path}: model.safetensors.index.json names 2 weight shards but 1 are missing "
                         f"(model-00002-of-00002.safetensors)",
        "bad index": f"--model {path}: cannot read model.safetensors.index.json (JSONDecodeError",
    }[kind]
    assert reason in _prepare_error(monkeypatch, ["--model", str(path), "--data", str(path / "text.txt"),
                                                  "--seq-len", "64"])


@pytest.mark.parametrize("kind", ["safetensors", "shards", "pickle and safetensors"])
def test_model_dir_with_safetensors_weights_passes_the_preflight(kind, tmp_path, monkeypatch):
    path = _three_head_model(tmp_path)
    _write_weights(path, kind)
    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.syspath_prepend(str(ROOT / "launch"))
    import train

    cfg, _, config, _ = train.prepare(["--device", "cpu", "--model", str(path), "--data", str(path / "text.txt"),
                                       "--seq-len", "64"])
    assert cfg.preset is None and config.num_attention_heads == 3


def test_autotune_tunes_the_runs_attention_shapes_and_is_skipped_on_cpu(monkeypatch):
    """``DISTATTN_AUTOTUNE=1``: the shapes a rank's attention kernels see (4 ranks, 2048 tokens, the tiny-gqa
    preset: 4/2 heads of 32), and one line saying it is skipped on CPU (no process group needed for that)."""
    for key, value in {"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.syspath_prepend(str(ROOT / "launch"))
    import train_config
    import train_model
    import train_tune

    def cases(*argv):
        args = train_config.build_parser().parse_args(["--device", "cpu", "--model", "tiny-gqa", "--seq-len", "2048",
                                                       *argv])
        cfg = train_config.resolve(args, train_config.Env.from_environ())
        config = train_model.hf_config(cfg, 256)
        return cfg, config, train_tune.attention_cases(cfg, config)

    shape = dict(batch=2, seq_q=512, seq_k=512, heads_q=4, heads_kv=2, head_dim=32, dtype=torch.float32)
    cfg, config, plain = cases("--batch-size", "2")
    assert plain == [dict(shape, causal=True), dict(shape, causal=False)]  # diagonal pairs causal, others dense
    assert cases("--batch-size", "2", "--schedule", "zigzag")[2] == [dict(shape, bounds=True)]
    assert cases("--pack")[2] == [dict(shape, batch=1, bounds=True)]
    two_d = dict(shape, seq_q=1024, seq_k=1024, heads_q=2, heads_kv=1)  # ring of 2, 2 heads per Ulysses rank
    assert cases("--batch-size", "2", "--ulysses", "2")[2] == [dict(two_d, causal=True), dict(two_d, causal=False)]
    lines = []
    monkeypatch.setenv("DISTATTN_AUTOTUNE", "1")
    train_tune.autotune_attention(cfg, config, torch.device("cpu"), lines.append)
    assert lines == [f"DISTATTN_AUTOTUNE=1: skipped, attention runs with the {cfg.attn_backend} backend on cpu "
                     f"(only the Triton kernels on CUDA have launch configs to tune)"]
    monkeypatch.setenv("DISTATTN_AUTOTUNE", "0")
    train_tune.autotune_attention(cfg, config, torch.device("cpu"), lines.append)
    assert len(lines) == 1


def _three_head_model(tmp_path):
    """A model directory whose 3 query heads cannot split over 2 Ulysses ranks: config.json, a word-level
    tokenizer and a small text (no weights: the job must stop before reading them; ``_write_weights`` adds some)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    path = tmp_path / "three"
    LlamaConfig(vocab_size=8, hidden_size=24, intermediate_size=32, num_hidden_layers=1, num_attention_heads=3,
                num_key_value_heads=3).save_pretrained(path)
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(path)
    (path / "text.txt").write_text("a a a a\n" * 200)
    return path


def test_help_prints_once():
    proc = _start(["--help"])
    out, err = proc.communicate(timeout=PREFLIGHT_TIMEOUT_S)
    assert proc.returncode == 0, err
    assert out.count("usage: train.py") == 1 and "--resume [{auto,must}]" in out  # rank 0 only
    plain = subprocess.run([sys.executable, str(TRAIN), "--help"], capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0 and plain.stdout.count("usage: train.py") == 1
    # the docstring it used to point at is shown, as written (commands on their own lines)
    assert "see the module docstring" not in out and "Quick start. CPU is enough" in out
    assert "\n    torchrun --standalone --nproc-per-node 4 launch/train.py --pack --seq-len 8192" in out


def test_a_rank_stopped_while_preparing_exits_2():
    """torchrun stops the other ranks (SIGTERM) as soon as rank 0 exits on a bad argument; a rank still importing
    torch or loading data then must leave with rank 0's status 2, not as killed by a signal (seen in CI: -15)."""
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    proc = subprocess.Popen([sys.executable, str(TRAIN)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    # once its SIGTERM handler is in place (Linux: the caught-signals mask; elsewhere 1.5 s), it is in its imports of
    # torch or past them waiting for a rendezvous that never comes (port 1): both before the process group exists
    deadline, status = time.monotonic() + 30, f"/proc/{proc.pid}/status"
    while os.path.exists(status) and time.monotonic() < deadline and proc.poll() is None:
        caught = next((line.split()[1] for line in open(status) if line.startswith("SigCgt:")), "0")
        if int(caught, 16) & (1 << (signal.SIGTERM - 1)):
            break
        time.sleep(0.01)
    else:
        time.sleep(1.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2, (proc.returncode, err[-2000:])
    assert "Traceback" not in err, err


def test_ckpt_dir_without_save_every_warns(tmp_path, monkeypatch, capsys):
    """--ckpt-dir alone saves nothing: one warning (rank 0) says so and how to save; with --save-every, none."""
    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.syspath_prepend(str(ROOT / "launch"))
    import train

    train.prepare(["--device", "cpu", "--seq-len", "256", "--ckpt-dir", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert (f"warning: --ckpt-dir {tmp_path / 'c'} is given but this run saves no checkpoint there: add "
            f"--save-every N") in err
    train.prepare(["--device", "cpu", "--seq-len", "256", "--ckpt-dir", str(tmp_path / "c"), "--save-every", "5"])
    assert "warning: --ckpt-dir" not in capsys.readouterr().err


def test_log_json_folder_is_created_before_step_1(tmp_path, monkeypatch):
    """--log-json in a folder that does not exist yet: created by the preflight (it used to be rank 0's
    FileNotFoundError traceback after the model was built); an existing log is kept for --resume to append to."""
    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.syspath_prepend(str(ROOT / "launch"))
    import train

    log = tmp_path / "runs" / "a" / "log.jsonl"
    train.prepare(["--device", "cpu", "--seq-len", "256", "--log-json", str(log)])
    assert log.is_file() and log.read_text() == ""
    log.write_text('{"step": 1}\n')
    train.prepare(["--device", "cpu", "--seq-len", "256", "--log-json", str(log)])
    assert log.read_text() == '{"step": 1}\n'


def test_no_progress_prints_a_plain_line_per_log_step(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "launch"))
    import train_log

    bar = train_log.Progress(4, 0, enabled=True, log_every=2, mem_label="peak rss", plain=True)
    for step in range(1, 5):
        bar.update(step, 5.0 - step, 1000.0, [2 ** 20])
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" |")[0] for line in lines] == ["step 1/4 loss 4.0000", "step 2/4 loss 3.0000",
                                                      "step 4/4 loss 1.0000"]
    assert all("#" not in line and "\r" not in line for line in lines)


def test_gloo_ranks_share_a_gpu_nccl_ranks_need_one_each(monkeypatch, tmp_path):
    """Two local ranks, one GPU (faked: preflight allocates nothing on it): NCCL refuses two ranks on one device,
    so that is a usage error; gloo ranks share it (local rank r on GPU r % GPUs) and split its memory."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=80 << 30))
    for key, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.syspath_prepend(str(ROOT / "launch"))
    import train
    import train_config
    import train_memory

    argv = ["--device", "cuda", "--model", "tiny-gqa", "--seq-len", "256", "--shard", "ddp", "--ckpt-dir",
            str(tmp_path / "ckpt")]
    with pytest.raises(train_config.UsageError, match=r"2 ranks on this node but only 1 CUDA devices; use "
                                                      r"--nproc-per-node 1, --device cpu, or --dist-backend gloo"):
        train.prepare([*argv, "--dist-backend", "nccl"])
    cfg, _, config, _ = train.prepare([*argv, "--dist-backend", "gloo"])
    assert (cfg.device_type, cfg.dist_backend, cfg.cuda_index, cfg.ranks_per_gpu) == ("cuda", "gloo", 0, 2)
    # 50 GiB fits the 80 GiB GPU alone, not half of it
    monkeypatch.setattr(train_memory, "predicted_peak",
                        lambda cfg, config: SimpleNamespace(total=50 << 30, dominant="x", parts={"x": 50 << 30}))
    with pytest.raises(train_config.UsageError, match=r"does not fit the 39.0 GiB of this GPU"):
        train_memory.check(cfg, config)
