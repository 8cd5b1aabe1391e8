"""Tests for distattn.schedule.cost: the per-step time model, choose() and `python -m distattn.schedule explain`."""

import math

import pytest

from distattn import schedule as sched
from distattn.schedule import Shapes, make_plan, payload_bytes, simulate
from distattn.schedule.cost import BWD_FLOP_FACTOR, LINKS, Cluster, Link, choose, predict

GQA = Shapes(seq_per_rank=4096, heads_q=32, heads_kv=8, head_dim=128)  # LLaMA-3-8B-shaped layer
MHA = Shapes(seq_per_rank=4096, heads_q=32, heads_kv=32, head_dim=128)  # LLaMA-7B-shaped layer
ODD = Shapes(seq_per_rank=4096, heads_q=33, heads_kv=33, head_dim=128)
IB = Cluster.preset("ib")
NVLINK = Cluster.preset("nvlink")
FREE = Cluster(intra=Link(name="free", bandwidth=1e30, latency=0.0), inter=Link(name="free", bandwidth=1e30,
                                                                                 latency=0.0))
FLAT = {"ring", "balanced", "zigzag"}


def _pair_seconds(shapes: Shapes, ulysses: int, cluster: Cluster) -> float:
    """Forward seconds of one full pair of the ring's shards (m = U n tokens, h_q / U heads)."""
    m = shapes.seq_per_rank * ulysses
    return 4 * shapes.batch * m * m * (shapes.heads_q // ulysses) * shapes.head_dim / cluster.flops


# -- the time model -------------------------------------------------------------------------------------------


def test_links_and_cluster_rules():
    assert LINKS["ib"].bandwidth == 12.5e9 and LINKS["nvlink"].bandwidth == 300e9
    assert IB.ring_link(8) is IB.intra and IB.ring_link(16) is IB.inter  # R * U <= 8: one node
    assert NVLINK.ring_link(64).bandwidth == 300e9
    assert IB.a2a_link(8) is IB.intra
    with pytest.raises(ValueError, match=r"Link.bandwidth=0 must be a positive number"):
        Link(name="x", bandwidth=0, latency=1e-6)
    with pytest.raises(ValueError, match=r"link='eth' is not one of \('nvlink', 'ib'\)"):
        Cluster.preset("eth")
    with pytest.raises(ValueError, match=r"Cluster.gpus_per_node=0 must be a positive int"):
        Cluster(gpus_per_node=0)


@pytest.mark.parametrize("schedule,ulysses", [("ring", 1), ("balanced", 1), ("zigzag", 1), ("balanced", 2),
                                              ("zigzag", 4), ("balanced", 8)])
def test_compute_bound_equals_work_makespan(schedule, ulysses):
    # free links: the predicted time is the plan's work makespan (slowest rank per step) at the kernel's rate
    c = predict(8, GQA, schedule, ulysses, cluster=FREE)
    makespan = simulate(8, True, schedule, GQA, ulysses=ulysses).work_makespan
    pair = _pair_seconds(GQA, ulysses, FREE)
    assert c.forward == pytest.approx(makespan * pair, rel=1e-12)
    assert c.backward == pytest.approx(makespan * pair * BWD_FLOP_FACTOR, rel=1e-12)
    assert c.exposed == pytest.approx(0.0, abs=1e-15) and c.a2a == pytest.approx(0.0, abs=1e-15)
    assert c.total == c.forward + c.backward == c.compute + c.exposed + c.a2a


def test_p2_ring_by_hand():
    # P=2 causal ring: step 0 both diagonals (half a pair), step 1 rank 1 computes (1, 0) with kv from rank 0.
    # forward:  max(0.5 c, kv) + c                       (nothing to fetch first, nothing returned)
    # backward: max(0.5 c', kv) + max(c', 0) + dkv       (dk/dv of step 1 go back after the last step)
    shapes = Shapes(seq_per_rank=64, heads_q=2, heads_kv=2, head_dim=8)
    link = Link(name="slow", bandwidth=1e6, latency=1e-3)
    cluster = Cluster(intra=link, inter=link, flops=1e9)
    pair = _pair_seconds(shapes, 1, cluster)
    kv = payload_bytes("kv", "forward", shapes) / 1e6 + 1e-3  # each of the two ranks posts one message
    dkv = payload_bytes("dkv", "backward", shapes) / 1e6 + 1e-3
    c = predict(2, shapes, "ring", cluster=cluster)
    assert c.forward == pytest.approx(max(0.5 * pair, kv) + pair)
    bwd = BWD_FLOP_FACTOR * pair
    assert c.backward == pytest.approx(max(0.5 * bwd, kv) + bwd + dkv)
    assert c.compute == pytest.approx(1.5 * pair + 1.5 * bwd) and c.steps == 2


def test_more_bytes_more_time():
    slow = predict(16, GQA, "balanced", cluster=IB)
    assert predict(16, MHA, "balanced", cluster=IB).total > slow.total  # 4x the kv heads
    halved = predict(16, GQA, "balanced", cluster=IB, partials="input")  # bf16 partials: fewer bytes back
    assert halved.bytes_fwd < slow.bytes_fwd and halved.total < slow.total
    assert predict(16, GQA, "balanced", cluster=NVLINK).total < slow.total  # faster link
    # a 2D candidate pays its all-to-alls over NVLink, on top of the ring
    two = predict(16, GQA, "zigzag", 4, cluster=IB)
    assert two.a2a_fwd > 0 and two.a2a_bwd > two.a2a_fwd and two.steps == 4


# -- choose ---------------------------------------------------------------------------------------------------


def _assert_argmin(choice):
    runnable = [c for c in choice.candidates if c.runnable]
    assert choice.best is runnable[0] and choice.best.total == min(c.total for c in runnable)
    assert [c.total for c in runnable] == sorted(c.total for c in runnable)


def test_choose_zigzag_for_gqa():
    # inside one NVLink node (P=8): compute-bound, and zigzag has the smallest work makespan (equal work per step)
    node = choose(8, GQA, cluster=IB)
    _assert_argmin(node)
    assert (node.best.schedule, node.best.ulysses) == ("zigzag", 1)
    # across 100 Gb/s IB (P=16) the ring is comm-bound; the winner runs zigzag at the ring level under a
    # Ulysses all-to-all inside each node (U=4 and U=8 are within 2% of each other, 0.25 ms of 23: U=4's ring of 4
    # gains more from zigzag's half-shard pairs with earlier ranks, U=8's ring of 2 more from the backward's head,
    # Plan.head_task, which hides its one exposed fetch over IB)
    across = choose(16, GQA, cluster=IB)
    _assert_argmin(across)
    assert across.best.schedule == "zigzag" and across.best.ulysses in (4, 8)
    u4, u8 = (next(c.total for c in across.candidates if c.label == f"2d U={u} x zigzag R={16 // u}") for u in (4, 8))
    assert abs(u4 - u8) < 0.02 * min(u4, u8) and min(u4, u8) == across.best.total
    flat = {c.label: c.total for c in across.candidates if c.runnable and c.ulysses == 1}
    assert flat["zigzag"] < flat["balanced"]  # helpers would move q (32 heads) and fp32 partials


def test_choose_balanced_for_mha_over_ib():
    # MHA across 100 Gb/s IB is communication-bound, and the backward dominates. There a helper task returns one
    # fp32 dq (q-sized) where an owner task returns fp32 dk and dv (two kv-sized tensors, as large as q each in
    # MHA); balanced also has the fewest steps. zigzag returns dk/dv on every one of its P - 1 steps.
    # With 2D allowed, a Ulysses x zigzag layout wins instead (P=16: U=8, R=2), so: flat only, or 33 heads
    # (which no U > 1 divides).
    flat = choose(16, MHA, cluster=IB, allow=FLAT)
    _assert_argmin(flat)
    assert flat.best.schedule == "balanced"
    odd = choose(16, ODD, cluster=IB)
    _assert_argmin(odd)
    assert (odd.best.schedule, odd.best.ulysses) == ("balanced", 1)
    # the runner-up on the per-pair timeline is zigzag (the ring's one cross-node message per step hides better)
    assert "leaves" in odd.why() and "its owner steps return fp32 dk/dv" in odd.why()


def test_33_heads_excludes_2d_with_reasons():
    choice = choose(16, ODD, cluster=IB)
    excluded = {c.label: c.reason for c in choice.candidates if not c.runnable}
    assert excluded == {
        "2d U=2": "33 query heads cannot be split over ulysses=2 ranks",
        "2d U=4": "33 query heads cannot be split over ulysses=4 ranks",
        "2d U=8": "33 query heads cannot be split over ulysses=8 ranks",
        "2d U=16": "U=16 > 8 GPUs per node: the all-to-all would cross nodes",
    }
    assert {c.label for c in choice.candidates if c.runnable} == FLAT
    assert all(math.isnan(c.total) for c in choice.candidates if not c.runnable)
    kv = choose(8, Shapes(seq_per_rank=64, heads_q=24, heads_kv=6, head_dim=8), cluster=IB)
    assert {c.label: c.reason for c in kv.candidates if not c.runnable} == {
        "2d U=4": "6 kv heads cannot be split over ulysses=4 ranks",
        "2d U=8": "6 kv heads cannot be split over ulysses=8 ranks"}


def test_allow_and_zigzag_needs_even_tokens():
    contiguous = choose(16, GQA, cluster=IB, allow={"ring", "balanced"})
    assert [c.label for c in contiguous.candidates] == ["ring", "balanced"]  # predicted: ring is faster here
    two = choose(8, GQA, cluster=IB, allow={"zigzag", "2d"})
    assert {c.label for c in two.candidates} == {"zigzag", "2d U=2 x zigzag R=4", "2d U=4 x zigzag R=2",
                                                 "ulysses U=8"}
    with pytest.raises(ValueError, match=r"allow=\['zz'\] must be a non-empty set of"):
        choose(8, GQA, allow={"zz"})
    odd_n = Shapes(seq_per_rank=5, heads_q=2, heads_kv=2, head_dim=8)
    zig = [c for c in choose(2, odd_n, cluster=IB).candidates if c.label == "zigzag"][0]
    assert zig.reason == ("the zigzag layout splits every rank's shard into 2 chunks, so tokens per rank (5) "
                          "must be even")
    with pytest.raises(ValueError, match=r"no candidate can run for P=2 .*zigzag: the zigzag layout"):
        choose(2, odd_n, allow={"zigzag"})


def test_deterministic_and_ties_in_fixed_order():
    a, b = choose(16, GQA, cluster=IB), choose(16, GQA, cluster=IB)
    assert a.candidates == b.candidates and a.explain() == b.explain()
    # non-causal: balanced is the ring plan, so the two tie exactly; the fixed order puts balanced first
    nc = choose(4, MHA, causal=False, cluster=IB, allow=FLAT)
    labels = [c.label for c in nc.candidates]
    totals = {c.label: c.total for c in nc.candidates}
    assert totals["balanced"] == totals["ring"] and labels.index("balanced") < labels.index("ring")
    assert make_plan(4, False, "balanced").steps == make_plan(4, False, "ring").steps


def test_why_names_the_helper_bytes():
    choice = choose(16, GQA, cluster=IB, allow={"balanced", "zigzag"})
    why = choice.why()
    assert why.startswith("zigzag: ") and " vs balanced " in why
    assert "helper steps move q (32 heads) and fp32 partials" in why
    assert "580 vs 240 MiB forward" in why


def test_cli_explain(capsys):
    argv = ["--world", "16", "--heads", "32", "--heads-kv", "8", "--head-dim", "128", "--seq-per-rank", "4096"]
    sched._main(["explain", *argv, "--link", "ib"])
    out = capsys.readouterr().out
    choice = choose(16, GQA, cluster=IB)
    for cand in choice.candidates:
        assert f"| {cand.label} |" in out
    assert f"winner: {choice.why()}" in out and "cannot run: U=16 > 8 GPUs per node" in out
    sched._main(["explain", *argv, "--link", "nvlink", "--non-causal", "--window", "1024"])
    assert "winner: " in capsys.readouterr().out
    sched._main(["--world", "4", "--seq-per-rank", "1024"])  # the table command is unchanged
    assert "| 4 | zigzag | True | 4 |" in capsys.readouterr().out


def test_report_script(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import schedule_report

    schedule_report.main(["--out", str(tmp_path), "--world", "8", "--links", "ib", "--seq-per-rank", "256"])
    readme = (tmp_path / "README.md").read_text()
    csv_rows = (tmp_path / "results.csv").read_text().splitlines()
    assert "## Winners" in readme and "| 33-head (33/33) | ib | 8 |" in readme
    assert "cannot run: 33 query heads cannot be split over ulysses=2 ranks" in readme
    # 3 models: flat 3 each; 32-head models also U = 2, 4 (balanced, zigzag) and U = 8 (pure Ulysses); 33 heads: 3
    assert len(csv_rows) == 1 + 2 * (3 + 5) + (3 + 3)
