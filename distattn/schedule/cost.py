"""A cost model of the sequence-parallel plans on a cluster, and the choice among them (``choose``).

Every number is read off the plan objects that the executors run (:func:`distattn.schedule.ring_plan`), step by
step (their runs, as arrays: seconds at P = 16384; each phase in the order it runs the steps, ``Plan.run_order``:
the backward's reversed), never from closed-form formulas. Legend: ``P`` ranks, ``U``
Ulysses degree (heads split over ``U`` ranks by an all-to-all), ``R = P / U`` ranks of the ring level, ``n`` tokens
per rank, ``m = U * n`` tokens per ring shard.

Time of one phase (forward or backward) of one attention layer, on the busiest rank::

    compute_t  = max over ranks of the task's work (in full m x m pairs) * flops_per_pair / flops
    comm(S)    = max over ranks of max(bytes sent, bytes received in S) / bandwidth + latency * messages posted
    ring time  = comm(fetches of step 0)
               + sum_t max(compute_t, comm(fetches of step t+1 + returns of step t-1))   # overlap, as the executor
               + comm(returns of the last step)
    phase time = ring time + a2a_bytes / intra bandwidth + (U - 1) * latency            # all-to-alls, not overlapped

The ring time is read off the per-pair timeline (``distattn.schedule.timeline``): the executor's own
synchronisation (a rank waits only for the peers of its rounds), each message on its own link (inside a node or
across), ``compute_t`` per rank; the formula above is the lockstep walk it replaced (``_phase`` without a cluster),
with ``flops_per_pair = 4 * b * m * m * (h_q / U) * d`` forward and 2.5x that backward (FlashAttention's backward
runs 5 matmuls to the forward's 2). Links: the all-to-all stays inside a node (candidates have ``U <=
gpus_per_node`` and its ranks are adjacent); the ring's ranks are ``U`` apart, so it stays inside a node iff
``R * U = P <= gpus_per_node``, else every ring step is charged to the inter-node link (each GPU has its own
NIC). What the model leaves out: kernel launch overheads, the merge of partials, everything outside attention,
contention between the ``U`` ranks of a node sharing a switch.

Defaults (assumed, not measured):

* NVLink: H100 SXM's NVLink 4 gives 900 GB/s per GPU in both directions together, 450 GB/s per direction
  (NVIDIA H100 datasheet); point-to-point copies through NVSwitch reach well below that, so we charge
  300e9 B/s per direction, about two thirds of peak, and 3 us per message.
* InfiniBand: 100 Gb/s per GPU = 12.5e9 B/s per direction, 5 us per message.
* Compute: 350e12 FLOP/s of attention per GPU, FlashAttention-2's forward on H100 at head dim 128 and long
  sequences (the FlashAttention-3 paper's comparison; about 35% of the 989 TFLOP/s dense bf16 peak). Backward is
  charged 2.5x the forward FLOPs at the same rate (FA2's backward runs somewhat slower, so backward time is
  if anything underestimated, which favours communication-heavy plans slightly less than reality).

Override any of them: ``Cluster(intra=Link(...), inter=Link(...), flops=...)``. Pure Python + numpy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import numpy as np

from distattn.schedule.cluster import (  # noqa: F401  (handed on)
    BWD_FLOP_FACTOR,
    H100_FA2_FLOPS,
    LINKS,
    Cluster,
    Link,
)
from distattn.schedule.heads import head_groups
from distattn.schedule.layouts import Layout
from distattn.schedule.masks import MaskSpec
from distattn.schedule.plan import SCHEDULES, Plan
from distattn.schedule.sim import (
    PARTIALS,
    Shapes,
    a2a_bytes,
    payload_bytes,
    ring_plan,
    simulate,
    step_costs,
    transfer_spans,
    ulysses_heads,
)
from distattn.schedule.timeline import phase_timeline

__all__ = ["Link", "LINKS", "Cluster", "Candidate", "Choice", "predict", "choose", "BWD_FLOP_FACTOR",
           "H100_FA2_FLOPS", "TIE_ORDER", "TIMELINE_MAX_TASKS"]

TIMELINE_MAX_TASKS = 1 << 20
"""Plans of more tasks are timed by the lockstep walk (O(runs), seconds at P = 16384) instead of the per-pair timeline
(O(tasks) time and memory: a dense ring of 16384 ranks holds 1.3 x 10^8 tasks)."""
TIE_ORDER = ("balanced", "zigzag", "ring", "placed")  # equal predicted times: flat in this order, then 2D by U, then this
_MIB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One way to run the layer, and its predicted cost (seconds, per layer); ``reason`` if it cannot run."""

    world_size: int
    schedule: str | None
    """ring-level schedule (``None``: an excluded 2D degree, whichever ring schedule)"""
    ulysses: int = 1
    reason: str | None = None
    """why it cannot run (``None``: it can)"""
    steps: int = 0
    bytes_fwd: int = 0
    """the busiest rank's larger of bytes sent / received, forward (ring transfers + all-to-alls)"""
    bytes_bwd: int = 0
    compute_fwd: float = 0.0
    compute_bwd: float = 0.0
    exposed_fwd: float = 0.0
    """ring communication not hidden behind compute"""
    exposed_bwd: float = 0.0
    a2a_fwd: float = 0.0
    a2a_bwd: float = 0.0
    helper_tasks: int = 0
    """tasks computed by a kv owner for a query owner (q travels there, a partial back)"""
    ring_link: str = ""
    head_groups: int = 1
    """passes of the plan the executor makes, one per group of kv heads (``distattn.schedule.heads``): every ring
    message travels in this many pieces, the same bytes, and each slot pays its latency this many times"""
    messages_fwd: int = 0
    """the busiest rank's ring messages posted (sent + received), forward, every head group's"""
    messages_bwd: int = 0

    @property
    def runnable(self) -> bool:
        return self.reason is None

    @property
    def ring(self) -> int:
        """R, the ranks of the ring level."""
        return self.world_size // self.ulysses

    @property
    def forward(self) -> float:
        return self.compute_fwd + self.exposed_fwd + self.a2a_fwd if self.runnable else float("nan")

    @property
    def backward(self) -> float:
        return self.compute_bwd + self.exposed_bwd + self.a2a_bwd if self.runnable else float("nan")

    @property
    def total(self) -> float:
        return self.forward + self.backward

    @property
    def compute(self) -> float:
        return self.compute_fwd + self.compute_bwd

    @property
    def exposed(self) -> float:
        return self.exposed_fwd + self.exposed_bwd

    @property
    def a2a(self) -> float:
        return self.a2a_fwd + self.a2a_bwd

    @property
    def label(self) -> str:
        """``"zigzag"``, ``"2d U=4 x zigzag R=2"``, ``"ulysses U=8"`` (R = 1), ``"2d U=16"`` (excluded degree)."""
        if self.ulysses == 1:
            return self.schedule
        if self.schedule is None:
            return f"2d U={self.ulysses}"
        if self.ring == 1:
            return f"ulysses U={self.ulysses}"
        return f"2d U={self.ulysses} x {self.schedule} R={self.ring}"

    def order(self) -> tuple:
        """The fixed tie-break order: flat balanced, zigzag, ring; then 2D by U (balanced before zigzag)."""
        rank = TIE_ORDER.index(self.schedule) if self.schedule in TIE_ORDER else -1
        return (self.ulysses > 1, self.ulysses, rank)


# -- the time model --------------------------------------------------------------------------------------------


def _slot_comm(plan: Plan, phase: str, sizes: dict, link: Link) -> list[float]:
    """Seconds the busiest rank needs for each overlap slot's transfers: its larger direction's bytes, plus a
    latency per message posted (sent or received). Slot 0 holds the fetches of step 0; slot ``t + 1`` the fetches of
    step ``t + 1`` and the returns of step ``t - 1`` (they travel while step t computes); slot ``n + 1`` the returns
    of the last step. Read off the plan's runs in one sweep: a run's messages cover a range of senders and a range
    of receivers, so sorting the range ends by (slot, rank) and taking running sums gives every rank's totals."""
    p, n = plan.world_size, plan.num_steps()
    fetch, back = (transfer_spans(plan, phase, which, sizes) for which in ("fetch", "return"))
    slot = np.tile(np.concatenate([fetch.step, back.step + 2]), 4)
    src, dst, length, size = (np.concatenate([getattr(fetch, f), getattr(back, f)]) for f in
                              ("src", "dst", "length", "size"))
    zero, one = np.zeros_like(size), np.ones_like(size)
    pos = np.concatenate([src, src + length, dst, dst + length])  # a range starts adding, ends taking away
    deltas = {"sent": [size, -size, zero, zero], "recv": [zero, zero, size, -size], "msgs": [one, -one, one, -one]}
    key = slot * (p + 1) + pos
    order = np.argsort(key, kind="stable")
    key = key[order]
    sent, recv, msgs = (np.cumsum(np.concatenate(d)[order]) for d in deltas.values())  # a slot's deltas sum to 0
    last = np.append(key[1:] != key[:-1], True)[:len(key)]  # the totals on ranks [pos, next pos) of a slot
    seconds = np.maximum(sent[last], recv[last]) / link.bandwidth + msgs[last] * link.latency
    out = np.zeros(n + 2)
    np.maximum.at(out, key[last] // (p + 1), seconds)
    return out.tolist()


def _phase(plan: Plan, phase: str, ring_shapes: Shapes, link: Link, flops: float,
           partials: str, cluster: Cluster | None = None, stride: int = 1) -> tuple[float, float]:
    """``(compute, ring time)`` of one phase, seconds. With a ``cluster``: the per-pair timeline
    (``distattn.schedule.timeline``: the executor's synchronisation, each message on its own link; compute is the
    busiest rank's). Without: the lockstep walk on ``link`` (the fetches of step t+1 and the returns of step t-1 travel
    while step t computes; every step as long as its slowest rank; the backward's first fetch beside the local pairs'
    head, ``Plan.head``)."""
    plan = plan.run_order(phase)  # the order the phase runs its steps in (the backward: reversed)
    if cluster is not None and plan.num_tasks() <= TIMELINE_MAX_TASKS:
        tl = phase_timeline(plan, phase, ring_shapes, cluster, partials, stride)
        return float(tl.busy.max(initial=0.0)), tl.makespan
    b, m, d = ring_shapes.batch, ring_shapes.seq_per_rank, ring_shapes.head_dim
    pair_flops = 4 * b * m * m * ring_shapes.heads_q * d * (BWD_FLOP_FACTOR if phase == "backward" else 1.0)
    kinds = ("kv", "q", "out") if phase == "forward" else ("kv", "q", "dkv", "dq")
    sizes = {kind: payload_bytes(kind, phase, ring_shapes, partials) for kind in kinds}
    n_steps = plan.num_steps()
    compute = (step_costs(plan) * pair_flops / flops).tolist()
    comm = _slot_comm(plan, phase, sizes, link)
    head = plan.head * compute[-1] if n_steps > 1 else 0.0  # the local pairs' head (Plan.head_task): before step 0
    if head:
        compute[-1] -= head
    total = max(comm[0], head) + comm[n_steps + 1]
    for t in range(n_steps):
        total += max(compute[t], comm[t + 1])
    return sum(compute) + head, total


def predict(world_size: int, shapes: Shapes, schedule: str, ulysses: int = 1, *, causal: bool = True,
            mask: MaskSpec | None = None, cluster: Cluster = Cluster(), partials: str = "fp32") -> Candidate:
    """Predicted cost of ``schedule`` on ``world_size = U * R`` ranks (``U = ulysses``). Raises ``ValueError``
    if it cannot run (heads not divisible by ``U``, odd tokens per rank for zigzag, ...)."""
    if partials not in PARTIALS:
        raise ValueError(f"partials={partials!r} is not one of {PARTIALS}")
    if schedule == "zigzag":
        Layout("zigzag", world_size // ulysses, ulysses).check(shapes.seq_per_rank)
    plan, ring_shapes = ring_plan(world_size, causal, schedule, shapes, mask=mask, ulysses=ulysses)
    report = simulate(world_size, causal, schedule, shapes, mask=mask, ulysses=ulysses, partials=partials)
    link = cluster.ring_link(world_size)
    a2a_link = cluster.a2a_link(ulysses)
    rs = ring_shapes  # the executor runs the plan once per head group (G), as the call's shapes decide
    groups = head_groups(rs.batch, rs.seq_per_rank, rs.heads_q, rs.heads_kv, rs.head_dim, rs.dtype_bytes,
                         4 if partials == "fp32" else rs.dtype_bytes)
    # G passes of 1/G of the bytes and of the compute each: the same time but every message's latency paid G times
    lat = lambda each: replace(each, latency=each.latency * groups)  # noqa: E731
    cluster = replace(cluster, intra=lat(cluster.intra), inter=lat(cluster.inter))
    link, messages = cluster.ring_link(world_size), {}
    times = {}
    for phase in ("forward", "backward"):
        compute, ring_time = _phase(plan, phase, ring_shapes, link, cluster.flops, partials, cluster, ulysses)
        a2a = 0.0
        if ulysses > 1:
            a2a = a2a_bytes(phase, shapes, ulysses) / a2a_link.bandwidth + (ulysses - 1) * a2a_link.latency
        times[phase] = (compute, ring_time - compute, a2a)
        count = np.zeros(plan.world_size + 1, dtype=np.int64)  # ring messages per rank: sent (src) + received (dst)
        for which in ("fetch", "return"):
            spans = transfer_spans(plan, phase, which, dict.fromkeys(("kv", "q", "out", "dkv", "dq"), 0))
            for first in (spans.src, spans.dst):
                np.add.at(count, first, 1)
                np.add.at(count, first + spans.length, -1)
        messages[phase] = int(np.cumsum(count)[:-1].max(initial=0)) * groups
    busiest = lambda sent, recv: max(max(sent), max(recv))  # noqa: E731  (the larger direction of the busiest rank)
    return Candidate(
        world_size=world_size, schedule=schedule, ulysses=ulysses, steps=plan.num_steps(),
        bytes_fwd=busiest(report.bytes_sent_fwd, report.bytes_recv_fwd),
        bytes_bwd=busiest(report.bytes_sent_bwd, report.bytes_recv_bwd),
        compute_fwd=times["forward"][0], exposed_fwd=times["forward"][1], a2a_fwd=times["forward"][2],
        compute_bwd=times["backward"][0], exposed_bwd=times["backward"][1], a2a_bwd=times["backward"][2],
        helper_tasks=_helper_tasks(plan),
        ring_link=link.name if plan.world_size > 1 else "none", head_groups=groups,
        messages_fwd=messages["forward"], messages_bwd=messages["backward"],
    )  # fmt: skip


def _helper_tasks(plan: Plan) -> int:
    rt = plan.run_table
    return int((rt.stop - rt.start)[(rt.dkv == 0) & (rt.dq != 0)].sum())


# -- the choice ------------------------------------------------------------------------------------------------


def _short(err: Exception) -> str:
    """The first clause of an error message (what is wrong, without the fix)."""
    return re.split(r"; | \(heads must|: they must|: pad ", str(err))[0]


def _allowed(allow, schedule: str, ulysses: int) -> bool:
    if allow is None:
        return True
    if ulysses > 1:
        return "2d" in allow and schedule in allow
    return schedule in allow


def _check_allow(allow) -> frozenset | None:
    if allow is None:
        return None
    if isinstance(allow, str):
        allow = (allow,)
    allow = frozenset(allow)
    known = set(SCHEDULES) | {"2d"}
    bad = sorted(allow - known)
    if bad or not allow:
        raise ValueError(f"allow={sorted(allow)!r} must be a non-empty set of {sorted(known)} (schedule names; "
                         f"'2d' also admits Ulysses x ring with the allowed ring schedules); e.g. "
                         f"allow={{'ring', 'balanced'}} for contiguous shards only")
    return allow


def _flat_schedules(mask) -> tuple[str, ...]:
    """The flat candidates: "placed" only for a mask with documents or a window (on a dense mask it is balanced)."""
    return TIE_ORDER if mask is not None and not mask.dense else TIE_ORDER[:3]


def _ring_schedules(mask) -> tuple[str, ...]:
    """The ring-level candidates of a Ulysses x ring grid: balanced, zigzag, ring (the last only for a fixed ``U``),
    and "placed" for a mask with documents (the placement of the ring level, ``R`` ranks of ``U * n`` tokens)."""
    return TIE_ORDER if mask is not None and mask.cu_seqlens is not None else TIE_ORDER[:3]


def _candidates(world_size, shapes, causal, mask, cluster, partials, allow) -> list[Candidate]:
    def attempt(schedule, ulysses):
        try:
            return predict(world_size, shapes, schedule, ulysses, causal=causal, mask=mask, cluster=cluster,
                           partials=partials)
        except ValueError as err:
            return Candidate(world_size=world_size, schedule=schedule, ulysses=ulysses, reason=_short(err))

    out = [attempt(s, 1) for s in _flat_schedules(mask) if _allowed(allow, s, 1)]
    for u in range(2, world_size + 1):
        if world_size % u:
            continue
        ring_schedules = [s for s in _ring_schedules(mask) if s != "ring" and _allowed(allow, s, u)]
        if world_size // u == 1:  # pure Ulysses: one local step, the ring schedule is moot
            ring_schedules = ring_schedules[:1]
        if not ring_schedules:
            continue
        reason = None
        if u > cluster.gpus_per_node:
            reason = f"U={u} > {cluster.gpus_per_node} GPUs per node: the all-to-all would cross nodes"
        else:
            try:
                ulysses_heads(shapes.heads_q, shapes.heads_kv, u)
            except ValueError as err:
                reason = _short(err)
        if reason:
            out.append(Candidate(world_size=world_size, schedule=None, ulysses=u, reason=reason))
        else:
            out += [attempt(s, u) for s in ring_schedules]
    return out


@dataclass(frozen=True)
class Choice:
    """The candidates of :func:`choose`, best first (runnable by predicted total time, then the excluded)."""

    world_size: int
    shapes: Shapes
    causal: bool
    cluster: Cluster
    partials: str
    candidates: tuple[Candidate, ...]
    allow: frozenset | None = None
    mask: MaskSpec | None = field(default=None, repr=False)

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def why(self) -> str:
        """One line: the winner against the runner-up, and the component that separates them."""
        runnable = [c for c in self.candidates if c.runnable]
        win = runnable[0]
        if len(runnable) == 1:
            return f"{win.label}: {_ms(win.total)}, the only candidate that can run"
        return _why(win, runnable[1], self.partials, self.shapes.heads_q)

    def explain(self) -> str:
        """A markdown table of every candidate (excluded ones with their reason) and the winner line."""
        s = self.shapes
        kind = "causal" if self.causal else "non-causal"
        if self.mask is not None and not self.mask.dense:
            kind += f", mask docs={'yes' if self.mask.cu_seqlens else 'no'} window={self.mask.window}"
        c = self.cluster
        lines = [
            f"P={self.world_size}: {s.heads_q} q / {s.heads_kv} kv heads, d={s.head_dim}, {s.seq_per_rank} tokens "
            f"per rank, batch {s.batch}, {s.dtype_bytes}-byte inputs, {kind}, {self.partials} partials",
            f"cluster: {c.gpus_per_node} GPUs per node; intra {c.intra.name} ({c.intra.bandwidth / 1e9:g} GB/s, "
            f"{c.intra.latency * 1e6:g} us); inter {c.inter.name} ({c.inter.bandwidth / 1e9:g} GB/s, "
            f"{c.inter.latency * 1e6:g} us); {c.flops / 1e12:g} TFLOP/s attention per GPU (assumed)"
            + (f"; allow={sorted(self.allow)}" if self.allow is not None else ""),
            "",
            "| candidate | fwd ms | bwd ms | total ms | steps | max MiB/rank fwd | max MiB/rank bwd | compute ms "
            "| exposed comm ms | all-to-all ms | note |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for cand in self.candidates:
            if not cand.runnable:
                lines.append(f"| {cand.label} | - | - | - | - | - | - | - | - | - | cannot run: {cand.reason} |")
                continue
            note = "winner" if cand is self.best else ""
            if cand.head_groups > 1:  # distattn.schedule.heads: the plan runs once per group of kv heads
                g = cand.head_groups
                note += f"{'; ' if note else ''}{g} head groups: {g}x messages, same bytes"
            lines.append(
                f"| {cand.label} | {cand.forward * 1e3:.3f} | {cand.backward * 1e3:.3f} | {cand.total * 1e3:.3f} "
                f"| {cand.steps} | {cand.bytes_fwd / _MIB:.0f} | {cand.bytes_bwd / _MIB:.0f} "
                f"| {cand.compute * 1e3:.3f} | {cand.exposed * 1e3:.3f} | {cand.a2a * 1e3:.3f} | {note} |")
        lines += ["", f"winner: {self.why()}"]
        return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _why(win: Candidate, other: Candidate, partials: str, heads_q: int) -> str:
    head = f"{win.label}: {_ms(win.total)} vs {other.label} {_ms(other.total)}"
    if round(other.total, 12) == round(win.total, 12):
        return f"{head}: a tie, broken by the fixed order (flat balanced, zigzag, ring, then 2D by U)"
    diffs = {"compute": other.compute - win.compute, "comm": other.exposed - win.exposed, "a2a": other.a2a - win.a2a}
    key = max(diffs, key=diffs.get)
    if key == "compute":
        reason = (f"{other.label} computes {_ms(other.compute)} on its busiest rank ({other.steps} steps) vs "
                  f"{_ms(win.compute)}")
        if other.schedule == "ring" and other.ulysses == 1:
            reason += " (the causal ring leaves ranks idle)"
    elif key == "comm":
        moves = f"{other.bytes_fwd / _MIB:.0f} vs {win.bytes_fwd / _MIB:.0f} MiB forward, " \
                f"{other.bytes_bwd / _MIB:.0f} vs {win.bytes_bwd / _MIB:.0f} MiB backward per rank"
        reason = (f"{other.label} leaves {_ms(other.exposed)} of communication exposed vs {_ms(win.exposed)} "
                  f"over {other.ring_link}: {moves}")
        if other.helper_tasks and not win.helper_tasks:
            reason += (f"; its helper steps move q ({heads_q // other.ulysses} heads) and {partials} partials, "
                       f"{win.label}'s steps only k/v and dk/dv")
        elif win.helper_tasks and not other.helper_tasks:
            reason += (f"; its owner steps return {partials} dk/dv (both kv tensors) on every backward step, "
                       f"{win.label}'s helper steps return one dq instead")
    else:
        reason = f"{other.label}'s all-to-alls take {_ms(other.a2a)} vs {_ms(win.a2a)}"
    return f"{head}: {reason}"


def choose(world_size: int, shapes: Shapes, causal: bool = True, mask: MaskSpec | None = None,
           cluster: Cluster = Cluster(), partials: str = "fp32", allow=None, ulysses: int | None = None) -> Choice:
    """Predict every candidate (flat ring/balanced/zigzag, and placed for a non-dense mask; Ulysses x ring for every
    ``U <= gpus_per_node`` dividing P whose heads split, ring level balanced/zigzag, and placed for packed documents)
    and rank them by predicted forward + backward time.

    Args:
        world_size: P, ranks of the sequence-parallel group.
        shapes: per-rank shapes (``seq_per_rank`` = n, tokens each rank holds).
        causal, mask: the attention mask (a ``mask`` decides causality itself).
        cluster: links and FLOP/s (:class:`Cluster`; defaults are assumptions, see the module docstring).
        partials: dtype of the partial results sent back (``"fp32"`` or ``"input"``).
        allow: ``None`` (everything) or a set of schedule names and ``"2d"``: e.g. ``{"ring", "balanced"}``
            for callers that shard contiguously before choosing (the functional API); ``"2d"`` admits
            Ulysses x ring with the allowed ring-level schedules.
        ulysses: ``None`` (every degree) or the one Ulysses degree ``U`` the group already has (1: flat); with
            ``U > 1`` the ring-level schedules ring/balanced/zigzag (and placed, for packed documents) are all
            candidates.

    Returns:
        A :class:`Choice`; ``.best`` is the argmin, ties broken by :data:`TIE_ORDER` then U. Deterministic.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive int (ranks in the group)")
    allow = _check_allow(allow)
    causal = mask.causal if mask is not None else causal
    if ulysses is None:
        found = _candidates(world_size, shapes, causal, mask, cluster, partials, allow)
    else:
        if isinstance(ulysses, bool) or not isinstance(ulysses, int) or ulysses < 1 or world_size % ulysses:
            raise ValueError(f"ulysses={ulysses!r} must be a positive int dividing world_size={world_size}")
        found = []
        for schedule in _flat_schedules(mask) if ulysses == 1 else _ring_schedules(mask):
            if allow is not None and schedule not in allow:
                continue
            try:
                found.append(predict(world_size, shapes, schedule, ulysses, causal=causal, mask=mask,
                                     cluster=cluster, partials=partials))
            except ValueError as err:
                found.append(Candidate(world_size=world_size, schedule=schedule, ulysses=ulysses, reason=_short(err)))
    runnable = sorted((c for c in found if c.runnable), key=lambda c: (round(c.total, 12), c.order()))
    if not runnable:
        why = "; ".join(f"{c.label}: {c.reason}" for c in found) or "allow admits nothing"
        raise ValueError(f"no candidate can run for P={world_size} with allow={allow and sorted(allow)}: {why}")
    excluded = sorted((c for c in found if not c.runnable), key=lambda c: c.order())
    return Choice(world_size=world_size, shapes=shapes, causal=causal, cluster=cluster, partials=partials,
                  candidates=tuple(runnable + excluded), allow=allow, mask=mask)
