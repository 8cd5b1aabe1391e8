"""Sequence-parallel attention plans (which rank computes which chunk pair, when) and their simulator.

Rank r of a group of P ranks holds query chunk r and key/value chunk r (tokens ``[r*n, (r+1)*n)``).
A *pair* ``(i, j)`` means "query chunk i attends to kv chunk j". Causal attention needs the pairs
``j <= i`` (P(P+1)/2 of them), non-causal all P*P. Each step every rank computes at most one pair, and
a pair is computed either by its query owner (rank i, which fetches kv chunk j from rank j) or by a
*helper*, the kv owner (rank j, which fetches query chunk i from rank i, attends with its own kv and
returns a partial output + lse that rank i merges). See DistFlashAttn (Li et al.), Sec. 3.1.

"zigzag" balances by *layout* instead (``distattn.schedule.layouts``): rank r holds chunks r and 2P-1-r of 2P,
so every (query shard, kv shard) pair holds the same causal work; the plan is the ring order over all P*P pairs,
every task an owner task, so only k/v travel forward and dk/dv back (what GQA wants: ``h_kv`` heads only)::

    P=4, causal, zigzag (chunks held: rank0 {0,7}, rank1 {1,6}, rank2 {2,5}, rank3 {3,4})
    step  rank0   rank1   rank2   rank3
       0  (0,0)   (1,1)   (2,2)   (3,3)
       1  (0,3)   (1,0)   (2,1)   (3,2)
       2  (0,2)   (1,3)   (2,0)   (3,1)
       3  (0,1)   (1,2)   (2,3)   (3,0)

"ring" is the unbalanced baseline: at step t rank p computes (p, p - t); causal ranks with small p go
idle early, so causal takes P steps. "balanced" finishes causal in 1 + floor(P/2) steps, the lower bound
ceil(P(P+1)/2 / P): distance d = i - j has P - d pairs, and distance P - d has d, so one step holds
both -- owners i >= d compute (i, i-d), while the d ranks r < d that have run out of causal work help
with (r + P - d, r). For even P, distance P/2 is left alone in the last step. ``h`` = helper task::

    P=4, causal, balanced
    step  rank0   rank1   rank2   rank3
       0  (0,0)   (1,1)   (2,2)   (3,3)
       1  (3,0)h  (1,0)   (2,1)   (3,2)
       2    .       .     (2,0)   (3,1)

    P=5, causal, balanced
    step  rank0   rank1   rank2   rank3   rank4
       0  (0,0)   (1,1)   (2,2)   (3,3)   (4,4)
       1  (4,0)h  (1,0)   (2,1)   (3,2)   (4,3)
       2  (3,0)h  (4,1)h  (2,0)   (3,1)   (4,2)

One plan, several interpreters: the forward and backward executors (``distattn/attention.py``) and the
simulator (``distattn.schedule.sim``) all read the same :class:`Plan`, so the bytes the simulator predicts are the
bytes the comm layer counts. The plan is stored as runs of like tasks (``distattn.schedule.plan``), so the simulator
and the cost model read a plan of 16384 ranks in seconds. Pure Python + numpy: no torch, no torch.distributed.
"""


from __future__ import annotations

from distattn.schedule.build import layout_of, make_plan
from distattn.schedule.heads import head_groups, work_bytes
from distattn.schedule.layouts import LAYOUTS, Layout, local_bounds, pieces_of
from distattn.schedule.masks import MaskSpec, pair_work
from distattn.schedule.pairs import PlanTooLarge
from distattn.schedule.placement import place
from distattn.schedule.plan import (  # noqa: F401  (private names: tests rebuild uncached plans)
    HEAD,
    PHASES,
    SCHEDULES,
    Plan,
    Task,
    Transfer,
    _make_plan_cached,
    head_rows,
)
from distattn.schedule.sim import (
    PARTIALS,
    Shapes,
    SimReport,
    a2a_bytes,
    format_table,
    payload_bytes,
    ring_plan,
    simulate,
    ulysses_heads,
)

__all__ = ["SCHEDULES", "PARTIALS", "PHASES", "HEAD", "head_rows", "Task", "Transfer", "Plan", "make_plan", "MaskSpec",
           "pair_work",
           "PlanTooLarge", "Layout", "LAYOUTS", "layout_of", "local_bounds", "pieces_of", "place", "Shapes",
           "payload_bytes", "a2a_bytes", "ulysses_heads",
           "ring_plan", "SimReport", "simulate", "format_table", "head_groups", "work_bytes"]


def _main(argv=None) -> None:
    """The command line (``python -m distattn.schedule``; see ``distattn.schedule.cli``)."""
    from distattn.schedule.cli import main

    main(argv)
