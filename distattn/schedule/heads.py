"""Head groups: how many passes of the plan one attention call makes, each over a group of kv heads (issue 36).

Attention mixes no heads, so the plan can run once per group of kv heads (each with the query heads that read
them, GQA): the forward's fp32 state, the backward's fp32 dq/dk/dv accumulators, the double-buffered receive pool
and the partials in flight are then one group's, ``1/G`` of the call's. Nothing else changes: every message of
the call travels once, in ``G`` smaller pieces (``G`` times the rounds, the same bytes), and every kernel computes
the same sums. The call's inputs and outputs (q, k, v, out, lse, dout and the gradients, in the input dtype) are
whole either way.

The rule is deterministic in the call's shapes, which every rank has agreed on before it is applied, and in
``DISTATTN_ATTENTION_WORK_BYTES`` (the budget; the agreement carries the chosen ``G``, so ranks with different
budgets fail together instead of pairing different pieces): the fewest groups (a divisor of ``h_kv``) whose working
memory, as ``work_bytes`` estimates it for the backward, fits the budget; ``h_kv`` groups when none does. The
estimate decides; the byte model (``distattn.memory``) counts what the chosen groups really hold.

Legend: ``b`` batch, ``n`` tokens per rank, ``h_q``/``h_kv`` heads, ``d`` head dim.
"""

from __future__ import annotations

import os

__all__ = ["WORK_BYTES_ENV", "DEFAULT_WORK_BYTES", "work_bytes", "head_groups", "work_budget"]

WORK_BYTES_ENV = "DISTATTN_ATTENTION_WORK_BYTES"
DEFAULT_WORK_BYTES = 1 << 30
"""1 GiB: LLaMA-3-8B's shapes (32/8 heads, d 128, bf16) stay in one group up to about 10k tokens per rank; at 607k
tokens per rank every kv head is a group of its own (8 groups: 1/8 of the working memory)."""


def work_budget() -> int:
    """``DISTATTN_ATTENTION_WORK_BYTES`` (bytes, > 0), else 1 GiB."""
    raw = os.environ.get(WORK_BYTES_ENV)
    if raw is None:
        return DEFAULT_WORK_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{WORK_BYTES_ENV}={raw!r} must be a positive number of bytes (default {DEFAULT_WORK_BYTES})")
    return value


def work_bytes(b: int, n: int, h_q: int, h_kv: int, d: int, itemsize: int, partial_itemsize: int) -> int:
    """The backward's working memory of one pass over ``h_q``/``h_kv`` heads (an estimate for the rule, not the
    byte model): fp32 dq, dk, dv accumulators; two fetch slots of the larger payload (k and v, or q and dout and
    their fp32 row statistics); two return slots and one produced partial of the larger partial (dq, or dk and
    dv)."""
    rows = b * n
    accumulators = rows * d * 4 * (h_q + 2 * h_kv)
    fetch = 2 * rows * max(2 * h_kv * d * itemsize, 2 * h_q * d * itemsize + 2 * h_q * 4)
    partials = 3 * rows * d * partial_itemsize * max(h_q, 2 * h_kv)
    return accumulators + fetch + partials


def head_groups(b: int, n: int, h_q: int, h_kv: int, d: int, itemsize: int, partial_itemsize: int,
                budget: int | None = None) -> int:
    """The number of head groups for a call of these shapes (see the module doc): a divisor of ``h_kv``."""
    budget = work_budget() if budget is None else budget
    for groups in range(1, h_kv + 1):
        if h_kv % groups == 0 and work_bytes(b, n, h_q // groups, h_kv // groups, d, itemsize,
                                             partial_itemsize) <= budget:
            return groups
    return h_kv
