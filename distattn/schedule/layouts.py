"""Which global positions of the stream each rank holds: the *layout* of a sequence-parallel plan.

A stream of ``T = P * n`` tokens is split over ``P`` ranks, ``n`` tokens each. A rank's shard is a sorted union of
*segments* (``[start, stop)`` position ranges), kept in position order, so local token ``i`` of a shard is the
``i``-th smallest position it holds::

    contiguous (ring, balanced)   rank r: [r*n, (r+1)*n)
    zigzag, P = 4, c = n/2        rank 0: chunks 0, 7   rank 1: 1, 6   rank 2: 2, 5   rank 3: 3, 4   (of 2P chunks of c)

Zigzag (a.k.a. DualChunkSwap) balances causal work by layout instead of by helpers: rank r holds chunks r and
2P-1-r, so every (query shard, kv shard) pair holds the same causal work (half a pair: two of its four chunk
pairs are fully visible, two are invisible; the diagonal has two half-visible chunk pairs and one full one),
every rank computes only its own queries, and only k/v (``h_kv`` heads) travel.

Because positions within a shard are increasing, every mask of ``distattn.schedule.masks`` (causal, documents,
windows) still gives each query row one *interval* of the other shard's local key indices, nondecreasing down
the rows: :func:`local_bounds` maps the global bounds through the layout, and the kernels' ``KeyBounds`` contract
(per-row key intervals) holds unchanged with ``k_start = 0``. Pure Python + numpy.

Two-dimensional layouts (Ulysses x ring, ``ulysses = U > 1``): the ring of ``R = P / U`` ranks runs on *ring
shards* of ``U * n`` tokens laid out by ``kind``; a ring shard is cut into :attr:`Layout.pieces` equal pieces of its
local (position-ordered) tokens (contiguous 1, zigzag 2: its two chunks, placed 1: the whole ring shard, however
many segments it has) and rank ``(r, u)`` (global index ``r * U + u``) holds the ``u``-th ``1/U`` of every piece of
ring shard ``r``, so that the all-to-all over the ``U`` ranks of a row gathers exactly ring shard ``r`` in local
order (piece by piece, ``distattn.ulysses``)::

    placed, U = 2, n = 6:   ring shard r: [0, 4) [10, 14) [20, 24)
                            rank (r, 0):  [0, 4) [10, 12)      rank (r, 1): [12, 14) [20, 24)

For a placement the ring level is solved over ``R`` ring ranks of ``U * n`` tokens, timed on the links the ring takes
(``place(mask, R, U * n, stride=U)``: its ranks are ``U`` global ranks apart), as ``layout_of("placed", R, U, mask=,
n=)`` and ``distattn.sharding.placement`` solve it: the ring's plan, executors, simulator and cost model read it
unchanged, and every rank still holds exactly ``n`` tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import numpy as np

__all__ = ["LAYOUTS", "ORDERS", "BACKWARDS", "HEAD", "PREFETCHES", "RETURN_DEPTHS", "Layout", "local_bounds",
           "pieces_of"]

LAYOUTS = ("contiguous", "zigzag", "placed")
ORDERS = ("rotation", "pairs-work", "pairs-keys", "ranks-work", "ranks-keys")
BACKWARDS = ("reversed", "forward")
"""The order the backward runs a plan's steps in (``Layout.backward``, ``distattn.schedule.plan.Plan.run_order``)."""
HEAD = 0.25
"""The share of its local pair's work a rank computes *before* the backward's first step, while that step's fetch
travels (the *head*, ``Plan.head_task``); the rest at the local pair's own step, the backward's last, where it hides
the dk/dv return of the step before (``Plan.run_order``). Without it nothing hides the backward's first fetch (a whole
k/v shard on a dense plan; 56 us of NVLink at 4096 tokens and 8 kv heads of 128). On the per-pair timeline, with the
solver's plans of the time, shares of 0.15-0.4 did about alike on 46 packed seeds and a quarter lowered the worst
ones (the Pile at P = 8, seed 160: 1.105x -> 1.017x of perfect balance; uniform:8192 at P = 16, seed 95: 1.085x ->
1.061x); 0.5 and more leave too little of the pair to hide the last return. Rows, not keys, are split
(``distattn.schedule.plan.head_rows``): the two parts write disjoint dq rows and both add into dk, dv."""
PREFETCHES = tuple(range(1, 13))
"""How many steps ahead the executor posts a step's fetch (``Layout.prefetch``; ``distattn.executor.Executor._run``).
Up to 6 since the Pile's worst windowed seeds at P = 16 (modelled, on the per-pair timeline): their evened groups
balance the work to 1.005x, and what was left was fetches exposed behind short steps (seed 149: 1.125x of perfect
balance fetching 4 steps ahead and absorbing 3 steps later, 1.045x at 6 and 4;
``bench/results/placement-sim/DEEPER-8-16.md``). Up to 12 since each receive buffer holds only the rows its slot
receives (``distattn.schedule.pool``): a plan whose pairs borrow slices of the shards fetches deeper for the bytes a
plan 6 steps ahead held in whole shards, and the solver deepens a plan only that far (``pool.deepest``). At P = 64 the
worst seeds' fetch rounds, about as long as their compute, then travel behind more of it (longtail seed 7: 1.139x ->
1.099x; ``bench/results/placement-sim/DEEPER-POOL.md``)."""
RETURN_DEPTHS = tuple(range(1, 9))
"""How many steps after posting a step's return round the executor waits for it and absorbs the partials it received
(``Layout.return_depth``; ``distattn.executor.Executor._run``): 1, every plan's, or up to 8 for a placed layout (4
until its buffers were sized by the rows they receive; deeper than 4 only as far as ``distattn.schedule.pool.deepest``
admits). A round
needs both of its ends, so a rank that waits for its returns one step later cannot run more than about two steps ahead
of the peers whose partials it takes or sends; under the packed documents' uneven pairs that chain holds ranks back
where no rank is overloaded (the Pile at P = 16, seed 55, on the per-pair timeline: 1.154x of perfect balance with 1,
1.065x with 3; seed 112 windowed: 1.097x fetching 6 steps ahead with 3, 1.041x with 4). Each step deeper holds one
more set of return receive buffers and one more step's sent partials."""


@dataclass(frozen=True)
class Layout:
    """``kind`` of the ring-level layout over ``world_size`` ring ranks; ``ulysses`` ranks per ring rank.

    ``"placed"``: the segments of every ring rank are data (``placement[r]``, in position order), solved from the
    mask by ``distattn.schedule.placement.place`` over the ring ranks (``ulysses * n`` tokens each) on every rank
    alike; hashable like the other kinds."""

    kind: str = "contiguous"
    world_size: int = 1
    ulysses: int = 1
    placement: tuple[tuple[tuple[int, int], ...], ...] | None = None
    """``"placed"`` only: ``placement[r]`` = the ``(start, stop)`` segments of ring rank ``r``, increasing."""
    group: int = 1
    """``"placed"``: ranks per group of the placement (its documents' blocks stay inside ``group`` neighbouring ranks,
    but for the documents cut across groups); the plan runs each group's ring first."""
    order: str = "rotation"
    """``"placed"``: the order the plan runs the pairs in (:data:`ORDERS`, ``distattn.schedule.masked``):
    ``"rotation"``, each group's ring rotations (``rotation_steps``), or steps as matchings (``matched_steps``). The
    solver keeps the one its per-pair timeline finds fastest."""
    backward: str = "reversed"
    """The order the backward runs the plan's steps in (:data:`BACKWARDS`, ``Plan.run_order``): ``"reversed"``, as
    every plan's backward (the local pair last), or, ``"placed"`` only, ``"forward"``, the plan's own order, where the
    solver's per-pair timeline finds it faster."""
    prefetch: int = 1
    """How many steps ahead the executor posts a step's fetch (:data:`PREFETCHES`; the receive buffers of
    ``prefetch + 1`` fetch rounds are alive at once): 1, every plan's, or, ``"placed"`` only, up to 12 (deeper than 6 as
    far as ``distattn.schedule.pool.deepest`` admits): the shallowest depth that no deeper one makes faster on the
    solver's per-pair timeline by
    :data:`~distattn.schedule.placement.DEEPER` per extra set of receive buffers (``distattn.memory.executor`` counts
    them)."""
    return_depth: int = 1
    """How many steps after posting a step's return round the executor absorbs it (:data:`RETURN_DEPTHS`; the receive
    buffers of ``return_depth + 1`` return rounds alternate): 1, every plan's, or, ``"placed"`` only, up to 8 (deeper
    than 4 as far as ``distattn.schedule.pool.deepest`` admits): the shallowest depth that no deeper one makes faster
    on the solver's per-pair timeline by :data:`~distattn.schedule.placement.DEEPER` per extra set of buffers
    (``distattn.memory.executor`` counts them)."""
    head: bool = True
    """Whether a rank computes :data:`HEAD` of its local pair's work before the backward's first step
    (``Plan.head_task``): ``True``, every plan's, or, ``"placed"`` only, ``False`` (the local pair whole at the
    backward's last step) where the solver's per-pair timeline finds that faster (a head delays the first step's
    compute and leaves less of the local pair to hide the last return behind). A bool, not the share: a traced call
    (``torch.compile(dynamic=True)``) builds layouts, and a float field there is symbolic."""
    note: str = field(default="", compare=False)
    """How the layout was chosen (the placement's groups and block size, or why it fell back to contiguous)."""

    def __post_init__(self):
        if self.kind not in LAYOUTS:
            raise ValueError(f"layout kind {self.kind!r} is not one of {LAYOUTS}")
        if self.world_size < 1 or self.ulysses < 1:
            raise ValueError(f"world_size={self.world_size} and ulysses={self.ulysses} must be >= 1")
        if (self.kind == "placed") != (self.placement is not None):
            raise ValueError("a 'placed' layout needs its placement (per-rank segments), and only it has one: build "
                             "it with distattn.schedule.placement.place(mask, world_size, n)")
        if self.order not in ORDERS or (self.order != "rotation" and self.kind != "placed"):
            raise ValueError(f"order={self.order!r}: a placed layout's order is one of {ORDERS}; other layouts keep "
                             f"'rotation'")
        if self.backward not in BACKWARDS or (self.backward != "reversed" and self.kind != "placed"):
            raise ValueError(f"backward={self.backward!r}: a placed layout's backward order is one of {BACKWARDS}; "
                             f"other layouts keep 'reversed'")
        if (type(self.prefetch) is not int or self.prefetch not in PREFETCHES
                or (self.prefetch != 1 and self.kind != "placed")):
            raise ValueError(f"prefetch={self.prefetch!r}: a placed layout's prefetch depth is one of {PREFETCHES}; "
                             f"other layouts keep 1")
        if (type(self.return_depth) is not int or self.return_depth not in RETURN_DEPTHS
                or (self.return_depth != 1 and self.kind != "placed")):
            raise ValueError(f"return_depth={self.return_depth!r}: a placed layout's return depth is one of "
                             f"{RETURN_DEPTHS}; other layouts keep 1")
        if type(self.head) is not bool or (not self.head and self.kind != "placed"):
            raise ValueError(f"head={self.head!r}: a placed layout's head is True or False; other layouts keep "
                             f"True")
        if self.kind == "placed" and len(self.placement) != self.world_size:
            raise ValueError(f"a placed layout holds the segments of every ring rank ({len(self.placement)} given "
                             f"for world_size={self.world_size}); make it with distattn.sharding.placement(cu_seqlens, "
                             f"n, group) (or distattn.schedule.layout_of('placed', world_size, ulysses, mask=, n=))")

    @property
    def ranks(self) -> int:
        """All ranks: ring ranks x Ulysses ranks."""
        return self.world_size * self.ulysses

    @property
    def segments_per_rank(self) -> int:
        """Segments of every ring shard (contiguous 1, zigzag 2; placed: the most any ring rank holds)."""
        if self.kind == "placed":
            return max(len(segs) for segs in self.placement)
        return 2 if self.kind == "zigzag" else 1

    @property
    def pieces(self) -> int:
        """Equal pieces of a ring shard's local tokens of which every rank of its Ulysses row holds one ``1/U``
        each (module docstring): zigzag 2 (its chunks), contiguous and placed 1 (the shard in position order)."""
        return pieces_of(self.kind)

    @property
    def contiguous(self) -> bool:
        """Rank g holds ``[g*n, (g+1)*n)``: the plain split (``shard_sequence``'s default)."""
        return self.kind == "contiguous"

    def divisor(self) -> int:
        """Tokens per rank must be a multiple of this (zigzag splits every shard in two)."""
        return 2 if self.kind == "zigzag" else 1

    def check(self, n: int) -> None:
        """Raise a clear error if ``n`` tokens per rank cannot be laid out."""
        if self.kind == "placed":
            held = sum(b - a for a, b in self.placement[0])
            if held != n * self.ulysses:
                per = f"{held} tokens per rank" if self.ulysses == 1 else \
                    f"{held} tokens per ring rank ({held / self.ulysses:g} per rank of a Ulysses row of {self.ulysses})"
                raise ValueError(f"this placement was solved for {per}, not {n}: solve it again for the stream's "
                                 f"cu_seqlens and {n} tokens per rank (distattn.sharding.placement(cu_seqlens, {n}, "
                                 f"group))")
            return
        if n % self.divisor():
            raise ValueError(f"the zigzag layout splits every rank's shard into 2 chunks, so tokens per rank "
                             f"({n}) must be even: pad the sequence to a multiple of {2 * self.ranks} "
                             f"(2 x {self.ranks} ranks)")

    def ring_segments(self, ring_rank: int, m: int) -> tuple[tuple[int, int], ...]:
        """Segments of ring shard ``ring_rank`` (``m`` tokens per ring rank), in position order."""
        r, p = ring_rank, self.world_size
        if self.kind == "placed":
            return self.placement[r]
        if self.kind == "contiguous":
            return ((r * m, (r + 1) * m),)
        c = m // 2
        return ((r * c, (r + 1) * c), ((2 * p - 1 - r) * c, (2 * p - r) * c))

    def segments(self, rank: int, n: int) -> tuple[tuple[int, int], ...]:
        """Segments held by global rank ``rank`` (= ``ring_rank * ulysses + u``) with ``n`` tokens per rank: the
        ``u``-th ``1/U`` of every piece of its ring shard's local tokens (module docstring)."""
        self.check(n)
        r, u = divmod(rank, self.ulysses)
        ring = self.ring_segments(r, n * self.ulysses)
        if self.ulysses == 1:
            return ring
        piece = n // self.pieces  # local tokens of each piece of the ring shard that rank (r, u) holds
        size = piece * self.ulysses  # local tokens of each piece of the ring shard
        return tuple(seg for s in range(self.pieces)
                     for seg in _local_slice(ring, s * size + u * piece, s * size + (u + 1) * piece))

    def positions(self, rank: int, n: int) -> np.ndarray:
        """Global positions of the ``n`` local tokens of ``rank``, increasing (int64)."""
        return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in self.segments(rank, n)])

    def ring(self) -> "Layout":
        """The layout the ring sees after the Ulysses all-to-all (ring shards of ``U * n`` tokens)."""
        return dataclasses.replace(self, ulysses=1)

    def render(self, n: int) -> str:
        return "\n".join(f"rank {g}: " + " ".join(f"[{a}, {b})" for a, b in self.segments(g, n))
                         for g in range(self.ranks))


def pieces_of(schedule: str) -> int:
    """:attr:`Layout.pieces` of the layout ``schedule`` runs on, known from the name alone (a placement is one piece,
    as is its contiguous fallback): what the Ulysses all-to-all needs to put a ring shard together."""
    return 2 if schedule == "zigzag" else 1


def _local_slice(segments, lo: int, hi: int) -> tuple[tuple[int, int], ...]:
    """The positions of local tokens ``[lo, hi)`` of a shard made of ``segments`` (in position order), as
    segments."""
    out, offset = [], 0  # offset: local index of the current segment's first token
    for a, b in segments:
        start, stop = max(lo, offset), min(hi, offset + b - a)
        if start < stop:
            out.append((a + start - offset, a + stop - offset))
        offset += b - a
    return tuple(out)


def local_bounds(spec, layout: Layout, n: int, q_rank: int, kv_rank: int) -> tuple[np.ndarray, np.ndarray]:
    """``(lo, hi)``: for every local query row of ``q_rank``, the interval of ``kv_rank``'s *local* key indices it
    sees under ``spec`` (a ``MaskSpec``); ``hi < lo``: none. Both nondecreasing down the rows (int64)."""
    return _local_bounds_cached(spec, layout, n, q_rank, kv_rank)


@functools.lru_cache(maxsize=256)
def _local_bounds_cached(spec, layout, n, q_rank, kv_rank):
    total = layout.ranks * n
    lo, hi = spec.bounds_at(total, layout.positions(q_rank, n))
    keys = layout.positions(kv_rank, n)
    lo_l = np.searchsorted(keys, lo, side="left")  # first local key at a position >= lo
    hi_l = np.searchsorted(keys, hi, side="right") - 1  # last local key at a position <= hi
    hi_l = np.maximum(hi_l, lo_l - 1)
    for a in (lo_l, hi_l):
        a.flags.writeable = False
    return lo_l, hi_l
