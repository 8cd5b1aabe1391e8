"""GPU tier, training job: ``launch/train.py`` on the one GPU (torchrun ``--nproc-per-node 1``), its out-of-memory
pre-check, two gloo ranks sharing the GPU, ``DISTATTN_AUTOTUNE=1`` with the real timer and its disk cache, and
the planner's predicted peak against ``torch.cuda.max_memory_allocated`` of a real step.

``pytest -m gpu``; skipped without CUDA. Each job is a subprocess with a hard timeout (tests/test_train.py's
``_torchrun``: the whole process group is killed on expiry).
"""
import json

import pytest
import torch

from test_train import _records, _torchrun

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

JOB_TIMEOUT_S = 140  # the first job compiles the Triton kernels (autotune: every kept config)
JOB = ["--device", "cuda", "--model", "tiny-gqa", "--seq-len", "2048", "--batch-size", "2", "--steps", "4",
       "--lr", "3e-3", "--seed", "0", "--no-progress"]
# The byte model counts every tensor of a step; what it leaves out (allocator rounding, a few small temporaries)
# is well under 3% once activations are gigabytes.
PEAK_RTOL = 0.03


def _summary(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


# CUDA-only: launch/train_groups.py init_distributed (cuda device, set_device), train_config's CUDA runtime choices
# (bf16, triton, nccl), train_model's DDP device_ids, train_log.peak_memory_bytes (max_memory_allocated).
def test_train_one_gpu(tmp_path):
    log = tmp_path / "steps.jsonl"
    rc, out, err = _torchrun(1, *JOB, "--shard", "ddp", "--log-json", str(log), "--ckpt-dir", str(tmp_path / "c"),
                             timeout=JOB_TIMEOUT_S)
    assert rc == 0, err[-4000:]
    summary = _summary(out)
    assert summary["device"] == "cuda" and summary["steps"] == 4, summary
    losses = [r["loss"] for r in _records(log)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    assert summary["peak_mem_bytes"][0] > 0, summary


# CUDA-only: launch/train_memory.check (get_device_properties(...).total_memory): refused before any allocation.
def test_train_refuses_a_job_predicted_not_to_fit(tmp_path):
    rc, out, err = _torchrun(1, "--device", "cuda", "--model", "llama-7b", "--seq-len", "1048576", "--steps", "1",
                             "--ckpt-dir", str(tmp_path / "c"), timeout=JOB_TIMEOUT_S)
    assert rc != 0, (rc, err[-4000:])  # the worker exits 2 (bad arguments); torchrun reports a failure
    assert "does not fit" in err and "--no-memory-check" in err, err[-4000:]


# CUDA-only: train_config's gloo-shares-GPUs rule (cuda_index, ranks_per_gpu) and train.py on CUDA over gloo.
def test_train_two_gloo_ranks_share_the_gpu(tmp_path):
    log = tmp_path / "steps.jsonl"
    rc, out, err = _torchrun(2, *JOB, "--dist-backend", "gloo", "--shard", "ddp", "--log-json", str(log),
                             "--ckpt-dir", str(tmp_path / "c"), timeout=JOB_TIMEOUT_S)
    assert rc == 0, err[-4000:]
    summary = _summary(out)
    assert summary["world_size"] == 2 and summary["sp_size"] == 2 and summary["device"] == "cuda", summary
    assert len(summary["peak_mem_bytes"]) == 2 and min(summary["peak_mem_bytes"]) > 0, summary


# CUDA-only: launch/train_tune.autotune_attention (device_type == "cuda" and triton) -> distattn.autotune with
# triton.testing.do_bench, kernels/_tune.py's CUDA device, empty_cache and GPU-name cache key.
def test_train_autotune_with_the_real_timer_and_its_cache(tmp_path, monkeypatch):
    cache = tmp_path / "tune"
    monkeypatch.setenv("DISTATTN_AUTOTUNE", "1")
    monkeypatch.setenv("DISTATTN_TUNE_CACHE", str(cache))
    for attempt in range(2):  # the second job reads the first one's choices from the cache
        rc, out, err = _torchrun(1, *JOB, "--steps", "2", "--ckpt-dir", str(tmp_path / f"c{attempt}"),
                                 timeout=JOB_TIMEOUT_S)
        assert rc == 0, err[-4000:]
        assert "kernel configs from rank 0" in err, err[-4000:]
    files = list(cache.glob("*.json"))
    assert len(files) == 1, files
    data = json.loads(files[0].read_text())
    assert data["gpu"] == torch.cuda.get_device_name() and data["choices"], data


# CUDA-only: launch/train_memory's CUDA limit and distattn.memory.plan's predicted peak vs the CUDA allocator's
# measured peak of real steps (train_log.peak_memory_bytes).
def test_planner_predicts_the_measured_peak(tmp_path):
    rc, out, err = _torchrun(1, "--device", "cuda", "--model", "small", "--seq-len", "32768", "--batch-size", "1",
                             "--steps", "2", "--remat", "--shard", "ddp", "--no-progress",
                             "--ckpt-dir", str(tmp_path / "c"), timeout=JOB_TIMEOUT_S)
    assert rc == 0, err[-4000:]
    summary = _summary(out)
    measured, predicted = summary["peak_mem_bytes"][0], summary["predicted_peak_bytes"]
    assert measured > 1 << 30, summary  # activations dominate: the comparison is about them
    assert measured == pytest.approx(predicted, rel=PEAK_RTOL), (measured, predicted)


# CUDA-only: the step's byte model on CUDA (memory.techniques.technique_peak: a fetched offloaded checkpoint and the
# prefetched FSDP2 layer are device bytes; launch/train_memory.step_prediction) against the CUDA side of its measure
# (train_memory.StepMeasure: max_memory_allocated, host_memory_stats; memory.tiers._pinned), issue 36's GPU check.
def test_step_peaks_predicted_and_measured_on_the_device_and_the_host(tmp_path):
    rc, out, err = _torchrun(1, "--device", "cuda", "--model", "small", "--seq-len", "32768", "--batch-size", "1",
                             "--steps", "2", "--remat", "--tile-mlp", "4096", "--offload-checkpoints", "--shard", "ddp",
                             "--no-progress", "--no-memory-check", "--ckpt-dir", str(tmp_path / "c"),
                             timeout=JOB_TIMEOUT_S)
    assert rc == 0, err[-4000:]
    s = _summary(out)
    assert s["measured_peak_device_bytes"] > 1 << 30, s
    assert s["measured_peak_device_bytes"] == pytest.approx(s["predicted_peak_device_bytes"], rel=PEAK_RTOL), s
    assert s["measured_peak_host_bytes"] == pytest.approx(s["predicted_peak_host_bytes"], rel=PEAK_RTOL), s
    # what the cuBLAS workspaces hold of the device peak (the model leaves them to the reserve): measurable, and a
    # part of the peak, not all of it
    assert 0 <= s["measured_cublas_workspace_bytes"] < s["measured_peak_device_bytes"] // 4, s


# CUDA-only: launch/train_offload.check (pinned memory on CUDA) and launch/train_model._fully_shard's pinned
# CPUOffloadPolicy; distattn/offload.py's side streams and pinned buffers inside a real training step.
def test_train_one_gpu_with_every_offload(tmp_path):
    log = tmp_path / "steps.jsonl"
    rc, out, err = _torchrun(1, *JOB, "--offload-optimizer", "--offload-checkpoints", "--remat", "--log-json",
                             str(log), "--ckpt-dir", str(tmp_path / "c"), "--no-memory-check", timeout=JOB_TIMEOUT_S)
    assert rc == 0, err[-4000:]
    losses = [r["loss"] for r in _records(log)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses


# CUDA-only: launch/train_plan.apply_auto reads the GPU's memory (get_device_properties) to plan --memory auto.
def test_train_memory_auto_plans_for_this_gpu(tmp_path):
    rc, out, err = _torchrun(1, *JOB, "--memory", "auto", "--ckpt-dir", str(tmp_path / "c"), timeout=JOB_TIMEOUT_S)
    assert rc == 0, err[-4000:]
    assert "--memory auto: remat ckpt" in err, err[-4000:]  # a small job fits with remat alone
