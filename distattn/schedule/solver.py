"""The placement solver (``distattn.schedule.placement.place`` is its cached entry): candidate layouts of a packed
stream dealt, each one's plan timed on the per-pair timeline, the fastest kept.

The group size ``k`` (``distattn.schedule.placement``: groups of ``k`` ranks, each group's blocks dealt to its ranks)
is chosen by the plan it produces: for each divisor of ``P``, smallest first, the solver deals the blocks, builds
the placed plan (``distattn.schedule.masked``) and times one training step of it on the per-pair timeline
(``distattn.schedule.timeline``: the executor's own synchronisation, each message on its link) on the cluster
``schedule="auto"`` assumes (``DISTATTN_LINK`` / ``DISTATTN_GPUS_PER_NODE``, ``distattn.schedule.cluster``), with
:data:`ASSUMED_SHAPES`; it keeps the fastest. Small groups keep a document's blocks on few ranks (few bytes, and on
nodes of 8 the traffic stays on NVLink), large groups balance the work; the timeline weighs one against the other in
step time, so on InfiniBand the solver gives up balance for bytes where that is faster. A candidate is dropped early
when a rank's own rows' work already passes the best time (a rank computes its own rows, so that bounds the makespan
from below). The search starts at the smallest group whose dealt work balances within :data:`BALANCED` (so it is never
worse than that rule), climbs down and up the divisors while the step improves, and always tries a node's size.
With the group size chosen, the mirrored chunks and, with them or the snake, a cut document's shortest piece holding its
first rows (``distattn.schedule.groups``: a short end of a document would see every key of its long piece, one step per
rank that piece is dealt to) are timed on those groups and on twice them, and kept where faster: on the sweep's worst
causal seeds of uniform:8192 the snake's kv fetches (a whole shard per pair) outlast the compute they feed (P = 16, seed
161: 1.105x -> 1.079x of perfect balance on NVLink, the chunks), or a 64-token document end costs its rank 8 steps (P =
64, seed 188: 1.121x -> 1.091x, the shortest piece first); ``tests/test_deal.py``. Then the *windowed deal* of the
groups (``distattn.schedule.windows``: each document over an
aligned window of the ranks its work needs, not over the whole group, so a pair shares fewer documents and a step moves
fewer keys) is timed too, once per :data:`~distattn.schedule.windows.SHARES` and per rule for a block two documents
share (it goes with its heaviest piece, so a document's last rows stay with its window, or with its longest; and a
third deal keeps a short document beside its neighbour's rank, :data:`NEAR`; each timed, each wins on some seeds),
each with its long pieces over their windows in the snake and in mirrored chunks (:data:`WINDOW_CHUNKS`), and
kept where it is faster
(``bench/results/placement-sim/REFINE.md``: it lowers some of the worst seeds, never one on the timeline it is judged
by; the windowed deal kept is timed once more with a cut document's shortest piece first: uniform:8192 at P = 64, seed
83, 1.111x -> 1.098x, a document end on rank 32 borrowing from the 8 ranks of another group otherwise); up to
:data:`WIDER_MAX_RANKS` ranks also on groups of twice that size, where the plain deal was too slow but
windows keep the short documents on few ranks (``--docs pile:4``, P = 256, seed 197: 2.47x -> 2.31x of perfect
balance on NVLink, the windowed deal on groups of 128 where the climb chose 64). Candidates are dealt and timed under
``spec`` itself, window and causal flag included: a window is weighed both in the blocks' row work and in the timed
plan. The callers of the library (``make_placed_plan``,
``distattn.sharding.placement``, ``layout_of``) pass the documents and the call's window, causal
(``distattn.schedule.build.placement_mask``: the window's left side), so a windowed call's group is chosen for its
windowed work (``bench/results/placement-sim/DIAGNOSIS.md``: the group chosen for causal work left the worst windowed
seeds communication bound); the call's plan follows the window its shards were placed for
(``distattn.schedule.build.placed_window``). A windowed solve over up to :data:`FALLBACK_MAX_RANKS` ranks also times
the documents-only placement on the windowed plan and keeps it when it is faster (the deal by windowed row work is a
heuristic too: on InfiniBand it lost to the causal deal on some seeds, ``bench/results/placement-sim/DIAGNOSIS.md``), so
there it is never worse than that; and the documents dealt by causal work at the windowed solve's own group size, where
the documents-only solve chose another (longtail at P = 8, seed 118, window 4096: 1.110x -> 1.066x of perfect balance,
the deal by causal work in groups of 4 where the documents-only solve chose 8). Beyond that many ranks the
documents-only solve, a whole second solve, cost half the windowed solve or more and no longer won.

Under a left window the solver also times the *stream deal* (``distattn.schedule.streams``: a group's blocks in classes
by work, every rank a run of each) on every group size the climb timed and on one group (longtail, P = 64, window 4096,
seed 101: 1.211x -> 1.051x of perfect balance on NVLink, groups of 32).

Under a left window the solver also times *documents cut by their work* (``distattn.schedule.groups``): a document whose
windowed work passes :data:`CUTS` of a rank's mean is cut into consecutive pieces of about equal work before the groups
are dealt, so a long document no longer fills whole groups by their token room (its heavy rows alone on a few ranks) but
spreads in pieces that short documents fill around; under a window a piece borrows at most the window's keys from the
pieces before it. Timed on groups of 1, 2, the chosen size, half of it and every size the climb timed, at each cut, kept
where faster (the Pile at P = 64, seed 22, window 4096: one document of 65,353 tokens holds 58% of the work;
2.40x -> 1.46x of perfect balance on NVLink; causal work is never cut this way: the last piece would borrow the whole
document's keys). Half the chosen size helps where the climb chose groups whose windowed deal is communication bound
(longtail at P = 16: the worst of 200 windowed seeds 1.282x -> 1.244x, seed 157 1.280x -> 1.136x;
``bench/results/placement-sim/COMPARE-200-cut-halves.md``; the other sizes the climb timed: longtail at P = 16,
seed 111, 1.136x -> 1.054x on the node's 8 ranks where the climb chose 2, before the return depth below). Each cut is
timed twice: its pieces as cut, and each piece longer than :data:`PIECES` of a group's tokens cut again every that many
rows. A document's first rows see few keys, so its first piece of equal work is long and light: alone it fills a group's
token room and leaves the group short of work (the Pile at P = 16, seed 37: a rank at 0.53x of the mean work beside one
at 1.32x); two halves fill a group exactly and share it with heavier pieces (1.325x -> 1.235x of perfect balance). The
capped cut is timed once more with the groups' work evened (:data:`EVENED`, ``distattn.schedule.groups.even_groups``:
the heaviest group and the lightest exchange equal numbers of tokens, densest pieces for lightest, until every group is
within :data:`EVEN` of the mean), in each of its two exchange orders, up to :data:`EVEN_MAX_RANKS` ranks: the groups
hold equal tokens, and longest-first leaves them of unequal work where the heavy pieces do not fall evenly (longtail at
P = 16, seed 7: 1.133x -> 1.091x of perfect balance on groups of one rank where the climb chose 8; the Pile, seed 37:
1.163x -> 1.085x), and on groups of 1 or 2 ranks up to :data:`EVEN_LOOSE_MAX_RANKS` (one way up to
:data:`EVEN_WIDE_MAX_RANKS`) evened only to within :data:`EVEN_LOOSE`: fewer pieces move, so fewer pairs (the Pile
windowed at P = 64, seed 19: 1.134x -> 1.073x).

Every candidate deal is timed in each order of :data:`~distattn.schedule.layouts.ORDERS` (``Layout.order``,
``distattn.schedule.masked``) and keeps its fastest: the groups' ring rotations, or steps as *matchings* (every step a
rank fetches from one rank and sends to one), the pairs heaviest first or the ranks with most work left first, heavy
by work or by keys borrowed. After a windowed deal a rank holds few pairs of unequal weight, and the rotations, whose
steps are matchings only while every pair of a group has work, draw several fetches from one sender in a step and
set a heavy pair beside a light one; the matchings lowered the worst seeds most where the windowed deal wins (the
worst of 200 seeds of the Pile on NVLink: 1.61x -> 1.29x of perfect balance at P = 16, 1.91x -> 1.56x at P = 64;
``bench/results/placement-sim/COMPARE-200-orders.md``). A deal's pair table is built once for its orders and not
cached (only the chosen plan's is, when the library builds it). Each order's backward is timed twice, its steps
reversed (every plan's backward, ``Plan.run_order``: the local pair last hides the dk/dv return before it, its head
computed first hides the first fetch, ``Plan.head_task``) and in the plan's own order (``Layout.backward =
"forward"``), the forward once; a tie keeps the reversed one. The reversal alone lowered nearly every seed but slowed
48 of 3600 (mostly windowed at P = 64, by up to 0.04); with the choice no causal seed is slower than before and three
windowed ones are, by at most 0.011 (their documents-only fallback can change:
``bench/results/placement-sim/COMPARE-200-backward.md``). The layout chosen (at its depth, below) is then timed once
more each way, and reversed with the local pair whole at the last step (``Layout.head = False``: a head delays the first
step's compute and leaves less of the pair to hide the last return behind), and keeps the fastest (the Pile at P = 16,
window 4096: 4 of 200 seeds kept no head, 1 the plan's order, 195 both the reversal and the head; since the solver
times fetching up to 6 steps ahead and absorbing up to 4 steps later, all 2400 seeds at P = 8 and 16 keep both,
``bench/results/placement-sim/DEEPER-8-16.md``).

Every candidate is timed with the executor fetching as many steps ahead (``Layout.prefetch``, up to 12:
:data:`~distattn.schedule.layouts.PREFETCHES`; the executor posts each step's fetch ``depth`` steps before that step
computes, over ``depth + 1`` sets of receive buffers) and absorbing its partials as many steps after their round
(``Layout.return_depth``, up to 8, :data:`~distattn.schedule.layouts.RETURN_DEPTHS`, over ``return_depth + 1`` sets of
return buffers) as its buffers admit (``distattn.schedule.pool.deepest``: at most the bytes of 6 and 4 with
whole-shard buffers); the layout chosen is then timed at the shallower depths and takes the shallowest that no
deeper depth beats by :data:`DEEPER` per extra set of buffers, then likewise the return depth. A fetch round
reuses the buffers the compute before its posting read, so it cannot start before that compute is done on both ends: a
busy sender holds its peers back, and posting the round further ahead gives it more computes to travel behind. Timing
only the winner deeper (the solver before) chose among candidates by their step at depth 1, where a deal whose order
stalls on a busy sender loses to one that is faster only there (``bench/results/placement-sim/WORST-8-64-089630e.md``).
A return round needs both ends too: a rank absorbing its partials one step after their round cannot run more than two
steps ahead of the ranks it sends partials to or takes them from, and over a packed batch's uneven pairs that chain
holds back ranks no one overloads (the Pile at P = 16, seed 55: 1.154x of perfect balance absorbing a step later, 1.065x
three steps later; longtail windowed at P = 16, seed 33: 1.226x -> 1.104x, re-solved). Once the groups' work is evened
what is left on the worst windowed seeds is fetches and returns exposed behind short steps, which the deeper depths
hide: the Pile at P = 16, seed 149, 1.125x fetching at most 4 steps ahead and absorbing 3 steps later, 1.045x at 6
and 4 (``bench/results/placement-sim/DEEPER-8-16.md``). The memory is counted:
``distattn.memory.executor`` replays the plan's slots, and the planner counts the deepest for ``"placed"``.

Block size ``B``: :data:`BLOCK` = 64 tokens, a key tile of the Triton kernels (their ``BLOCK_N`` is 64 or 128), so
a block fills whole 64-key tiles and a shard's segments add few partly masked tiles; 64 rather than 128 because
the snake's symmetry holds per cycle of ``2k`` whole blocks, and twice the blocks leave half the remainder (at 64
ranks x 4096 tokens the simulator's makespan is 1.05-1.07x of perfect with 64-token blocks, 1.12-1.13x with 128;
``bench/results/placement-sim``). When ``n`` is not a multiple of 64 the largest power of two dividing ``n`` is used
(a stream of fewer than ``P * 64`` tokens gets smaller blocks); a long shard (more than
:data:`MAX_BLOCKS_PER_RANK` blocks of 64) gets the least larger power of two dividing ``n`` that leaves at most that
many (32768 tokens per rank: 128; a 2-D ring's ``U * n``-token shards alike; before, every ``n`` over 16384 fell back
to contiguous shards: longtail at P = 4 x 32768 tokens, 2.76x -> 1.00x of perfect balance on NVLink). When no power
of two will do (e.g. an odd ``n`` in the thousands) the solver falls back to the contiguous layout and says why, and
to what multiple to pad, in the layout's ``note``. A dense mask (one causal document) also falls back: the
balanced schedule is already optimal.

Cost: a deal, its pair table and one plan and timeline per order (:data:`~distattn.schedule.layouts.ORDERS`; the
backward's twice) per group size tried (3-4 of them), per deal with a cut document's shortest piece first (in mirrored
chunks or not, on one or two group sizes) and per windowed deal (5 shares x 3 block rules x the snake or chunks, on one
or two group sizes, often cut short by the bound above or dealt alike by two shares, timed once) and, under a window,
per cut (3 cuts, capped or not, on up to all the climb's group sizes, the capped ones evened two ways to 0.5% up to 32
ranks and, on groups of 1 and 2, to 2% and 4% up to 64 and 2% one way up to 256: 1.3-1.5x the windowed solve at P = 64,
1.1-1.2x at P = 16, ``EVEN-LOOSE.md``) and per stream deal (2 class counts on the climb's group sizes and one group: at
P = 64 the windowed solve's median CPU 1.7-1.8 s -> 2.5-2.8 s, ``STREAMS.md``), and 8 timelines of the chosen layout at
the shallower depths (on the pair table its timing built, kept); at 4096 tokens per rank the median over 200 seeds is
0.9-1.4 s of CPU at P = 64 on NVLink, 1.0-2.1 s on InfiniBand
(``bench/results/placement-sim/SWEEP-200-p8-64.md``, solver time of a causal mask, on 2 cores with a second sweep job
beside each solve, the solver of 447c42d; today's times the same candidates 6 steps ahead and absorbing 4 steps later,
under a window more cuts, and the chunked and shortest-first deals: at most 1.9 s causal and 4.5 s windowed over the 200
uniform seeds at P = 64, ``DEEPER-8-16.md``, a test suite beside; the depths cost no time: one solve alternated
between depths 4 and 3 and depths 6 and 4 took 4.0-4.3 / 3.6-3.7 s, uniform seed 83; 1a8cda0's solver: 1.6 / 3.6 s, and
7.4 s on the worst longtail and Pile seeds, ``WORST-8-64.md``, a test suite beside; earlier solvers' times are in
the results beside them), and up to 42 s (causal) / 40 s (windowed) on the worst seeds at P = 256 with the return depth
(``WORST-256.md``; 33 / 43 s with the solver of 447c42d, 30 / 49 s before it); before the windowed deal 3.4 s
(NVLink) / 8.2 s (IB) at P = 4096 (``tests/test_masked_scale.py`` bounds the CLI's plans there in time and memory). At
P = 8 and 16 the evened cuts add up to 1.8x (the worst windowed solve at P = 16: 1.0 s -> 1.8 s, a second job beside;
``EVEN-8-64.md``), the looser ones another 1.1-1.2x; the windowed deal in chunks too doubles the windowed candidates
(the worst P = 64 seeds: 9.5 s windowed against 5.1 s, ``WINDOW-CHUNKS.md``). The same candidates now cost 1.3-2.1x less
CPU, the same layouts on every case timed (a pair table's sums and row unions from one sort, the placed plan's steps as
arrays, the matched steps on bit masks, and an order whose forward plus its busiest rank's backward compute cannot beat
the step to beat not timed backward): 0.1-0.6 s at P = 16, 0.4-2.6 s on the worst seeds at P = 64 and 8-11 s at P = 256
(``bench/results/placement-sim/SOLVE-AHEAD.md``). Since 544df82 again with the same layout on every case timed (a deal
whose ``distattn.schedule.timeline.owner_bounds`` already lose builds no plan, a timeline stops once it reaches the step
to beat, a causal pair table is built per document and query rank, and beyond :data:`FALLBACK_MAX_RANKS` a windowed
solve no longer solves the documents-only placement too): 0.1-0.7 s at P = 16, 0.3-1.3 s on the worst seeds at P = 64,
5.0-7.9 s causal and 3.5-7.1 s windowed on the worst at P = 256, 1.4-1.7x and 2.6-4.1x less CPU there
(``bench/results/placement-sim/SOLVE-SPEED.md``). A training loop need not wait for it: :func:`solve_ahead` hands the
next batches' solves to worker processes while the step runs (``distattn.schedule.ahead``; ``launch/train.py``
asks two batches ahead). Pure Python + numpy.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from distattn.schedule.cluster import BWD_FLOP_FACTOR, Cluster, cluster_from_env
from distattn.schedule.deal import deal
from distattn.schedule.groups import RowWork, assign_groups, even_groups, group_loads
from distattn.schedule.layouts import BACKWARDS, ORDERS, PREFETCHES, RETURN_DEPTHS, Layout
from distattn.schedule.pool import deepest
from distattn.schedule.masked import masked_plan_of
from distattn.schedule.pairs import pair_table
from distattn.schedule.streams import STREAM_CLASSES
from distattn.schedule.masks import MaskSpec
from distattn.schedule.timeline import owner_bounds, phase_timeline
from distattn.schedule.settings import (BALANCED, CUTS, DEEPER, EVEN, EVEN_LOOSE, EVEN_LOOSE_MAX_GROUP,
                                       EVEN_LOOSE_MAX_RANKS, EVEN_MAX_RANKS, EVEN_WIDE_MAX_RANKS, EVENED,
                                       FALLBACK_MAX_RANKS, MAX_BLOCKS_PER_RANK, NEAR, PIECES, WIDER_MAX_RANKS,
                                       WINDOW_CHUNKS, block_size, pad_block, solve_shapes)
from distattn.schedule.windows import SHARES


@functools.lru_cache(maxsize=64)
def _place_cached(spec: MaskSpec, p: int, n: int, group: int | None = None, cluster: Cluster | None = None,
                  stride: int = 1, cut: float | None = None, share: float | None = None, by: str = "work",
                  capped: bool = False, chunks: bool = False, short_first: bool = False,
                  even: str | None = None, streams: int | None = None, tolerance: float = EVEN) -> Layout:
    """``group``: ``None`` chooses the group size (module docstring); a divisor of ``p`` forces it (the trade-off
    table of ``bench/placement_sim.py --groups``), and with it ``cut`` the documents cut by work
    (``distattn.schedule.groups``: pieces of at most ``cut`` of a rank's mean work; ``capped``: and of at most
    :data:`PIECES` of a group's tokens), ``share``, ``by`` the windowed deal (``distattn.schedule.windows``) and
    ``chunks``, ``short_first`` the mirrored chunks (``distattn.schedule.deal``) and a cut document's shortest piece
    first (``distattn.schedule.groups``), ``even`` the groups' work evened in that exchange order to within
    ``tolerance`` of the mean (``distattn.schedule.groups.even_groups``), ``streams`` the stream deal
    (``distattn.schedule.streams``); tests, benches, diagnosis."""
    if p == 1:
        return Layout("contiguous", 1, note="one rank: nothing to place")
    if spec.dense:
        return Layout("contiguous", p, note="dense mask: the balanced schedule is already optimal on contiguous "
                                           "shards (1 + P//2 steps causal)")
    b = block_size(n)
    if b is None:
        return Layout("contiguous", p, note=f"{n} tokens per rank split into blocks of a power of two leaves more "
                                            f"than {MAX_BLOCKS_PER_RANK} blocks per rank; pad to a multiple of "
                                            f"{pad_block(n)} to place the documents")
    cu = np.asarray(spec.documents(p * n), dtype=np.int64)
    starts, lengths = cu[:-1], np.diff(cu)
    keep = lengths > 0  # empty documents hold no tokens
    starts, lengths = starts[keep], lengths[keep]
    rows = RowWork(spec, lengths)
    whole = rows.prefix(np.arange(len(lengths)), lengths)
    cluster = cluster if cluster is not None else cluster_from_env()
    shapes = solve_shapes(n, stride)
    per_key = 4 * shapes.heads_q * shapes.head_dim * (1 + BWD_FLOP_FACTOR) / cluster.flops  # s per visible key

    mean = whole.sum() / p

    def dealt(k: int, limit: float = float("inf"), share: float | None = None, by: str = "work",
              cut: float | None = None, capped: bool = False, chunks: bool = False,
              short_first: bool = False, even: str | None = None, streams: int | None = None,
              tolerance: float = EVEN) -> Layout | None:
        """Groups of ``k``, or ``None`` as soon as a group's (then a dealt rank's) work passes ``limit`` per group: a
        document that fits a group (never cut), a group's documents, then a rank's blocks; loads only grow."""
        cut_work = None if cut is None else cut * mean
        if whole[(lengths <= k * n) & (whole <= (cut_work or np.inf))].max(initial=0) > limit:
            return None
        tokens = max(1, int(PIECES * k * n)) if capped and cut is not None else None
        pieces = assign_groups(starts, lengths, rows, p // k, k * n, np.inf if even else limit, cut_work, tokens,
                               short_first)
        if even and pieces is not None:  # the groups' work evened by exchanges of tokens between groups
            pieces = even_groups(pieces, starts, rows, p // k, tolerance, even)
            if group_loads(pieces, starts, rows, p // k).max() > limit:
                return None
        segments = None if pieces is None else deal(pieces, starts, rows, p, k, n, b, limit / k, share, mean, by,
                                                    NEAR if by == "near" else 0.0, chunks, streams)  # per rank
        if segments is None:
            return None
        how = "" if share is None else f", documents over windows of their work (share {share}, a block with " \
                                       f"its {'longest' if by == 'tokens' else 'heaviest'} piece" \
                                       f"{', a short document beside its neighbour' if by == 'near' else ''})"
        if cut is not None and (whole > cut_work).any():  # a cut that cuts nothing deals the documents whole
            how += f", documents cut by work (pieces of at most {cut} of a rank's mean" + \
                   (f" and {tokens} tokens)" if tokens else ")")
        how += f", documents in mirrored chunks{'' if share is None else ' over their windows'}" if chunks else ""
        how += ", a cut document's shortest piece first" if short_first else ""
        how += f", every rank a run of each of {streams} classes of blocks by work (the stream deal)" if streams else ""
        how += f", the groups' work evened ({even}{'' if tolerance == EVEN else f', to {tolerance:g}'})" if even else ""
        return Layout("placed", p, placement=segments, group=k, note=f"{p // k} groups of {k} ranks, blocks of {b} "
                                                                       f"tokens{how}")

    if group is not None:
        return dealt(group, share=share, by=by, cut=cut, capped=capped, chunks=chunks, short_first=short_first,
                     even=even, streams=streams, tolerance=tolerance)
    divisors = _divisors(p)
    times: dict[int, tuple[float, Layout | None]] = {}

    def timed(k: int) -> float:
        """The modelled step of groups of ``k`` (``inf`` when a rank's own rows' work, a lower bound of the makespan,
        already passes the best time so far: then the plan is never built)."""
        if k not in times:
            best = min((t for t, _ in times.values()), default=float("inf"))
            times[k] = fastest(dealt(k, best / per_key * k))
        return times[k][0]

    def fastest(lay: Layout | None, bound: float = float("inf")) -> tuple[float, Layout | None]:
        """The modelled step of ``lay`` in its fastest order (:data:`~distattn.schedule.layouts.ORDERS`; a tie: the
        first, rotation) and the layout with that order; ``(inf, None)`` for no layout, for segments another
        candidate of this solve dealt already (shares often deal alike: they were timed then), or for one no faster
        than ``bound`` (the caller keeps only a step under it): a deal whose bounds of any order's forward and backward
        (``distattn.schedule.timeline.owner_bounds``: compute, its side streams' rounds) reach ``bound`` builds no plan,
        an order's forward stops once it reaches ``bound`` less that backward bound, and an order whose forward plus
        its busiest rank's backward compute or the backward bound reaches ``bound`` is not timed backward; a backward
        stops once it reaches ``bound`` less its forward (``phase_timeline``'s ``stop_at``). Exact: the step and the
        layout returned are the same as with every order timed in full, for every candidate that can win."""
        if lay is None:
            return float("inf"), None
        digest = hash(lay.placement)  # the segments' hash, not the segments (at 4096 ranks they are 10^7 ints)
        if digest in seen:  # another candidate dealt the same blocks: timed already
            return float("inf"), None
        seen.add(digest)
        table, found = pair_table(spec, p, n, lay, cache=False), []  # one table, every order
        low_f, low_b = (x * (1 - 1e-9) for x in owner_bounds(table, n, shapes, cluster, stride))  # any order's
        if low_f + low_b >= bound:  # no order of this deal can win: none is built
            return float("inf"), None
        for order in ORDERS:
            cand = dataclasses.replace(lay, order=order, head=True)
            plan = masked_plan_of(p, "placed", spec, n, cand, table)
            fetch, keep = deepest(plan, PREFETCHES, RETURN_DEPTHS)  # at the deepest depths its buffers admit
            cand = dataclasses.replace(cand, prefetch=fetch, return_depth=keep)
            plan = dataclasses.replace(plan, layout=cand)
            forward = phase_timeline(plan, "forward", shapes, cluster, stride=stride,
                                     stop_at=(bound - low_b) * (1 + 1e-12))  # inf: this order cannot win
            fwd = forward.makespan
            if fwd + max(BWD_FLOP_FACTOR * float(forward.busy.max(initial=0.0)) * (1 - 1e-9), low_b) >= bound:
                continue  # the backward computes every task's work x BWD_FLOP_FACTOR: this order cannot win
            for backward in BACKWARDS:  # the backward's steps reversed (every plan's; a tie keeps it) or as planned
                timed = dataclasses.replace(cand, backward=backward)
                bwd = phase_timeline(dataclasses.replace(plan, layout=timed), "backward", shapes, cluster,
                                     stride=stride, stop_at=(bound - fwd) * (1 + 1e-12)).makespan  # inf: lost
                found.append((fwd + bwd, timed))
        if not found:
            return float("inf"), None
        t, fast = min(found, key=lambda tl: tl[0])
        if t < kept.get("time", float("inf")):  # the fastest deal so far: the depth pick reuses its table
            kept.update(time=t, digest=digest, table=table)
        return t, fast

    seen: set[int] = set()  # the placements timed (their hashes)
    kept: dict = {}  # the pair table of the fastest deal timed so far (one table, not one per candidate)

    # start from the smallest group whose dealt blocks balance (never worse than that rule), then climb down and up
    # the divisors while the modelled step improves; a node's size is always tried (on InfiniBand it keeps a group's
    # traffic on NVLink, a minimum the climb could miss)
    at = next(i for i, k in enumerate(divisors) if k == p or dealt(k, BALANCED * mean * k) is not None)
    timed(divisors[at])
    for step in (-1, 1):
        i = at + step
        while 0 <= i < len(divisors) and timed(divisors[i]) < times[divisors[i - step]][0] * (1 - 1e-9):
            i += step
    if p % cluster.gpus_per_node == 0:
        timed(cluster.gpus_per_node)
    k = min((k for k in times if times[k][1] is not None), key=lambda k: (round(times[k][0], 15), k))  # tie: small k
    best_time, best = times[k]
    wider = (k, 2 * k) if p % (2 * k) == 0 and p <= WIDER_MAX_RANKS else (k,)
    for kk, chunks in [(kk, chunks) for kk in wider for chunks in (True, False)]:  # a cut document's shortest
        t, lay = fastest(dealt(kk, best_time / per_key * kk, chunks=chunks, short_first=True),  # piece first
                         best_time * (1 - 1e-9))
        if t < best_time * (1 - 1e-9):
            best_time, best = t, lay
    windowed = None  # the windowed deal kept, if one is
    for kk, share, by, chunks in [(kk, s, by, c) for kk in wider for s in SHARES for by in ("work", "tokens", "near")
                                  for c in WINDOW_CHUNKS]:  # documents over windows of the groups, snake or chunks
        t, lay = fastest(dealt(kk, best_time / per_key * kk, share, by, chunks=chunks), best_time * (1 - 1e-9))
        if t < best_time * (1 - 1e-9):  # kept only where the timeline finds it faster
            best_time, best, windowed = t, lay, (kk, share, by, chunks)
    if windowed is not None:  # and that deal with a cut document's shortest piece first
        kk, share, by, chunks = windowed
        t, lay = fastest(dealt(kk, best_time / per_key * kk, share, by, chunks=chunks, short_first=True),
                         best_time * (1 - 1e-9))
        if t < best_time * (1 - 1e-9):
            best_time, best = t, lay
    if rows.l < n * p:  # a left window: documents cut by work, over 1 and 2 ranks, the chosen groups and their halves
        # and every group size the climb timed
        evened = [(EVEN, EVENED, False)] * (p <= EVEN_MAX_RANKS)  # (tolerance, exchange orders, a looser evening)
        evened += [(tol, EVENED, True) for tol in EVEN_LOOSE] * (p <= EVEN_LOOSE_MAX_RANKS)
        wide = EVEN_LOOSE_MAX_RANKS < p <= EVEN_WIDE_MAX_RANKS  # one tolerance, one way
        evened += [(tol, EVENED[:1], True) for tol in EVEN_LOOSE[:1]] * wide
        hows = ((False, None, EVEN, False), (True, None, EVEN, False),
                *((*how, tol, loose) for tol, ways, loose in evened for how in ways))
        sizes = sorted(({1, 2, k // 2, k} | set(times)) & set(divisors))
        for kk, cut, capped, even, tol in [(kk, c, *how[:3]) for kk in sizes for c in CUTS for how in hows
                                           if not how[3] or kk <= EVEN_LOOSE_MAX_GROUP]:
            t, lay = fastest(dealt(kk, best_time / per_key * kk, cut=cut, capped=capped, even=even, tolerance=tol),
                             best_time * (1 - 1e-9))
            if t < best_time * (1 - 1e-9):
                best_time, best = t, lay
        # and every rank a run of each class of its group's blocks (the stream deal)
        for kk, classes in [(kk, c) for kk in sorted((set(times) | {p}) & set(divisors)) for c in STREAM_CLASSES]:
            t, lay = fastest(dealt(kk, best_time / per_key * kk, streams=classes), best_time * (1 - 1e-9))
            if t < best_time * (1 - 1e-9):  # on every group size the climb timed and on one group
                best_time, best = t, lay
    if spec.window != (-1, -1) and p <= FALLBACK_MAX_RANKS:  # never worse than the documents-only placement, timed
        # on the same windowed plan (up to FALLBACK_MAX_RANKS ranks: beyond, half the solve for 1 win in 1000 seeds)
        causal = dataclasses.replace(spec, window=(-1, -1))
        plain = _place_cached(causal, p, n, None, cluster, stride)
        # and the documents' deal by causal work at this solve's group too (a heuristic beside the windowed deal)
        deals = [plain] + ([_place_cached(causal, p, n, best.group, cluster, stride)]
                           if plain.kind == "placed" and best.group != plain.group else [])
        for lay in deals:
            if lay is None or lay.kind != "placed" or lay.placement == best.placement:
                continue
            t, lay = fastest(lay, best_time * (1 - 1e-9))
            if t < best_time * (1 - 1e-9):
                what = "placement" if lay.group == plain.group else "deal by causal work"
                best_time, best = t, dataclasses.replace(lay, note=f"{_dealt_note(lay.note)} (the {what} of the "
                                                                   f"documents without the window: faster)")
    table = kept["table"] if kept.get("digest") == hash(best.placement) else pair_table(spec, p, n, best, cache=False)
    plan = masked_plan_of(p, "placed", spec, n, best, table)
    # the candidates were timed at the deepest depths: the prefetch depth, then the return depth, each the shallowest
    # that no deeper one beats by DEEPER per extra set of receive buffers
    for field, depths in (("prefetch", PREFETCHES), ("return_depth", RETURN_DEPTHS)):
        depths = tuple(d for d in depths if d <= getattr(best, field))  # up to the depth it was timed at
        times = {depths[-1]: best_time}
        for depth in depths[:-1]:
            shallower = dataclasses.replace(plan, layout=dataclasses.replace(best, **{field: depth}))
            times[depth] = sum(phase_timeline(shallower, phase, shapes, cluster, stride=stride).makespan
                               for phase in ("forward", "backward"))
        depth = next(d for d in depths if all(times[e] >= times[d] * (1 - DEEPER * (e - d)) for e in depths if e > d))
        best_time, best = times[depth], dataclasses.replace(best, **{field: depth})
        plan = dataclasses.replace(plan, layout=best)
    # the backward's three ways on that layout: reversed with the local pair's head first, reversed with the pair whole
    # at its last step, in the plan's order (the candidates were timed with the head); the first of the fastest
    ways = [best] + [way for way in (dataclasses.replace(best, backward="reversed", head=h) for h in (True, False))
                     if way != best]
    ways += [] if best.backward == "forward" else [dataclasses.replace(best, backward="forward")]
    bwd = [phase_timeline(dataclasses.replace(plan, layout=way), "backward", shapes, cluster, stride=stride).makespan
           for way in ways]
    i = min(range(len(ways)), key=lambda i: (round(bwd[i] / bwd[0], 9), i))  # the forward is the same every way
    best_time, best = best_time - bwd[0] + bwd[i], ways[i]
    how = "" if best.order == "rotation" else f", steps as matchings ({best.order})"
    how += ", the backward in the plan's order" if best.backward == "forward" else ""
    how += f", fetches {best.prefetch} steps ahead" if best.prefetch > 1 else ""
    how += f", partials absorbed {best.return_depth} steps after their round" if best.return_depth > 1 else ""
    how += ", the backward's local pair whole at its last step" if not best.head else ""
    return dataclasses.replace(best, note=f"{best.note}{how}; modelled step {best_time * 1e3:.3f} ms per layer on "
                                          f"{_cluster_name(cluster, p * stride)}")


def _dealt_note(note: str) -> str:
    """A solved layout's note without what the solve adds to its deal's (order, backward, depth, modelled step): those
    are said again for the layout they end up on."""
    note = note.split(";")[0]
    for added in (", steps as matchings", ", the backward in the plan's order", ", fetches ", ", partials absorbed",
                  ", the backward's local pair whole"):
        note = note.split(added)[0]
    return note


def _cluster_name(cluster: Cluster, ranks: int) -> str:
    if ranks <= cluster.gpus_per_node or cluster.inter == cluster.intra:
        return cluster.intra.name
    return f"nodes of {cluster.gpus_per_node} ({cluster.intra.name} inside, {cluster.inter.name} across)"


def _divisors(p: int) -> list[int]:
    return [k for k in range(1, p + 1) if p % k == 0]
