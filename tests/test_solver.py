"""The placement solver's search (``distattn.schedule.solver``): what it skips is exact (the same layout as timing
every candidate and order in full), and the documents-only fallback of a windowed solve stops at
``FALLBACK_MAX_RANKS``."""

import pytest

import distattn.schedule.solver as solver
from distattn.schedule import MaskSpec
from distattn.schedule.cli import document_lengths
from distattn.schedule.cluster import Cluster


def _solve(docs, p, n, window, seed, cluster):
    spec = MaskSpec(causal=True, window=window, cu_seqlens=document_lengths(docs, p * n, seed=seed))
    return solver._place_cached.__wrapped__(spec, p, n, None, cluster)


@pytest.mark.parametrize("docs, p, window, link", [("pile:4", 16, (-1, -1), "nvlink"),
                                                   ("longtail:2048", 16, (4096, 0), "nvlink"),
                                                   ("uniform:8192", 16, (4096, 0), "ib")])
def test_the_search_skips_only_candidates_that_cannot_win(docs, p, window, link, monkeypatch):
    """With the deal bounds (``owner_bounds``) and the timelines' ``stop_at`` switched off, every candidate and order
    is timed in full: the solve returns the very same layout (segments, order, depths, backward, note with its
    modelled step), on 3 seeds per setting; and the bounds did skip work."""
    cluster = Cluster.preset(link) if link == "nvlink" else Cluster.preset(link, gpus_per_node=8)
    timeline = solver.phase_timeline
    counts = {"fast": 0, "stopped": 0, "full": 0}

    def counted(*args, **kwargs):
        out = timeline(*args, **kwargs)
        counts["stopped"] += out.makespan == float("inf")
        counts["fast"] += 1
        return out

    monkeypatch.setattr(solver, "phase_timeline", counted)
    solver._place_cached.cache_clear()  # a windowed solve's documents-only solve is cached: solved again each way
    fast = [_solve(docs, p, 4096, window, seed, cluster) for seed in (1, 2, 3)]

    def in_full(*args, stop_at=None, **kwargs):
        counts["full"] += 1
        return timeline(*args, **kwargs)

    monkeypatch.setattr(solver, "owner_bounds", lambda *args: (0.0, 0.0))
    monkeypatch.setattr(solver, "phase_timeline", in_full)
    solver._place_cached.cache_clear()
    full = [_solve(docs, p, 4096, window, seed, cluster) for seed in (1, 2, 3)]
    solver._place_cached.cache_clear()
    assert fast == full
    assert counts["stopped"] > 0 and counts["fast"] <= counts["full"], counts  # timelines cut short


def test_the_documents_only_fallback_is_timed_up_to_fallback_max_ranks(monkeypatch):
    """A windowed solve times the causal solve of its documents (the documents-only placement) up to
    ``FALLBACK_MAX_RANKS`` ranks and not beyond (beyond, it cost half the windowed solve or more and won 1 of 1000
    windowed seeds at P = 64 and 256, that one no slower without it: ``bench/results/placement-sim/SOLVE-SPEED.md``)."""
    nested = []
    solve = solver._place_cached

    def counted(spec, p, *args, **kwargs):
        nested.append(spec.window)
        return solve(spec, p, *args, **kwargs)

    monkeypatch.setattr(solver, "_place_cached", counted)  # the windowed solve's own call to the cached solve
    for p in (solver.FALLBACK_MAX_RANKS, 2 * solver.FALLBACK_MAX_RANKS):
        nested.clear()
        cu = document_lengths("longtail:256", p * 512, seed=3)
        solve.__wrapped__(MaskSpec(causal=True, window=(512, 0), cu_seqlens=cu), p, 512, None,
                          Cluster.preset("nvlink"))
        assert ((-1, -1) in nested) == (p <= solver.FALLBACK_MAX_RANKS), (p, nested)
