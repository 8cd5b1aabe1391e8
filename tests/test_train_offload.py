"""launch/train.py with offload: --offload-checkpoints and --offload-optimizer train to the same losses as without.

Real 2-rank torchrun jobs of gloo ranks on the CPU (the tiny preset, 3 steps, started side by side). Offloading
moves bytes, it computes nothing differently, so the per-step losses are equal to the bit: checkpoints offloaded
(layer-boundary, and with --remat) against no checkpointing; FSDP2's CPUOffloadPolicy (on the CPU the policy's
copies are CPU to CPU, but its code path runs) against plain FSDP2. Bad input fails before step 1, on every rank.
"""

from __future__ import annotations

import pytest

from test_train import _losses
from test_train_cli import _prepare_error, assert_one_clean_error, run_side_by_side

RUN = ["--model", "tiny", "--seq-len", "128", "--batch-size", "2", "--steps", "3", "--lr", "3e-3", "--seed", "0",
       "--no-progress"]
JOBS_TIMEOUT_S = 300  # five 2-rank jobs at once on a shared two-core machine
VARIANTS = {"base": [], "offload-full": ["--offload-checkpoints"], "remat": ["--remat"],
            "offload-remat": ["--remat", "--offload-checkpoints"], "offload-optimizer": ["--offload-optimizer"],
            # issue 22: every technique at once (tiles of 48 and 40 tokens on a 64-token shard: two tiles each)
            "everything": ["--remat", "--offload-checkpoints", "--offload-optimizer", "--tile-loss", "48",
                           "--tile-mlp", "40"]}
TILED_RTOL = 1e-4  # tiles change the fp32 summation order of the head and MLP gradients (tests/test_tiling.py)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offload")
    runs = {name: ([*RUN, *extra, "--log-json", str(tmp / f"{name}.jsonl"), "--ckpt-dir", str(tmp / name)], {})
            for name, extra in VARIANTS.items()}
    results = run_side_by_side(runs, timeout=JOBS_TIMEOUT_S)
    for name, (rc, _, err) in results.items():
        assert rc == 0, f"{name}:\n{err[-4000:]}"
    return {name: _losses(tmp / f"{name}.jsonl") for name in VARIANTS}, results


@pytest.mark.parametrize("name", ["offload-full", "remat", "offload-remat", "offload-optimizer"])
def test_offloaded_runs_give_the_same_losses(jobs, name):
    losses, _ = jobs
    assert len(losses["base"]) == 3
    assert losses[name] == losses["base"], f"{name}: {losses[name]} vs {losses['base']}"


def test_every_technique_at_once_trains_to_the_same_losses(jobs):
    losses, results = jobs
    assert "+tile-mlp 40 +tile-loss 48 +offload-ckpt" in results["everything"][2]
    for ours, base in zip(losses["everything"], losses["base"], strict=True):
        assert abs(ours - base) <= TILED_RTOL * abs(base), (losses["everything"], losses["base"])


def test_offload_optimizer_runs_fsdp2(jobs):
    _, results = jobs
    assert "params fsdp2" in results["offload-optimizer"][2]
    assert "+offload-ckpt" in results["offload-remat"][2] and "+remat" in results["offload-remat"][2]


def test_too_little_host_memory_fails_on_every_rank_before_step_1(tmp_path):
    args = [*RUN, "--offload-checkpoints", "--remat", "--offload-optimizer", "--host-mem", "0.00001",
            "--ckpt-dir", str(tmp_path / "ckpt")]
    results = run_side_by_side({"host": (args, {})})
    assert_one_clean_error("host", *results["host"], "of host memory but the limit given is 0.01 MiB")
    # CPU memory: the host bytes at their peak, the optimizer step (the checkpoints are freed by then)
    assert "2 ranks on this node x (optimizer params " in results["host"][2]


@pytest.mark.parametrize("argv, reason", [
    (["--host-mem", "0"], "--host-mem must be > 0 GiB, got 0.0"),
    (["--offload-optimizer", "--shard", "ddp"], "--offload-optimizer needs FSDP2 (CPUOffloadPolicy); drop --shard ddp"),
])
def test_bad_offload_flags(monkeypatch, argv, reason):
    assert reason in _prepare_error(monkeypatch, argv)


def test_host_memory_counts_every_rank_of_the_node(monkeypatch):
    # 2 ranks of 64 tokens: per rank 4 layers x (2 x 64 x 128 x 4 B) = 0.25 MiB, 0.50 MiB for the node
    msg = _prepare_error(monkeypatch, ["--offload-checkpoints", "--seq-len", "128", "--host-mem", "0.0004"])
    assert "offload (2 ranks on this node x (checkpoints 0.25 MiB)) needs 0.50 MiB of host memory but the " \
           "limit given is 0.41 MiB" in msg


def test_offload_on_cuda_without_pinned_memory_is_refused(monkeypatch):
    """On CUDA, offload without pinned memory stops in ``prepare`` (before the process group, nothing allocated)."""
    import types

    import distattn.offload
    import train_config
    import train_offload

    monkeypatch.setattr(distattn.offload, "pinned_memory_available", lambda: False)
    args = types.SimpleNamespace(offload_checkpoints=True, offload_optimizer=False, host_mem=None)
    cfg = types.SimpleNamespace(args=args, device_type="cuda")
    with pytest.raises(train_config.UsageError, match=r"offload on CUDA needs pinned host memory.*ulimit -l"):
        train_offload.check(cfg, config=None)
