"""The simulator: what a plan costs (idle slots, work makespan, bytes per rank), read off the plan's runs.

Bytes are the wire contract (:func:`payload_bytes`, per whole shard; an owner task of a masked plan borrows only the
rows of the kv shard its queries see, ``Plan.key_ranges``, so its k/v in and dk/dv back shrink in proportion) that the
comm layer's byte counters meet. The plan's runs
(``Plan.run_table``) are read as arrays, so a plan of P = 16384 ranks (~10^8 tasks) is simulated in well under a
second: a run of L tasks is L messages from ranks ``src .. src + L - 1`` to ``dst .. dst + L - 1``
(:func:`transfer_spans`), and per-rank totals are prefix sums over those spans. Pure Python + numpy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from distattn.schedule.build import make_plan
from distattn.schedule.masks import MaskSpec
from distattn.schedule.plan import PHASES, Plan
from distattn.schedule.timeline import step_timeline
from distattn.schedule.wire import (  # noqa: F401  (handed on: the simulator's names before the split)
    PARTIALS,
    Shapes,
    Spans,
    _bytes_per_rank,
    a2a_bytes,
    payload_bytes,
    step_costs,
    transfer_spans,
    ulysses_heads,
)

__all__ = ["PARTIALS", "Shapes", "payload_bytes", "a2a_bytes", "ulysses_heads", "ring_plan", "SimReport", "simulate",
           "format_table", "Spans", "transfer_spans", "step_costs"]
_MIB = 1 << 20


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
    pair_ratio: float | None = None  # per-pair timeline (``cluster=``): step makespan / perfect balance
    pair_idle: float | None = None  # ... its compute idle (1 - total compute / (P x makespan))
    pair_exposed_ms: float | None = None  # ... the most communication one rank waits inside its own transfers

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
            **({} if self.pair_ratio is None else {
                "per-pair / perfect": f"{self.pair_ratio:.3f}", "per-pair idle": f"{self.pair_idle:.1%}",
                "exposed ms": f"{self.pair_exposed_ms:.3f}"}),
        }


def ring_plan(world_size: int, causal: bool, schedule: str, shapes: Shapes, *, mask: MaskSpec | None = None,
              ulysses: int = 1) -> tuple[Plan, Shapes]:
    """The plan of the ring level and the shapes of its shards: ``R = world_size / ulysses`` ranks of ``U * n``
    tokens with ``1/U`` of the heads (``ulysses = 1``: the plan over all ranks and ``shapes`` unchanged)."""
    ring_shapes = shapes
    if ulysses > 1:
        hq, hkv, _ = ulysses_heads(shapes.heads_q, shapes.heads_kv, ulysses)
        ring_shapes = dataclasses.replace(shapes, seq_per_rank=shapes.seq_per_rank * ulysses, heads_q=hq,
                                          heads_kv=hkv)
    plan = make_plan(world_size // ulysses, causal, schedule, mask=mask, chunk=ring_shapes.seq_per_rank, stride=ulysses)
    return plan, ring_shapes


def simulate(world_size: int, causal: bool = True, schedule: str = "balanced", shapes: Shapes = Shapes(), *,
             mask: MaskSpec | None = None, ulysses: int = 1, partials: str = "fp32", cluster=None) -> SimReport:
    """Read :func:`make_plan`'s plan run by run and tally idle slots, work makespan and bytes.

    With a ``mask`` (packed documents, window) the plan is built for ``shapes.seq_per_rank`` tokens per rank and
    the report also counts the pairs and the pair work the mask lets the plan skip against the dense causal
    plan of the same stream. ``ulysses = U > 1``: two-dimensional sequence parallelism, ``world_size`` ranks as
    ``U`` (all-to-all over heads) x ``R = world_size / U`` (the plan's ring over ``U * n``-token shards with
    ``1/U`` of the heads); the bytes of every rank then include its all-to-alls. Work stays in units of one
    ``n x n`` pair of the *ring's* shards. ``cluster`` (a ``distattn.schedule.cluster.Cluster``): also the per-pair
    timeline's figures (``pair_ratio``, ``pair_idle``, ``pair_exposed_ms``) beside the lockstep ones.
    """
    if isinstance(ulysses, bool) or not isinstance(ulysses, int) or ulysses < 1 or world_size % ulysses:
        raise ValueError(f"ulysses={ulysses!r} must be a positive int dividing world_size={world_size}")
    plan, ring_shapes = ring_plan(world_size, causal, schedule, shapes, mask=mask, ulysses=ulysses)
    p, n_steps = plan.world_size, plan.num_steps()
    rt = plan.run_table
    busy = int((rt.stop - rt.start).sum())
    work = float(np.dot(rt.stop - rt.start, rt.cost))
    makespan = sum(step_costs(plan).tolist())  # in step order, as the executor runs them
    a2a_f, a2a_b = a2a_bytes("forward", shapes, ulysses), a2a_bytes("backward", shapes, ulysses)
    # global rank g = ring rank * U + u does ring rank g // U's transfers, plus its all-to-alls
    (sent_f, recv_f), (sent_b, recv_b) = [
        tuple(np.repeat(per_ring, ulysses) + a2a for per_ring in _bytes_per_rank(plan, phase, ring_shapes, partials))
        for phase, a2a in zip(PHASES, (a2a_f, a2a_b))]
    ints = lambda a: tuple(a.tolist())  # noqa: E731  (Python ints: the report is plain data)
    dense_pairs = p * (p + 1) // 2
    dense_work = p * (p - 1) / 2 + p * 0.5  # the dense causal plan, in units of full pairs
    return SimReport(
        world_size=world_size, causal=plan.causal, schedule=schedule, steps=n_steps,
        idle_fraction=1.0 - busy / (n_steps * p) if n_steps else 0.0,
        work_makespan=makespan,
        compute_idle_fraction=1.0 - work / (p * makespan) if makespan else 0.0,
        bytes_sent=ints(sent_f + sent_b), bytes_recv=ints(recv_f + recv_b),
        bytes_sent_fwd=ints(sent_f), bytes_recv_fwd=ints(recv_f),
        bytes_sent_bwd=ints(sent_b), bytes_recv_bwd=ints(recv_b),
        ulysses=ulysses, a2a_fwd=a2a_f, a2a_bwd=a2a_b, partials=partials,
        pairs=busy, pairs_skipped=max(dense_pairs - busy, 0) if plan.causal else 0,
        work_fraction=work / dense_work,
        **_per_pair(plan, ring_shapes, cluster, partials, ulysses),
    )  # fmt: skip


def _per_pair(plan: Plan, shapes: Shapes, cluster, partials: str, ulysses: int) -> dict:
    """The per-pair timeline's columns of a report (``distattn.schedule.timeline``), with a ``cluster`` only."""
    if cluster is None:
        return {}
    step = step_timeline(plan, shapes, cluster, partials, stride=ulysses)
    return {"pair_ratio": step["ratio"], "pair_idle": step["compute_idle"], "pair_exposed_ms": step["exposed"] * 1e3}


def format_table(reports) -> str:
    """A markdown table, one row per :class:`SimReport`."""
    rows = [r.table_row() for r in reports]
    if not rows:
        return ""
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(row[k]) for k in header) + " |" for row in rows]
    return "\n".join(lines)

