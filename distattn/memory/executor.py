"""The attention executor's own buffers, byte for byte: a replay of its allocations over the plan it runs.

The executors (``dist_attn_forward``/``dist_attn_backward``) allocate, beyond their inputs and outputs:

* forward: the carried state's fp32 ``out`` (its ``lse`` is the output's); backward: ``delta`` (fp32
  ``(b, h_q, n)``) and the fp32 accumulators ``dq, dk, dv`` of the whole shard (cast to the input dtype once, at
  the end: the outputs);
* the receive pool (``distattn.executor.Executor.post``): one set of buffers per ``(slot, kind, order in the round)``
  the plan ever uses, made at first use and kept to the end of the call, a k/v or dk/dv set as large as the most rows
  its slot receives (``distattn.schedule.pool.slot_rows``; whole shards on dense plans); the fetch slots alternate over
  ``prefetch + 1`` (``Plan.prefetch``: ``t % 2`` at depth 1, up to ``t % 13`` where the placement solver deepened it;
  the return slots over ``return_depth + 1``, ``Plan.return_depth``), so a rank that fetches k/v at one step and
  queries at another of the same slot holds both kinds, and a helper's partial (``out``/``dq`` of ``h_q`` heads, fp32
  by default) is received into a buffer of the query shard's size;
* the partials a task computes (a helper's fp32 state or ``dq``; an owner's fp32 ``dk, dv`` of the borrowed slice,
  ``partials="input"``: plus their cast copies), alive until their send round is waited for, ``Plan.return_depth``
  steps later (one, but where the placement solver deepened it), and the next step's partial is made before that
  wait;
* the per-row key bounds of a task's pair when the plan has a layout (zigzag, placed) or a mask beyond causal
  (int32 ``(lo, hi)`` per query row, cached for the call);
* send copies: messages need contiguous memory, so a non-contiguous ``q``/``k``/``v``/``dout`` (HF's transposed
  ``(b, h, n, d)`` views) that is sent is copied once per call, and a row slice of it per send.

``executor_peak(plan, ...)`` walks the same :class:`~distattn.schedule.Plan` the executor runs (``plan.task``,
``plan.rank_ops``, ``plan.key_ranges``; the backward's steps reversed, ``Plan.run_order``) in the executor's order of
events (``Executor._run``: post the fetch ``prefetch`` steps ahead, wait this fetch, compute, absorb the previous
step's partials, post this step's partials) and gives the peak of the live bytes, when it happens and what it is made
of.
``tests/test_executor_memory.py`` holds it equal to the bytes the real executor allocates on CPU/gloo
(``distattn.memory.measure.live_bytes``). Not here: the kernels' own working set
(Triton: O(b h n) fp32 statistics; the CPU backends' per-tile temporaries), the agreement's and the NaN check's small
tensors, and NCCL's internal buffers.

Legend: ``b`` batch, ``n`` tokens per rank, ``h_q``/``h_kv`` heads, ``d`` head dim.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from distattn.schedule import MaskSpec, Plan, head_groups, make_plan
from distattn.schedule.pool import FETCH_SHARDS, RETURN_SHARDS, slot_rows

__all__ = ["ExecutorPeak", "executor_peak", "attention_buffers", "ATTENTION_SCHEDULES"]

ATTENTION_SCHEDULES = ("balanced", "zigzag", "ring")
"""The dense causal schedules the planner weighs (``placed`` is for packed documents)."""


@dataclass(frozen=True)
class ExecutorPeak:
    """The executor's peak live bytes on one rank (the worst rank), beyond its inputs and outputs."""

    total: int
    parts: dict
    """Bytes per kind of buffer at the peak."""
    moment: str
    rank: int

    @property
    def dominant(self) -> str:
        return max(self.parts, key=self.parts.get)


@dataclass(frozen=True)
class _Sizes:
    b: int
    n: int
    hq: int
    hkv: int
    d: int
    A: int  # bytes of the input dtype
    part: int  # bytes of a travelling partial: 4 (fp32) or A ("input")

    def q(self, rows=None, itemsize=None) -> int:
        return self.b * (self.n if rows is None else rows) * self.hq * self.d * (itemsize or self.A)

    def kv(self, rows=None, itemsize=None) -> int:
        return self.b * (self.n if rows is None else rows) * self.hkv * self.d * (itemsize or self.A)

    @property
    def stats(self) -> int:
        return self.b * self.hq * self.n * 4


class _Live:
    """Allocations and frees in order; the peak, its moment and its parts."""

    def __init__(self):
        self.live: dict[int, tuple[str, int]] = {}
        self.now = self.peak = 0
        self.peak_parts: dict = {}
        self.moment = "nothing allocated"
        self._id = 0
        self.where = ""
        self.group_ids: list[int] = []  # what lives until the current pass of the plan ends

    def alloc(self, kind: str, nbytes: int) -> int:
        self._id += 1
        self.live[self._id] = (kind, nbytes)
        self.now += nbytes
        if self.now > self.peak:
            self.peak, self.moment = self.now, self.where
            parts: dict = {}
            for k, nb in self.live.values():
                parts[k] = parts.get(k, 0) + nb
            self.peak_parts = parts
        return self._id

    def free(self, *ids) -> None:
        for i in ids:
            self.now -= self.live.pop(i)[1]


def _replay(plan: Plan, rank: int, phase: str, sz: _Sizes, partials: str, copied: frozenset,
            outputs: bool = False, full: _Sizes | None = None) -> _Live:
    """``dist_attn_forward``/``dist_attn_backward`` on ``rank``, allocations only, in the executor's order
    (``outputs``: with the call's outputs, as a training step holds them).

    ``full``: the call's sizes when ``sz`` is one head group's (``distattn.schedule.heads``): the plan then runs
    once per group, the receive pool and the key bounds kept across groups (the executor's), the state or
    accumulators and the send copies one group's at a time; two passes show every event (a third repeats the
    second); the call's outputs are made before the first group, and the forward's finished group ``out``/``lse``
    live until they are copied into them."""
    lv, fwd = _Live(), phase == "forward"
    plan = plan.run_order(phase)  # the executor's order of steps (the backward: reversed)
    grouped = full is not None
    full = sz if full is None else full
    lv.where = f"{phase}, before step 0"
    if fwd and outputs:
        lv.alloc("outputs", full.stats if not grouped else full.q() + full.stats)  # G = 1: the state's lse is it
    if not fwd:
        lv.alloc("delta (fp32)", full.stats)
        if outputs and grouped:
            lv.alloc("outputs", full.q() + 2 * full.kv())
    pool: set = set()
    bounds: set = set()
    for group in range(2 if grouped else 1):
        _pass(lv, plan, rank, phase, sz, partials, copied, pool, bounds, f"group {group + 1}, " if grouped else "",
              grouped)
        if grouped and fwd:  # kernels.finalize of the group (its lse is the state's), copied into the call's
            lv.where = f"{phase}, rank {rank}: group {group + 1}'s out made, before it is copied"
            lv.free(lv.alloc("one group's out", sz.q()))
        lv.free(*lv.group_ids)
    if outputs and not grouped:  # cast once at the end, the fp32 state or accumulators still alive
        lv.where = f"{phase}, rank {rank}: the outputs cast, after the last step"
        lv.alloc("outputs", sz.q() if fwd else sz.q() + 2 * sz.kv())
    return lv


def _pass(lv: _Live, plan: Plan, rank: int, phase: str, sz: _Sizes, partials: str, copied: frozenset, pool: set,
          bounds: set, label: str, grouped: bool = False) -> None:
    """One run of the plan (a head group's, or the call's): its allocations and frees on ``lv``; what lives until
    the pass ends (state or accumulators, send copies) is left in ``lv.group_ids``."""
    fwd = phase == "forward"
    if fwd:  # the state's lse is the call's output lse (finalize), unless the pass is one group's
        lv.group_ids = [lv.alloc("state (fp32 out)", sz.q(itemsize=4) + (sz.stats if grouped else 0))]
    else:
        lv.group_ids = [lv.alloc("accumulators (fp32 dq, dk, dv)", sz.q(itemsize=4) + 2 * sz.kv(itemsize=4))]
    rounds: dict = {}
    wire: set = set()  # tensors whose contiguous copy exists (made once per pass)

    def ranges(qc, kc):
        return plan.key_ranges(qc, kc) or ((0, sz.n),)

    def count(qc, kc):
        return sum(b - a for a, b in ranges(qc, kc))

    def whole_copy(name, nbytes):
        if name in copied and name not in wire:
            wire.add(name)
            lv.group_ids.append(lv.alloc("send copies (contiguous)", nbytes))

    def fetch_payload(tr) -> list[int]:
        if tr.kind == "kv":
            rs = ranges(tr.dst, tr.src)
            if rs == ((0, sz.n),):
                for name in "kv":
                    whole_copy(name, sz.kv())
                return []
            if len(rs) > 1:  # several runs of rows: one packed copy each of k and v
                return [lv.alloc("send copies (packed rows)", sz.kv(count(tr.dst, tr.src))) for _ in "kv"]
            a, b = rs[0]
            # a row slice of a (b, n, h, d) tensor is contiguous only with batch 1 and contiguous memory
            per = [sz.kv(b - a) for name in "kv" if name in copied or sz.b > 1]
            return [lv.alloc("send copies (row slices)", nb) for nb in per]
        whole_copy("q", sz.q())
        if not fwd:
            whole_copy("dout", sz.q())
        return []

    def fetch_buffers(tr, rows) -> int:
        if tr.kind == "kv":
            return 2 * sz.kv(rows)
        return sz.q() if fwd else 2 * sz.q() + 2 * sz.stats

    def return_buffers(tr, rows) -> int:
        if tr.kind == "out":
            return sz.q(itemsize=sz.part) + sz.stats
        return sz.q(itemsize=sz.part) if tr.kind == "dq" else 2 * sz.kv(rows, itemsize=sz.part)

    def post(slot, ops, payload, buffers):
        """Receive buffers new to the pool, each of the most rows its set receives in the phase
        (``distattn.schedule.pool.slot_rows``); the round holds what it sends until it is waited for."""
        held = payload if isinstance(payload, list) else [h for tr in ops[0] for h in payload(tr)]
        for i, tr in enumerate(ops[1]):
            if (slot, tr.kind, i) not in pool:
                pool.add((slot, tr.kind, i))
                which, at = slot
                sized = slot_rows(plan, rank, phase, which, (depth if which == "fetch" else keep) + 1)
                lv.alloc("receive pool", buffers(tr, sized[(at, tr.kind, i)]))
        rounds[slot] = held

    def wait(slot):
        lv.free(*rounds.pop(slot))

    def compute(task) -> tuple[list[int], list[int]]:
        """(allocations the task's result holds, the subset that travels)."""
        key = None  # the executor's key-bounds cache (``Executor.mask``): int32 (lo, hi) per query row, kept
        if plan.layout is not None:  # shards are unions of segments: one per (q, kv, borrowed rows) pair
            borrowed = ranges(task.q_chunk, task.kv_chunk) if task.rank == task.q_chunk != task.kv_chunk else None
            key = (task.q_chunk, task.kv_chunk, borrowed)
        elif plan.work is not None:  # documents / window on contiguous shards: one per query chunk
            key = task.q_chunk
        if key is not None and key not in bounds:
            bounds.add(key)
            lv.alloc("key bounds (int32)", 2 * sz.n * 4)
        if task.is_local or (fwd and not task.is_helper):
            return [], []
        if fwd:  # a helper's fp32 state; the partial out travels as is or cast
            out = lv.alloc("partials (computed, in flight)", sz.q(itemsize=4))
            lse = lv.alloc("partials (computed, in flight)", sz.stats)
            if partials == "fp32":
                return [out, lse], [out, lse]
            cast = lv.alloc("partials (computed, in flight)", sz.q())
            return [out, lse, cast], [cast, lse]
        if task.is_helper:
            made = [lv.alloc("partials (computed, in flight)", sz.q(itemsize=4))]
        else:
            r = rows_of(task)
            made = [lv.alloc("partials (computed, in flight)", sz.kv(r, itemsize=4)) for _ in "kv"]
        if partials == "fp32":
            return made, made
        cast = [lv.alloc("partials (computed, in flight)", nb) for nb in
                ([sz.q()] if task.is_helper else [sz.kv(rows_of(task))] * 2)]
        lv.free(*made)  # the fp32 partial dies when compute returns its cast
        return cast, cast

    def rows_of(task):
        return count(task.q_chunk, task.kv_chunk)

    steps, depth, keep = plan.num_steps(), plan.prefetch, plan.return_depth

    def fetch(t):
        post(("fetch", t % (depth + 1)), plan.rank_ops(t, rank, phase, "fetch"), fetch_payload, fetch_buffers)

    for t in range(min(depth, steps)):
        fetch(t)
    head = plan.head_task(rank)  # the backward's head of the local pair (Plan.head_task): its key bounds made now
    if head is not None and sz.n >= 2:  # (one row per rank: no head rows, Executor.head_rows, nothing computed)
        lv.where = f"{phase} {label}before step 0 of {steps}, rank {rank}: computing the local pair's head"
        compute(head)
    stay: list[int] = []  # what the variable ``produced`` keeps of the last partial beyond what travels
    returned: list[tuple] = []  # (step, slot) of the return rounds posted, not yet absorbed
    for t in range(steps):
        where = f"{phase} {label}step {t} of {steps}, rank {rank}"
        lv.where = f"{where}: the next step's fetch posted"
        if t + depth < steps:
            fetch(t + depth)
        wait(("fetch", t % (depth + 1)))
        task = plan.task(t, rank)
        lv.where = f"{where}: computing " + ("nothing" if task is None else "a helper task" if task.is_helper else
                                              "a local task" if task.is_local else "an owner task on borrowed k/v")
        held, travels = compute(task) if task is not None else ([], [])
        lv.free(*stay)  # ``produced`` is rebound: the previous partial lives on only in its send round
        stay = [h for h in held if h not in travels]
        while len(returned) >= keep:
            old, slot = returned.pop(0)
            lv.where = f"{where}: absorbing step {old}'s partials"
            wait(slot)
        returned.append((t, ("return", t % (keep + 1))))
        lv.where = f"{where}: this step's partials posted"
        post(returned[-1][1], plan.rank_ops(t, rank, phase, "return"), travels, return_buffers)
    for _, slot in returned:
        wait(slot)
    lv.free(*stay)  # ``produced`` dies with the plan walk


@functools.lru_cache(maxsize=256)
def _peak(plan: Plan, phase: str, sz: _Sizes, partials: str, copied: frozenset, outputs: bool,
          full: _Sizes | None) -> ExecutorPeak:
    best = None
    for rank in range(plan.world_size):
        lv = _replay(plan, rank, phase, sz, partials, copied, outputs, full)
        if best is None or lv.peak > best.total:
            best = ExecutorPeak(lv.peak, dict(lv.peak_parts), lv.moment, rank)
    return best


def executor_peak(plan: Plan, *, batch: int, n: int, heads: int, kv_heads: int, head_dim: int,
                  dtype: torch.dtype = torch.bfloat16, partials: str = "fp32", phase: str = "backward",
                  copied=("q", "k", "v"), rank: int | None = None, outputs: bool = False,
                  groups: int | None = None) -> ExecutorPeak:
    """Peak bytes the executor allocates beyond its inputs and outputs (see the module docstring).

    Args:
        plan: the plan the call runs (``DistAttnConfig.plan(n)``, i.e.
            ``make_plan(P, causal, schedule, mask=..., chunk=n)``).
        batch, n, heads, kv_heads, head_dim: the shard's shape ``(b, n, h, d)``; dtype: the inputs' dtype.
        partials: ``"fp32"`` or ``"input"`` (``DistAttnConfig.partials``).
        phase: ``"forward"`` or ``"backward"``.
        copied: which of ``q, k, v, dout`` are non-contiguous (HF's attention passes ``(b, h, n, d)`` transposed
            views of q, k, v: copied when sent); ``()`` for contiguous inputs.
        rank: one rank's peak (``None``: the worst rank's).
        outputs: count the call's outputs too (``out, lse``; ``dq, dk, dv`` in the input dtype), as the step holds
            them (the test compares the bytes beyond them).
        groups: the head groups the plan runs for (``None``: what the executor chooses for these shapes,
            ``distattn.schedule.head_groups``); with more than one, a group's slices of every input are
            non-contiguous, so each is copied when sent.
    """
    if partials not in ("fp32", "input"):
        raise ValueError(f"partials={partials!r} must be 'fp32' or 'input'")
    if phase not in ("forward", "backward"):
        raise ValueError(f"phase={phase!r} must be 'forward' or 'backward'")
    A = dtype.itemsize
    part = 4 if partials == "fp32" else A
    sz = full = _Sizes(batch, n, heads, kv_heads, head_dim, A, part)
    G = head_groups(batch, n, heads, kv_heads, head_dim, A, part) if groups is None else groups
    if kv_heads % G:
        raise ValueError(f"groups={G} must divide kv_heads={kv_heads}")
    copied = frozenset(copied)
    if G > 1:
        sz = _Sizes(batch, n, heads // G, kv_heads // G, head_dim, A, part)
        copied = frozenset(("q", "k", "v", "dout"))
    else:
        full = None
    if rank is not None:
        lv = _replay(plan, rank, phase, sz, partials, copied, outputs, full)
        return ExecutorPeak(lv.peak, dict(lv.peak_parts), lv.moment, rank)
    return _peak(plan, phase, sz, partials, copied, outputs, full)


_REF_TOKENS = 1024  # the shard length of the reference replay (even: zigzag's half-shard spans are exact)


def attention_buffers(schedule: str, sp: int, n: int, *, batch: int, heads: int, kv_heads: int, head_dim: int,
                      dtype: torch.dtype = torch.bfloat16, partials: str = "fp32", phase: str = "backward",
                      copied=("q", "k", "v"), outputs: bool = True, groups: int | None = None) -> ExecutorPeak:
    """``executor_peak`` of a dense causal call on ``sp`` ranks with ``n`` tokens each (the plan
    ``DistAttnConfig(causal=True, schedule=...).plan(n)`` builds; zigzag: ``n`` even), with its outputs.

    Every buffer of a dense plan is a whole or half shard (or ``n`` int32 key bounds), so each byte count is ``n``
    times one of a reference length and the peak falls at the same event: the plan is replayed once at
    ``_REF_TOKENS`` tokens per rank and scaled (exact for even ``n``), so the planner's search replays each plan once.

    ``"placed"`` (packed documents; its dense stand-in is the balanced plan) also counts what the placement solver
    lets a deeper plan hold (``distattn.schedule.pool.deepest``): fetch rounds up to ``FETCH_SHARDS`` whole k/v shards
    of receive buffers and as many of sends in flight, that is 5 more sets of whole-shard k/v receive buffers and k/v
    send copies than a plan one step ahead (part ``"deeper prefetch (placed)"``: what fetching 6 steps ahead held with
    whole-shard buffers), and, in the backward, return rounds up to ``RETURN_SHARDS``: 3 more sets of whole-shard dk/dv
    receive buffers and the dk/dv partials sent, in the partials' dtype (``"deeper returns (placed)"``; a placed plan
    has owner tasks only: its forward returns nothing), so a plan the solver deepens never holds more than the planner
    counted for them.
    """
    if groups is None:  # the executor decides at the real length
        groups = head_groups(batch, n, heads, kv_heads, head_dim, dtype.itemsize,
                             4 if partials == "fp32" else dtype.itemsize)
    ref = executor_peak(make_plan(sp, True, schedule, mask=MaskSpec(causal=True), chunk=_REF_TOKENS), batch=batch,
                        n=_REF_TOKENS, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                        partials=partials, phase=phase, copied=copied, outputs=outputs, groups=groups)
    scale = lambda nbytes: nbytes * n // _REF_TOKENS  # noqa: E731
    parts = {k: scale(v) for k, v in ref.parts.items()}
    if schedule == "placed":  # k and v received, k and v sent, per round in flight beyond the first
        parts["deeper prefetch (placed)"] = ((FETCH_SHARDS - 2) * 4 * batch * n * (kv_heads // groups) * head_dim
                                             * dtype.itemsize)
        if phase == "backward":  # dk and dv received, dk and dv sent, per return round held beyond the first
            part = 4 if partials == "fp32" else dtype.itemsize
            parts["deeper returns (placed)"] = ((RETURN_SHARDS - 2) * 4 * batch * n * (kv_heads // groups)
                                                * head_dim * part)
    return ExecutorPeak(sum(parts.values()), parts, ref.moment, ref.rank)
