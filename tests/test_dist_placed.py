"""schedule="placed" on spawned gloo ranks: packed documents on the work-balanced placement, against fp64.

Every rank solves the placement from the same ``cu_seqlens`` and window (``distattn.sharding.placement``), shards
q/k/v with it, runs ``dist_flash_attn_varlen_func(..., schedule="placed")``, and checks its out/dq/dk/dv against the
fp64 per-document reference over the whole stream (the accuracy rule), its byte counters against the simulator's plan,
that every rank holds the same placement, and that ``gather_sequence`` with the placement puts the stream back.
The same on a Ulysses x ring grid (the placement of its ring level): ``tests/test_dist_layouts.py``, section
"placed2d", which shares that file's spawns.
"""

import pytest
import torch

import distattn
from attn_ref import assert_all_close_by_rule
from dist_utils import placed_forced, run_distributed
from distattn import comm
from distattn.schedule import MaskSpec, Shapes, simulate
from distattn.sharding import gather_sequence, placement, shard_sequence
from test_dist_varlen import _reference, _stream_mask

TIMEOUT_S = 240


def _streams(world, n):
    """cu_seqlens per case: empty and single-token documents, one document longer than several ranks' streams,
    random mixes, a short tail (padding document)."""
    total = world * n
    g = torch.Generator().manual_seed(world)
    yield [0, 1, 1, 3, 3 + min(3 * n + 2, total - 3), total]  # empty, single-token, one over ~3 ranks
    cu = [0]
    while cu[-1] < total:
        cu.append(min(total, cu[-1] + int(torch.randint(1, 2 * n, (1,), generator=g))))
    yield cu
    yield [0, total - 2]  # one document and a 2-token padding tail


CASES = [  # (causal, window, h_q, h_kv, dtype)
    (True, (-1, -1), 4, 2, torch.float32),
    (True, (5, 0), 2, 2, torch.float32),
    (False, (3, 4), 2, 1, torch.float32),
    (True, (-1, -1), 2, 1, torch.float16),
]


def _check(rank, world, case, cu, n, seed):
    causal, window, h_q, h_kv, dtype = case
    total, d = world * n, 16
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(total, h, d, generator=g).to(dtype) for h in (h_q, h_kv, h_kv, h_q))
    lay = placement(cu, n, window=window)  # the call's window weighs the placement (its left side; causal alike)
    qs, ks, vs = (shard_sequence(t, 0, layout=lay).clone().requires_grad_() for t in (q, k, v))
    comm.reset_counters()
    out = distattn.dist_flash_attn_varlen_func(qs, ks, vs, torch.tensor(cu, dtype=torch.int32), total,
                                               causal=causal, window_size=window, schedule="placed",
                                               backend="torch")
    out.backward(shard_sequence(dout, 0, layout=lay))
    rep = simulate(world, causal, "placed", Shapes(batch=1, seq_per_rank=n, heads_q=h_q, heads_kv=h_kv,
                                                     head_dim=d, dtype_bytes=q.element_size()),
                   mask=MaskSpec(causal=causal, window=window, cu_seqlens=tuple(cu)))
    assert (comm.COUNTERS.bytes_sent, comm.COUNTERS.bytes_recv) == (rep.bytes_sent[rank], rep.bytes_recv[rank])
    keep = _stream_mask(cu, total, causal, window)
    ref = [shard_sequence(t, 0, layout=lay) for t in _reference(q, k, v, dout, keep, torch.float64)]
    base = [shard_sequence(t, 0, layout=lay) for t in _reference(q, k, v, dout, keep, dtype)]
    assert_all_close_by_rule(("out", "dq", "dk", "dv"), [out, qs.grad, ks.grad, vs.grad], base, ref, dtype)
    whole = gather_sequence(out.detach(), 0, layout=lay)
    assert torch.equal(shard_sequence(whole, 0, layout=lay), out.detach())
    return hash(lay.placement) if lay.placement else lay.kind, rep.pairs_skipped


def _worker(rank, world, n):
    seen = []
    for i, case in enumerate(CASES):
        for j, cu in enumerate(_streams(world, n)):
            if (i + j) % 2 and world > 1:
                continue  # every case meets two of the streams at P > 1 (the suite's time budget)
            try:
                seen.append(_check(rank, world, case, cu, n, seed=10 * i + j))
            except AssertionError as exc:
                raise AssertionError(f"world={world} case={case} cu={cu}: {exc}") from exc
    return seen


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_placed_documents_against_reference(world):
    n = 12  # blocks of 4 tokens: three per rank, so the solver has something to place
    seen = run_distributed(_worker, world, n, timeout=TIMEOUT_S)
    assert all(s == seen[0] for s in seen)  # one placement on every rank
    assert len(seen[0]) == (3 * len(CASES) if world == 1 else 6)


# A stream whose placement (one group of 4, steps as matchings) leaves a pair that sees two runs of
# a kv shard's rows with another document's rows between them: it borrows only the rows it sees, packed
# (``Plan.key_ranges``).
PACKED_CU, PACKED_WORLD, PACKED_N = [0, 284, 309, 344, 512], 4, 128


def _packed_worker(rank, world, n):
    from distattn.schedule import make_plan

    plan = make_plan(world, True, "placed", mask=MaskSpec(causal=True, cu_seqlens=tuple(PACKED_CU)), chunk=n)
    ranges = {(i, j): plan.key_ranges(i, j) for i in range(world) for j in range(world) if i != j}
    multi = [ij for ij, rs in ranges.items() if rs and len(rs) > 1]
    for case in (CASES[0], CASES[3]):  # causal: fp32 GQA, fp16
        _check(rank, world, case, PACKED_CU, n, seed=7)
    return multi, {ij: plan.key_span(*ij) for ij in multi}, {ij: ranges[ij] for ij in multi}


def test_placed_pairs_borrow_only_the_rows_they_see():
    """Exact against fp64 (and the byte counters equal the plan's) where a pair's queries see two runs of the kv
    shard's rows with rows of another document between them: only the runs travel, packed, and the dk/dv partial
    comes back for them alone."""
    results = run_distributed(_packed_worker, PACKED_WORLD, PACKED_N, timeout=TIMEOUT_S)
    multi, spans, ranges = results[0]
    assert multi, "the stream no longer leaves a pair seeing two runs of rows: pick another one"
    for ij in multi:
        (a, b), rs = spans[ij], ranges[ij]
        assert a == rs[0][0] and b == rs[-1][1] and sum(y - x for x, y in rs) < b - a  # fewer rows than the span


# Streams on which a matched order leaves some rank idle between two of its pairs (found by search; n = 12).
HOLES = {(3, "pairs-keys"): [0, 9, 19, 30, 36], (4, "ranks-work"): [0, 8, 11, 22, 36, 47, 48],
         (5, "ranks-keys"): [0, 4, 14, 37, 52, 60]}


def _ordered_worker(rank, world, n, order):
    """:func:`_check` on plans whose steps run in a matched ``order`` (``Layout.order``), forced on the solver's
    layout (its shards and its plan alike); returns how many idle steps between two pairs the plans hold."""
    from distattn.schedule import make_plan

    holes, seen = 0, []
    with placed_forced(order):
        for i, cu in enumerate(list(_streams(world, n))[:2] + [HOLES[(world, order)]]):
            plan = make_plan(world, True, "placed", mask=MaskSpec(causal=True, cu_seqlens=tuple(cu)), chunk=n)
            assert plan.layout.order == order, plan.layout
            for r in range(world):
                steps = [t for t in range(plan.num_steps()) if plan.task(t, r) is not None]
                holes += sum(1 for t in range(max(steps, default=0)) if t not in steps)
            for case in (CASES[0], CASES[3]):  # causal: fp32 GQA, fp16
                seen.append(_check(rank, world, case, cu, n, seed=20 + i))
    return holes, seen


@pytest.mark.parametrize("world,order", sorted(HOLES))
def test_matched_orders_against_reference(world, order):
    """The placed plan with its steps as matchings (``distattn.schedule.masked.matched_steps``), exact against fp64
    with the byte counters equal to the plan's, on odd and even worlds; some rank idles between two of its pairs (the
    executor steps over it)."""
    results = run_distributed(_ordered_worker, world, 12, order, timeout=TIMEOUT_S)
    assert all(r[1] == results[0][1] for r in results)  # one placement on every rank
    assert results[0][0] > 0, "no rank idles between its pairs: pick a stream that leaves a hole"


def _backward_worker(rank, world, n, order, backward, head):
    """:func:`_check` on placed plans whose backward runs the steps in ``backward``'s order (``Layout.backward``),
    its local pair's head first or not (``head``, ``Layout.head``), forced; the executor's computes
    (``distattn.executor.TRACE``) run the backward's pairs in that order, the head first where there is one."""
    from distattn import executor
    from distattn.schedule import make_plan

    seen = []
    with placed_forced(order, backward=backward, head=head):
        for i, cu in enumerate(list(_streams(world, n))[:2]):
            plan = make_plan(world, True, "placed", mask=MaskSpec(causal=True, cu_seqlens=tuple(cu)), chunk=n)
            assert (plan.layout.order, plan.layout.backward, plan.layout.head) == (order, backward, head), plan.layout
            executor.TRACE = []
            try:
                seen.append(_check(rank, world, CASES[0], cu, n, seed=40 + i))
                trace = executor.TRACE
            finally:
                executor.TRACE = None
            fwd, bwd = ([e[2:] for p, e in trace if p == ph and e[0] == "compute"] for ph in ("forward", "backward"))
            assert fwd and bwd == (fwd if backward == "forward" else fwd[::-1]), (backward, fwd, bwd)
            heads = [e for p, e in trace if p == "backward" and e[0] == "head"]  # one per call when there is a head
            last = plan.run_order("backward").task(plan.num_steps() - 1, rank)
            has = backward == "reversed" and head and last is not None and last.is_local
            assert heads == ([("head", plan.num_steps() - 1, rank, rank)] if has else []), heads
            kinds = [e[0] for p, e in trace if p == "backward"]
            assert not has or kinds.index("head") < kinds.index("wait"), kinds  # before step 0's wait
    return seen


@pytest.mark.parametrize("world,order", [(3, "rotation"), (4, "pairs-work")])
@pytest.mark.parametrize("backward,head", [("forward", True), ("reversed", True), ("reversed", False)])
def test_either_backward_order_against_reference(world, order, backward, head):
    """A placed layout's backward runs the plan's steps reversed (every plan's default, ``Plan.run_order``), its local
    pair's head first (``Plan.head_task``) or not (``Layout.head``), or in the plan's own order where the solver finds
    that faster (``Layout.backward``): exact against fp64 every way, the byte counters equal to the plan's, and the
    executor computes the backward's pairs in that order, the head before step 0's wait."""
    results = run_distributed(_backward_worker, world, 12, order, backward, head, timeout=TIMEOUT_S)
    assert all(r == results[0] for r in results)  # one placement on every rank


def _deeper_worker(rank, world, n, order, depth, keep=1):
    """:func:`_check` on placed plans fetching ``depth`` steps ahead (``Layout.prefetch``: ``depth + 1`` fetch slots
    whose receive buffers the executor reuses that many steps later) and absorbing their partials ``keep`` steps after
    their round (``Layout.return_depth``: ``keep + 1`` return slots), forced; the executor posts each fetch ``depth``
    steps ahead and waits for step ``t``'s returns after step ``t + keep``'s compute."""
    from distattn import executor
    from distattn.schedule import make_plan

    seen, steps = [], []
    with placed_forced(order, prefetch=depth, return_depth=keep):
        for i, cu in enumerate(list(_streams(world, n))[::2]):  # the second: one document over all ranks
            plan = make_plan(world, True, "placed", mask=MaskSpec(causal=True, cu_seqlens=tuple(cu)), chunk=n)
            assert (plan.layout.order, plan.prefetch, plan.return_depth) == (order, depth, keep), plan.layout
            steps.append(plan.num_steps())
            executor.TRACE = []
            try:
                for case in (CASES[0], CASES[3]):  # causal: fp32 GQA, fp16
                    seen.append(_check(rank, world, case, cu, n, seed=50 + i))
                trace = executor.TRACE
            finally:
                executor.TRACE = None
            events = [e[:3] for ph, e in trace if ph == "forward"][:depth + 4]  # the first call's forward
            if plan.num_steps() > depth:  # step depth's fetch is posted before step 0's is waited for
                assert events.index(("post", "fetch", depth)) < events.index(("wait", "fetch", 0)), events
            backward = [e for ph, e in trace if ph == "backward"]
            backward = backward[:backward.index(("wait", "return", plan.num_steps() - 1)) + 1]  # the first call's
            for t in range(plan.num_steps() - keep):  # step t's returns: absorbed after step t + keep's compute
                assert backward.index(("wait", "return", t)) > backward.index(("wait", "fetch", t + keep)), backward
                if t + keep + 1 < plan.num_steps():  # and before the next step's fetch is waited for
                    assert backward.index(("wait", "return", t)) < backward.index(("wait", "fetch", t + keep + 1))
    assert max(steps) >= max(depth, keep) + 2, steps  # a fetch slot and a return slot are reused
    return seen


@pytest.mark.parametrize("world,order,depth,keep", [(4, "rotation", 2, 2), (5, "pairs-work", 3, 3),
                                                     (6, "rotation", 4, 1), (5, "rotation", 1, 3),
                                                     (8, "ranks-work", 6, 4), (10, "rotation", 8, 6)])
def test_fetching_steps_ahead_against_reference(world, order, depth, keep):
    """A placed layout whose fetches the executor posts ``depth`` steps ahead (``Layout.prefetch``, as deep as the
    solver finds it faster) and whose partials it absorbs ``keep`` steps after their round (``Layout.return_depth``):
    exact against fp64 with the byte counters equal to the plan's; at 10 ranks 8 and 6 deep, past the whole-shard
    depths, its receive buffers sized by the rows their slots receive (``distattn.schedule.pool.slot_rows``)."""
    results = run_distributed(_deeper_worker, world, 12, order, depth, keep, timeout=TIMEOUT_S)
    assert all(r == results[0] for r in results)  # one placement on every rank


def _cut_worker(rank, world, n):
    """:func:`_check` on placements whose documents are cut by work (``distattn.schedule.groups``) over groups of one
    rank: the long document of the first stream goes to several ranks in consecutive pieces, each with short documents
    beside it. Returns the placements and how many ranks hold the long document."""
    seen, spread = [], 0
    with placed_forced(group=1, cut=0.5):
        for i, cu in enumerate(list(_streams(world, n))[:2]):
            lay = placement(cu, n, window=(5, 0))
            assert "cut by work" in lay.note, lay.note
            if i == 0:
                a, b = cu[3], cu[4]  # the document over ~3 ranks' streams
                spread = sum(any(lo < b and a < hi for lo, hi in lay.segments(r, n)) for r in range(world))
            for case in CASES[:3]:  # causal, causal windowed, bidirectional windowed; fp32
                seen.append(_check(rank, world, case, cu, n, seed=30 + i))
    return spread, seen


@pytest.mark.parametrize("world", [3, 5])
def test_documents_cut_by_work_against_reference(world):
    """Placements with documents cut by their work into pieces dealt like documents: exact against fp64 with the byte
    counters equal to the plan's, causal and windowed, on odd worlds; the long document lies on several ranks."""
    results = run_distributed(_cut_worker, world, 12, timeout=TIMEOUT_S)
    assert all(r[1] == results[0][1] for r in results)  # one placement on every rank
    assert results[0][0] >= 3, results[0][0]


def _even_worker(rank, world, n, tolerance=None):
    """:func:`_check` on placements whose groups' work is evened (``distattn.schedule.groups.even_groups``; to within
    ``tolerance`` of the mean, ``None``: the solver's ``EVEN``) over groups of one rank, documents cut by work: pieces
    move between ranks and are cut where the exchanged tokens meet. Returns the placements and how many of them the
    evening changed."""
    import distattn.schedule.placement as pl

    seen, changed = [], 0
    for i, cu in enumerate(list(_streams(world, n))[:2]):
        spec = MaskSpec(causal=True, window=(5, 0), cu_seqlens=tuple(cu))
        plain = pl._place_cached.__wrapped__(spec, world, n, 1, None, cut=0.5)
        with placed_forced(group=1, cut=0.5, even="dense", tolerance=tolerance):
            lay = placement(cu, n, window=(5, 0))
            said = "(dense)" if tolerance is None else f"(dense, to {tolerance:g})"
            assert f"the groups' work evened {said}" in lay.note, lay.note
            changed += lay.placement != plain.placement
            for case in CASES[:3]:  # causal, causal windowed, bidirectional windowed; fp32
                seen.append(_check(rank, world, case, cu, n, seed=90 + i))
    return changed, seen


@pytest.mark.parametrize("world", [3, 5])
def test_evened_groups_against_reference(world):
    """Placements whose groups' work is evened by exchanges of tokens (densest pieces for lightest, a piece cut where
    the sizes meet): exact against fp64 with the byte counters equal to the plan's, causal and windowed, on odd
    worlds; the evening moved something on at least one stream."""
    results = run_distributed(_even_worker, world, 12, timeout=TIMEOUT_S)
    assert all(r[1] == results[0][1] for r in results)  # one placement on every rank
    assert results[0][0] >= 1


def test_loosely_evened_groups_against_reference():
    """The same, the groups evened only to within 4% of the mean (``EVEN_LOOSE``), at 4 ranks."""
    results = run_distributed(_even_worker, 4, 12, 0.04, timeout=TIMEOUT_S)
    assert all(r[1] == results[0][1] for r in results)
    assert results[0][0] >= 1


def _chunks_worker(rank, world, n):
    """:func:`_check` on placements of one group dealt in mirrored chunks (``distattn.schedule.deal``): two long
    documents (one mirrored), and the solver's random streams; returns the placements."""
    total, seen = world * n, []
    with placed_forced(group=world, chunks=True, short_first=True):
        for i, cu in enumerate([[0, 3, 3 + (total - 5) // 2, total - 2, total], list(_streams(world, n))[1]]):
            lay = placement(cu, n)
            assert "mirrored chunks" in lay.note, lay.note
            for case in CASES:  # causal (fp32 GQA, fp16), causal windowed, bidirectional windowed
                seen.append(_check(rank, world, case, cu, n, seed=60 + i))
    return seen


def _window_chunks_worker(rank, world, n):
    """:func:`_check` on placements of one group dealt over windows in mirrored chunks (``distattn.schedule.windows``,
    share 0.25): two long documents (one mirrored) and a stream of the solver's; returns the placements."""
    total, seen = world * n, []
    for i, cu in enumerate([[0, 3, 3 + (total - 5) // 2, total - 2, total], list(_streams(world, n))[1]]):
        with placed_forced(group=world, share=0.25):
            snake = placement(cu, n)
        with placed_forced(group=world, share=0.25, chunks=True):
            lay = placement(cu, n)
            assert "in mirrored chunks over their windows" in lay.note, lay.note
            assert i or lay.placement != snake.placement  # the two long documents: in chunks, not in the snake
            for case in CASES:  # causal (fp32 GQA, fp16), causal windowed, bidirectional windowed
                seen.append(_check(rank, world, case, cu, n, seed=70 + i))
    return seen


@pytest.mark.parametrize("world", [3, 4])
def test_mirrored_chunks_over_windows_against_reference(world):
    """Documents over windows of their work with their long pieces in mirrored chunks (rank i of a window holding the
    piece's chunks i and 2w-1-i, every other piece mirrored): exact against fp64 with the byte counters equal to the
    plan's, causal, windowed and bidirectional, on an odd and an even world."""
    results = run_distributed(_window_chunks_worker, world, 40, timeout=TIMEOUT_S)  # 5 blocks of 8 tokens per rank
    assert all(r == results[0] for r in results)  # one placement on every rank


@pytest.mark.parametrize("world", [2, 5])
def test_mirrored_chunks_against_reference(world):
    """Documents dealt in mirrored chunks (each one's 2k chunks, rank i holding chunks i and 2k-1-i, every other
    document mirrored; a pair borrows only the rows its queries see, half a shard from one side): exact against fp64
    with the byte counters equal to the plan's, causal, windowed and bidirectional, on an even and an odd world."""
    results = run_distributed(_chunks_worker, world, 40, timeout=TIMEOUT_S)  # 5 blocks of 8 tokens per rank
    assert all(r == results[0] for r in results)  # one placement on every rank
