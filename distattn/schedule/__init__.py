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
simulator below all read the same :class:`Plan`, so the bytes the simulator predicts are the bytes the
comm layer counts. Pure Python: no torch, no torch.distributed.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from distattn.schedule.layouts import LAYOUTS, Layout, layout_of, local_bounds
from distattn.schedule.masks import MaskSpec, pair_work

SCHEDULES = ("ring", "balanced", "zigzag")
PARTIALS = ("fp32", "input")
__all__ = ["SCHEDULES", "PARTIALS", "PHASES", "Task", "Transfer", "Plan", "make_plan", "MaskSpec", "pair_work",
           "Layout", "LAYOUTS", "layout_of", "local_bounds", "Shapes", "payload_bytes", "a2a_bytes", "ulysses_heads", "ring_plan",
           "SimReport",
           "simulate", "format_table"]
PHASES = ("forward", "backward")
_FP32_BYTES = 4  # softmax statistics always travel in fp32; partial results too unless partials="input"
_MIB = 1 << 20


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


@dataclass(frozen=True)
class Plan:
    """An immutable schedule: ``steps[t]`` are the tasks of step t, at most one per rank, sorted by rank."""

    world_size: int
    causal: bool
    schedule: str
    steps: tuple[tuple[Task, ...], ...]
    work: tuple[tuple[int, ...], ...] | None = None
    """Visible (query, key) pairs of every (q chunk, kv chunk) pair, for plans built from a mask (else None)."""
    chunk: int | None = None
    """Tokens per chunk the work was computed for (mask plans only)."""
    layout: Layout | None = None
    """Which positions each rank holds (``None``: contiguous, rank r holds ``[r*n, (r+1)*n)``)."""

    def num_steps(self) -> int:
        return len(self.steps)

    def task(self, step: int, rank: int) -> Task | None:
        """The task ``rank`` computes at ``step``, or None when it is idle."""
        for t in self.steps[step]:
            if t.rank == rank:
                return t
        return None

    def fetches(self, step: int, phase: str = "forward") -> tuple[Transfer, ...]:
        """Inputs that step ``step``'s tasks need, sorted by (src, dst, kind): post in this order."""
        _check_phase(phase)
        found = (_fetch(t, step) for t in self.steps[step])
        return tuple(sorted((tr for tr in found if tr is not None), key=_sort_key))

    def returns(self, step: int, phase: str = "forward") -> tuple[Transfer, ...]:
        """Partial results produced at step ``step``, sorted by (src, dst, kind)."""
        _check_phase(phase)
        found = (_return(t, step, phase) for t in self.steps[step])
        return tuple(sorted((tr for tr in found if tr is not None), key=_sort_key))

    def rank_ops(self, step: int, rank: int, phase: str = "forward", which: str = "fetch"):
        """``(sends, recvs)`` of ``rank`` among the step's fetches (``which="fetch"``) or returns."""
        if which not in ("fetch", "return"):
            raise ValueError(f"which={which!r} is not one of ('fetch', 'return'); pass one of them")
        transfers = self.fetches(step, phase) if which == "fetch" else self.returns(step, phase)
        sends = tuple(tr for tr in transfers if tr.src == rank)
        recvs = tuple(tr for tr in transfers if tr.dst == rank)
        return sends, recvs

    def pairs(self) -> list[tuple[int, int]]:
        """All (q_chunk, kv_chunk) pairs, in step order then rank order."""
        return [(t.q_chunk, t.kv_chunk) for tasks in self.steps for t in tasks]

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


# -- plan construction --------------------------------------------------------------------------------


def _ring_steps(p: int, causal: bool) -> list[list[Task]]:
    """Step t: every rank r computes (r, r - t) with kv fetched from r - t; causal ranks r < t idle."""
    steps = []
    for t in range(p):
        if causal:
            steps.append([Task(r, r, r - t) for r in range(t, p)])
        else:
            steps.append([Task(r, r, (r - t) % p) for r in range(p)])
    return steps


def _balanced_causal_steps(p: int) -> list[list[Task]]:
    """Diagonals, then distance d (owners) paired with distance P - d (helpers); even P ends with P/2."""
    steps = [[Task(r, r, r) for r in range(p)]]
    for d in range(1, (p + 1) // 2):  # d = 1 .. ceil(P/2) - 1
        helpers = [Task(r, r + p - d, r) for r in range(d)]  # ranks r < d have no distance-d pair
        owners = [Task(i, i, i - d) for i in range(d, p)]
        steps.append(helpers + owners)
    if p > 1 and p % 2 == 0:  # distance P/2 pairs with itself: half the ranks idle
        steps.append([Task(i, i, i - p // 2) for i in range(p // 2, p)])
    return steps


def _check_steps(p: int, causal: bool, steps: list[list[Task]]) -> None:
    """Internal invariants: one task per rank per step, every required pair exactly once."""
    for tasks in steps:
        ranks = [t.rank for t in tasks]
        assert len(set(ranks)) == len(ranks), f"a rank computes twice in one step: {tasks}"
    got = sorted((t.q_chunk, t.kv_chunk) for tasks in steps for t in tasks)
    want = sorted((i, j) for i in range(p) for j in range(p) if j <= i or not causal)
    assert got == want, f"P={p} causal={causal}: pairs computed {got} != required {want}"


def _validate(world_size, causal, schedule) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(
            f"world_size={world_size!r} must be an int (the sequence-parallel group size); "
            f"pass e.g. world_size=dist.get_world_size(group)"
        )
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1; pass the number of ranks in the group")
    if not isinstance(causal, bool):
        raise TypeError(f"causal={causal!r} must be a bool; pass causal=True or causal=False")
    if schedule not in SCHEDULES:
        raise ValueError(
            f"schedule={schedule!r} is not one of {SCHEDULES}; pass schedule='balanced' for the "
            f"load-balanced plan, 'zigzag' for the balanced layout, or 'ring' for the unbalanced baseline"
        )


def make_plan(world_size: int, causal: bool = True, schedule: str = "balanced", *, mask: MaskSpec | None = None,
              chunk: int | None = None) -> Plan:
    """Build (and cache) the plan for ``world_size`` ranks.

    Args:
        world_size: P, the number of ranks in the sequence-parallel group (>= 1).
        causal: whether only pairs ``kv_chunk <= q_chunk`` are needed (dense plans).
        schedule: one of :data:`SCHEDULES`. "balanced" equals "ring" for non-causal dense attention; "zigzag"
            runs on the zigzag layout (the plan's ``layout``; shard with ``shard_sequence(..., schedule="zigzag")``).
        mask: packed documents and/or a sliding window (``MaskSpec``); ``None`` or a dense spec gives the dense
            plans. A masked plan drops every pair with no visible (query, key) pair and, balanced, assigns
            each remaining pair to its query owner or its kv owner (helper) so that the work is balanced.
        chunk: tokens per rank; needed with a non-dense ``mask`` (zigzag: default 2, even).

    Returns:
        An immutable :class:`Plan`; dense causal "balanced" has 1 + P//2 steps, causal "ring" P, non-causal P,
        "zigzag" P (every step half a pair of work on every rank when causal).
    """
    _validate(world_size, causal, schedule)
    if schedule == "zigzag":
        chunk = 2 if chunk is None else chunk
        mask = mask if mask is not None else MaskSpec(causal=causal)
    if mask is None or (mask.dense and schedule != "zigzag"):
        return _make_plan_cached(world_size, mask.causal if mask is not None else causal, schedule)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk={chunk!r} must be the positive number of tokens per rank for a masked plan")
    if schedule == "zigzag":
        Layout("zigzag", world_size).check(chunk)
    return _make_masked_plan(world_size, schedule, mask, chunk)


@functools.lru_cache(maxsize=None)
def _make_plan_cached(p: int, causal: bool, schedule: str) -> Plan:
    if schedule == "balanced" and causal:
        steps = _balanced_causal_steps(p)
    else:
        steps = _ring_steps(p, causal)
    _check_steps(p, causal, steps)
    frozen = tuple(tuple(sorted(tasks, key=lambda t: t.rank)) for tasks in steps)
    return Plan(world_size=p, causal=causal, schedule=schedule, steps=frozen)


@functools.lru_cache(maxsize=64)
def _make_masked_plan(p: int, schedule: str, mask: MaskSpec, n: int) -> Plan:
    layout = layout_of(schedule, p)
    work = pair_work(mask, p, n, None if layout.contiguous else layout)
    needed = {(i, j) for i in range(p) for j in range(p) if work[i][j] > 0}
    # ring: every pair computed by its query owner, in ring order, empty pairs dropped
    ring = [[Task(r, r, (r - t) % p) for t in range(p) if ((r, (r - t) % p)) in needed] for r in range(p)]
    per_rank = ring
    if schedule == "balanced":  # the work-balanced assignment, unless it is no shorter than owners-only
        owners = [[ts[0]] + sorted(ts[1:], key=lambda t: (-work[t.q_chunk][t.kv_chunk], t.kv_chunk)) if ts else []
                  for ts in ring]
        balanced = _balance_by_work(p, work, needed)
        per_rank = min((owners, balanced), key=lambda plan: _length(plan, work))
    steps = [[tasks[t] for tasks in per_rank if t < len(tasks)] for t in range(max(map(len, per_rank), default=0))]
    got = sorted((t.q_chunk, t.kv_chunk) for tasks in steps for t in tasks)
    assert got == sorted(needed), f"masked plan P={p}: pairs {got} != needed {sorted(needed)}"
    frozen = tuple(tuple(sorted(tasks, key=lambda t: t.rank)) for tasks in steps)
    return Plan(world_size=p, causal=mask.causal, schedule=schedule, steps=frozen, work=work, chunk=n,
                layout=None if layout.contiguous else layout)


def _length(per_rank: list[list[Task]], work) -> int:
    """The simulator's length of a plan given as per-rank task lists: sum over steps of the largest task."""
    steps = max(map(len, per_rank), default=0)
    return sum(max(work[ts[t].q_chunk][ts[t].kv_chunk] for ts in per_rank if t < len(ts)) for t in range(steps))


def _balance_by_work(p: int, work, needed) -> list[list[Task]]:
    """Diagonals first; then each off-diagonal pair, largest first, to the owner that keeps the plan shortest.

    A pair ``(i, j)`` can be computed by query owner ``i`` (fetching kv ``j``) or by kv owner ``j`` as a helper
    (fetching q ``i``, returning a partial): DistFlashAttn's load balancing, generalized from "idle ranks help"
    to "whichever owner makes the plan shorter" so that it works for any mask. Each rank runs its tasks
    largest first, and the plan's length is the simulator's: the sum over steps of the step's largest task.
    A pair goes to the helper only if that is strictly shorter (an owner step moves only k/v, a helper step q
    and a partial back). Deterministic: every rank builds the same plan from the same work matrix.
    """
    import numpy as np

    lists = [[work[r][r]] if (r, r) in needed else [] for r in range(p)]  # per rank: task work, largest first
    tasks: list[list[Task]] = [[] for _ in range(p)]
    off = sorted((pair for pair in needed if pair[0] != pair[1]), key=lambda ij: (-work[ij[0]][ij[1]], ij))
    width = 1 + len(off)

    def profile(rows) -> np.ndarray:
        mat = np.zeros((p, width))
        for r, row in enumerate(rows):
            mat[r, :len(row)] = sorted(row, reverse=True)
        return mat

    mat = profile(lists)
    for i, j in off:
        w = work[i][j]
        best = None
        for rank in (i, j):  # the owner first: on a tie it keeps the pair
            row = np.sort(np.append(mat[rank][mat[rank] > 0], w))[::-1]
            trial = mat.copy()
            trial[rank, :] = 0.0
            trial[rank, :len(row)] = row
            length = trial.max(axis=0).sum()
            if best is None or length < best[0]:
                best = (length, rank, trial)
        _, rank, mat = best
        tasks[rank].append(Task(rank, i, j))
    per_rank = [[Task(r, r, r)] if (r, r) in needed else [] for r in range(p)]
    for r in range(p):
        per_rank[r] += sorted(tasks[r], key=lambda t: (-work[t.q_chunk][t.kv_chunk], t.q_chunk, t.kv_chunk))
    return per_rank


# -- simulator ----------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Shapes:
    """Per-rank shard shapes, for bytes accounting."""

    batch: int = 1
    """b"""
    seq_per_rank: int = 4096
    """n, tokens per rank (chunk length)"""
    heads_q: int = 32
    """query heads"""
    heads_kv: int = 32
    """key/value heads (GQA/MQA: kv travels with heads_kv heads only)"""
    head_dim: int = 128
    """d"""
    dtype_bytes: int = 2
    """bytes per element of q/k/v/dout (bf16 = 2)"""

    def __post_init__(self):
        for name in ("batch", "seq_per_rank", "heads_q", "heads_kv", "head_dim", "dtype_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Shapes.{name}={value!r} must be a positive int; pass e.g. {name}=1")


def payload_bytes(kind: str, phase: str, shapes: Shapes, partials: str = "fp32") -> int:
    """Bytes of one transfer of ``kind`` in ``phase``: the wire contract the comm byte counters meet.

    ``partials``: ``"fp32"`` (default) or ``"input"``: the dtype of partial results sent back (a helper's
    partial output, dq and dk/dv partials); softmax statistics (lse, delta) are always fp32."""
    _check_phase(phase)
    if partials not in PARTIALS:
        raise ValueError(f"partials={partials!r} is not one of {PARTIALS}")
    b, n, d, e = shapes.batch, shapes.seq_per_rank, shapes.head_dim, shapes.dtype_bytes
    part = _FP32_BYTES if partials == "fp32" else e
    q_elems = b * n * shapes.heads_q * d  # one (b, n, h_q, d) tensor
    kv_elems = b * n * shapes.heads_kv * d  # one (b, n, h_kv, d) tensor
    stat_elems = b * shapes.heads_q * n  # one (b, h_q, n) lse / delta
    sizes = {
        ("forward", "kv"): 2 * kv_elems * e,
        ("forward", "q"): q_elems * e,
        ("forward", "out"): q_elems * part + stat_elems * _FP32_BYTES,
        ("backward", "kv"): 2 * kv_elems * e,
        ("backward", "q"): 2 * q_elems * e + 2 * stat_elems * _FP32_BYTES,  # q, dout; lse, delta
        ("backward", "dkv"): 2 * kv_elems * part,
        ("backward", "dq"): q_elems * part,
    }
    if (phase, kind) not in sizes:
        allowed = sorted(k for ph, k in sizes if ph == phase)
        raise ValueError(f"kind={kind!r} is not a {phase} transfer kind; pass one of {allowed}")
    return sizes[(phase, kind)]


def ulysses_heads(heads_q: int, heads_kv: int, ulysses: int) -> tuple[int, int, int]:
    """``(h_q / U, h_kv' / U, replicas)`` per Ulysses rank: kv heads fewer than ``U`` are replicated ``replicas``
    times (``U % h_kv == 0``) so that every rank holds one. Raises if the heads cannot be split over ``U``."""
    if heads_q % ulysses:
        raise ValueError(f"{heads_q} query heads cannot be split over ulysses={ulysses} ranks (heads must be a "
                         f"multiple of the Ulysses degree); pick a Ulysses degree that divides {heads_q}")
    if heads_kv % ulysses == 0:
        return heads_q // ulysses, heads_kv // ulysses, 1
    if ulysses % heads_kv:
        raise ValueError(f"{heads_kv} kv heads cannot be split over ulysses={ulysses} ranks: they must be a "
                         f"multiple of it, or divide it (then each kv head is replicated on ulysses/h_kv ranks)")
    return heads_q // ulysses, 1, ulysses // heads_kv


def a2a_bytes(phase: str, shapes: Shapes, ulysses: int) -> int:
    """Bytes one rank sends (and receives) in the Ulysses all-to-alls of ``phase`` (``distattn.ulysses``).

    Forward: q, k, v to head shards (kv heads replicated if fewer than ``U``), out (input dtype) and lse (fp32)
    back. Backward: q, k, v, dout and the fp32 lse and ``delta = rowsum(dout * out)`` in (``out`` itself never
    travels); dq, dk, dv back in the input dtype. Each rank keeps ``1/U`` of every tensor and sends the rest."""
    _check_phase(phase)
    u = ulysses
    if u == 1:
        return 0
    hq, hkv, _ = ulysses_heads(shapes.heads_q, shapes.heads_kv, u)
    b, n, d, e = shapes.batch, shapes.seq_per_rank, shapes.head_dim, shapes.dtype_bytes
    q = b * n * hq * u * d  # a rank's (b, n, h_q, d) before the exchange
    kv = b * n * hkv * u * d  # after replication: (b, n, max(h_kv, U), d)
    stat = b * hq * u * n
    if phase == "forward":
        total = (2 * q + 2 * kv) * e + stat * _FP32_BYTES  # q, k, v in; out, lse back
    else:
        total = (3 * q + 4 * kv) * e + 2 * stat * _FP32_BYTES  # q, dout, k, v in; dq, dk, dv back; lse, delta in
    return total * (u - 1) // u


@dataclass(frozen=True)
class SimReport:
    """What a plan costs, read off the plan itself (never from closed-form formulas)."""

    world_size: int
    causal: bool
    schedule: str
    steps: int
    idle_fraction: float  # idle (rank, step) slots / (steps * P), every task counted as one slot
    work_makespan: float  # sum over steps of the step's largest task cost (causal diagonal 0.5, else 1)
    compute_idle_fraction: float  # 1 - total work / (P * work_makespan)
    bytes_sent: tuple[int, ...]  # per rank, forward + backward
    bytes_recv: tuple[int, ...]
    bytes_sent_fwd: tuple[int, ...]
    bytes_recv_fwd: tuple[int, ...]
    bytes_sent_bwd: tuple[int, ...]
    bytes_recv_bwd: tuple[int, ...]
    ulysses: int = 1  # U: ranks of the all-to-all; the plan's ring has world_size / U ranks
    a2a_fwd: int = 0  # bytes every rank sends (and receives) in the all-to-alls, forward
    a2a_bwd: int = 0  # ... and backward
    partials: str = "fp32"
    pairs: int = 0  # (q chunk, kv chunk) pairs computed
    pairs_skipped: int = 0  # pairs of the dense causal plan that this plan does not compute
    work_fraction: float = 1.0  # visible (query, key) pairs / those of dense causal attention on the stream

    @property
    def label(self) -> str:
        """``"zigzag"``; with Ulysses ``"2d U=4 x zigzag R=2"``; ``+partials=input`` when not fp32."""
        name = self.schedule
        if self.ulysses > 1:
            name = f"2d U={self.ulysses} x {self.schedule} R={self.world_size // self.ulysses}"
        return name if self.partials == "fp32" else f"{name} partials={self.partials}"

    def ring_bytes(self, phase: str, rank: int = None) -> int:
        """Bytes sent by ``rank`` (default: the busiest) in the plan's point-to-point rounds of ``phase``."""
        sent = self.bytes_sent_fwd if phase == "forward" else self.bytes_sent_bwd
        a2a = self.a2a_fwd if phase == "forward" else self.a2a_bwd
        return (max(sent) if rank is None else sent[rank]) - a2a

    def table_row(self) -> dict:
        """One row of :func:`format_table`; byte columns are the worst rank, in MiB."""
        return {
            "P": self.world_size,
            "schedule": self.label,
            "causal": self.causal,
            "steps": self.steps,
            "work makespan": f"{self.work_makespan:.1f}",
            "idle slots": f"{self.idle_fraction:.1%}",
            "compute idle": f"{self.compute_idle_fraction:.1%}",
            "fwd max send MiB": f"{max(self.bytes_sent_fwd) / _MIB:.0f}",
            "fwd max recv MiB": f"{max(self.bytes_recv_fwd) / _MIB:.0f}",
            "bwd max send MiB": f"{max(self.bytes_sent_bwd) / _MIB:.0f}",
            "bwd max recv MiB": f"{max(self.bytes_recv_bwd) / _MIB:.0f}",
            "pairs (skipped)": f"{self.pairs} ({self.pairs_skipped})",
            "work vs causal": f"{self.work_fraction:.1%}",
        }


def _task_cost(task: Task, plan: Plan) -> float:
    """A task's compute in units of one full ``n x n`` pair."""
    if plan.work is not None:
        return plan.work[task.q_chunk][task.kv_chunk] / plan.chunk ** 2
    return 0.5 if plan.causal and task.is_diagonal else 1.0


def _bytes_per_rank(plan: Plan, phase: str, shapes: Shapes, partials: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    sent = [0] * plan.world_size
    recv = [0] * plan.world_size
    for s in range(plan.num_steps()):
        for tr in plan.fetches(s, phase) + plan.returns(s, phase):
            size = payload_bytes(tr.kind, phase, shapes, partials)
            sent[tr.src] += size
            recv[tr.dst] += size
    return tuple(sent), tuple(recv)


def ring_plan(world_size: int, causal: bool, schedule: str, shapes: Shapes, *, mask: MaskSpec | None = None,
              ulysses: int = 1) -> tuple[Plan, Shapes]:
    """The plan of the ring level and the shapes of its shards: ``R = world_size / ulysses`` ranks of ``U * n``
    tokens with ``1/U`` of the heads (``ulysses = 1``: the plan over all ranks and ``shapes`` unchanged)."""
    ring_shapes = shapes
    if ulysses > 1:
        hq, hkv, _ = ulysses_heads(shapes.heads_q, shapes.heads_kv, ulysses)
        ring_shapes = dataclasses.replace(shapes, seq_per_rank=shapes.seq_per_rank * ulysses, heads_q=hq,
                                          heads_kv=hkv)
    plan = make_plan(world_size // ulysses, causal, schedule, mask=mask, chunk=ring_shapes.seq_per_rank)
    return plan, ring_shapes


def simulate(world_size: int, causal: bool = True, schedule: str = "balanced", shapes: Shapes = Shapes(), *,
             mask: MaskSpec | None = None, ulysses: int = 1, partials: str = "fp32") -> SimReport:
    """Walk :func:`make_plan`'s plan step by step and tally idle slots, work makespan and bytes.

    With a ``mask`` (packed documents, window) the plan is built for ``shapes.seq_per_rank`` tokens per rank and
    the report also counts the pairs and the pair work the mask lets the plan skip against the dense causal
    plan of the same stream. ``ulysses = U > 1``: two-dimensional sequence parallelism, ``world_size`` ranks as
    ``U`` (all-to-all over heads) x ``R = world_size / U`` (the plan's ring over ``U * n``-token shards with
    ``1/U`` of the heads); the bytes of every rank then include its all-to-alls. Work stays in units of one
    ``n x n`` pair of the *ring's* shards.
    """
    if isinstance(ulysses, bool) or not isinstance(ulysses, int) or ulysses < 1 or world_size % ulysses:
        raise ValueError(f"ulysses={ulysses!r} must be a positive int dividing world_size={world_size}")
    plan, ring_shapes = ring_plan(world_size, causal, schedule, shapes, mask=mask, ulysses=ulysses)
    p, n_steps = plan.world_size, plan.num_steps()
    busy = sum(len(tasks) for tasks in plan.steps)
    work = sum(_task_cost(t, plan) for tasks in plan.steps for t in tasks)
    makespan = sum(max((_task_cost(t, plan) for t in tasks), default=0.0) for tasks in plan.steps)
    a2a_f, a2a_b = a2a_bytes("forward", shapes, ulysses), a2a_bytes("backward", shapes, ulysses)
    ring = [_bytes_per_rank(plan, phase, ring_shapes, partials) for phase in PHASES]
    # global rank g = ring rank * U + u does ring rank g // U's transfers, plus its all-to-alls
    (sent_f, recv_f), (sent_b, recv_b) = [
        tuple(tuple(per_ring[g // ulysses] + a2a for g in range(world_size)) for per_ring in pair)
        for pair, a2a in zip(ring, (a2a_f, a2a_b))]
    dense_pairs = p * (p + 1) // 2
    dense_work = p * (p - 1) / 2 + p * 0.5  # the dense causal plan, in units of full pairs
    return SimReport(
        world_size=world_size, causal=plan.causal, schedule=schedule, steps=n_steps,
        idle_fraction=1.0 - busy / (n_steps * p) if n_steps else 0.0,
        work_makespan=makespan,
        compute_idle_fraction=1.0 - work / (p * makespan) if makespan else 0.0,
        bytes_sent=tuple(a + b for a, b in zip(sent_f, sent_b)),
        bytes_recv=tuple(a + b for a, b in zip(recv_f, recv_b)),
        bytes_sent_fwd=sent_f, bytes_recv_fwd=recv_f, bytes_sent_bwd=sent_b, bytes_recv_bwd=recv_b,
        ulysses=ulysses, a2a_fwd=a2a_f, a2a_bwd=a2a_b, partials=partials,
        pairs=busy, pairs_skipped=max(dense_pairs - busy, 0) if plan.causal else 0,
        work_fraction=work / dense_work,
    )  # fmt: skip


def format_table(reports) -> str:
    """A markdown table, one row per :class:`SimReport`."""
    rows = [r.table_row() for r in reports]
    if not rows:
        return ""
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(row[k]) for k in header) + " |" for row in rows]
    return "\n".join(lines)


def _main(argv=None) -> None:
    """The command line (``python -m distattn.schedule``; see ``distattn.schedule.cli``)."""
    from distattn.schedule.cli import main

    main(argv)
