"""The placement solver's settings (``distattn.schedule.solver``): its block size, the attention shapes it times a
candidate with, and the thresholds of its search, each with the measurement that set it."""

from __future__ import annotations

import dataclasses

from distattn.schedule.wire import Shapes, ulysses_heads

__all__ = ["BLOCK", "MAX_BLOCKS_PER_RANK", "ASSUMED_SHAPES", "BALANCED", "CUTS", "PIECES", "EVEN", "EVENED",
           "EVEN_MAX_RANKS", "EVEN_LOOSE", "EVEN_LOOSE_MAX_RANKS", "EVEN_WIDE_MAX_RANKS", "EVEN_LOOSE_MAX_GROUP",
           "NEAR", "WIDER_MAX_RANKS", "WINDOW_CHUNKS", "DEEPER", "FALLBACK_MAX_RANKS", "block_size", "pad_block",
           "solve_shapes"]

BLOCK = 64
"""Target block size in tokens: a key tile of the kernels (``distattn.schedule.solver``'s docstring)."""
MAX_BLOCKS_PER_RANK = 256
"""More blocks of 64 per rank than this (a long shard): larger blocks (:func:`block_size`); where no power of two
dividing ``n`` leaves at most this many (tiny blocks of a large odd ``n``), contiguous shards."""
ASSUMED_SHAPES = Shapes(heads_q=32, heads_kv=8, head_dim=128, dtype_bytes=2)
"""The attention shapes a candidate's plan is timed with (LLaMA-3-8B's: 32 query / 8 kv heads, d = 128, bf16): the
layout must follow from ``cu_seqlens`` and ``n`` alone, before the model is known. Only the ratio of a pair's FLOPs to
its bytes matters, ``(h_q / h_kv) * n``: grouped-query attention of ratio 4."""
BALANCED = 1.04
"""Where the search starts: the smallest group size whose dealt blocks leave every rank's work within this factor of the
mean (the former rule, which the timeline then improves on)."""
CUTS = (0.5, 0.75, 1.0)
"""Under a left window, documents whose work passes this share of a rank's mean work are also cut by work into
pieces (``distattn.schedule.groups``) in candidates of groups of 1, 2, the chosen size and half of it, each timed."""
NEAR = 0.02
"""The windowed deal's third rule (``by="near"``): a short document goes to the rank of the block next to it when that
rank is within this share of a rank's mean work of the window the deal picks (``distattn.schedule.windows``)."""
PIECES = 0.5
"""Cut documents are also timed with every piece holding at most this share of its group's tokens (a long piece is
cut again every that many rows, ``distattn.schedule.groups.cut_by_work``): under a window a document's
first piece of equal work is long and light, and a group it fills is left short of work."""
DEEPER = 0.002
"""The chosen layout, timed with the executor fetching 1 to 12 steps ahead (``Layout.prefetch``,
:data:`~distattn.schedule.layouts.PREFETCHES`: one more set of receive buffers each, and a fetch posted that much
earlier), takes the shallowest depth that no deeper one makes shorter on the per-pair timeline by at least this share
per extra set of buffers (a gain, not a rounding difference, pays for the memory)."""
EVEN = 0.005
"""Cut documents are also timed with the groups' work evened to within this share of their mean
(``distattn.schedule.groups.even_groups``)."""
EVENED = ((True, "dense"), (True, "short"))
"""The evened cuts timed: capped pieces, each exchange order of ``distattn.schedule.groups.even_groups`` (beyond
:data:`EVEN_LOOSE_MAX_RANKS` the first only)."""
EVEN_MAX_RANKS = 32
"""The cuts evened to :data:`EVEN` are timed up to this many ranks: at P = 8 and 16 the solver kept them on 608 of the
1200 windowed solves of ``bench/results/placement-sim/EVEN-8-64.md``, at P = 64 on 1 of 216 (for 1.7x the solve time:
uniform, at most 6.1 s against 3.6 s) and at P = 256 on 1 of 13 (up to 72 s against 38 s), none of them a worst seed."""
EVEN_LOOSE = (0.02, 0.04)
"""The evened cuts are also timed evened only to within these shares of the mean, up to :data:`EVEN_LOOSE_MAX_RANKS`:
evening to :data:`EVEN` scatters pieces over many ranks, and at P = 64 the pairs it adds cost more than the balance
gains; a looser evening keeps most of the balance for fewer pairs (the Pile windowed at P = 64, seed 19: 1.134x ->
1.073x of perfect balance, ``bench/results/placement-sim/EVEN-LOOSE.md``)."""
EVEN_LOOSE_MAX_RANKS, EVEN_WIDE_MAX_RANKS, EVEN_LOOSE_MAX_GROUP = 64, 256, 2
"""The loosely evened cuts are timed up to ``EVEN_LOOSE_MAX_RANKS`` ranks, beyond that up to ``EVEN_WIDE_MAX_RANKS``
to the first tolerance in the first exchange order only (longtail windowed at P = 256, seed 65: 1.107x -> 1.066x), and
on groups of at most ``EVEN_LOOSE_MAX_GROUP`` ranks only (where they win: every seed of ``EVEN-LOOSE.md``)."""
WIDER_MAX_RANKS = 1024
"""Up to this many ranks the windowed deal is also timed on groups twice the chosen size (module docstring); beyond it
only on the chosen groups: at 4096 ranks those plans pass the memory the CLI's plans are held to
(``tests/test_masked_scale.py``, 768 MiB)."""
WINDOW_CHUNKS = (False, True)
"""The windowed deal is timed with a long piece over its window in the snake and in mirrored chunks
(``distattn.schedule.windows``: a chunk's queries see of an earlier rank only its first chunk, so a window's pairs
borrow about a quarter fewer keys; the Pile at P = 64, seed 118: 1.231x -> 1.161x of perfect balance on NVLink)."""
FALLBACK_MAX_RANKS = 32
"""A windowed solve also times the documents-only placement (the causal solve of the same documents, a whole second
solve) on its windowed plan up to this many ranks, and not beyond. It was kept on 9 of the 1200 windowed seeds at P = 8
and 16 (``bench/results/placement-sim/streams-8-16.log``), on 1 of 600 at P = 64 (uniform:8192, seed 43, 1.0405x of
perfect balance; solved without it 1.0400x, ``streams-uniform-64.log``, ``streams-64.log``) and on none of 400 at
P = 256 (``worst-256-window-all.log``), where it took half the solve's CPU or more (longtail seed 32: 21.3 s -> 11.1 s
without it; the Pile seed 197: 14.1 s -> 3.4 s; the same layouts)."""


def block_size(n: int) -> int | None:
    """Tokens per block for ``n`` tokens per rank: 64, or the largest power of two dividing ``n``; past
    :data:`MAX_BLOCKS_PER_RANK` blocks per rank, the least power of two over 64 dividing ``n`` that leaves at most
    that many (a long shard: 32768 tokens, blocks of 128); ``None`` when none does."""
    b = BLOCK
    while n % b:
        b //= 2
    while n // b > MAX_BLOCKS_PER_RANK and n % (2 * b) == 0:
        b *= 2
    return b if n // b <= MAX_BLOCKS_PER_RANK else None


def pad_block(n: int) -> int:
    """The multiple to pad ``n`` tokens per rank to for :func:`block_size` to find a block: 64, or the least power
    of two over it whose blocks of ``n`` rounded up number at most :data:`MAX_BLOCKS_PER_RANK`."""
    b = BLOCK
    while -(-n // b) > MAX_BLOCKS_PER_RANK:
        b *= 2
    return b


def solve_shapes(n: int, stride: int = 1) -> Shapes:
    """:data:`ASSUMED_SHAPES` for ``n`` tokens per rank; on a 2-D group's ring (``stride`` = the Ulysses degree ``U``)
    each rank's ``1/U`` of the heads, as the executor runs the ring level (``distattn.ulysses``): the messages'
    latency then weighs ``U`` times more against a pair's compute. Heads that do not split ``U`` ways keep the
    full shapes (such a group cannot run; the solve is only a model)."""
    shapes = dataclasses.replace(ASSUMED_SHAPES, seq_per_rank=n)
    if stride > 1:
        try:
            hq, hkv, _ = ulysses_heads(shapes.heads_q, shapes.heads_kv, stride)
        except ValueError:
            return shapes
        shapes = dataclasses.replace(shapes, heads_q=hq, heads_kv=hkv)
    return shapes
