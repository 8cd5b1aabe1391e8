"""``launch/train.py --memory auto`` with real capacities (issue 36, part 3), and the cost model's head-group rounds.

* the search: tile sizes and schedules are weighed, not only the techniques (a budget that only smaller tiles fit,
  a schedule whose executor buffers do not fit), the choice applied to the flags and explained in one line;
* ``--gpu-mem`` defaults to what the device reports less a stated reserve (CPU: it must be given);
* bad input: nothing fits -> one ``train.py: error:`` line naming the closest fit and what it lacks, on every rank of
  a torchrun job (gloo, 2 ranks) before step 1; the offload check counts pinned blocks as the allocator rounds them;
* ``distattn.schedule.cost.predict`` counts the messages of every head group: equal to what the executor posts
  (gloo, P = 2 and 3, one group and one kv head per group), the same bytes.
"""

from __future__ import annotations

import dataclasses
import re
import types

import pytest
import torch

from dist_utils import run_distributed
from distattn.memory import plan
from distattn.schedule.heads import WORK_BYTES_ENV
from test_train_cli import assert_one_clean_error, run_side_by_side

GIB = 2 ** 30
MIB = 2 ** 20
ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
SPAWN_TIMEOUT_S = 180


def _prepare(monkeypatch, argv):
    """``train.prepare`` as rank 0 of a 2-rank job (in-process: it runs before any process group exists)."""
    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.syspath_prepend(str(ROOT / "launch"))
    import train

    return train.prepare(["--device", "cpu", "--model", "tiny", *argv])


# -- the search ------------------------------------------------------------------------------------------------
def test_auto_searches_tile_sizes_and_schedules_and_says_why(monkeypatch, capsys):
    """90 MiB per rank at 8192 tokens (4096 per rank): no combination with 4096-token tiles fits (what --memory auto
    weighed before), smaller MLP tiles do."""
    budget = 90 * MIB
    cfg, _, config, _ = _prepare(monkeypatch, ["--memory", "auto", "--gpu-mem", str(budget / GIB), "--host-mem", "64",
                                               "--seq-len", "8192"])
    a = cfg.args
    line = capsys.readouterr().err
    assert "--memory auto: " in line and "runner-up " in line and "schedules balanced/zigzag/ring" in line, line
    assert "tiles 1024/2048/4096" in line, line  # tiles past the 4096-token shard are one tile: not weighed twice
    assert a.remat or a.offload_checkpoints
    assert a.tile_mlp is not None and a.tile_mlp < 4096 and a.schedule in ("balanced", "zigzag", "ring")
    import train_memory
    import train_plan

    precision = train_memory._precision(cfg)
    peak = train_plan.technique_peak(cfg, config, precision, train_memory._shard(cfg), pinned=False)
    assert peak.total <= budget  # the flags it set are a job the byte model fits
    assert f"predicted peak {peak.total / GIB:.2f} of {budget / GIB:.2f} GiB" in line
    cluster = plan.Cluster(2, budget, 32 * GIB, pinned=False, shard=2)
    old = plan.weigh(plan.model_spec(config), 8192, cluster, loss_tile=4096, mlp_tile=4096, batch=2,
                     precision=precision, schedules=("balanced", "zigzag", "ring"),
                     allow=lambda c: c.strategy == "remat" or c.tech.offload_checkpoints)
    assert not old[0].fits  # 4096-token tiles alone: refused


def test_auto_schedule_is_weighed_by_memory_and_attention_time(monkeypatch):
    """Plenty of memory: the cost model's fastest schedule (not the fixed order); a given --schedule is kept."""
    import distattn

    cfg = _prepare(monkeypatch, ["--memory", "auto", "--gpu-mem", "64", "--seq-len", "8192"])[0]
    fastest = distattn.choose_schedule(2, 4, 4, 32, 4096, batch=2, dtype=torch.float32,
                                       allow={"balanced", "zigzag", "ring"}, ulysses=1).best.schedule
    assert cfg.args.schedule == fastest and cfg.args.remat
    cfg = _prepare(monkeypatch, ["--memory", "auto", "--gpu-mem", "64", "--seq-len", "8192", "--schedule", "ring"])[0]
    assert cfg.args.schedule == "ring"
    cfg = _prepare(monkeypatch, ["--seq-len", "8192"])[0]
    assert cfg.args.schedule == "balanced"  # without --memory auto the default is unchanged


def test_auto_with_pack_weighs_the_placement(tmp_path, monkeypatch, capsys):
    """``--pack``: the placed schedule is a candidate, on the first batch's documents (skewed: the placement wins, as
    ``--schedule auto`` finds in tests/test_train_placed.py)."""
    from test_train_placed import _prepare as prepare_4
    from test_train_placed import _skewed_documents

    data = tmp_path / "docs.jsonl"
    _skewed_documents(data, 16384)
    cfg = prepare_4(monkeypatch, ["--model", "llama-1b", "--seq-len", "16384", "--batch-size", "1", "--data", str(data),
                                  "--pack", "--memory", "auto", "--gpu-mem", "64", "--host-mem", "64"])
    line = capsys.readouterr().err
    assert "schedules balanced/zigzag/ring/placed" in line and cfg.args.schedule == "placed", line


def test_the_zigzag_buffers_can_rule_zigzag_out():
    """The same techniques, tiles 1024: the zigzag executor's buffers peak above balanced's at 8192 tokens on 2 ranks,
    so a budget between the two picks another schedule even though the cost model prefers zigzag."""
    from distattn.memory.techniques import Techniques

    spec = plan.model_spec(dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                                num_key_value_heads=4, vocab_size=256))
    tech = Techniques(loss_tile=1024, mlp_tile=1024)
    peaks = {s: plan.combo_peak(spec, plan.Combo("remat", tech, s), 8192, gpus=2, batch=2, precision="fp32",
                                pinned=False).total for s in ("balanced", "zigzag")}
    assert peaks["zigzag"] > peaks["balanced"]
    cluster = plan.Cluster(2, (peaks["zigzag"] + peaks["balanced"]) / 2, 64 * GIB, pinned=False)
    options = plan.weigh(spec, 8192, cluster, loss_tile=1024, mlp_tile=1024, batch=2, precision="fp32",
                         schedules=("balanced", "zigzag"), allow=lambda c: c.strategy == "remat" and c.tech == tech)
    assert [o.combo.schedule for o in options if o.fits] == ["balanced"]
    assert options[-1].combo.schedule == "zigzag" and options[-1].gpu_short > 0


# -- real capacities ---------------------------------------------------------------------------------------------
def test_gpu_mem_defaults_to_the_device_total_less_the_reserve(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "launch"))
    import train_config
    import train_plan

    props = types.SimpleNamespace(total_memory=81559 * MIB, name="NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    args = types.SimpleNamespace(gpu_mem=None, gpu_reserve=None)
    cfg = types.SimpleNamespace(args=args, device_type="cuda", cuda_index=0, ranks_per_gpu=1)
    got, source = train_plan.gpu_budget(cfg)
    assert got == 81559 * MIB - 2 * GIB and train_plan.RESERVE_GIB == 2.0
    assert source == "NVIDIA H100 80GB HBM3's 79.65 GiB less 2 reserved"
    args.gpu_reserve, cfg.ranks_per_gpu = 0.5, 2  # two gloo ranks share the GPU
    assert train_plan.gpu_budget(cfg)[0] == (81559 * MIB - GIB // 2) / 2
    args.gpu_mem = 40.0
    assert train_plan.gpu_budget(cfg) == (40 * GIB, "--gpu-mem")
    with pytest.raises(train_config.UsageError, match="--memory auto on CPU needs --gpu-mem"):
        train_plan.gpu_budget(types.SimpleNamespace(args=types.SimpleNamespace(gpu_mem=None), device_type="cpu"))


def test_offload_check_counts_pinned_blocks_as_allocated(monkeypatch):
    """384 tokens on 2 ranks: each offloaded layer input is 2 x 192 x 128 fp32 = 192 KiB, which the pinned allocator
    rounds to 256 KiB: 1.5 MiB per node unrounded, 2 MiB pinned. 1.75 MiB passes on CPU (plain host memory) and is
    refused on CUDA, with the planner's own numbers."""
    import distattn.offload

    argv = ["--offload-checkpoints", "--seq-len", "384", "--host-mem", str(1.75 * MIB / GIB)]
    cfg, _, config, _ = _prepare(monkeypatch, argv)  # CPU: fits
    import train_config
    import train_memory
    import train_offload

    assert train_offload.host_bytes(cfg, config) == {"checkpoints": 4 * 192 * 1024}
    cuda = dataclasses.replace(cfg, device_type="cuda")
    monkeypatch.setattr(distattn.offload, "pinned_memory_available", lambda: True)
    assert train_offload.host_bytes(cuda, config) == {"checkpoints": 4 * 256 * 1024}
    import train_plan

    planner = train_plan.technique_peak(cuda, config, train_memory._precision(cfg), train_memory._shard(cfg))
    assert planner.host == {"checkpoints": 4 * 256 * 1024}  # what --memory auto weighs: the same accounting
    with pytest.raises(train_config.UsageError, match=r"pinned blocks rounded up to powers of two\) needs 2.00 MiB "
                       r"of host memory but the limit given is 1.75 MiB.*--host-mem"):
        train_offload.check(cuda, config)


# -- bad input -----------------------------------------------------------------------------------------------------
def test_nothing_fits_names_the_closest_fit_and_what_it_lacks(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "launch"))
    import train_config

    with pytest.raises(train_config.UsageError) as err:
        _prepare(monkeypatch, ["--memory", "auto", "--gpu-mem", str(20 * MIB / GIB), "--host-mem", "64",
                               "--seq-len", "8192"])
    msg = str(err.value)
    assert msg.startswith("--memory auto: nothing fits --seq-len 8192 on 2 rank(s) of 20.00 MiB (--gpu-mem)"), msg
    # the lowest peak there is: every technique, layer-boundary checkpoints offloaded
    assert "closest: full ckpt + loss tile " in msg and "offload ckpt, offload optim, schedule " in msg, msg
    peak, short = map(float, re.search(r"peak ([\d.]+) MiB per rank, ([\d.]+) MiB short on the device", msg).groups())
    assert peak - short == 20.0 and "host" not in msg.split("closest:")[1].split(";")[0], msg
    with pytest.raises(train_config.UsageError) as err:  # offload's host bytes short too
        _prepare(monkeypatch, ["--memory", "auto", "--gpu-mem", str(76 * MIB / GIB), "--host-mem", str(24 * MIB / GIB),
                               "--seq-len", "8192"])
    msg = str(err.value)
    host, short = map(float, re.search(r"host ([\d.]+) MiB per rank, ([\d.]+) MiB short;", msg).groups())
    assert host - short == 12.0, msg  # 24 MiB per node of 2 ranks


def test_nothing_fits_fails_on_every_rank_before_step_1(tmp_path):
    args = ["--model", "tiny", "--seq-len", "8192", "--memory", "auto", "--gpu-mem", str(20 * MIB / GIB),
            "--host-mem", "64", "--ckpt-dir", str(tmp_path / "ckpt"), "--no-progress"]
    rc, out, err = run_side_by_side({"auto": (args, {})})["auto"]
    assert_one_clean_error("auto", rc, out, err, "--memory auto: nothing fits --seq-len 8192 on 2 rank(s)")
    # torchrun's report: both ranks exit with train.py's usage-error code (2; a rank torchrun stopped would show a
    # signal), and quotes the reason from each rank's error file that it collected before tearing the group down
    # (a rank that exits seconds after the first may be listed without one: it raced torchrun's teardown)
    report = err.split("Failures:", 1)[-1]
    assert len(re.findall(r"exitcode\s*:\s*2\b", report)) == 2, report
    assert 1 <= report.count("train.py: error: --memory auto: nothing fits --seq-len 8192") <= 2, report


# -- the cost model counts the head groups' rounds ---------------------------------------------------------------
N, H_Q, H_KV, D = 16, 4, 2, 8


def _count_worker(rank, world, budget):
    import os

    from distattn import comm
    from distattn.attention import DistAttnConfig, dist_attn_backward, dist_attn_forward

    if budget is None:
        os.environ.pop(WORK_BYTES_ENV, None)
    else:
        os.environ[WORK_BYTES_ENV] = budget
    counts, phase = {}, [""]
    real = comm.PeerExchange.post

    def post(self, slot, sends, recvs):  # every transfer the executor posts: one message per peer and payload
        counts[phase[0]] = counts.get(phase[0], 0) + len(sends) + len(recvs)
        return real(self, slot, sends, recvs)

    comm.PeerExchange.post = post
    g = torch.Generator().manual_seed(rank)
    q, dout = (torch.randn(1, N, H_Q, D, generator=g) for _ in range(2))
    k, v = (torch.randn(1, N, H_KV, D, generator=g) for _ in range(2))
    out = {}
    for schedule in ("ring", "balanced", "zigzag"):
        cfg = DistAttnConfig(causal=True, scale=D ** -0.5, schedule=schedule, timeout=60.0)
        counts.clear()
        phase[0] = "forward"
        o, lse = dist_attn_forward(q, k, v, cfg)
        phase[0] = "backward"
        dist_attn_backward(dout, q, k, v, o, lse, cfg)
        out[schedule] = dict(counts)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_cost_model_messages_equal_the_executors_in_every_head_group(world, monkeypatch):
    from distattn.schedule import Shapes
    from distattn.schedule.cost import choose, predict

    shapes = Shapes(batch=1, seq_per_rank=N, heads_q=H_Q, heads_kv=H_KV, head_dim=D, dtype_bytes=4)
    found = {}
    for budget in (None, "1"):  # one group; nothing fits: one kv head per group (2 groups)
        per_rank = run_distributed(_count_worker, world, budget, timeout=SPAWN_TIMEOUT_S)
        if budget is None:
            monkeypatch.delenv(WORK_BYTES_ENV, raising=False)
        else:
            monkeypatch.setenv(WORK_BYTES_ENV, budget)
        for schedule in ("ring", "balanced", "zigzag"):
            cand = predict(world, shapes, schedule, causal=True)
            assert cand.head_groups == (1 if budget is None else H_KV)
            for ph, modelled in (("forward", cand.messages_fwd), ("backward", cand.messages_bwd)):
                assert max(r[schedule].get(ph, 0) for r in per_rank) == modelled, (schedule, ph, budget, per_rank)
            found[(budget, schedule)] = cand
        if budget == "1":
            assert "2 head groups: 2x messages, same bytes" in choose(world, shapes, causal=True).explain()
    for schedule in ("ring", "balanced", "zigzag"):
        one, two = found[(None, schedule)], found[("1", schedule)]
        assert two.messages_fwd == 2 * one.messages_fwd > 0 and two.messages_bwd == 2 * one.messages_bwd
        assert (two.bytes_fwd, two.bytes_bwd) == (one.bytes_fwd, one.bytes_bwd)  # the same bytes, in more pieces
        assert two.total > one.total  # each piece pays its latency
