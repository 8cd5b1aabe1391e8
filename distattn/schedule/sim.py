"""The simulator: what a plan costs (idle slots, work makespan, bytes per rank), read off the plan's runs.

Bytes are the wire contract (:func:`payload_bytes`, per whole shard; an owner task of a masked plan borrows only the
rows of the kv shard its queries see, ``Plan.key_span``, so its k/v in and dk/dv back shrink in proportion) that the
comm layer's byte counters meet. The plan's runs
(``Plan.run_table``) are read as arrays, so a plan of P = 16384 ranks (~10^8 tasks) is simulated in well under a
second: a run of L tasks is L messages from ranks ``src .. src + L - 1`` to ``dst .. dst + L - 1``
(:func:`transfer_spans`), and per-rank totals are prefix sums over those spans. Pure Python + numpy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from distattn.schedule.masks import MaskSpec
from distattn.schedule.plan import PHASES, Plan, _check_phase, make_plan

PARTIALS = ("fp32", "input")
__all__ = ["PARTIALS", "Shapes", "payload_bytes", "a2a_bytes", "ulysses_heads", "ring_plan", "SimReport", "simulate",
           "format_table", "Spans", "transfer_spans", "step_costs"]
_FP32_BYTES = 4  # softmax statistics always travel in fp32; partial results too unless partials="input"
_MIB = 1 << 20


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


@dataclass(frozen=True)
class Spans:
    """Transfers of one phase as spans (int64 arrays, one entry per run of the plan that sends): ``length`` messages
    of ``size`` bytes each, from ranks ``src + k`` to ``dst + k`` for ``k < length``, posted at ``step``."""

    step: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray
    size: np.ndarray


def transfer_spans(plan: Plan, phase: str, which: str, sizes: dict) -> Spans:
    """The fetches (``which="fetch"``) or returns of every step of ``phase`` as :class:`Spans`, the same messages as
    ``plan.fetches`` / ``plan.returns``; ``sizes`` maps each transfer kind of ``phase`` to its bytes for a whole
    shard (``kv`` and ``dkv`` of an owner task are scaled to the rows it borrows, the run table's ``keys``)."""
    _check_phase(phase)
    rt = plan.run_table
    helper = (rt.dkv == 0) & (rt.dq != 0)  # the kv owner computes: q comes in, a partial goes back
    owner = (rt.dq == 0) & (rt.dkv != 0)  # the query owner computes with borrowed kv
    other = np.where(helper, rt.dq, rt.dkv)  # offset from the computing rank to the rank it borrows from
    def borrowed(full: int) -> np.ndarray:  # an owner task's k/v slice (or its dk/dv partial): its rows of n
        return np.where(rt.keys < 0, full, full // (plan.chunk or 1) * rt.keys)

    if which == "fetch":
        keep = helper | owner
        size = np.where(helper, sizes["q"], borrowed(sizes["kv"]))
        src, dst = rt.start + other, rt.start
    elif which == "return":
        keep = helper if phase == "forward" else helper | owner  # forward: an owner's output is already home
        size = np.where(helper, sizes["out" if phase == "forward" else "dq"], borrowed(sizes.get("dkv", 0)))
        src, dst = rt.start, rt.start + other
    else:
        raise ValueError(f"which={which!r} is not one of ('fetch', 'return'); pass one of them")
    length = rt.stop - rt.start
    return Spans(rt.step[keep], src[keep], dst[keep], length[keep], size[keep].astype(np.int64))


def step_costs(plan: Plan) -> np.ndarray:
    """The largest task cost of every step (units of one full ``n x n`` pair; float64, one per step)."""
    out = np.zeros(plan.num_steps(), dtype=np.float64)
    np.maximum.at(out, plan.run_table.step, plan.run_table.cost)
    return out


def _sizes(phase: str, shapes: Shapes, partials: str) -> dict:
    kinds = ("kv", "q", "out") if phase == "forward" else ("kv", "q", "dkv", "dq")
    return {kind: payload_bytes(kind, phase, shapes, partials) for kind in kinds}


def _per_rank(p: int, first: np.ndarray, length: np.ndarray, size: np.ndarray) -> np.ndarray:
    """Bytes per rank of spans covering ranks ``[first, first + length)`` with ``size`` each (a prefix sum)."""
    diff = np.zeros(p + 1, dtype=np.int64)
    np.add.at(diff, first, size)
    np.add.at(diff, first + length, -size)
    return np.cumsum(diff[:-1])


def _bytes_per_rank(plan: Plan, phase: str, shapes: Shapes, partials: str) -> tuple[np.ndarray, np.ndarray]:
    """``(sent, recv)`` bytes per rank of ``phase`` (every step's fetches and returns)."""
    sizes = _sizes(phase, shapes, partials)
    spans = [transfer_spans(plan, phase, which, sizes) for which in ("fetch", "return")]
    sent = sum(_per_rank(plan.world_size, s.src, s.length, s.size) for s in spans)
    recv = sum(_per_rank(plan.world_size, s.dst, s.length, s.size) for s in spans)
    return sent, recv


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
    """Read :func:`make_plan`'s plan run by run and tally idle slots, work makespan and bytes.

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

