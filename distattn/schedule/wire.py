"""What travels, and its size: the shard shapes (:class:`Shapes`), the bytes of every transfer kind (the wire
contract the comm layer's byte counters meet), and a plan's transfers read off its runs as arrays
(:func:`transfer_spans`).

The ground floor the simulator (``distattn.schedule.sim``), the per-pair timeline (``distattn.schedule.timeline``)
and the cost model stand on; it imports only the plan object (``distattn.schedule.plan``). Pure Python + numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from distattn.schedule.plan import Plan, _check_phase

PARTIALS = ("fp32", "input")
__all__ = ["PARTIALS", "Shapes", "payload_bytes", "a2a_bytes", "ulysses_heads", "Spans", "transfer_spans",
           "step_costs"]
_FP32_BYTES = 4  # softmax statistics always travel in fp32; partial results too unless partials="input"


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
class Spans:
    """Transfers of one phase as spans (int64 arrays, one entry per run of the plan that sends): ``length`` messages
    of ``size`` bytes each, from ranks ``src + k`` to ``dst + k`` for ``k < length``, posted at ``step``."""

    step: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray
    size: np.ndarray

    def messages(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every message as arrays ``(step, src, dst, size)``, one entry per message (the spans unrolled)."""
        k = np.arange(int(self.length.sum()), dtype=np.int64) - np.repeat(np.cumsum(self.length) - self.length,
                                                                          self.length)
        step, src, dst, size = (np.repeat(x, self.length) for x in (self.step, self.src, self.dst, self.size))
        return step, src + k, dst + k, size


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
