"""Measured links (issue 39): the fit of the timeline's round formula, links files, DISTATTN_LINK=<file> reaching the
placement solver and the agreement, and bench/link_measure.py end to end on gloo."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from distattn.config import DistAttnConfig
from distattn.schedule.cluster import LINKS, LINKS_FORMAT, Cluster, Link, cluster_from_env, cluster_from_file, fit_link
from distattn.schedule.masks import MaskSpec
from distattn.schedule.placement import place

ROOT = Path(__file__).resolve().parents[1]


def _rounds(latency, bandwidth, noise=0.0, seed=0):
    """Rounds as bench/link_measure.py samples them (m peers, s bytes each) timed by the timeline's formula."""
    rng = np.random.default_rng(seed)
    m, s = np.meshgrid([1, 2, 4, 7], [4096, 1 << 16, 1 << 20, 1 << 24])
    messages, nbytes = 2 * m.ravel(), (m * s).ravel()
    seconds = (messages * latency + nbytes / bandwidth) * (1 + noise * rng.standard_normal(messages.size))
    return messages, nbytes, seconds


def _write(path, intra, inter=None, g=8):
    entry = lambda bw, lat: {"name": f"measured {bw:g} B/s, {lat:g} s", "bandwidth": bw, "latency": lat}  # noqa: E731
    data = {"format": LINKS_FORMAT, "measured": True, "gpus_per_node": g, "intra": entry(*intra),
            "inter": None if inter is None else entry(*inter)}
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("latency,bandwidth", [(3e-6, 300e9), (12e-6, 150e9), (0.0, 25e9), (5e-6, 12.5e9)])
def test_the_fit_recovers_the_timelines_formula(latency, bandwidth):
    link = fit_link("x", *_rounds(latency, bandwidth))
    assert link.bandwidth == pytest.approx(bandwidth, rel=1e-9)
    assert link.latency == pytest.approx(latency, rel=1e-9, abs=1e-15)
    noisy = fit_link("x", *_rounds(latency, bandwidth, noise=0.02, seed=1))  # 2% noise per round
    assert noisy.bandwidth == pytest.approx(bandwidth, rel=0.03)
    assert noisy.latency == pytest.approx(latency, rel=0.3, abs=0.3e-6)
    assert noisy.latency >= 0 and "GB/s" in noisy.name and "us per message" in noisy.name


def test_the_fit_refuses_what_does_not_resolve_a_link():
    with pytest.raises(ValueError, match="at least 2 rounds"):
        fit_link("x", [2], [4096], [1e-5])
    with pytest.raises(ValueError, match="at least 2 rounds"):
        fit_link("x", [2, 2], [4096, 8192], [1e-5, float("nan")])
    with pytest.raises(ValueError, match="do not resolve a bandwidth"):  # time falls as the bytes grow
        fit_link("x", [2, 2], [4096, 1 << 20], [1e-3, 1e-5])
    for messages, nbytes in (([2, 2], [4096, 4096]), ([2, 4, 8], [4096, 8192, 16384])):  # bytes ~ messages
        with pytest.raises(ValueError, match="cannot be told apart"):
            fit_link("x", messages, nbytes, [1e-5, 2e-5, 4e-5][:len(messages)])
    with pytest.raises(ValueError, match="not a plausible link"):  # 1 PB/s
        fit_link("x", [2, 2], [1 << 20, 1 << 30], [1e-9, 1e-6])
    # a latency the noise makes negative: refitted through the origin, bytes alone
    link = fit_link("x", [2, 2, 4], [1 << 20, 1 << 24, 1 << 25], [1.0e-5 * 0.9, 1.6e-4, 3.2e-4])
    assert link.latency == 0.0 and link.bandwidth > 0


def test_a_links_file_is_the_cluster(tmp_path, monkeypatch):
    path = _write(tmp_path / "links.json", (250e9, 8e-6), (40e9, 9e-6), g=4)
    cluster = cluster_from_file(str(path))
    assert cluster == Cluster(gpus_per_node=4, intra=Link(name=cluster.intra.name, bandwidth=250e9, latency=8e-6),
                              inter=Link(name=cluster.inter.name, bandwidth=40e9, latency=9e-6))
    assert cluster_from_file(str(path), gpus_per_node=8).gpus_per_node == 8
    monkeypatch.setenv("DISTATTN_LINK", str(path))
    monkeypatch.delenv("DISTATTN_GPUS_PER_NODE", raising=False)
    assert cluster_from_env() == cluster
    monkeypatch.setenv("DISTATTN_GPUS_PER_NODE", "2")
    assert cluster_from_env().gpus_per_node == 2 and cluster_from_env().intra == cluster.intra
    assert cluster_from_env(link="nvlink").intra == LINKS["nvlink"]  # the presets as before
    one = cluster_from_file(str(_write(tmp_path / "one.json", (250e9, 8e-6))))  # one node measured
    assert one.inter.bandwidth == LINKS["ib"].bandwidth and "assumed" in one.inter.name
    copy = tmp_path / "elsewhere" / "one.json"  # the same figures at another path: the same cluster (ranks agree)
    copy.parent.mkdir()
    copy.write_text((tmp_path / "one.json").read_text())
    assert cluster_from_file(str(copy)) == one
    data = json.loads((tmp_path / "one.json").read_text())  # one GPU per node: the link across only
    data["intra"], data["inter"] = None, data["intra"]
    (tmp_path / "across.json").write_text(json.dumps(data))
    across = cluster_from_file(str(tmp_path / "across.json"))
    assert across.intra.bandwidth == LINKS["nvlink"].bandwidth and "assumed" in across.intra.name
    assert across.inter.bandwidth == 250e9


def test_a_rewritten_links_file_is_read_again(tmp_path, monkeypatch):
    path = _write(tmp_path / "links.json", (250e9, 8e-6))
    monkeypatch.setenv("DISTATTN_LINK", str(path))
    assert cluster_from_env().intra.latency == 8e-6
    assert cluster_from_env() is cluster_from_env()  # read once per version of the file
    _write(path, (250e9, 9.5e-6))
    assert cluster_from_env().intra.latency == 9.5e-6


@pytest.mark.parametrize("content,match", [
    (None, "not a readable links file"),
    ("{", "not a readable links file"),
    ({"format": "other"}, "not a links file of format"),
    ({"format": LINKS_FORMAT, "gpus_per_node": 8, "intra": {"name": "x", "bandwidth": -1.0, "latency": 0.0}},
     "'intra' must hold"),
    ({"format": LINKS_FORMAT, "gpus_per_node": 8, "intra": {"name": "x", "bandwidth": 1e9, "latency": True}},
     "'intra' must hold"),
    ({"format": LINKS_FORMAT, "gpus_per_node": 0, "intra": {"name": "x", "bandwidth": 1e9, "latency": 0.0}},
     "gpus_per_node=0"),
    ({"format": LINKS_FORMAT, "gpus_per_node": 8, "intra": None, "inter": None}, "measures no link"),
])
def test_a_bad_links_file_names_itself_and_the_fix(tmp_path, monkeypatch, content, match):
    path = tmp_path / "links.json"
    if content is not None:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    monkeypatch.setenv("DISTATTN_LINK", str(path))
    with pytest.raises(ValueError, match=match) as err:
        cluster_from_env()
    assert str(path) in str(err.value) and "link_measure.py" in str(err.value)
    monkeypatch.setenv("DISTATTN_LINK", "nvlnk")  # neither a preset nor a file: the preset's error, as before
    with pytest.raises(ValueError, match="is not one of"):
        cluster_from_env()


def test_the_placement_and_the_agreement_read_the_links_file(tmp_path, monkeypatch):
    """``DISTATTN_LINK=<file>`` times the solver's candidates on the measured links (the layout's note says so), and
    two ranks reading files whose figures differ in the last bit disagree loudly (the agreement's fields)."""
    spec = MaskSpec(causal=True, cu_seqlens=(0, 300, 1100, 1500, 4096))
    monkeypatch.setenv("DISTATTN_LINK", str(_write(tmp_path / "a.json", (250e9, 8e-6))))
    layout = place(spec, 4, 1024)
    assert layout.kind == "placed" and "measured 2.5e+11 B/s" in layout.note
    assert layout == place(spec, 4, 1024, cluster=cluster_from_file(str(tmp_path / "a.json")))
    config = DistAttnConfig(causal=True, scale=1.0, schedule="placed", cu_seqlens=spec.cu_seqlens)
    mine = config.fingerprint_fields()["placement_cluster"]
    monkeypatch.setenv("DISTATTN_LINK", str(_write(tmp_path / "b.json", (250e9, 8e-6 * (1 + 1e-15)))))
    assert config.fingerprint_fields()["placement_cluster"] != mine


@pytest.mark.timeout(180)
def test_link_measure_runs_the_executors_rounds_on_gloo_and_writes_a_file_the_library_reads(tmp_path):
    out = tmp_path / "links.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "link_measure.py"), "--spawn", "3", "--out", str(out),
                          "--peers", "1", "2", "--sizes", "4096", str(1 << 24), "--reps", "3", "--rounds", "2",
                          "--timeout", "150"],
                         capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    data = json.loads(out.read_text())
    assert data["backend"] == "gloo" and data["world_size"] == 3 and data["inter"] is None
    assert {(s["peers"], s["bytes"]) for s in data["samples"]} == {(1, 4096), (1, 1 << 24), (2, 4096), (2, 1 << 24)}
    assert all(s["seconds"] > 0 and s["tensors"] == 2 and s["fitted_seconds"] > 0 for s in data["samples"])
    cluster = cluster_from_file(str(out))
    assert cluster.gpus_per_node == 3 and cluster.intra.bandwidth > 0 and "gloo" in cluster.intra.name
    assert "intra: measured, gloo" in run.stdout


def test_the_cli_times_plans_on_a_links_file(tmp_path, capsys):
    from distattn.schedule.cli import build_parser, explain_main

    path = _write(tmp_path / "links.json", (250e9, 8e-6), g=4)
    explain_main(["--world", "16", "--heads", "32", "--heads-kv", "8", "--seq-per-rank", "4096", "--link", str(path)])
    out = capsys.readouterr().out
    assert "cluster: 4 GPUs per node; intra measured 2.5e+11 B/s" in out and "assumed: " in out
    explain_main(["--world", "16", "--seq-per-rank", "4096", "--link", str(path), "--gpus-per-node", "8"])
    assert "cluster: 8 GPUs per node" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--link", str(tmp_path / "absent.json")])
    assert "neither one of" in capsys.readouterr().err


def test_the_memory_cli_takes_its_node_size_from_the_links_file(tmp_path, monkeypatch, capsys):
    """``python -m distattn.memory plan`` with ``DISTATTN_LINK=<file>``: the file's node size shares the host memory
    and times the attention, unless ``--gpus-per-node`` names another."""
    from distattn.memory.cli import main

    monkeypatch.delenv("DISTATTN_GPUS_PER_NODE", raising=False)
    monkeypatch.setenv("DISTATTN_LINK", str(_write(tmp_path / "links.json", (250e9, 8e-6), (40e9, 9e-6), g=4)))
    base = ["plan", "--model", "llama-7b", "--gpus", "8", "--gpu-mem", "80"]
    assert main(base) == 0
    assert "per node of 4 GPUs" in capsys.readouterr().out
    assert main(base + ["--gpus-per-node", "2"]) == 0
    assert "per node of 2 GPUs" in capsys.readouterr().out
    monkeypatch.delenv("DISTATTN_LINK")
    assert main(base) == 0
    assert "per node of 8 GPUs" in capsys.readouterr().out  # the presets' node, as before
