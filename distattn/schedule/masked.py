"""The plans of a mask (packed documents, windows): ring, balanced, zigzag and placed, built from the pairs with work.

The pairs come sparse (``distattn.schedule.pairs.pair_table``: only those with work, O(P + documents) of them for
documents of bounded length), and every step below walks the pairs or the ranks' task lists, never a ``P x P``
matrix, so a plan of 16384 ranks costs what its pairs cost. The plans are stored as runs of neighbouring equal tasks
(``distattn.schedule.plan.RunTable``). Pure Python + numpy.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np

from distattn.schedule.layouts import Layout
from distattn.schedule.masks import MaskSpec
from distattn.schedule.pairs import SpanView, WorkView, pair_table
from distattn.schedule.plan import Plan, RunTable, Task

__all__ = ["make_masked_plan", "masked_plan_of", "rotation_steps", "matched_steps"]


def _as_runs(per_rank: list[list[Task]], table, n: int) -> RunTable:
    """Every rank's tasks, the ``t``-th at step ``t``, as runs (:func:`_runs`)."""
    tasks = [task for ts in per_rank for task in ts]
    step = np.concatenate([np.arange(len(ts), dtype=np.int64) for ts in per_rank]) if tasks else np.zeros(0, np.int64)
    rank, q, kv = (np.fromiter((getattr(t, f) for t in tasks), dtype=np.int64, count=len(tasks))
                   for f in ("rank", "q_chunk", "kv_chunk"))
    return _runs(step, rank, q, kv, table, n)


def _runs(step, rank, q, kv, table, n: int) -> RunTable:
    """Tasks given as arrays (``rank`` computes ``(q, kv)`` at ``step``) as runs: neighbouring ranks of a step with the
    same offsets, work and borrowed kv rows share one run. Arrays throughout (a plan of 16384 ranks holds ~10^5
    tasks); asserts that the tasks are the table's pairs, each once."""
    p = table.world_size
    pair_keys = table.q * p + table.kv  # ascending: the table is sorted by query rank, then kv rank
    at = np.searchsorted(pair_keys, q * p + kv)
    assert np.array_equal(np.sort(q * p + kv), pair_keys), f"masked plan P={p}: the tasks are not the pairs with work"
    cost = table.work[at] / n ** 2
    keys = np.where((rank == q) & (q != kv), table.seen[at], -1)  # owner tasks borrow the rows their queries see
    order = np.lexsort((rank, step))
    step, rank, dq, dkv, cost, keys = (x[order] for x in (step, rank, q - rank, kv - rank, cost, keys))
    same = [step, dq, dkv, cost, keys]
    new = np.ones(len(step), dtype=bool)
    new[1:] = (rank[1:] != rank[:-1] + 1) | np.any([x[1:] != x[:-1] for x in same], axis=0)
    first = np.flatnonzero(new)
    stop = rank[np.append(first[1:], len(rank)) - 1] + 1
    return RunTable.build(int(step.max(initial=-1)) + 1, step[first], rank[first], stop, dq[first], dkv[first],
                          cost[first], keys[first])


@functools.lru_cache(maxsize=64)
def make_masked_plan(p: int, schedule: str, mask: MaskSpec, n: int, layout: Layout | None = None) -> Plan:
    """The plan of ``schedule`` for ``mask`` over ``p`` ranks of ``n`` tokens (``layout``: the placement of a
    "placed" plan; else the schedule's own). Cached."""
    layout = layout if layout is not None else Layout("zigzag" if schedule == "zigzag" else "contiguous", p)
    return masked_plan_of(p, schedule, mask, n, layout, pair_table(mask, p, n, None if layout.contiguous else layout))


def masked_plan_of(p: int, schedule: str, mask: MaskSpec, n: int, layout: Layout, table) -> Plan:
    """:func:`make_masked_plan` from the pair table of ``layout`` (``distattn.schedule.pairs``), uncached: the
    placement solver builds each candidate's plans (one per order) from one table it does not keep."""
    work = WorkView(table)
    if schedule == "placed":  # owner tasks: by the groups' rotations or with steps as matchings
        steps = rotation_steps(p, layout.group, table) if layout.order == "rotation" else matched_steps(
            p, table, layout.order)
        runs = _runs(steps, table.q, table.q, table.kv, table, n)
    else:
        runs = _as_runs(_per_rank(p, schedule, table, work), table, n)
    return Plan(world_size=p, causal=mask.causal, schedule=schedule, run_table=runs, work=work, chunk=n,
                layout=None if layout.contiguous else layout,
                spans=(SpanView(table, False), SpanView(table, True)), pair_table=table)


def _per_rank(p: int, schedule: str, table, work) -> list[list[Task]]:
    """Every rank's tasks in step order: ring, or balanced (placed: :func:`rotation_steps`, :func:`matched_steps`)."""
    rows, cols = table.q, table.kv  # the pairs with work, by query rank then kv rank
    needed = set(zip(rows.tolist(), cols.tolist()))
    # ring: every pair computed by its query owner, in ring order, empty pairs dropped
    dist = np.split((rows - cols) % p, table.offsets[1:-1])  # per query rank
    ring = [[Task(r, r, (r - t) % p) for t in sorted(ts.tolist())] for r, ts in enumerate(dist)]
    if schedule != "balanced":
        return ring
    # the work-balanced assignment, unless it is no shorter than owners-only
    return min((_owners(ring, work), _balance_by_work(p, work, needed)), key=lambda plan: _length(plan, work))


def _owners(ring: list[list[Task]], work) -> list[list[Task]]:
    """Owner tasks only: the local pair first, then the rest largest first (aligns the ranks' large tasks)."""
    return [[ts[0]] + sorted(ts[1:], key=lambda t: (-work[t.q_chunk][t.kv_chunk], t.kv_chunk)) if ts else []
            for ts in ring]


def _length(per_rank: list[list[Task]], work) -> int:
    """The simulator's length of a plan given as per-rank task lists: sum over steps of the largest task."""
    top: list[int] = []  # the largest task of every step so far
    for ts in per_rank:
        for t, task in enumerate(ts):
            w = work[task.q_chunk][task.kv_chunk]
            if t == len(top):
                top.append(w)
            elif w > top[t]:
                top[t] = w
    return sum(top)


def _balance_by_work(p: int, work, needed) -> list[list[Task]]:
    """Diagonals first; then each off-diagonal pair, largest first, to the owner that keeps the plan shortest.

    A pair ``(i, j)`` can be computed by query owner ``i`` (fetching kv ``j``) or by kv owner ``j`` as a helper
    (fetching q ``i``, returning a partial): DistFlashAttn's load balancing, generalized from "idle ranks help"
    to "whichever owner makes the plan shorter" so that it works for any mask. Each rank runs its tasks
    largest first, and the plan's length is the simulator's: the sum over steps of the step's largest task.
    A pair goes to the helper only if that is strictly shorter (an owner step moves only k/v, a helper step q
    and a partial back). Deterministic: every rank builds the same plan from the same work matrix.
    """
    tasks: list[list[Task]] = [[] for _ in range(p)]
    off = sorted((pair for pair in needed if pair[0] != pair[1]), key=lambda ij: (-work[ij[0]][ij[1]], ij))
    # rows[r]: rank r's task work, largest first. A plan's length is the sum over columns (the t-th largest task of
    # every rank) of the column's largest entry (``top``). Adding a task to a row never lowers any of its entries
    # (an insertion into a sorted list), so with a candidate row the steps are max(its entry, top): O(its list),
    # not O(P x pairs). Plain Python: a rank holds a few tasks. Works are integers, so every length is an
    # exact sum and ties break alike on every rank.
    rows = [[work[r][r]] if (r, r) in needed else [] for r in range(p)]
    top = [max((work[r][r] for r in range(p) if rows[r]), default=0)]
    for i, j in off:
        w = work[i][j]
        best = None
        for rank in (i, j):  # the owner first: on a tie it keeps the pair
            row = sorted(rows[rank] + [w], reverse=True)
            steps = [max(x, t) for x, t in itertools.zip_longest(row, top, fillvalue=0)]
            if best is None or sum(steps) < best[0]:
                best = (sum(steps), rank, row, steps)
        _, rank, row, top = best
        rows[rank] = row
        tasks[rank].append(Task(rank, i, j))
    per_rank = [[Task(r, r, r)] if (r, r) in needed else [] for r in range(p)]
    for r in range(p):
        per_rank[r] += sorted(tasks[r], key=lambda t: (-work[t.q_chunk][t.kv_chunk], t.q_chunk, t.kv_chunk))
    return per_rank


def rotation_steps(p: int, k: int, table) -> np.ndarray:
    """The step of every pair of ``table`` (its order) in the placed plan of groups of ``k`` ranks (``Layout.order``
    ``"rotation"``; owner tasks: ``distattn.schedule.plan``). Per rank, first the pairs inside its group of ``k`` by
    the group's ring rotations (every step a permutation of the group: each rank sends its k/v to one rank; the pairs of
    one group hold like work), the diagonal first, then the rotations whose largest pair is heaviest; then the pairs of
    documents cut across groups, rotated by the rank's offset in its group (rank ``g0 + x`` first fetches the other
    group's rank at offset ``x``: the ``k`` ranks that share a cut document fetch from ``k`` different ranks in a step,
    not all from one). A rank's ``t``-th pair in that order runs at step ``t``. A rotation's size is its largest pair
    with work. Arrays, O(pairs log pairs)."""
    q, kv, work = table.q, table.kv, table.work
    inside = q // k == kv // k
    rotation = q // k * k + (q - kv) % k  # pair (r, j) of group g0 is in g0's rotation (r - j) % k
    size = np.zeros(p, dtype=work.dtype)
    np.maximum.at(size, rotation[inside], work[inside])
    at = np.arange(p)
    t = at % k
    by = np.lexsort((t, -size, t != 0, at // k))  # per group: rotation 0, then the heaviest rotations first (a tie: t)
    place_of = np.empty(p, dtype=np.int64)
    place_of[by] = at % k  # where rotation t runs in its group's order
    key = np.where(inside, place_of[rotation], (kv - q) % k)  # cross-group pairs: by their offset, then kv rank
    order = np.lexsort((kv, key, ~inside, q))
    step = np.empty(len(q), dtype=np.int64)
    step[order] = np.arange(len(q)) - np.repeat(table.offsets[:-1], np.diff(table.offsets))
    return step


def matched_steps(p: int, table, order: str) -> np.ndarray:
    """The step of every pair of ``table`` (its order) in the placed plan whose steps are *matchings*
    (``Layout.order`` ``"pairs-work"``, ``"pairs-keys"``, ``"ranks-work"`` or ``"ranks-keys"``): every step a rank
    fetches from one rank and sends its k/v to one rank at most, every rank's local pair at step 0, owner tasks only.
    A pair weighs its work (visible query-key pairs) or its keys (the kv rows it borrows: its bytes):

    * ``"pairs-..."``: the pairs heaviest first (a tie: by query rank, then kv rank), each at the first step where its
      query rank computes nothing yet and its kv rank sends to no one yet: heavy pairs share the early steps, light
      ones the late steps;
    * ``"ranks-..."``: step by step, the ranks with the most work left choose first, each its heaviest pair left whose
      kv rank sends to no one yet in this step (a tie: the lower kv rank): the ranks with most to do never wait for a
      sender.

    A rank may idle at a step between two of its pairs (its rounds still run; the executor steps over it). Against the
    rotation order (:func:`rotation_steps`): the rotations are matchings only while every pair of a group has work, and
    a rank's list skips its empty pairs, so after a windowed deal (few pairs per rank) one step can draw several
    ranks' fetches from one sender and pair a heavy task with a light one; here the steps stay matchings whatever the
    deal. Which order is fastest depends on the deal: the solver times each (``distattn.schedule.placement``).
    Deterministic; pure Python, O(pairs x steps) at worst."""
    how, _, by = order.partition("-")
    if how not in ("pairs", "ranks") or by not in ("work", "keys"):
        raise ValueError(f"order={order!r}: a matched order is 'pairs-' or 'ranks-' then 'work' or 'keys'")
    q, kv = table.q, table.kv
    weight = table.work if by == "work" else table.seen
    off = np.flatnonzero(q != kv)  # x: the table's order (query rank, then kv rank)
    step = [0] * len(q)
    if how == "pairs":
        busy = [1] * p  # bit t: the rank computes at step t (step 0: its local pair, or nothing)
        sends = [0] * p  # bit t: the rank's k/v go out at step t
        order = off[np.lexsort((off, -weight[off]))]  # heaviest first, a tie by the table's order
        for x, i, j in zip(order.tolist(), q[order].tolist(), kv[order].tolist()):
            taken = busy[i] | sends[j]
            bit = ~taken & (taken + 1)  # the lowest step free at both ends
            busy[i] |= bit
            sends[j] |= bit
            step[x] = bit.bit_length() - 1
        return np.asarray(step, dtype=np.int64)
    work = table.work.tolist()
    neg = np.zeros(p, dtype=np.int64)
    np.add.at(neg, q[off], -table.work[off])
    neg = neg.tolist()  # minus the work left per query rank
    order = off[np.lexsort((kv[off], -weight[off], q[off]))]  # per query rank, its pairs heaviest first
    cut = np.cumsum(np.bincount(q[order], minlength=p))[:-1]
    todo = [x.tolist() for x in np.split(order, cut)]
    kvs = [x.tolist() for x in np.split(kv[order], cut)]  # todo's kv ranks, kept in step with it
    t = 0
    waiting = [r for r in range(p) if todo[r]]
    while waiting:
        t += 1
        sending = bytearray(p)  # sending[j]: rank j's k/v go out in this step
        for i in sorted(waiting, key=neg.__getitem__):  # most work left first (stable: a tie by rank)
            ks = kvs[i]
            for y, j in enumerate(ks):
                if not sending[j]:
                    del ks[y]
                    x = todo[i].pop(y)
                    sending[j] = 1
                    neg[i] += work[x]
                    step[x] = t
                    break
        waiting = [r for r in waiting if todo[r]]
    return np.asarray(step, dtype=np.int64)
