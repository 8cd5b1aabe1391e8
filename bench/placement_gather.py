"""What-if: documents *gathered* over their windows, on the per-pair timeline (issue 39; a design study, modelled).

The executor fetches a document's keys pair by pair: a document dealt over ``w`` ranks costs each of its ranks up to
``w - 1`` messages per phase, and at P = 64 and 256 the per-message latency and the bytes of those messages hold the
worst seeds (``bench/results/placement-sim/LATENCY.md``). The design this bench weighs, not built in the executor:
a document whose blocks lie on ``min_ranks`` ranks or more has its k/v *all-gathered* over the smallest aligned
power-of-two window of ranks holding it, in stages of radix ``R = 2^radix_bits`` (``--radix-bits``): ``R - 1`` rounds
per stage, ``log_R w`` stages, instead of ``w - 1`` messages (radix 2: recursive doubling, ``log2 w`` rounds; radix
``w``: every rank fetched directly, the whole document's rows):

* forward, stage ``s`` (the rank's ``s``-th digit of ``radix_bits`` bits), round ``t = 1 .. R - 1``: rank ``r`` fetches
  from the rank whose digit ``s`` is ``r``'s plus ``t`` (mod ``R``) everything that rank holds of the window's gathered
  documents by then, the rows of the ``R^s`` ranks of its block, and computes its rows against those keys (a
  permutation of the ranks per round); its own keys of the document fold into its local pair;
* backward, in reverse (largest rounds first): the same rows' dq, and the dk/dv partial of those keys returned to the
  rank fetched from (a reduce-scatter, each round's partial the sum of what the rank computed and received for that
  block; the rounds' sizes are the forward's, in fp32); the gathered k/v either kept from the forward (``--kept``: no
  fetch in the backward, each rank holding its documents' k/v per layer) or fetched again round by round (the
  default: the bytes of a second gather charged, a pessimistic count).

Every other document keeps today's pairs and the candidate's step order; the rounds are extra steps of the plan,
inserted ``first`` (right after the local pair), ``spread`` over the plan, or ``tail`` (the rounds first but the
last, which goes after ``prefetch`` of the other steps). A rank receives a round's block only where it sees keys in it
or forwards it in a later stage. The rounds are steps of every rank: one outside them idles there, and its fetch
depth counts those steps (``--compact``: a bound where they would not, every fetch posted as many steps further ahead
as there are rounds). The timeline (``distattn.schedule.timeline``) runs them as it runs any
step: a round meets its peer, rounds of a kind queue on their side stream, a compute waits for its round. Left out:
the adds of the reduction (as the absorbs are), kernel launches. Per seed: today's solve, then the gathered what-if
on the deals the solver times (its groups and windowed shares, ``--groups``) with every order and insertion, the
fastest kept. Modelled, not measured; no executor runs it.

    python bench/placement_gather.py --docs pile:4 --world 64 --seeds 193 --min-ranks 4 8 16 32 \
        --radix-bits 1 2 3 6 --kept

Causal masks only: under a window a rank needs only its window's keys, which the pairs fetch and a gather would not.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.placement_worst import _solved, spec_of  # noqa: E402
from distattn.schedule import MaskSpec  # noqa: E402
from distattn.schedule import timeline as tl  # noqa: E402
from distattn.schedule.layouts import ORDERS, PREFETCHES, RETURN_DEPTHS  # noqa: E402
from distattn.schedule.masked import matched_steps, rotation_steps  # noqa: E402
from distattn.schedule.pairs import _pieces, pair_table  # noqa: E402
from distattn.schedule.placement import _place_cached  # noqa: E402
from distattn.schedule.plan import Plan, RunTable  # noqa: E402
from distattn.schedule.timeline import phase_timeline  # noqa: E402

WHERE = ("first", "spread", "tail")


@dataclasses.dataclass(frozen=True)
class Gathered:
    """The gathered part of a layout: per rank ``r`` and round ``x`` the work (visible pairs) and the k/v rows it
    receives (``work[r, x]``, ``rows[r, x]``; 0 rows: no receive, for a rank outside the round's windows or one that
    neither sees nor forwards the block), from ``partner[r, x]``, and the pair table of the rest (the gathered
    documents' tokens as documents of one token each)."""

    work: np.ndarray
    rows: np.ndarray
    partner: np.ndarray
    block: np.ndarray
    """the first rank of the block whose rows ``partner`` holds by round ``x`` (``size[x]`` ranks)"""
    size: np.ndarray
    rest: object
    docs: int


def gather(spec: MaskSpec, p: int, n: int, layout, min_ranks: int, radix_bits: int = 1,
           tables: dict | None = None) -> Gathered | None:
    """The documents of ``layout`` on ``min_ranks`` ranks or more, gathered (module docstring); ``None``: none.
    ``tables``: the layout's pair tables kept across calls (the full one, and the rest's per set of documents)."""
    tables = {} if tables is None else tables
    cu = np.asarray(spec.documents(p * n), dtype=np.int64)
    start, stop, owner, _, doc_lo, _ = _pieces(spec, p, n, layout)
    doc = np.searchsorted(cu, doc_lo, side="right") - 1
    held = np.zeros((len(cu) - 1, p), dtype=np.int64)  # tokens of document d on rank j
    np.add.at(held, (doc, owner), stop - start)
    picked, window = [], {}
    for d in np.flatnonzero((held > 0).sum(axis=1) >= min_ranks).tolist():
        on = np.flatnonzero(held[d])
        w = 1 << int(np.ceil(np.log2(on[-1] - on[0] + 1)))
        while on[0] // w != on[-1] // w:
            w *= 2
        if w <= p and p % w == 0 and w > 1:
            picked.append(d)
            window[d] = (on[0] // w * w, w)
    if not picked:
        return None
    if tuple(picked) not in tables:
        bounds = [cu]
        for d in picked:  # the gathered documents' tokens as one-token documents: no pair of the rest sees them
            bounds.append(np.arange(cu[d], cu[d + 1] + 1, dtype=np.int64))
        rest_cu = tuple(int(x) for x in np.unique(np.concatenate(bounds)))
        tables[tuple(picked)] = pair_table(dataclasses.replace(spec, cu_seqlens=rest_cu), p, n, layout, cache=False)
    if "full" not in tables:
        tables["full"] = pair_table(spec, p, n, layout, cache=False)
    full, rest = tables["full"], tables[tuple(picked)]
    g = np.zeros((p, p), dtype=np.int64)  # the gathered documents' work of each pair (r, j)
    g[full.q, full.kv] += full.work
    g[rest.q, rest.kv] -= rest.work
    g[np.arange(p), np.arange(p)] = 0  # the local pair keeps all its work (``full``'s): see ``plans``
    bits = int(np.log2(max(w for _, w in window.values())))
    stages = [(lo, min(radix_bits, bits - lo)) for lo in range(0, bits, radix_bits)]
    rounds = [(lo, width, t) for lo, width in stages for t in range(1, 1 << width)]
    ranks = np.arange(p)
    work = np.zeros((p, len(rounds)), dtype=np.int64)
    rows = np.zeros((p, len(rounds)), dtype=np.int64)
    partner = np.zeros((p, len(rounds)), dtype=np.int64)
    block_of = np.zeros((p, len(rounds)), dtype=np.int64)
    inside = np.array([[window[d][0] <= r < window[d][0] + window[d][1] for d in picked] for r in range(p)])
    wins = np.array([window[d][1] for d in picked])
    for x, (lo, width, t) in enumerate(rounds):
        radix, size = 1 << width, 1 << lo
        digit = (ranks >> lo) & (radix - 1)
        partner[:, x] = ranks - (digit << lo) + (((digit + t) % radix) << lo)
        for r in range(p):
            block = partner[r, x] // size * size  # what the partner holds by now: its block of 2^lo ranks
            docs = inside[r] & (wins > size)
            work[r, x] = int(g[r, block:block + size].sum())
            block_of[r, x] = block
            if work[r, x] or (wins[docs] > size * radix).any():  # needed here, or forwarded in a later stage
                rows[r, x] = int(held[np.asarray(picked)[docs], block:block + size].sum())
    off = g.sum(axis=1) - work.sum(axis=1)
    assert not off.any(), f"gathered work outside the rounds: {off[off != 0][:4]}"
    assert (work[rows == 0] == 0).all()
    sizes = np.asarray([1 << lo for lo, _, _ in rounds])
    return Gathered(work, rows, partner, block_of, sizes, rest, len(picked))


def plans(gathered: Gathered, p: int, n: int, layout, full_local: np.ndarray, where: str):
    """The forward plan with the gathered rounds inserted (``where``), and the set of ``step * p + rank`` of the
    rounds in the backward's reversed view (whose fetches ``--kept`` drops)."""
    rest = gathered.rest
    steps = (rotation_steps(p, layout.group, rest) if layout.order == "rotation"
             else matched_steps(p, rest, layout.order))
    local = rest.q == rest.kv
    n_rest = int(steps.max()) + 1
    rounds = gathered.rows.shape[1]
    if where == "first":
        pos = [0] * rounds
    elif where == "spread":
        pos = [min(n_rest - 1, (i + 1) * (n_rest - 1) // (rounds + 1)) for i in range(rounds)]
    else:
        pos = [0] * (rounds - 1) + [min(n_rest - 1, layout.prefetch)]
    pos = np.asarray(pos)
    before = np.searchsorted(pos, np.arange(n_rest), side="left")  # rounds placed before rest step s
    rest_step = steps + before[steps]
    round_step = pos + 1 + np.arange(rounds)
    cost = np.where(local, full_local[rest.q], rest.work)  # the local pair: all its work, gathered documents' too
    r_idx, i_idx = np.nonzero(gathered.rows > 0)
    step = np.concatenate((rest_step, round_step[i_idx]))
    start = np.concatenate((rest.q, r_idx))
    dkv = np.concatenate((rest.kv - rest.q, gathered.partner[r_idx, i_idx] - r_idx))
    costs = np.concatenate((cost, gathered.work[r_idx, i_idx])) / n ** 2
    keys = np.concatenate((np.where(local, -1, rest.seen), gathered.rows[r_idx, i_idx]))
    n_steps = int(step.max()) + 1
    assert len(np.unique(step * p + start)) == len(step), "a rank with two tasks in one step"
    table = RunTable.build(n_steps, step, start, start + 1, 0, dkv, costs, keys)
    plan = Plan(world_size=p, causal=True, schedule="placed", run_table=table, chunk=n, layout=layout)
    flipped = {int((n_steps - 1 - s) * p + r) for s, r in zip(round_step[i_idx].tolist(), r_idx.tolist())}
    return plan, flipped


@contextlib.contextmanager
def backward_fetch_dropped(codes: set, p: int):
    """The timeline with the backward's fetches of the given ``step * p + rank`` tasks dropped (``--kept``)."""
    original = tl.transfer_spans
    codes = np.fromiter(codes, dtype=np.int64)

    def spans(plan, phase, which, sizes):
        s = original(plan, phase, which, sizes)
        if phase != "backward" or which != "fetch":
            return s
        assert (s.length == 1).all()  # one run per task here
        keep = ~np.isin(s.step * p + s.dst, codes)
        return type(s)(s.step[keep], s.src[keep], s.dst[keep], s.length[keep], s.size[keep])

    tl.transfer_spans = spans
    try:
        yield
    finally:
        tl.transfer_spans = original


def timed(plan, flipped, shapes, cluster, kept: bool, p: int, extra: int = 0) -> tuple[float, float]:
    """``(forward + backward makespan, perfect)`` of a gathered plan; ``extra``: fetches that many steps further
    ahead (``--compact``)."""
    depth = plan.prefetch + extra
    fwd = phase_timeline(plan, "forward", shapes, cluster, prefetch=depth)
    with backward_fetch_dropped(flipped if kept else set(), p):
        bwd = phase_timeline(plan, "backward", shapes, cluster, prefetch=depth)
    return fwd.makespan + bwd.makespan, fwd.perfect + bwd.perfect


def candidates(spec, p, n, cluster, today, groups):
    """The deals the what-if is timed on: today's layout, and each group size of ``groups`` dealt plain and over
    windows of every share, in mirrored chunks or not."""
    out = [today]
    for k in groups:
        for share in (None, 0.125, 0.25, 0.5, 1.0):
            for chunks in (False, True):
                lay = _place_cached.__wrapped__(spec, p, n, k, cluster, 1, None, share, "work", False, chunks)
                if lay is not None and lay.kind == "placed" and all(lay.placement != o.placement for o in out):
                    out.append(lay)
    return out


def study(docs: str, p: int, mask: str, seed: int, n: int, groups, min_ranks, radices, kept: bool,
          compact: bool = False) -> dict:
    """One seed: today's placement over perfect balance, and the fastest gathered what-if over the deals of
    :func:`candidates`, the ``min_ranks`` and ``radices`` (bits), every order and insertion, and how it was dealt."""
    if mask != "causal":
        raise ValueError(f"mask={mask!r}: the what-if gathers whole documents, for causal masks only")
    today, plan, cluster, shapes, _ = _solved(docs, p, mask, seed, n, None)
    base = tl.step_timeline(plan, shapes, cluster)
    spec = spec_of(docs, p, mask, seed, n)
    best, timed_ = (float("inf"),), 0
    for lay in candidates(spec, p, n, cluster, today, groups):
        tables = {"full": pair_table(spec, p, n, lay, cache=False)}  # one table per deal, every gather reads it
        full = tables["full"]
        full_local = np.zeros(p, dtype=np.int64)
        on = full.q == full.kv
        full_local[full.q[on]] = full.work[on]
        for m, radix in [(m, x) for m in min_ranks for x in radices]:
            g = gather(spec, p, n, lay, m, radix, tables)
            if g is None:
                continue
            for order in ORDERS:
                for where in WHERE:
                    cand = dataclasses.replace(lay, order=order, prefetch=PREFETCHES[-1],
                                               return_depth=RETURN_DEPTHS[-1], head=True, backward="reversed")
                    gplan, flipped = plans(g, p, n, cand, full_local, where)
                    t, perfect = timed(gplan, flipped, shapes, cluster, kept, p,
                                       g.rows.shape[1] if compact else 0)
                    assert abs(perfect - base["perfect"]) <= 1e-9 * perfect, (perfect, base["perfect"])
                    timed_ += 1
                    if t / perfect < best[0]:
                        best = (t / perfect, dict(group=lay.group, min_ranks=m, radix=1 << radix, order=order,
                                                  where=where, docs_gathered=g.docs, deal=lay.note.split(";")[0]))
    return {"docs": docs, "P": p, "seed": seed, "today": round(base["ratio"], 3), "gathered": round(best[0], 3),
            "plans timed": timed_, **(best[1] if len(best) > 1 else {})}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--seeds", type=int, nargs="+", required=True)
    ap.add_argument("--seq-per-rank", type=int, default=4096)
    ap.add_argument("--groups", type=int, nargs="+", help="group sizes to deal the what-if on (default: P)")
    ap.add_argument("--min-ranks", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--radix-bits", type=int, nargs="+", default=[1, 2, 3],
                    help="log2 of the gather's radix (1: recursive doubling; log2 w: every rank direct)")
    ap.add_argument("--compact", action="store_true",
                    help="a bound: every fetch posted as many steps further ahead as there are rounds (the rounds' "
                         "steps, empty on ranks outside them, no longer eat the prefetch depth)")
    ap.add_argument("--kept", action="store_true", help="the forward's gathered k/v kept for the backward")
    args = ap.parse_args(argv)
    for seed in args.seeds:
        r = study(args.docs, args.world, "causal", seed, args.seq_per_rank, args.groups or [args.world],
                  args.min_ranks, args.radix_bits, args.kept, args.compact)
        print(r, flush=True)


if __name__ == "__main__":
    main()
