"""The plan object (:class:`Plan`) and the dense plans' runs; the schedules: the package docstring. ``make_plan``, which
picks the plan of a schedule and mask, is ``distattn.schedule.build``'s.

A plan is stored as *runs* (:class:`RunTable`): in one step, the ranks ``[start, stop)`` each compute
``(r + dq, r + dkv)`` at the same cost. The dense plans are one or two runs per step (ring: owners, wrapped or not;
balanced: helpers and owners), built as arrays, so a plan of P = 16384 ranks is ~3 x 10^4 runs, not the ~10^8 tasks
it describes. The executors read single tasks and transfers (:meth:`Plan.task`, :meth:`Plan.fetches`), the simulator
and the cost model read the runs as arrays. Masked plans (``distattn.schedule.masked``) are built from the sparse pairs
with work and stored as runs of neighbouring equal tasks. Pure Python + numpy.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from distattn.schedule.layouts import HEAD, Layout
from distattn.schedule.pairs import PairTable, SpanView, WorkView

SCHEDULES = ("ring", "balanced", "zigzag", "placed")
PHASES = ("forward", "backward")
__all__ = ["SCHEDULES", "PHASES", "HEAD", "Task", "Transfer", "RunTable", "Plan", "head_rows"]


@dataclass(frozen=True)
class Task:
    """One (query chunk, kv chunk) pair computed by ``rank`` at some step."""

    rank: int  # who computes
    q_chunk: int  # query chunk index (== owner rank of the queries)
    kv_chunk: int  # kv chunk index (== owner rank of the keys/values)

    def __post_init__(self):
        assert self.rank in (self.q_chunk, self.kv_chunk), f"{self} computed by a rank owning neither"

    @property
    def is_local(self) -> bool:
        """Needs no communication: the rank's own queries against its own kv."""
        return self.q_chunk == self.kv_chunk == self.rank

    @property
    def is_helper(self) -> bool:
        """Computed by the kv owner on behalf of the query owner (needs q in, partial out back)."""
        return self.rank == self.kv_chunk != self.q_chunk

    @property
    def is_diagonal(self) -> bool:
        """Query and kv chunk coincide; under a causal mask this pair is half the work."""
        return self.q_chunk == self.kv_chunk


@dataclass(frozen=True)
class Transfer:
    """One point-to-point message. ``kind`` per phase:

    forward:  "kv" (k, v to a query owner), "q" (query chunk to a helper),
              "out" (helper's fp32 partial out + lse back to the query owner);
    backward: "kv", "q" (q, dout, lse, delta to a helper), "dkv" (fp32 dk, dv partial back to the kv
              owner), "dq" (fp32 dq partial back to the query owner).
    """

    src: int
    dst: int
    kind: str
    chunk: int  # whose data it is (the chunk index of the payload)
    step: int

    def __post_init__(self):
        assert self.src != self.dst, f"{self} sends to itself"


@dataclass(frozen=True, eq=False)
class RunTable:
    """Every run of a plan as read-only arrays, one entry per run, sorted by step then rank: in step ``step[k]`` the
    ranks ``r`` in ``[start[k], stop[k])`` compute ``(r + dq[k], r + dkv[k])``, each task ``cost[k]`` (units of one
    full ``n x n`` pair). ``dq == 0``: owner tasks (``dkv == 0`` too: local); ``dkv == 0``: helper tasks (the kv
    owner computes for query owner ``r + dq``). ``keys[k]``: how many kv rows an owner task borrows (its k/v rows in,
    its dk/dv partial back; :meth:`Plan.key_ranges`), ``-1``: the whole shard. Runs of step t are the entries
    ``offsets[t]:offsets[t + 1]``."""

    step: np.ndarray
    start: np.ndarray
    stop: np.ndarray
    dq: np.ndarray
    dkv: np.ndarray
    cost: np.ndarray
    keys: np.ndarray
    offsets: np.ndarray

    @classmethod
    def build(cls, n_steps: int, step, start, stop, dq, dkv, cost, keys=-1) -> "RunTable":
        *ints, cost = np.broadcast_arrays(*(np.asarray(x, dtype=np.int64) for x in (step, start, stop, dq, dkv, keys)),
                                          np.asarray(cost, dtype=np.float64))  # scalars: the same in every run
        order = np.lexsort((ints[1], ints[0]))  # by step, then by first rank
        cols = [x[order] for x in ints[:5]] + [cost[order], ints[5][order]]
        offsets = np.searchsorted(cols[0], np.arange(n_steps + 1), side="left")
        for arr in (*cols, offsets):
            arr.flags.writeable = False
        return cls(*cols, offsets)

    def __len__(self) -> int:
        return len(self.step)

    def rows(self, step: int) -> list[tuple[int, int, int, int]]:
        """``(start, stop, dq, dkv)`` of the runs of ``step``, as Python ints."""
        lo, hi = self.offsets[step], self.offsets[step + 1]
        return list(zip(*(col[lo:hi].tolist() for col in (self.start, self.stop, self.dq, self.dkv))))


def head_rows(counts, share: float = HEAD) -> int:
    """The rows ``[0, h)`` of a local pair computed as its head (:data:`HEAD`): the fewest leading rows whose visible
    keys (``counts``, per query row of the pair) reach ``share`` of the pair's, kept within ``[1, rows - 1]`` so that
    both parts hold a row (``0`` for a pair of one row: no head; a pair with no visible key splits at its middle)."""
    counts = np.asarray(counts, dtype=np.int64)
    rows = len(counts)
    if rows < 2:
        return 0
    cum = np.cumsum(counts)
    if cum[-1] <= 0:
        return rows // 2
    h = int(np.searchsorted(cum, share * cum[-1], side="left")) + 1  # the first row whose prefix reaches the share
    return min(max(h, 1), rows - 1)


def _sort_key(tr: Transfer):
    return (tr.src, tr.dst, tr.kind, tr.chunk)


def _check_phase(phase: str) -> None:
    if phase not in PHASES:
        raise ValueError(f"phase={phase!r} is not one of {PHASES}; pass phase='forward' or 'backward'")


def _fetch(task: Task, step: int) -> Transfer | None:
    """The input a task needs from another rank (same kinds in both phases; payloads differ)."""
    if task.is_local:
        return None
    if task.is_helper:
        return Transfer(task.q_chunk, task.rank, "q", task.q_chunk, step)
    return Transfer(task.kv_chunk, task.rank, "kv", task.kv_chunk, step)


def _return(task: Task, step: int, phase: str) -> Transfer | None:
    """The partial result a task sends back to the owner of the data it borrowed."""
    if task.is_local:
        return None
    if task.is_helper:  # partial belongs to the query owner
        kind = "out" if phase == "forward" else "dq"
        return Transfer(task.rank, task.q_chunk, kind, task.q_chunk, step)
    if phase == "forward":  # owner computed with borrowed kv: its output is already at home
        return None
    return Transfer(task.rank, task.kv_chunk, "dkv", task.kv_chunk, step)


@dataclass(frozen=True, eq=False)
class Plan:
    """An immutable schedule: the runs of every step (``run_table``); every rank computes at most one task per step.
    Built by :func:`make_plan`, which caches it: one object per arguments."""

    world_size: int
    causal: bool
    schedule: str
    run_table: RunTable
    work: WorkView | _DenseZigzagWork | None = None
    """Visible (query, key) pairs of every (q chunk, kv chunk) pair, ``work[i][j]``, for plans built from a mask
    (``distattn.schedule.pairs.WorkView``: the pairs with work, 0 for every other) and for zigzag (else None)."""
    chunk: int | None = None
    """Tokens per chunk the work was computed for (mask and zigzag plans only)."""
    layout: Layout | None = None
    """Which positions each rank holds (``None``: contiguous, rank r holds ``[r*n, (r+1)*n)``)."""
    spans: tuple[SpanView, SpanView] | tuple[_DenseZigzagSpans, _DenseZigzagSpans] | None = None
    """``spans[0][i, j], spans[1][i, j]``: masked plans, ``distattn.schedule.masks.key_spans`` of the plan's mask and
    layout, read from the sparse pairs (``SpanView``); dense causal zigzag: the same in closed form
    (``_DenseZigzagSpans``); ``None``: whole shards."""
    pair_table: PairTable | None = None
    """Masked plans: the pairs with work (``distattn.schedule.pairs.PairTable``), whose ranges are the rows inside a
    span that the pair's queries see (:meth:`key_ranges`); ``None``: a span is seen whole."""
    runs: str = "forward"
    """The order of ``run_table``'s steps (:meth:`run_order`): ``"forward"``, the plan's own, or ``"backward"``, its
    steps reversed, the view the backward walks (unless its layout keeps the plan's order, ``Layout.backward``)."""

    def run_order(self, phase: str) -> "Plan":
        """The plan as ``phase`` runs it: its step ``t`` is the ``t``-th step that phase runs. The forward runs the
        steps in order; the backward in reverse. Step 0 holds every rank's local pair, which needs no fetch: first in
        the forward, it hides the next step's fetch; last in the backward, it hides the dk/dv partials the step before
        it returns, where in order the last step's return (fp32 by default: twice the k/v it borrowed) would wait
        alone at the end of the phase, and the reversed backward's first fetch is the forward's last step's (the
        plans run their heavy pairs early, so it is one of the light ones). On the per-pair timeline it takes the
        worst of 200 packed seeds per setting up to 0.06 of perfect balance lower (uniform at P = 8: 1.134x ->
        1.084x; ``bench/results/placement-sim/COMPARE-200-backward.md``) and dense plans by at most 0.005.
        A placed layout may keep the plan's order in the backward too (``Layout.backward == "forward"``: the
        placement solver times both and keeps the faster). Every walker of a phase reads this: the executor
        (``distattn.executor.Executor._run``), its memory replay (``distattn.memory.executor``), the per-pair timeline
        and the cost model. Cached: one view per plan."""
        _check_phase(phase)
        flip = phase == "backward" and (self.layout is None or self.layout.backward == "reversed")
        return self if self.runs == ("backward" if flip else "forward") else self._flipped

    @property
    def prefetch(self) -> int:
        """How many steps ahead the executor posts a step's fetch (``Layout.prefetch``: 1 but for placed layouts the
        solver deepened); ``prefetch + 1`` fetch rounds' receive buffers alternate. Read by every walker of a phase
        (the executor, its memory replay, the per-pair timeline and ``rank_events``)."""
        return 1 if self.layout is None else self.layout.prefetch

    @property
    def return_depth(self) -> int:
        """How many steps after posting a step's return round the executor waits for it and absorbs its partials
        (``Layout.return_depth``: 1 but for placed layouts the solver deepened); ``return_depth + 1`` return rounds'
        receive buffers alternate. Read by every walker of a phase, as :attr:`prefetch`."""
        return 1 if self.layout is None else self.layout.return_depth

    @functools.cached_property
    def _flipped(self) -> "Plan":
        """The plan with its steps reversed, as the other phase runs it (its own ``_flipped``: this plan)."""
        rt, last = self.run_table, self.num_steps() - 1
        table = RunTable.build(last + 1, last - rt.step, rt.start, rt.stop, rt.dq, rt.dkv, rt.cost, rt.keys)
        flipped = dataclasses.replace(self, run_table=table, runs="forward" if self.runs == "backward" else "backward")
        flipped.__dict__["_flipped"] = self  # frozen: cached_property writes the instance dict directly, as here
        return flipped

    @property
    def head(self) -> float:
        """The share of a local pair's work computed before step 0 in this view of the plan (:meth:`run_order`): in
        the backward's reversed view, whose last step holds the local pairs, :data:`HEAD` (but where the placement
        solver found none faster, ``Layout.head``); 0 in the plan's own order (the forward's, and the backward's of a
        layout that keeps it: there the local pair is first)."""
        if self.runs != "backward":
            return 0.0
        return HEAD if self.layout is None or self.layout.head else 0.0

    def head_task(self, rank: int) -> Task | None:
        """The local pair ``rank`` starts computing before step 0 (its first rows, :func:`head_rows`; the rest at the
        last step), or ``None``: no head in this view (:attr:`head`), a plan of one step (no fetch to hide: one rank),
        or the rank's last step is not its local pair. Read by the executor (``distattn.executor.Executor._run``), its
        memory replay, the per-pair timeline and ``rank_events``."""
        if not self.head or self.num_steps() < 2:
            return None
        task = self.task(self.num_steps() - 1, rank)
        return task if task is not None and task.is_local else None

    def key_ranges(self, q_chunk: int, kv_chunk: int) -> tuple[tuple[int, int], ...] | None:
        """The local rows of ``kv_chunk``'s k/v that ``q_chunk``'s queries see, as ascending ranges inside
        :meth:`key_span`: what an owner task borrows (the ranges packed one after the other) and whose dk/dv partial
        it returns. Rows between them (other documents, or past every query's reach) do not travel. ``None``: the
        whole shard (dense plans)."""
        if self.spans is None:
            return None
        if self.pair_table is None:
            return (self.key_span(q_chunk, kv_chunk),)
        return self.pair_table.ranges(q_chunk, kv_chunk)

    def key_span(self, q_chunk: int, kv_chunk: int) -> tuple[int, int] | None:
        """``(a, b)``: the local rows ``[a, b)`` of ``kv_chunk``'s k/v that ``q_chunk``'s queries see, the slice an
        owner task borrows and whose dk/dv partial it returns; ``None``: the whole shard (dense plans)."""
        if self.spans is None:
            return None
        return int(self.spans[0][q_chunk, kv_chunk]), int(self.spans[1][q_chunk, kv_chunk])

    def num_steps(self) -> int:
        return len(self.run_table.offsets) - 1

    @functools.cached_property
    def steps(self) -> tuple[tuple[Task, ...], ...]:
        """``steps[t]``: the tasks of step t sorted by rank (built on first use: one object per task; the simulator
        and the cost model never need it)."""
        return tuple(self._tasks(s) for s in range(self.num_steps()))

    def _tasks(self, step: int) -> tuple[Task, ...]:
        return tuple(Task(r, r + dq, r + dkv) for start, stop, dq, dkv in self.run_table.rows(step)
                     for r in range(start, stop))

    def task(self, step: int, rank: int) -> Task | None:
        """The task ``rank`` computes at ``step``, or None when it is idle."""
        rt = self.run_table
        lo, hi = rt.offsets[step], rt.offsets[step + 1]
        k = lo + int(np.searchsorted(rt.start[lo:hi], rank, side="right")) - 1  # the last run starting <= rank
        if k < lo or rank >= rt.stop[k]:
            return None
        return Task(rank, rank + int(rt.dq[k]), rank + int(rt.dkv[k]))

    def fetches(self, step: int, phase: str = "forward") -> tuple[Transfer, ...]:
        """Inputs that step ``step``'s tasks need, sorted by (src, dst, kind): post in this order."""
        _check_phase(phase)
        found = (_fetch(t, step) for t in self._tasks(step))
        return tuple(sorted((tr for tr in found if tr is not None), key=_sort_key))

    def returns(self, step: int, phase: str = "forward") -> tuple[Transfer, ...]:
        """Partial results produced at step ``step``, sorted by (src, dst, kind)."""
        _check_phase(phase)
        found = (_return(t, step, phase) for t in self._tasks(step))
        return tuple(sorted((tr for tr in found if tr is not None), key=_sort_key))

    def rank_ops(self, step: int, rank: int, phase: str = "forward", which: str = "fetch"):
        """``(sends, recvs)`` of ``rank`` among the step's fetches (``which="fetch"``) or returns, each in the order
        of :meth:`fetches` / :meth:`returns` (how sends meet their receives).

        What the executor reads every step, so it costs O(runs of the step) in numpy, not a task per rank: the
        transfers ``rank`` receives are those of its own task (fetches) or those of the tasks that borrowed its data
        (returns), and the ones it sends the other way round; a run's task borrows from ``rank`` when ``rank - dkv``
        (an owner task's kv) or ``rank - dq`` (a helper task's queries) is one of the run's ranks. Memoized on the
        plan: the later calls of a batch (every layer, forward and backward) read each round back."""
        key = (step, rank, phase, which)
        if key not in self._rank_ops:  # every layer's calls walk the same plan: each round is derived once
            self._rank_ops[key] = self._derive_rank_ops(step, rank, phase, which)
        return self._rank_ops[key]

    @functools.cached_property
    def _rank_ops(self) -> dict:
        return {}

    def _derive_rank_ops(self, step: int, rank: int, phase: str, which: str):
        if which not in ("fetch", "return"):
            raise ValueError(f"which={which!r} is not one of ('fetch', 'return'); pass one of them")
        _check_phase(phase)
        own = self.task(step, rank)
        mine = ()
        if own is not None:
            tr = _fetch(own, step) if which == "fetch" else _return(own, step, phase)
            mine = () if tr is None else (tr,)
        rt = self.run_table
        lo, hi = rt.offsets[step], rt.offsets[step + 1]
        start, stop, dq, dkv = rt.start[lo:hi], rt.stop[lo:hi], rt.dq[lo:hi], rt.dkv[lo:hi]
        helper = (dkv == 0) & (dq != 0)
        owner = (dq == 0) & (dkv != 0)
        if which == "return" and phase == "forward":
            owner[:] = False  # an owner's forward output is already at home: nothing comes back
        borrower = np.where(helper, rank - dq, rank - dkv)  # the rank of each run that would borrow from ``rank``
        hit = (helper | owner) & (start <= borrower) & (borrower < stop)
        theirs = []
        for k in np.flatnonzero(hit).tolist():
            task = Task(int(borrower[k]), int(borrower[k] + dq[k]), int(borrower[k] + dkv[k]))
            theirs.append(_fetch(task, step) if which == "fetch" else _return(task, step, phase))
        theirs.sort(key=_sort_key)
        return (mine, tuple(theirs)) if which == "return" else (tuple(theirs), mine)

    def pairs(self) -> list[tuple[int, int]]:
        """All (q_chunk, kv_chunk) pairs, in step order then rank order."""
        return [(t.q_chunk, t.kv_chunk) for s in range(self.num_steps()) for t in self._tasks(s)]

    def num_tasks(self) -> int:
        """How many (q chunk, kv chunk) pairs the plan computes (without listing them)."""
        return int((self.run_table.stop - self.run_table.start).sum())

    def render(self) -> str:
        """ASCII picture of the plan (rows = steps, columns = ranks, ``h`` = helper task)."""
        kind = "causal" if self.causal else "non-causal"
        lines = [f"P={self.world_size}, {kind}, {self.schedule}"]
        lines.append("step  " + "".join(f"{'rank' + str(r):<8}" for r in range(self.world_size)).rstrip())
        for s in range(self.num_steps()):
            cells = [_cell(self.task(s, r)) for r in range(self.world_size)]
            lines.append(f"{s:>4}  " + "".join(cells).rstrip())
        return "\n".join(lines)


def _cell(task: Task | None) -> str:
    if task is None:
        return "  .     "
    return f"({task.q_chunk},{task.kv_chunk}){'h' if task.is_helper else ''}".ljust(8)


# -- dense plans, run by run ------------------------------------------------------------------------------------


def _ring_runs(p: int, causal: bool, diag: float, off: float) -> RunTable:
    """Step t: every rank r computes (r, r - t) with kv fetched from r - t (non-causal: mod P, so the ranks r < t
    are a second run with kv chunk r - t + P); causal ranks r < t idle."""
    t = np.arange(1, p)
    steps, starts, stops, dkvs = [[0], t], [[0], t], [[p], np.full(p - 1, p)], [[0], -t]
    if not causal:
        steps, starts, stops, dkvs = steps + [t], starts + [0 * t], stops + [t], dkvs + [p - t]
    cat = np.concatenate
    cost = np.where(cat(dkvs) == 0, diag, off)
    return RunTable.build(p, cat(steps), cat(starts), cat(stops), 0, cat(dkvs), cost)


def _balanced_causal_runs(p: int) -> RunTable:
    """Diagonals, then distance d (owners) paired with distance P - d (helpers); even P ends with P/2. At step d,
    ranks r < d have no distance-d pair: they help with (r + P - d, r); owners i >= d compute (i, i - d)."""
    d = np.arange(1, (p + 1) // 2)  # d = 1 .. ceil(P/2) - 1
    half = np.arange(p // 2, p // 2 + 1) if p > 1 and p % 2 == 0 else d[:0]  # distance P/2: half the ranks idle
    cat = np.concatenate
    step = cat([[0], d, d, half])
    start, stop = cat([[0], 0 * d, d, half]), cat([[p], d, p + 0 * d, p + 0 * half])
    dq, dkv = cat([[0], p - d, 0 * d, 0 * half]), cat([[0], 0 * d, -d, -half])
    return RunTable.build(len(d) + len(half) + 1, step, start, stop, dq, dkv, np.where(step == 0, 0.5, 1.0))


def _check_runs(p: int, causal: bool, rt: RunTable) -> None:
    """Internal invariants of a dense plan, in O(runs): runs of a step are disjoint and inside the group, tasks are
    owner or helper tasks, and every required pair is computed exactly once. A run covers the pairs at distance
    ``q - kv = dq - dkv`` with queries ``[start + dq, stop + dq)``; per distance these intervals must tile the
    required queries (causal: distances 0..P-1, queries d..P-1; non-causal: -(P-1)..P-1, all valid queries)."""
    same_step = rt.step[1:] == rt.step[:-1]
    assert np.all(rt.stop[:-1][same_step] <= rt.start[1:][same_step]), "runs of a step overlap or are unsorted"
    assert np.all((rt.dq == 0) | (rt.dkv == 0)), "a task computed by a rank owning neither chunk"
    for lo, hi in ((rt.start, rt.stop), (rt.start + rt.dq, rt.stop + rt.dq), (rt.start + rt.dkv, rt.stop + rt.dkv)):
        assert np.all((0 <= lo) & (lo < hi) & (hi <= p)), f"P={p}: a run leaves the group"
    d, q_lo, q_hi = rt.dq - rt.dkv, rt.start + rt.dq, rt.stop + rt.dq
    order = np.lexsort((q_lo, d))
    d, q_lo, q_hi = d[order], q_lo[order], q_hi[order]
    first = np.append(True, d[1:] != d[:-1])
    last = np.append(d[1:] != d[:-1], True)
    want = np.arange(0 if causal else 1 - p, p)
    assert np.array_equal(d[first], want), f"P={p} causal={causal}: distances {d[first]} != {want}"
    assert np.array_equal(q_lo[first], np.maximum(0, want)) and np.array_equal(q_hi[last], p + np.minimum(0, want))
    assert np.array_equal(q_hi[~last], q_lo[1:][~last[:-1]]), f"P={p}: queries of a distance do not tile once"


# -- zigzag: closed-form work ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _DenseZigzagWork:
    """``work[i][j]`` of the dense zigzag layout (rank r holds chunks r and 2P-1-r of ``n / 2`` tokens), in closed
    form, equal to ``pair_work(MaskSpec(causal=causal), P, n, Layout("zigzag", P))``: causal, an off-diagonal
    shard pair sees two of its four chunk pairs fully (``n^2 / 2``), a diagonal one a full chunk pair and two
    causal diagonals (``n^2 / 2 + n / 2``); non-causal, everything (``n^2``)."""

    world_size: int
    n: int
    causal: bool

    @property
    def diagonal(self) -> int:
        return self.n * self.n // 2 + self.n // 2 if self.causal else self.n * self.n

    @property
    def off_diagonal(self) -> int:
        return self.n * self.n // 2 if self.causal else self.n * self.n

    def __len__(self) -> int:
        return self.world_size

    def __getitem__(self, i: int) -> tuple[int, ...]:
        if not 0 <= i < self.world_size:
            raise IndexError(i)
        return tuple(self.diagonal if j == i else self.off_diagonal for j in range(self.world_size))

    def __iter__(self):
        return (self[i] for i in range(self.world_size))


@dataclass(frozen=True)
class _DenseZigzagSpans:
    """One side of ``key_spans(MaskSpec(causal=True), P, n, Layout("zigzag", P))`` in closed form, indexed
    ``[q rank, kv rank]`` like the array it stands for (which would hold P^2 entries: 2 GiB at 16384 ranks). Rank
    ``i``'s chunks ``i`` and ``2P-1-i`` see of an earlier rank ``j < i`` only its first chunk ``j``, the local rows
    ``[0, n/2)``; of a later rank both chunks (``2P-1-j`` precedes ``2P-1-i``); the diagonal, everything."""

    n: int
    stop: bool  # False: the first row of the span (always 0); True: the row after its last

    def __getitem__(self, ij: tuple[int, int]) -> int:
        i, j = ij
        return (self.n // 2 if j < i else self.n) if self.stop else 0


@functools.lru_cache(maxsize=None)
def _make_plan_cached(p: int, causal: bool, schedule: str) -> Plan:
    if schedule == "balanced" and causal:
        runs = _balanced_causal_runs(p)
    else:
        runs = _ring_runs(p, causal, 0.5 if causal else 1.0, 1.0)
    _check_runs(p, causal, runs)
    return Plan(world_size=p, causal=causal, schedule=schedule, run_table=runs)


@functools.lru_cache(maxsize=64)
def _make_zigzag_plan(p: int, causal: bool, n: int) -> Plan:
    """Every (i, j) pair in ring order. Causal: a query rank ``i`` sees only the first chunk (``j``) of an earlier kv
    rank ``j < i`` (its chunk ``2P-1-j`` lies after both of ``i``'s), so those pairs borrow the first half of the kv
    shard (``key_spans``), a quarter less k/v and dk/dv on the wire than whole shards."""
    work = _DenseZigzagWork(p, n, causal)
    runs = _ring_runs(p, False, work.diagonal / n ** 2, work.off_diagonal / n ** 2)  # every (i, j) has work
    _check_runs(p, False, runs)
    layout, spans = Layout("zigzag", p), None
    if causal:
        spans = (_DenseZigzagSpans(n, False), _DenseZigzagSpans(n, True))
        runs = RunTable.build(len(runs.offsets) - 1, runs.step, runs.start, runs.stop, runs.dq, runs.dkv, runs.cost,
                              np.where(runs.dkv < 0, n // 2, -1))  # a run at dkv < 0: kv rank before query rank
    return Plan(world_size=p, causal=causal, schedule="zigzag", run_table=runs, work=work, chunk=n, layout=layout,
                spans=spans)
