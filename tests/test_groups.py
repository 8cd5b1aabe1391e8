"""The placement's first level (``distattn.schedule.groups``): documents to groups of ranks, and documents cut by
their work into pieces, against row-by-row work; on a real batch, the cut balances what a long windowed document
left on a few ranks."""

import dataclasses
import random

import numpy as np
import pytest

from distattn.schedule import MaskSpec
from distattn.schedule.cli import document_lengths
from distattn.schedule.groups import RowWork, assign_groups, cut_by_work, even_groups, group_loads

from dist_utils import solver_depths


def _row_work(spec, length):
    """Visible keys of each row of a document of ``length`` tokens, row by row."""
    left, right = spec.window
    i = np.arange(length)
    lo = np.zeros(length, dtype=np.int64) if left < 0 else np.maximum(0, i - left)
    hi = i if spec.causal else (np.full(length, length - 1) if right < 0 else np.minimum(length - 1, i + right))
    return hi - lo + 1


def _spec(rng):
    causal = rng.random() < 0.6
    window = rng.choice([(-1, -1), (rng.randint(0, 40), 0 if causal else rng.randint(0, 40))])
    return MaskSpec(causal=causal, window=window)


@pytest.mark.parametrize("seed", range(10))
def test_pieces_cover_every_document_in_order_with_about_equal_work(seed):
    rng = random.Random(seed)
    spec = _spec(rng)
    lengths = np.asarray([rng.choice([1, 2, 5, rng.randint(1, 300)]) for _ in range(rng.randint(1, 30))])
    rows = RowWork(spec, lengths)
    per_row = [_row_work(spec, int(x)) for x in lengths]
    total = sum(int(w.sum()) for w in per_row)
    cut = total / rng.choice([3, 10, 40])
    doc, lo, hi = cut_by_work(lengths, rows, cut)
    for d, length in enumerate(lengths.tolist()):
        mine = np.flatnonzero(doc == d)
        assert lo[mine[0]] == 0 and hi[mine[-1]] == length and (lo[mine[1:]] == hi[mine[:-1]]).all()  # consecutive
        assert (hi[mine] > lo[mine]).all()
        work = [int(per_row[d][a:b].sum()) for a, b in zip(lo[mine], hi[mine])]
        whole = int(per_row[d].sum())
        assert work == (rows.prefix(doc[mine], hi[mine]) - rows.prefix(doc[mine], lo[mine])).tolist()
        if whole <= cut:
            assert len(mine) == 1  # light documents stay whole
        else:  # at most ceil(work / cut) pieces (fewer where rows run out), each within a row of an equal share
            parts = int(np.ceil(whole / cut))
            assert min(2, length) <= len(mine) <= parts
            assert max(work) <= whole / parts + int(per_row[d].max())
    assert (doc == np.sort(doc)).all()  # stream order
    same = cut_by_work(lengths, rows, None)
    assert (same[0] == np.arange(len(lengths))).all() and (same[2] - same[1] == lengths).all()
    with pytest.raises(ValueError, match="positive"):
        cut_by_work(lengths, rows, 0.0)


@pytest.mark.parametrize("seed", range(10))
def test_pieces_capped_in_rows_cut_the_equal_work_pieces_every_so_many_rows(seed):
    """``tokens``: every piece of equal work longer than ``tokens`` rows is cut again every ``tokens`` rows (the last
    part shorter); documents that are not cut stay whole, however long."""
    rng = random.Random(50 + seed)
    spec = _spec(rng)
    lengths = np.asarray([rng.choice([1, 2, 5, rng.randint(1, 300)]) for _ in range(rng.randint(1, 30))])
    rows = RowWork(spec, lengths)
    cut, tokens = float(rows.prefix(np.arange(len(lengths)), lengths).sum()) / rng.choice([3, 10]), rng.randint(1, 40)
    doc, lo, hi = cut_by_work(lengths, rows, cut)
    cdoc, clo, chi = cut_by_work(lengths, rows, cut, tokens)
    assert (cdoc == np.sort(cdoc)).all() and (chi > clo).all()
    for d in range(len(lengths)):
        mine, capped = np.flatnonzero(doc == d), np.flatnonzero(cdoc == d)
        if len(mine) == 1:  # not cut by work: whole
            assert len(capped) == 1 and (clo[capped[0]], chi[capped[0]]) == (0, lengths[d])
            continue
        want = [(a + i, min(a + i + tokens, b)) for a, b in zip(lo[mine].tolist(), hi[mine].tolist())
                for i in range(0, b - a, tokens)]
        assert list(zip(clo[capped].tolist(), chi[capped].tolist())) == want
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="positive number of rows"):
            cut_by_work(lengths, rows, cut, bad)


@pytest.mark.parametrize("seed", range(10))
def test_groups_of_cut_documents_hold_every_token_once_and_their_loads(seed):
    rng = random.Random(100 + seed)
    spec = _spec(rng)
    groups, cap = rng.randint(1, 6), rng.randint(8, 64)
    total, cu = groups * cap, [0]
    while cu[-1] < total:
        cu.append(min(total, cu[-1] + rng.choice([1, 3, rng.randint(1, total)])))
    starts, lengths = np.asarray(cu[:-1]), np.diff(cu)
    rows = RowWork(spec, lengths)
    whole = rows.prefix(np.arange(len(lengths)), lengths)
    pieces = assign_groups(starts, lengths, rows, groups, cap, cut=whole.sum() / groups / rng.choice([1, 2, 4]))
    _assert_full_partition(pieces, cu, groups, cap)
    assert _row_loads(pieces, spec, cu, lengths, groups).sum() == whole.sum()


def _assert_full_partition(pieces, cu, groups, cap):
    """``pieces`` (``[start, stop, group, doc]`` rows) partition the stream ``cu``, each inside its document, and every
    group holds exactly ``cap`` tokens."""
    held = np.zeros(cu[-1], dtype=np.int64)
    for a, b, _, d in pieces.tolist():
        assert cu[d] <= a < b <= cu[d + 1]  # inside its document
        held[a:b] += 1
    assert (held == 1).all()  # a partition of the stream
    assert np.bincount(pieces[:, 2], weights=pieces[:, 1] - pieces[:, 0], minlength=groups).tolist() == [cap] * groups


def _row_loads(pieces, spec, cu, lengths, groups):
    """Every group's work, row by row (not through ``RowWork``)."""
    load = np.zeros(groups, dtype=np.int64)
    for a, b, g, d in pieces.tolist():
        load[g] += int(_row_work(spec, int(lengths[d]))[a - cu[d]:b - cu[d]].sum())
    return load


def _pile_22():
    """The Pile (pile:4), 64 ranks x 4096 tokens, seed 22: a document of 65,353 tokens among 232 short ones."""
    cu = document_lengths("pile:4", 64 * 4096, seed=22)
    return np.asarray(cu[:-1]), np.diff(cu), cu


def test_the_cut_spreads_a_long_windowed_document():
    """Under a window of 4096, the long document holds 58% of the work in a quarter of the tokens: over groups of one
    rank, whole documents leave the busiest rank at 2.40x of the mean; cut into pieces of half a rank's mean, every
    rank ends within 1.15x."""
    starts, lengths, cu = _pile_22()
    spec = MaskSpec(causal=True, window=(4096, 0), cu_seqlens=tuple(cu))
    rows = RowWork(spec, lengths)
    mean = rows.prefix(np.arange(len(lengths)), lengths).sum() / 64

    def busiest(cut):
        return group_loads(assign_groups(starts, lengths, rows, 64, 4096, cut=cut), starts, rows, 64).max() / mean

    assert busiest(None) > 2.3
    assert busiest(0.5 * mean) < 1.15


def test_the_solver_times_the_cut_under_a_window_only():
    """The library's placement of that batch on NVLink: the cut wins for the window (the step on the per-pair timeline
    from 2.40x to 1.46x of perfect balance), and is never tried for causal work (the last piece would borrow the
    whole document's keys). Since the solver also times the stream deal (``distattn.schedule.streams``) it keeps that
    here (1.25 ms per layer; ``tests/test_streams.py``): the example runs without it (``dist_utils.solver_depths``)."""
    from distattn.schedule.cluster import Cluster
    from distattn.schedule.placement import _place_cached

    _, _, cu = _pile_22()
    with solver_depths(stream_deal=False):
        lay, ratio = _solved_windowed(cu, 64)
    assert "cut by work" in lay.note and ratio < 1.5, lay.note
    causal = _place_cached.__wrapped__(MaskSpec(causal=True, cu_seqlens=tuple(cu)), 64, 4096, None,
                                       Cluster.preset("nvlink"))
    assert "cut by work" not in causal.note


def _solved_windowed(cu, p):
    """The library's placement of the stream ``cu`` at ``p`` ranks x 4096 tokens, window 4096, on NVLink, and its
    step on the per-pair timeline over perfect balance."""
    from distattn.schedule.cluster import Cluster
    from distattn.schedule.masked import make_masked_plan
    from distattn.schedule.placement import ASSUMED_SHAPES, _place_cached
    from distattn.schedule.timeline import step_timeline

    nvlink = Cluster.preset("nvlink")
    spec = MaskSpec(causal=True, window=(4096, 0), cu_seqlens=tuple(cu))
    lay = _place_cached.__wrapped__(spec, p, 4096, None, nvlink)
    plan = make_masked_plan.__wrapped__(p, "placed", spec, 4096, lay)
    return lay, step_timeline(plan, dataclasses.replace(ASSUMED_SHAPES, seq_per_rank=4096), nvlink)["ratio"]


@pytest.mark.parametrize("order", ["dense", "short"])
@pytest.mark.parametrize("seed", range(12))
def test_evened_groups_hold_every_token_once_and_never_load_the_busiest_more(seed, order):
    """``even_groups`` on random streams, masks and group counts: still a partition of the stream into pieces inside
    their documents, every group exactly its tokens, no two neighbouring pieces of a document in one group; the
    heaviest group's work (counted row by row) never grows."""
    rng = random.Random(300 + seed)
    spec = _spec(rng)
    groups, cap = rng.randint(2, 8), rng.randint(16, 96)
    total, cu = groups * cap, [0]
    while cu[-1] < total:
        cu.append(min(total, cu[-1] + rng.choice([1, 3, rng.randint(1, cap), rng.randint(1, total)])))
    starts, lengths = np.asarray(cu[:-1]), np.diff(cu)
    rows = RowWork(spec, lengths)
    pieces = assign_groups(starts, lengths, rows, groups, cap,
                           cut=rng.choice([None, rows.prefix(np.arange(len(lengths)), lengths).sum() / groups]))
    even = even_groups(pieces, starts, rows, groups, 0.005, order)
    _assert_full_partition(even, cu, groups, cap)
    ordered = even[np.lexsort((even[:, 0], even[:, 2]))]
    assert not ((ordered[1:, 2] == ordered[:-1, 2]) & (ordered[1:, 3] == ordered[:-1, 3])
                & (ordered[1:, 0] == ordered[:-1, 1])).any()  # joined
    before, after = (_row_loads(p, spec, cu, lengths, groups) for p in (pieces, even))
    assert after.sum() == before.sum() and after.max() <= before.max()
    assert group_loads(even, starts, rows, groups).tolist() == after.tolist()


@pytest.mark.parametrize("docs,seed,cut", [("longtail:2048", 7, 0.5), ("pile:4", 37, 1.0)])
def test_evening_brings_the_worst_windowed_batches_within_half_a_percent(docs, seed, cut):
    """The worst windowed seeds at P = 16 before evening (window 4096, groups of one rank, documents cut by work and
    capped at 2048 tokens): the busiest rank's work from 1.28x / 1.21x of the mean to within ``EVEN`` (0.5%), in
    few exchanges (each cuts at most two pieces)."""
    from distattn.schedule.placement import EVEN

    cu = document_lengths(docs, 16 * 4096, seed=seed)
    spec = MaskSpec(causal=True, window=(4096, 0), cu_seqlens=tuple(cu))
    starts, lengths = np.asarray(cu[:-1]), np.diff(cu)
    rows = RowWork(spec, lengths)
    mean = rows.prefix(np.arange(len(lengths)), lengths).sum() / 16
    pieces = assign_groups(starts, lengths, rows, 16, 4096, cut=cut * mean, tokens=2048)
    assert group_loads(pieces, starts, rows, 16).max() / mean > 1.2
    even = even_groups(pieces, starts, rows, 16, EVEN, "dense")
    assert group_loads(even, starts, rows, 16).max() / mean <= 1 + EVEN
    assert len(even) <= len(pieces) + 2 * 2 * 16


@pytest.mark.parametrize("docs,seed", [("longtail:2048", 7), ("pile:4", 37)])
def test_the_solver_keeps_evened_groups_where_faster(docs, seed):
    """The library's placement of those batches on NVLink times the evened cut and keeps it: 1.133x -> 1.091x and
    1.163x -> 1.085x of perfect balance on the per-pair timeline, within the issue's 1.10x. Since the solver also
    times the stream deal (``distattn.schedule.streams``) it keeps that on longtail (1.035x): the examples run without
    it (``dist_utils.solver_depths``)."""
    with solver_depths(stream_deal=False):
        lay, ratio = _solved_windowed(document_lengths(docs, 16 * 4096, seed=seed), 16)
    assert "the groups' work evened" in lay.note and ratio < 1.10, (lay.note, ratio)


def test_the_solver_evens_the_groups_up_to_its_rank_limits(monkeypatch):
    """The evened cuts are timed to :data:`EVEN` up to ``EVEN_MAX_RANKS`` ranks (at P = 64 and 256 they won 2 of 229
    solves for up to 1.9x the solve time, ``bench/results/placement-sim/EVEN-8-64.md``), to the looser
    ``EVEN_LOOSE`` both ways up to ``EVEN_LOOSE_MAX_RANKS``, to the first of them one way up to
    ``EVEN_WIDE_MAX_RANKS``, and not beyond; the looser ones on groups of at most ``EVEN_LOOSE_MAX_GROUP`` ranks."""
    import distattn.schedule.solver as pl
    from distattn.schedule.cluster import Cluster

    calls = []

    def counted(*args, **kwargs):
        calls.append((args[4], args[5], args[3]))  # the tolerance, the exchange order, the number of groups
        return even_groups(*args, **kwargs)

    monkeypatch.setattr(pl, "even_groups", counted)
    both = [how[1] for how in pl.EVENED]
    assert pl.EVEN_MAX_RANKS < pl.EVEN_LOOSE_MAX_RANKS < pl.EVEN_WIDE_MAX_RANKS
    for p, expected in ((pl.EVEN_MAX_RANKS, {(t, o) for t in (pl.EVEN, *pl.EVEN_LOOSE) for o in both}),
                        (pl.EVEN_LOOSE_MAX_RANKS, {(t, o) for t in pl.EVEN_LOOSE for o in both}),
                        (pl.EVEN_WIDE_MAX_RANKS, {(pl.EVEN_LOOSE[0], both[0])}),
                        (2 * pl.EVEN_WIDE_MAX_RANKS, set())):
        calls.clear()
        cu = document_lengths("longtail:256", p * 128, seed=3)
        pl._place_cached.__wrapped__(MaskSpec(causal=True, window=(128, 0), cu_seqlens=cu), p, 128, None,
                                     Cluster.preset("nvlink"))
        assert {call[:2] for call in calls} == expected, (p, sorted(set(calls)))
        loose = {groups for tol, _, groups in calls if tol != pl.EVEN}  # on groups of 1 and 2 ranks, not larger
        assert loose == ({p, p // pl.EVEN_LOOSE_MAX_GROUP} if expected - {(pl.EVEN, o) for o in both} else set()), loose


@pytest.mark.parametrize("tol", [0.02, 0.04])
def test_a_looser_evening_stops_at_its_tolerance_in_fewer_pieces(tol):
    """Evened only to within ``tol`` of the mean (``EVEN_LOOSE``), the Pile windowed at P = 64, seed 19 (groups of
    one rank, documents cut by work, capped at 2048 tokens): the heaviest group within ``tol`` of the mean, and fewer
    pieces, so fewer pairs, than evened to within ``EVEN`` (0.5%)."""
    from distattn.schedule.placement import EVEN

    cu = document_lengths("pile:4", 64 * 4096, seed=19)
    spec = MaskSpec(causal=True, window=(4096, 0), cu_seqlens=tuple(cu))
    starts, lengths = np.asarray(cu[:-1]), np.diff(cu)
    rows = RowWork(spec, lengths)
    mean = rows.prefix(np.arange(len(lengths)), lengths).sum() / 64
    pieces = assign_groups(starts, lengths, rows, 64, 4096, cut=mean, tokens=2048)
    loose, tight = (even_groups(pieces, starts, rows, 64, t, "short") for t in (tol, EVEN))
    assert group_loads(pieces, starts, rows, 64).max() / mean > 1 + tol
    assert group_loads(loose, starts, rows, 64).max() / mean <= 1 + tol
    assert group_loads(tight, starts, rows, 64).max() / mean <= 1 + EVEN
    assert len(loose) < len(tight), (len(loose), len(tight))


def test_the_solver_keeps_a_looser_evening_where_faster(monkeypatch):
    """The Pile windowed at P = 64, seed 19: without the looser evenings the solver's best is 1.134x of perfect
    balance (groups of one rank, capped cut pieces, not evened); with them it keeps the groups evened to within 4%
    (exchanging the lightest pieces first), 1.073x, within the issue's 1.10x (``EVEN-LOOSE.md``)."""
    import distattn.schedule.solver as pl

    cu = document_lengths("pile:4", 64 * 4096, seed=19)
    lay, ratio = _solved_windowed(cu, 64)
    assert lay.note.startswith("64 groups of 1 ranks") and ratio < 1.08, (lay.note, ratio)
    assert "the groups' work evened (short, to 0.04)" in lay.note, lay.note
    monkeypatch.setattr(pl, "EVEN_LOOSE", ())
    before, slower = _solved_windowed(cu, 64)
    assert "evened" not in before.note and slower > 1.13, (before.note, slower)
