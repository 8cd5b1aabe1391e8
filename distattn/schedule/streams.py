"""The placement's stream deal for a left window: every rank one run of each class of blocks (issue 39).

Under a window of ``l`` keys a row deep in a document sees ``l + 1`` keys and a row near a document's start (or in a
short document) fewer, so contiguous shards leave the ranks inside long documents with the most work. The group deals
(``distattn.schedule.deal``, ``distattn.schedule.windows``) balance it by dealing a document's blocks over several
ranks, and every rank of such a window then borrows keys from the others: on longtail at P = 64 the balanced deals were
communication bound and the cheap ones (documents cut by work on groups of 1 or 2) left a rank 1.16x of the mean work
(seed 101, window 4096). A window needs far less: a run of consecutive blocks borrows only the ``l`` keys before it.
So here the stream's blocks are split by their work into classes (a block's work: the visible keys of its rows,
``distattn.schedule.groups.RowWork``; class ``c`` of ``K``: the blocks at or above the ``(1 - (c + 1) / K)``-quantile
of block work, ties together, so the blocks of full windows form one class), each class in position order, and rank
``r`` takes the next run of every class: the middle classes in proportion to their size, and the heaviest and lightest
traded so that the ranks' work summed so far stays nearest ``(r + 1)`` ranks' mean. Every rank holds ``K`` runs
(fewer where runs meet), its work within about one block's of the mean where the classes allow it, and borrows the keys
before each run from the ranks that hold them: in its own class the rank before it, but where a window reaches back into
blocks of another class (a document's first rows, lighter, and its later ones in the heavy class), the rank that class's
run gave them to, which can lie far off, and each such rank adds a step (longtail:2048, P = 64, window 4096, seed 101,
NVLink: 1.211x -> 1.072x of perfect balance on the per-pair timeline; ``bench/results/placement-sim/STREAMS.md``).

The group deal (``distattn.schedule.deal.deal(..., streams=K)``) deals each group's blocks this way over the group's
ranks (the group's tokens in position order, as the snake's), and the solver (``distattn.schedule.placement``) times
it for :data:`STREAM_CLASSES` under a left window on every group size its climb timed and on one group of all ``P``
ranks, keeping it only where the per-pair timeline finds it faster (a group bounds how far off a rank borrows: seed 101
above, 1.051x in two groups of 32). Causal work has no plateau of full windows, and a late run of a causal document
borrows all of its earlier keys (the same seeds causal: 1.45-2.6x), so it is not timed there.
Deterministic; pure numpy.
"""

from __future__ import annotations

import numpy as np

__all__ = ["STREAM_CLASSES", "stream_owners"]

STREAM_CLASSES = (2, 3)
"""The numbers of classes timed: 2 (the blocks of full windows against the rest, where they are at least half of the
blocks) wins on longtail, 3 on some seeds of the Pile (seed 111 at P = 64: 1.110x with 2, 1.092x with 3)."""


def stream_owners(work: np.ndarray, p: int, n: int, b: int, classes: int) -> np.ndarray:
    """Each block's rank (module docstring): ``work`` per block of ``b`` tokens of a stream (or a group's) held by
    ``p`` ranks of ``n`` tokens, ``classes`` classes of blocks by work."""
    if classes < 2 or n % b or len(work) * b != p * n:
        raise ValueError(f"stream_owners: {classes} classes of {len(work)} blocks of {b} for {p} ranks of {n} tokens")
    work = np.asarray(work, dtype=np.float64)
    slots, mean = n // b, float(work.sum()) / p
    cls = np.full(len(work), classes - 1)
    for c, q in reversed(list(enumerate(np.quantile(work, [1 - (c + 1) / classes for c in range(classes - 1)])))):
        cls[work >= q] = c  # descending thresholds, ties in the heavier class
    streams = [s for s in (np.flatnonzero(cls == c) for c in range(classes)) if len(s)]
    if len(streams) < 2:  # every block of one work: any contiguous shards are balanced
        return np.arange(len(work)) // slots
    sums = [np.concatenate([[0.0], np.cumsum(work[s])]) for s in streams]
    at, done, owner = [0] * len(streams), 0.0, np.empty(len(work), dtype=np.int64)
    for r in range(p):
        take = [(r + 1) * len(s) // p - r * len(s) // p for s in streams]  # the middle classes' share
        room = slots - sum(take[1:-1])  # the heaviest and the lightest class share the rest
        middle = sum(sums[c][at[c] + take[c]] - sums[c][at[c]] for c in range(1, len(streams) - 1))
        heavy = np.arange(max(0, room - (len(streams[-1]) - at[-1])), min(room, len(streams[0]) - at[0]) + 1)
        got = (done + middle + sums[0][at[0] + heavy] - sums[0][at[0]] + sums[-1][at[-1] + room - heavy]
               - sums[-1][at[-1]])
        h = int(heavy[np.argmin(np.abs(got - (r + 1) * mean))])  # the first of the nearest
        take[0], take[-1] = h, room - h
        for c, s in enumerate(streams):
            owner[s[at[c]:at[c] + take[c]]] = r
            done += sums[c][at[c] + take[c]] - sums[c][at[c]]
            at[c] += take[c]
    assert all(a == len(s) for a, s in zip(at, streams)), "stream_owners: a block left without a rank"
    return owner

