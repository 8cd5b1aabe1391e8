"""Cost model: time per iteration of each method at P = 8..512 ranks, from our plan objects.

Its face and command is ``bench/model.py`` (``python bench/model.py <command>``, which hands these names on and runs
``bench/model_report.py``); this room imports neither of them.

Everything here is *modelled*: nothing is measured unless a number is read from a measurement file you pass
in (``Compute.from_json``, written by ``python bench/model.py measure``). Legend: ``P`` ranks, ``n`` tokens
per rank, ``N = P*n``, ``H`` hidden size (``h_q * d``), ``H_kv = h_kv * d``, ``e`` bytes per element.

1. Communication volume (the paper's Sec. 3.4 accounting, reproduced from our plans)
-----------------------------------------------------------------------------------
Count elements moved per rank per layer, all tensors at activation precision, softmax statistics ignored,
and express them in units of ``(P-1)/P * N * H`` -- what one all-gather of the ``(n, H)`` activations moves
per rank (the paper's "Nd", which drops the ``(P-1)/P``).

* Megatron-LM TP+SP, one layer: forward all-gathers before the QKV and the MLP-in projections and
  reduce-scatters after the output and MLP-out projections (2 AG + 2 RS); backward turns each RS into an AG
  and each AG into an RS, and all-gathers the layer input again for the weight gradients (4 AG + 2 RS):
  **10 units**. Checkpointing (HF style: the layer's forward is recomputed in backward) repeats the forward's
  2 AG + 2 RS: **14 units**. (:func:`megatron_bytes` charges exactly these collectives; the baseline in
  ``bench/baselines/megatron.py`` runs them and counts them.)
* DistFlashAttn, read off :func:`distattn.schedule.make_plan`: every causal pair ``(i, j), j < i`` moves
  one chunk forward -- kv (``2 n H_kv``) to an owner, or q (``n H``) to a helper plus a partial output
  (``n H``) back. ``P(P-1)/2`` pairs of ``2 n H`` is ``(P-1)/P N H`` per rank: **1 unit** (MHA). Backward:
  owners fetch kv and return dk, dv (**2 units** over the ring-order pairs); helpers fetch q and dout and
  return dq (3 tensors instead of 4). With the rematerialization-aware checkpoint the attention forward is
  never recomputed, so there is nothing to add: **3 units** in ring order, slightly less with helpers.

``14 / 3 = 4.67``: the paper's "4.7x less communication than Megatron-LM with checkpointing" is
:func:`paper_comm_ratio` (``schedule="ring"`` pair order, MHA); the balanced plan gives 4.84x at P=8. On the
wire our op sends fp32 partials (dk, dv, dq, out) and statistics, so the *byte* ratio is smaller
(:func:`wire_comm_ratio`, bf16 at P=8: 3.49x for the busiest rank, 3.59x on average) -- both are reported,
and the byte counters of every method must equal this module's byte formulas (``tests/test_baselines.py``).

2. Load balance (the paper's Sec. 3.1 claim)
-------------------------------------------
Causal attention over ``P`` chunks has ``P(P+1)/2`` chunk pairs. Counting every pair as one unit of work
(the paper's convention), the speedup over one device is pairs / steps: ring needs ``P`` steps
(``(P+1)/2 = 4.5x`` at P=8), the balanced plan ``1 + P//2`` (``36/5 = 7.2x`` of the ideal 8) --
:func:`balance_speedup`. Charging diagonal pairs half (their causal mask halves the work; the simulator's
``work_makespan``) gives 4.27x and 7.11x.

3. Time per iteration (per layer, forward + backward, times ``layers``)
---------------------------------------------------------------------
* Compute: matmul FLOPs / ``Compute.matmul``; attention-core FLOPs (``4 b s_q s_k h d``, x0.5 causal
  diagonal, x2.5 backward) / ``Compute.attn_fwd`` or ``attn_bwd``. Elementwise work is ignored.
* distattn (``ring``/``balanced``/``no_overlap``): walk the plan step by step. Step ``t`` computes its
  slowest rank's pair and moves its fetches (and the previous step's partial results) over the links they
  cross (NVLink inside a node, InfiniBand across; a rank's time is its larger of sent/received bytes per
  link plus a latency per message). Overlapped: ``max(compute, comm)`` per step; ``no_overlap``: the sum.
* Megatron: ring all-gather / reduce-scatter, ``(P-1) * (latency + n H e / bw)`` each, bw of the slowest
  link the ring crosses; not overlapped with compute (an upper bound: Megatron overlaps part of backward).
  Attention over ``N`` tokens with ``ceil(h_q/P)`` heads (dummy heads cost compute).
* Ulysses: distattn's two-dimensional path with ``U = P``, ``R = 1`` (``bench/baselines/ulysses.py``): 5
  all-to-alls forward (q, k, v in; out, lse back) and 9 backward (q, k, v, dout, lse, delta in; dq, dk, dv
  back), each rank sending ``(P-1)/P`` of each tensor (:func:`distattn.schedule.a2a_bytes`), intra-node and
  inter-node shares over their own links; not overlapped. Runs where the library splits the heads
  (``ulysses_heads``: ``P | h_q``, and ``P | h_kv`` or ``h_kv | P`` with kv heads replicated).
* Checkpointing: ``"hf"`` recomputes the layer forward (compute and communication) in backward; DistFlashAttn's
  ``"remat"`` recomputes all but the attention core (no communication). Megatron/Ulysses use ``"hf"``.

Defaults (stated, *assumed*, not measured): NVLink 300 GB/s per GPU per direction (A100 NVLink3), InfiniBand
100 Gb/s (12.5 GB/s) or 400 Gb/s (50 GB/s) per GPU, 5 us per message, 8 GPUs per node; A100 bf16 at
312 TFLOP/s peak with FlashAttention-2 at 50% (forward) / 40% (backward) and GEMMs at 60% of peak.
"""

from __future__ import annotations

import functools
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` and ``distattn`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.baselines.layers import LayerShape, flops_per_layer  # noqa: E402
from distattn.schedule import (Plan, Shapes, a2a_bytes, make_plan, payload_bytes, simulate,  # noqa: E402
                               ulysses_heads)

__all__ = ["Link", "Cluster", "Compute", "Workload", "NVLINK", "IB_100G", "IB_400G", "A100_ASSUMED",
           "DISTATTN_METHODS", "MODELS", "megatron_bytes", "ulysses_bytes", "distattn_bytes", "method_bytes",
           "paper_units", "paper_comm_ratio", "wire_comm_ratio", "balance_speedup", "predict"]

DISTATTN_METHODS = {"ring": ("ring", True), "balanced": ("balanced", True), "no_overlap": ("balanced", False)}
_ATTN_BWD_FLOP_FACTOR = 2.5  # FlashAttention backward: 2.5x the forward FLOPs (5 matmuls vs 2)
_MATMUL_BWD_FLOP_FACTOR = 2.0  # grad input + grad weight


# -- hardware ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Link:
    """One GPU's link of a kind: bandwidth per direction (bytes/s) and latency per message (s)."""

    name: str
    bandwidth: float
    latency: float = 5e-6


NVLINK = Link(name="NVLink3 300 GB/s", bandwidth=300e9)
IB_100G = Link(name="InfiniBand 100 Gb/s", bandwidth=12.5e9)
IB_400G = Link(name="InfiniBand 400 Gb/s", bandwidth=50e9)


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Nodes of ``gpus_per_node`` GPUs joined by ``intra``; nodes joined by ``inter`` (one NIC per GPU)."""

    intra: Link = NVLINK
    inter: Link = IB_100G
    gpus_per_node: int = 8

    def link(self, a: int, b: int) -> Link:
        return self.intra if a // self.gpus_per_node == b // self.gpus_per_node else self.inter

    def ring_link(self, world: int) -> Link:
        """The slowest link a ring over ``world`` ranks crosses."""
        return self.intra if world <= self.gpus_per_node else self.inter


@dataclass(frozen=True, kw_only=True)
class Compute:
    """Achieved FLOP/s of the attention kernel (forward, backward) and of GEMMs on one GPU."""

    name: str
    attn_fwd: float
    attn_bwd: float
    matmul: float
    measured: bool = False
    """True only when read from a measurement file (``python bench/model.py measure``)."""

    @classmethod
    def from_json(cls, path) -> "Compute":
        """Rates from ``bench/model.py measure``'s file; ``ValueError`` if one is missing, not finite or absurd."""
        data = json.loads(Path(path).read_text())
        fix = f"re-measure on the GPU with `python bench/model.py measure --out {path}`"
        missing = [k for k in ("name", *_RATES) if k not in data]
        if missing:
            raise ValueError(f"{path}: missing {missing}; {fix}")
        for key in _RATES:
            value = data[key]
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not (ok and 0 < value <= MAX_PLAUSIBLE_RATE):
                raise ValueError(f"{path}: {key}={value!r} FLOP/s is not a plausible rate (allowed: a finite "
                                 f"number in (0, {MAX_PLAUSIBLE_RATE:.0e}]); {fix}")
        return cls(name=data["name"], attn_fwd=data["attn_fwd"], attn_bwd=data["attn_bwd"], matmul=data["matmul"],
                   measured=bool(data.get("measured", False)))


_RATES = ("attn_fwd", "attn_bwd", "matmul")
MAX_PLAUSIBLE_RATE = 1e16
"""FLOP/s: 10 PFLOP/s, several times any single GPU's dense bf16 peak; a larger "measured" rate is a timing
error (e.g. a backward derived by subtracting two noisy times)."""

_A100_PEAK = 312e12  # bf16 dense tensor-core FLOP/s
A100_ASSUMED = Compute(name="A100 bf16, assumed efficiencies (FA2 fwd 50%, bwd 40%, GEMM 60%)",
                       attn_fwd=0.5 * _A100_PEAK, attn_bwd=0.4 * _A100_PEAK, matmul=0.6 * _A100_PEAK)


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one iteration computes: ``layers`` decoder layers over ``P * tokens_per_rank`` tokens."""

    shape: LayerShape
    tokens_per_rank: int
    layers: int = 32
    batch: int = 1
    dtype_bytes: int = 2
    causal: bool = True
    full_layer: bool = True
    """False: attention layer only (no MLP)."""
    checkpoint: bool = True
    """Activation checkpointing per layer: "hf" for the baselines, "remat" for DistFlashAttn."""


def _llama_variant(heads: int, heads_kv: int | None = None) -> tuple[LayerShape, int]:
    """LLaMA-7B with ``heads`` heads of dim 128: hidden and MLP width scale with the heads (MLP 2.6875 H, as
    11008 / 4096), and the layer count grows as 32 * 32 / heads (capped below at 32) so that the whole
    model's attention FLOPs per token stay LLaMA-7B's -- our reading of the paper's "fewer heads, more
    layers" variants, whose exact configurations we could not retrieve."""
    hidden = heads * 128
    ffn = 11008 * hidden // 4096
    return LayerShape(heads_q=heads, heads_kv=heads_kv or heads, head_dim=128, ffn=ffn), max(32, 32 * 32 // heads)


MODELS: dict[str, tuple[LayerShape, int]] = {
    "llama-7b": _llama_variant(32),
    "llama-gqa": _llama_variant(32, 8),
    "llama-33h": _llama_variant(33),
    "llama-16h": _llama_variant(16),
    "llama-8h": _llama_variant(8),
    "llama-4h": _llama_variant(4),
    "llama-2h": _llama_variant(2),
    # tiny shapes for CPU smoke runs and validation (not models anyone trains)
    "tiny-mha": (LayerShape(heads_q=4, heads_kv=4, head_dim=16, ffn=64), 2),
    "tiny-gqa": (LayerShape(heads_q=4, heads_kv=2, head_dim=16, ffn=64), 2),
    "tiny-odd": (LayerShape(heads_q=3, heads_kv=3, head_dim=16, ffn=48), 2),
}
"""name -> (layer shape, number of layers)."""


# -- bytes per rank (what the counters must show) ------------------------------------------------------------
def megatron_bytes(world: int, batch: int, n: int, hidden: int, dtype_bytes: int, *, full_layer: bool = True,
                   recompute: bool = False) -> int:
    """Bytes each rank sends per layer per iteration: ``(P-1) * b n H e`` per all-gather / reduce-scatter;
    5 collectives per block (attention; MLP), 2 more per block recomputed by checkpointing."""
    per_block = 5 + (2 if recompute else 0)
    blocks = 2 if full_layer else 1
    return blocks * per_block * (world - 1) * batch * n * hidden * dtype_bytes


def ulysses_bytes(world: int, batch: int, n: int, shape: LayerShape, dtype_bytes: int, *,
                  recompute: bool = False) -> int:
    """Bytes each rank sends per layer: the library's all-to-alls with ``U = P``, ``R = 1``
    (:func:`distattn.schedule.a2a_bytes`): q, k, v in and out, lse back forward; q, k, v, dout, lse, delta in and
    dq, dk, dv back backward (kv heads replicated when fewer than ``P``). The MLP is local. Checkpointing
    repeats the forward's. Raises ``ValueError`` where the heads cannot split (``ulysses_heads``)."""
    shapes = _shapes(batch, n, shape, dtype_bytes)
    fwd, bwd = a2a_bytes("forward", shapes, world), a2a_bytes("backward", shapes, world)
    return fwd * (2 if recompute else 1) + bwd


def _shapes(batch: int, n: int, shape: LayerShape, dtype_bytes: int) -> Shapes:
    return Shapes(batch=batch, seq_per_rank=n, heads_q=shape.heads_q, heads_kv=shape.heads_kv,
                  head_dim=shape.head_dim, dtype_bytes=dtype_bytes)


def distattn_bytes(world: int, batch: int, n: int, shape: LayerShape, dtype_bytes: int, *, causal: bool = True,
                   schedule: str = "balanced") -> tuple[int, ...]:
    """Bytes each rank sends per layer (forward + backward), read off the plan by the simulator; the
    rematerialization-aware checkpoint adds nothing (the attention forward is never recomputed)."""
    return _simulate(world, causal, schedule, _shapes(batch, n, shape, dtype_bytes)).bytes_sent


@functools.lru_cache(maxsize=256)
def _simulate(world, causal, schedule, shapes):
    return simulate(world, causal, schedule, shapes)


def method_bytes(method: str, world: int, rank: int, batch: int, n: int, shape: LayerShape, dtype_bytes: int, *,
                 causal: bool = True, full_layer: bool = True) -> int:
    """Bytes rank ``rank`` sends for one forward + backward of the layer (no checkpointing)."""
    if method == "megatron":
        return megatron_bytes(world, batch, n, shape.hidden, dtype_bytes, full_layer=full_layer)
    if method == "megatron-core":  # the same collectives; with kv heads < P its fused QKV output is all-gathered
        extra = 0 if shape.heads_kv % world == 0 else (  # once more along its last dim (backward: reduce-scatter)
            2 * (world - 1) * batch * n * (shape.heads_q + 2 * shape.heads_kv) * shape.head_dim * dtype_bytes)
        return megatron_bytes(world, batch, n, shape.hidden, dtype_bytes, full_layer=full_layer) + extra
    if method == "ulysses":
        return ulysses_bytes(world, batch, n, shape, dtype_bytes)
    if method == "deepspeed-ulysses":  # its 4 all-to-alls each way (q, k, v, out; dout, dq, dk, dv): all but 1/P
        heads = 2 * shape.heads_q + 2 * shape.heads_kv
        return 2 * heads * batch * n * shape.head_dim * dtype_bytes * (world - 1) // world
    schedule, _ = DISTATTN_METHODS[method]
    return distattn_bytes(world, batch, n, shape, dtype_bytes, causal=causal, schedule=schedule)[rank]


# -- the paper's claims, from plan objects -------------------------------------------------------------------
def _paper_elems(kind: str, phase: str, n: int, hq_d: int, hkv_d: int) -> int:
    """Elements of one transfer, paper accounting: one precision, statistics (lse, delta) left out."""
    q, kv = n * hq_d, n * hkv_d
    return {("forward", "kv"): 2 * kv, ("forward", "q"): q, ("forward", "out"): q,
            ("backward", "kv"): 2 * kv, ("backward", "q"): 2 * q, ("backward", "dkv"): 2 * kv,
            ("backward", "dq"): q}[(phase, kind)]


def paper_units(plan: Plan, heads_q: int = 32, heads_kv: int = 32, head_dim: int = 128) -> dict:
    """Per-rank average elements a plan moves per layer, in units of ``(P-1)/P * N * H`` (see docstring)."""
    return dict(_paper_units(plan.world_size, plan.causal, plan.schedule, heads_q, heads_kv, head_dim))


@functools.lru_cache(maxsize=256)
def _paper_units(world, causal, schedule, heads_q, heads_kv, head_dim):
    plan = make_plan(world, causal, schedule)
    p, n = plan.world_size, 1  # n cancels: everything is linear in it
    unit = (p - 1) * n * heads_q * head_dim  # (P-1)/P * N * H with N = P * n
    units = {}
    for phase in ("forward", "backward"):
        total = sum(_paper_elems(tr.kind, phase, n, heads_q * head_dim, heads_kv * head_dim)
                    for s in range(plan.num_steps()) for tr in plan.fetches(s, phase) + plan.returns(s, phase))
        units[phase] = total / p / unit if unit else 0.0
    units["total"] = units["forward"] + units["backward"]
    return tuple(units.items())


def paper_comm_ratio(world: int = 8, schedule: str = "ring", *, heads_q: int = 32, heads_kv: int = 32,
                     checkpoint: bool = True) -> float:
    """Megatron-LM's units (10, or 14 with checkpointing) over DistFlashAttn's, read off our causal plan."""
    units = paper_units(make_plan(world, True, schedule), heads_q, heads_kv)["total"]
    return (14.0 if checkpoint else 10.0) / units


def wire_comm_ratio(world: int = 8, schedule: str = "balanced", *, shape: LayerShape = LayerShape(),
                    dtype_bytes: int = 2, checkpoint: bool = True, reduce=max) -> float:
    """Megatron's bytes per rank over our op's *actual* bytes (fp32 partials, statistics); ``reduce`` picks
    the rank (``max``: the busiest; pass ``lambda xs: sum(xs) / len(xs)`` for the average)."""
    ours = reduce(distattn_bytes(world, 1, 1024, shape, dtype_bytes, schedule=schedule))
    return megatron_bytes(world, 1, 1024, shape.hidden, dtype_bytes, recompute=checkpoint) / ours


def balance_speedup(world: int = 8, schedule: str = "balanced", *, diagonal_half: bool = False) -> float:
    """Causal speedup over one device implied by the plan: pairs / steps (paper), or work / work makespan."""
    if diagonal_half:
        rep = simulate(world, True, schedule)
        return world * world / 2 / rep.work_makespan  # total work: P diagonals of 0.5 + P(P-1)/2 pairs of 1
    plan = make_plan(world, True, schedule)
    return len(plan.pairs()) / plan.num_steps()


# -- time per iteration --------------------------------------------------------------------------------------
def _matmul_time(shape: LayerShape, tokens: int, compute: Compute, full_layer: bool, scale: float = 1.0) -> float:
    """Forward GEMM time for ``tokens`` tokens (``scale``: share of the weights, padding included)."""
    return flops_per_layer(shape, tokens, full_layer=full_layer)["matmul"] * scale / compute.matmul


def _core_time(b: int, s_q: int, s_k: int, heads: int, d: int, compute: Compute, *, half: bool,
               backward: bool) -> float:
    flops = 4 * b * s_q * s_k * heads * d * (0.5 if half else 1.0)
    if backward:
        return flops * _ATTN_BWD_FLOP_FACTOR / compute.attn_bwd
    return flops / compute.attn_fwd


@functools.lru_cache(maxsize=256)
def _traffic(world: int, causal: bool, schedule: str, phase: str, which: str, gpus_per_node: int):
    """Per step: the distinct load patterns ``((kind, intra?, count), ...)`` of a (rank, direction), read off
    the plan once (large plans have ~P^2/2 transfers; the time model only needs these patterns)."""
    plan = make_plan(world, causal, schedule).run_order(phase)  # the phase's order of steps (backward: reversed)
    steps = []
    for s in range(plan.num_steps()):
        transfers = plan.fetches(s, phase) if which == "fetch" else plan.returns(s, phase)
        loads: dict[tuple[int, str], dict] = {}
        for tr in transfers:
            intra = tr.src // gpus_per_node == tr.dst // gpus_per_node
            for key in ((tr.src, "send"), (tr.dst, "recv")):
                load = loads.setdefault(key, {})
                load[(tr.kind, intra)] = load.get((tr.kind, intra), 0) + 1
        steps.append(tuple({tuple(sorted((k, i, c) for (k, i), c in ld.items())) for ld in loads.values()}))
    return tuple(steps)


def _comm_times(w: Workload, world: int, schedule: str, phase: str, which: str, cluster: Cluster, sizes: dict):
    """Per step, the slowest rank's transfer time (per link kind and direction, latency per message)."""
    out = []
    for patterns in _traffic(world, w.causal, schedule, phase, which, cluster.gpus_per_node):
        worst = 0.0
        for pattern in patterns:
            per_link = {True: 0.0, False: 0.0}
            for kind, intra, count in pattern:
                link = cluster.intra if intra else cluster.inter
                per_link[intra] += count * (link.latency + sizes[kind] / link.bandwidth)
            worst = max(worst, *per_link.values())
        out.append(worst)
    return out


@functools.lru_cache(maxsize=256)
def _step_has_full_pair(world: int, causal: bool, schedule: str, phase: str) -> tuple[bool, ...]:
    """Per step, in ``phase``'s order: whether some rank computes an off-diagonal (full-cost) pair."""
    plan = make_plan(world, causal, schedule).run_order(phase)
    return tuple(any(not (causal and t.is_diagonal) for t in tasks) for tasks in plan.steps)


_PHASE_KINDS = {"forward": ("kv", "q", "out"), "backward": ("kv", "q", "dkv", "dq")}


def _distattn_core(w: Workload, world: int, schedule: str, overlap: bool, cluster: Cluster, compute: Compute,
                   backward: bool) -> float:
    """Seconds of one attention-core pass following the executor (``distattn/attention.py``): fetches of
    step ``t+1`` and partial results of step ``t-1`` travel while step ``t`` computes (``overlap``)."""
    phase = "backward" if backward else "forward"
    shapes = Shapes(batch=w.batch, seq_per_rank=w.tokens_per_rank, heads_q=w.shape.heads_q,
                    heads_kv=w.shape.heads_kv, head_dim=w.shape.head_dim, dtype_bytes=w.dtype_bytes)
    sizes = {kind: payload_bytes(kind, phase, shapes) for kind in _PHASE_KINDS[phase]}
    comp = _step_computes(w, world, schedule, compute, backward)
    fetch = _comm_times(w, world, schedule, phase, "fetch", cluster, sizes)
    back = _comm_times(w, world, schedule, phase, "return", cluster, sizes)
    if not overlap:
        return sum(fetch) + sum(comp) + sum(back)
    total = fetch[0] + back[-1]
    for s in range(len(comp)):
        in_flight = (fetch[s + 1] if s + 1 < len(fetch) else 0.0) + (back[s - 1] if s else 0.0)
        total += max(comp[s], in_flight)
    return total


def _step_computes(w: Workload, world: int, schedule: str, compute: Compute, backward: bool) -> list[float]:
    """Per step, the slowest rank's attention-core time (causal diagonal pairs cost half)."""
    n, shape = w.tokens_per_rank, w.shape
    full = _core_time(w.batch, n, n, shape.heads_q, shape.head_dim, compute, half=False, backward=backward)
    half = _core_time(w.batch, n, n, shape.heads_q, shape.head_dim, compute, half=True, backward=backward)
    phase = "backward" if backward else "forward"
    return [full if f else half for f in _step_has_full_pair(world, w.causal, schedule, phase)]


def _collective_time(world: int, chunk_bytes: float, cluster: Cluster) -> float:
    link = cluster.ring_link(world)
    return (world - 1) * (link.latency + chunk_bytes / link.bandwidth)


def predict(method: str, world: int, w: Workload, *, cluster: Cluster = Cluster(),
            compute: Compute = A100_ASSUMED) -> dict:
    """Modelled seconds per iteration of ``w`` on ``world`` ranks (``nan`` where the method cannot run).

    Returns ``{"total", "compute", "comm_exposed", "per_layer"}``; ``comm_exposed`` is the time not hidden
    behind compute.
    """
    b, n, shape = w.batch, w.tokens_per_rank, w.shape
    big_n = world * n
    if method in DISTATTN_METHODS:
        schedule, overlap = DISTATTN_METHODS[method]
        mm = _matmul_time(shape, b * n, compute, w.full_layer)
        core_f = _distattn_core(w, world, schedule, overlap, cluster, compute, backward=False)
        core_b = _distattn_core(w, world, schedule, overlap, cluster, compute, backward=True)
        fwd, bwd = mm + core_f, mm * _MATMUL_BWD_FLOP_FACTOR + core_b
        recompute = mm if w.checkpoint else 0.0  # remat-aware: everything but the attention core
        pure = _pure_core_time(w, world, schedule, compute)
        per_layer = fwd + bwd + recompute
        compute_only = mm * (1 + _MATMUL_BWD_FLOP_FACTOR) + recompute + pure
    elif method in ("megatron", "ulysses"):
        if method == "ulysses" and not _ulysses_runs(shape, world):
            nan = float("nan")
            return {"total": nan, "compute": nan, "comm_exposed": nan, "per_layer": nan}
        heads_local = -(-shape.heads_q // world) if method == "megatron" else shape.heads_q // world
        pad = heads_local * world / shape.heads_q  # dummy heads' share of the projections and the core
        mm = _matmul_time(shape, b * n, compute, w.full_layer, scale=pad if method == "megatron" else 1.0)
        core_f = _core_time(b, big_n, big_n, heads_local, shape.head_dim, compute, half=w.causal, backward=False)
        core_b = _core_time(b, big_n, big_n, heads_local, shape.head_dim, compute, half=w.causal, backward=True)
        comm_f, comm_b = _baseline_comm(method, world, w, cluster)
        fwd = mm + core_f + comm_f
        bwd = mm * _MATMUL_BWD_FLOP_FACTOR + core_b + comm_b
        per_layer = fwd + bwd + (fwd if w.checkpoint else 0.0)  # HF checkpointing: the whole forward again
        compute_only = (mm + core_f) * (2 if w.checkpoint else 1) + mm * _MATMUL_BWD_FLOP_FACTOR + core_b
    else:
        raise ValueError(f"method={method!r} is unknown; use one of megatron, ulysses, "
                         f"{', '.join(DISTATTN_METHODS)}")
    return {"total": per_layer * w.layers, "compute": compute_only * w.layers,
            "comm_exposed": (per_layer - compute_only) * w.layers, "per_layer": per_layer}


def _pure_core_time(w: Workload, world: int, schedule: str, compute: Compute) -> float:
    """The plan's attention compute alone (forward + backward), slowest rank per step."""
    return sum(sum(_step_computes(w, world, schedule, compute, bwd)) for bwd in (False, True))


def _baseline_comm(method: str, world: int, w: Workload, cluster: Cluster) -> tuple[float, float]:
    """(forward, backward) communication seconds per layer of Megatron or Ulysses, not overlapped."""
    b, n, shape, e = w.batch, w.tokens_per_rank, w.shape, w.dtype_bytes
    blocks = 2 if w.full_layer else 1
    if method == "megatron":
        one = _collective_time(world, b * n * shape.hidden * e, cluster)
        return blocks * 2 * one, blocks * 3 * one
    shapes = _shapes(b, n, shape, e)
    return tuple(_a2a_phase_time(world, a2a_bytes(phase, shapes, world), _A2A_CALLS[phase], cluster)
                 for phase in ("forward", "backward"))


_A2A_CALLS = {"forward": 5, "backward": 9}
"""All-to-alls per pass in ``distattn.ulysses`` (forward: q, k, v, out, lse; backward: q, dout, k, v, lse, delta,
dq, dk, dv): each pays a latency per peer."""


def _ulysses_runs(shape: LayerShape, world: int) -> bool:
    try:
        ulysses_heads(shape.heads_q, shape.heads_kv, world)
    except ValueError:
        return False
    return True


def _a2a_phase_time(world: int, sent: int, calls: int, cluster: Cluster) -> float:
    """``calls`` all-to-alls in which a rank sends ``sent`` bytes in all, ``sent / (P-1)`` to each peer; the
    intra- and inter-node shares travel in parallel over their own links."""
    if world == 1:
        return 0.0
    per_peer = sent / (world - 1)
    intra_peers = min(world, cluster.gpus_per_node) - 1
    inter_peers = world - 1 - intra_peers
    return calls * (world - 1) * cluster.intra.latency + max(intra_peers * per_peer / cluster.intra.bandwidth,
                                                              inter_peers * per_peer / cluster.inter.bandwidth)

