"""The receive pool of a plan, sized by what its rounds carry, and the depths a memory budget admits.

The executor (``distattn.executor.Executor.post``) receives each round into a pool of buffers, one set per
``(slot, kind, order in the round)``: the fetch rounds alternate over ``Plan.prefetch + 1`` slots, the return rounds
over ``Plan.return_depth + 1``. A buffer is made at its first use with the most rows any round of the phase receives
there (:func:`slot_rows`): a whole shard on dense plans, where every pair borrows the whole k/v shard, but on a placed
plan of packed documents a pair borrows only the key rows its queries see, often a small part of the shard, and its
buffers are that small. So a placed plan can fetch more steps ahead for the same bytes: the placement solver deepens
a plan (``Layout.prefetch`` up to ``PREFETCHES[-1]``, ``Layout.return_depth`` up to ``RETURN_DEPTHS[-1]``) only as far
as :func:`deepest` admits, where its pool and the sends it holds in flight stay within :data:`FETCH_SHARDS` whole k/v
shards (fetches) and :data:`RETURN_SHARDS` whole dk/dv partials (returns) on every rank: what a plan fetching 6 steps
ahead and absorbing 4 steps later held with whole-shard buffers, which the memory planner counts for a placed plan
(``distattn.memory.executor.attention_buffers``). A deeper plan thus never holds more than the planner counted.

:func:`slot_rows` walks one rank's rounds (the executor and its memory replay, ``distattn.memory.executor``, read it);
:func:`pool_rows` gives every rank's pool and in-flight sends at once from the plan's runs (the solver's check),
held equal to :func:`slot_rows` by ``tests/test_pool.py``. Pure Python + numpy.
"""

from __future__ import annotations

import weakref

import numpy as np

from distattn.schedule.layouts import PREFETCHES, RETURN_DEPTHS
from distattn.schedule.plan import Plan, Transfer
from distattn.schedule.wire import transfer_spans

__all__ = ["FETCH_SHARDS", "RETURN_SHARDS", "transfer_rows", "slot_rows", "pool_rows", "deepest"]

FETCH_SHARDS = 7
"""Whole k/v shards of rows a placed plan's fetch rounds may hold on a rank: its receive pool, and, apart, the rows it
sends in the rounds in flight (``prefetch + 1``: posted and not yet waited for). A plan fetching 6 steps ahead with
whole-shard buffers held 7 of each."""
RETURN_SHARDS = 5
"""Likewise for the backward's return rounds (dk/dv partials): ``return_depth + 1`` of them in flight, 5 at depth 4."""


def transfer_rows(plan: Plan, tr: Transfer) -> int | None:
    """The sequence rows ``tr`` carries: the k/v rows an owner task borrows (``kv``) or their dk/dv partial
    (``dkv``), ``Plan.key_ranges`` packed; ``None`` for a whole shard: the other kinds (queries and their partials
    travel whole) and a dense plan's k/v."""
    if tr.kind not in ("kv", "dkv"):
        return None
    q_chunk, kv_chunk = (tr.dst, tr.src) if tr.kind == "kv" else (tr.src, tr.dst)
    ranges = plan.key_ranges(q_chunk, kv_chunk)
    return plan.chunk if ranges is None else sum(b - a for a, b in ranges)


_SLOTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per plan: {(rank, phase, which, slots): rows}


def slot_rows(plan: Plan, rank: int, phase: str, which: str, slots: int) -> dict:
    """``{(slot index, kind, i): rows}``: for each receive buffer set of ``rank``'s pool, the most rows a round of
    ``phase`` (``which``: its fetches or its returns, alternating over ``slots``) receives there as its ``i``-th
    message; ``rows`` is ``None`` for kinds that travel whole (:func:`transfer_rows`). ``plan``: as the phase runs it
    (``Plan.run_order``). Memoized on the plan while it lives (every layer's call of a batch reads it back)."""
    memo = _SLOTS.setdefault(plan, {})
    key = (rank, phase, which, slots)
    if key not in memo:
        memo[key] = _slot_rows(plan, rank, phase, which, slots)
    return memo[key]


def _slot_rows(plan: Plan, rank: int, phase: str, which: str, slots: int) -> dict:
    out: dict = {}
    for t in range(plan.num_steps()):
        for i, tr in enumerate(plan.rank_ops(t, rank, phase, which)[1]):
            key, rows = (t % slots, tr.kind, i), transfer_rows(plan, tr)
            out[key] = None if rows is None or out.get(key, 0) is None else max(out.get(key, 0), rows)
    return out


def pool_rows(plan: Plan, phase: str, which: str, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Per rank, ``(the rows of its receive pool, the most rows it sends in any slots consecutive rounds)`` for
    ``phase``'s fetch or return rounds alternating over ``slots``, whole shards counted as ``Plan.chunk`` rows
    (``plan``: as the phase runs it). A rank's pool is the sum over its buffer sets of :func:`slot_rows`."""
    return _Rounds(plan, phase, which).rows(slots)


class _Rounds:
    """One phase's fetch or return messages of every rank, as arrays, for :func:`pool_rows` at any depth; ``rows(slots,
    reverse=True)``: the same rounds with the steps in reverse order (the backward's reversed view of a plan of owner
    tasks, whose rounds are the same messages: :func:`deepest` reads both from one plan)."""

    def __init__(self, plan: Plan, phase: str, which: str):
        self.plan, self.phase, self.which = plan, phase, which
        p, n, self.steps = plan.world_size, plan.chunk, plan.num_steps()
        assert n, "pool_rows reads a plan of a mask's chunks (Plan.chunk)"
        self.step, self.src, self.dst, self.size = transfer_spans(
            plan, phase, which, {kind: n for kind in ("kv", "q", "out", "dkv", "dq")}).messages()  # rows, not bytes
        # the i-th message a rank receives in a round (Plan.rank_ops: one fetch, the returns by sender) is received
        # into its i-th buffer set; a plan with helper tasks (other kinds in a round) is walked rank by rank
        rt = plan.run_table
        self.walk = bool(np.any((rt.dkv == 0) & (rt.dq != 0)))
        cell = self.step * p + self.dst
        self.i = np.zeros(len(cell), dtype=np.int64)
        if len(cell) and np.bincount(cell).max() > 1:  # several messages to a rank in a round: ordered by sender
            order = np.lexsort((self.src, cell))
            ordered = cell[order]
            first = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
            self.i[order] = np.arange(len(cell)) - np.repeat(first, np.diff(np.r_[first, len(cell)]))
        # upper bounds of any depth's pool and sends in flight, per slot: the largest message, the most sent in a round
        self.largest = int(self.size.max(initial=0)) * (int(self.i.max(initial=0)) + 1)
        self.round_sent = int(np.bincount(self.step * p + self.src, weights=self.size).max(initial=0)) if len(
            cell) else 0

    def rows(self, slots: int, reverse: bool = False) -> tuple[np.ndarray, np.ndarray]:
        p, n = self.plan.world_size, self.plan.chunk
        cells = -(-self.steps // slots) * slots  # whole cycles of slots, the last one padded with empty rounds
        step = self.steps - 1 - self.step if reverse else self.step
        if self.walk:
            assert not reverse, "a plan with helper tasks is walked in its own view"
            pool = np.array([sum(n if r is None else r for r in
                                 slot_rows(self.plan, rank, self.phase, self.which, slots).values())
                             for rank in range(p)], dtype=np.int64)
        else:  # a buffer set holds the largest message it receives over the rounds of its slot
            got = np.zeros((cells, p, int(self.i.max(initial=0)) + 1), dtype=np.int64)
            got[step, self.dst, self.i] = self.size
            pool = got.reshape(-1, slots, *got.shape[1:]).max(axis=0).sum(axis=(0, 2))
        sent = np.zeros((cells + 1, p), dtype=np.int64)
        np.add.at(sent, (step + 1, self.src), self.size)
        sent = np.cumsum(sent, axis=0)
        return pool, (sent[slots:] - sent[:-slots]).max(axis=0, initial=0)

    def fits(self, slots: int, rows: int) -> bool:
        """Whether every rank's pool and sends in flight over ``slots`` fit ``rows``, the steps either way."""
        if slots * max(self.largest, self.round_sent) <= rows:  # bounds of both, whatever the order
            return True
        return all(max(int(x.max(initial=0)) for x in self.rows(slots, reverse)) <= rows for reverse in (False, True))


def deepest(plan: Plan, prefetches=PREFETCHES, return_depths=RETURN_DEPTHS) -> tuple[int, int]:
    """``(prefetch, return depth)``: the deepest of ``prefetches`` and ``return_depths`` at which ``plan`` (a placed
    plan, at any depth) holds, on every rank, in the forward and in the backward either way
    (``Layout.backward``: the plan's steps or their reverse), at most :data:`FETCH_SHARDS` whole k/v shards of fetch
    rows in its pool and as many in its sends in flight, and :data:`RETURN_SHARDS` of dk/dv partial rows likewise.
    Depths that held at most that with whole-shard buffers (6 and 4) are always admitted."""
    n, view = plan.chunk, plan.run_order("forward")
    fetches, returns = _Rounds(view, "forward", "fetch"), _Rounds(view, "backward", "return")
    assert not fetches.walk, "deepest reads a placed plan (owner tasks only)"
    fetch = next(d for d in reversed(prefetches) if d + 1 <= FETCH_SHARDS or fetches.fits(d + 1, FETCH_SHARDS * n))
    keep = next(d for d in reversed(return_depths) if d + 1 <= RETURN_SHARDS or returns.fits(d + 1, RETURN_SHARDS * n))
    return fetch, keep
