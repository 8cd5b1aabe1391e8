"""bench/placement_gather.py: the what-if of documents all-gathered over their windows (issue 39's design study)."""

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import placement_gather as pg  # noqa: E402
from distattn.schedule import MaskSpec, Shapes  # noqa: E402
from distattn.schedule.cluster import Cluster, Link  # noqa: E402
from distattn.schedule.layouts import Layout  # noqa: E402
from distattn.schedule.pairs import pair_table  # noqa: E402
from distattn.schedule.timeline import phase_timeline  # noqa: E402

P, N = 8, 256
# a document over ranks 1..6 (aligned window: all 8), one over ranks 0..1 and one over 6..7, short ones elsewhere
SPEC = MaskSpec(causal=True, window=(-1, -1), cu_seqlens=(0, 100, 300, 1700, 1800, 1900, 2048))
LAYOUT = Layout("placed", P, group=P, placement=tuple(((r * N, (r + 1) * N),) for r in range(P)))


def _held(spec, layout):
    """Tokens of each document on each rank, from the layout's segments."""
    cu = np.asarray(spec.documents(P * N))
    out = np.zeros((len(cu) - 1, P), dtype=np.int64)
    for r in range(P):
        for a, b in layout.segments(r, N):
            for d in range(len(cu) - 1):
                out[d, r] += max(0, min(b, cu[d + 1]) - max(a, cu[d]))
    return out


@pytest.mark.parametrize("radix_bits", [1, 2, 3])
@pytest.mark.parametrize("min_ranks", [2, 3])
def test_every_rank_receives_each_block_it_needs_once_and_all_its_work(radix_bits, min_ranks):
    """Any radix, nested windows (``min_ranks=2`` also gathers the documents on ranks 0-1 and 6-7, windows of 2):
    each round's fetches are a permutation of the ranks that take part; a rank forwards only rows it holds by
    then, receives no rank's rows twice, every rank whose gathered keys it sees among them, and a round's rows are its
    block's rows of the rank's gathered documents; the rounds' work plus the local pair's and the rest's is the rank's
    work in the full pair table."""
    g = pg.gather(SPEC, P, N, LAYOUT, min_ranks=min_ranks, radix_bits=radix_bits)
    gathered_docs = [2] if min_ranks == 3 else [1, 2, 3]
    assert g is not None and g.docs == len(gathered_docs)
    assert g.rows.shape[1] == sum((1 << w) - 1 for w in [min(radix_bits, 3 - lo) for lo in range(0, 3, radix_bits)])
    held = _held(SPEC, LAYOUT)
    windows = {1: range(0, 2), 2: range(0, 8), 3: range(6, 8)}
    full = pair_table(SPEC, P, N, LAYOUT, cache=False)
    sees = np.zeros((P, P), dtype=np.int64)  # the gathered documents' work of each pair
    sees[full.q, full.kv] += full.work
    sees[g.rest.q, g.rest.kv] -= g.rest.work
    for x in range(g.rows.shape[1]):
        on = g.rows[:, x] > 0
        assert len(set(g.partner[on, x].tolist())) == on.sum()  # no rank sends twice in a round
    has = [{r} for r in range(P)]  # the ranks whose rows each rank holds, round by round
    for x in range(g.rows.shape[1]):
        now = [set(h) for h in has]
        for r in np.flatnonzero(g.rows[:, x] > 0):  # a rank forwards only rows it holds by then
            members = range(g.block[r, x], g.block[r, x] + g.size[x])
            mine = [d for d in gathered_docs if r in windows[d]]
            assert {j for j in members if held[mine, j].sum()} <= has[g.partner[r, x]]
            now[r] |= set(members)
        has = now
    for r in range(P):
        got = []
        for x in np.flatnonzero(g.rows[r] > 0):
            members = range(g.block[r, x], g.block[r, x] + g.size[x])
            assert g.partner[r, x] in members and r not in members
            mine = [d for d in gathered_docs if r in windows[d]]
            assert g.rows[r, x] == held[mine][:, members.start:members.stop].sum()
            got += list(members)
        assert len(got) == len(set(got))
        assert {j for j in range(P) if j != r and sees[r, j] > 0} <= set(got)
    per_rank = np.bincount(full.q, weights=full.work, minlength=P)
    local = np.zeros(P)
    local[full.q[full.q == full.kv]] = full.work[full.q == full.kv]
    rest = np.bincount(g.rest.q, weights=np.where(g.rest.q == g.rest.kv, 0, g.rest.work), minlength=P)
    assert np.array_equal(local + rest + g.work.sum(axis=1), per_rank)


def test_the_plan_holds_all_the_work_and_moves_the_gathered_rows():
    """The plan with the rounds: every rank's cost is its full work; its forward fetches are the rest's borrowed rows
    plus the gathered rows; the backward with the forward's k/v kept (``backward_fetch_dropped``) fetches only the
    rest's, and still returns the gathered dk/dv partials."""
    g = pg.gather(SPEC, P, N, LAYOUT, min_ranks=3, radix_bits=1)
    full = pair_table(SPEC, P, N, LAYOUT, cache=False)
    local = np.zeros(P, dtype=np.int64)
    local[full.q[full.q == full.kv]] = full.work[full.q == full.kv]
    shapes = Shapes(seq_per_rank=N, heads_q=4, heads_kv=2, head_dim=64, dtype_bytes=2)
    kv_row = 2 * 2 * 64 * 2  # k and v, 2 kv heads, 64 dims, bf16
    for where in pg.WHERE:
        lay = dataclasses.replace(LAYOUT, order="ranks-keys", prefetch=2, return_depth=2, head=True)
        plan, flipped = pg.plans(g, P, N, lay, local, where)
        rt = plan.run_table
        cost = np.bincount(rt.start, weights=rt.cost, minlength=P) * N ** 2
        assert np.allclose(cost, np.bincount(full.q, weights=full.work, minlength=P))
        spans = pg.tl.transfer_spans(plan, "forward", "fetch", {"kv": N * kv_row, "q": 1, "out": 1})
        got = np.bincount(spans.dst, weights=spans.size, minlength=P)
        rest_rows = np.bincount(g.rest.q, weights=np.where(g.rest.q == g.rest.kv, 0, g.rest.seen), minlength=P)
        assert np.array_equal(got, (rest_rows + g.rows.sum(axis=1)) * kv_row)
        sizes = {"kv": N * kv_row, "q": 1, "dkv": 2 * N * kv_row, "dq": 1}
        back = plan.run_order("backward")
        with pg.backward_fetch_dropped(flipped, P):
            dropped = pg.tl.transfer_spans(back, "backward", "fetch", sizes)
            returned = pg.tl.transfer_spans(back, "backward", "return", sizes)
        assert np.array_equal(np.bincount(dropped.dst, weights=dropped.size, minlength=P), rest_rows * kv_row)
        assert returned.size.sum() == 2 * kv_row * (rest_rows.sum() + g.rows.sum())
        free = Cluster(intra=Link(name="free", bandwidth=float("inf"), latency=0.0),
                       inter=Link(name="free", bandwidth=float("inf"), latency=0.0))
        t, perfect = pg.timed(plan, flipped, shapes, free, True, P)
        busiest = sum(phase_timeline(plan, ph, shapes, free).busy.max() for ph in ("forward", "backward"))
        assert t >= busiest * (1 - 1e-12) and busiest >= perfect


def test_the_study_reports_today_and_the_gathered_what_if():
    """One small seed end to end: today's figure is the solve's, the what-if is timed on some plans and never below
    the busiest rank's bound of one (a step is at least perfect balance)."""
    row = pg.study("longtail:2048", 8, "causal", 3, 1024, [8], [2], [1, 3], True)
    assert row["plans timed"] > 0 and row["docs_gathered"] >= 1 and row["radix"] in (2, 8)
    assert isinstance(row["gathered"], float) and 1.0 <= row["gathered"] < 3.0 and row["today"] >= 1.0
    with pytest.raises(ValueError, match="causal masks only"):
        pg.study("longtail:2048", 8, "window 512", 3, 1024, [8], [2], [1], True)
