"""The placement's first level: the documents of a packed stream to groups of ranks, balanced by their rows' work.

:func:`assign_groups` deals the documents, longest first, to the least loaded group with room for them whole
(longest-processing-time first under a token capacity); a document no group has room for is cut by the groups' room,
the most room first, and its pieces laid out so that the last one cut, the shortest, holds the document's first rows
(``short_first``; else the first part to the group with the most room). A short piece cut off a document's end would
hold its heaviest rows, which see every key before them: the group holding it would fetch the long piece's keys from
every rank the long piece is dealt to, one step each (uniform:8192, P = 64, seed 181: a 64-token end on one rank
added 8 steps of a few microseconds each; seed 188: 1.121x -> 1.091x of perfect balance with the first rows there
instead); holding the first rows it borrows nothing, and each of those ranks fetches its few keys in one step. The
placement solver times both (``distattn.schedule.placement``). :class:`RowWork` gives the work (visible keys) of any
rows of a document in closed form, causal or not, with or without a sliding window.

A document may also be *cut by its work* before the groups are dealt (``cut``): every document whose rows' work
passes ``cut`` becomes consecutive pieces of about equal work, each then dealt like a document of its own. A long
document otherwise fills whole groups by their token room, so the group holding its heavy rows holds nothing else:
with a sliding window every row past the window sees as many keys as the window, and a document of 65,353 tokens
under a window of 4,096 holds 58% of a batch's work in a quarter of its tokens (the Pile, ``pile:4``, P = 64, seed
22: its busiest rank at 2.40x of the mean). Cut into pieces of a fraction of a rank's mean work, the document's rows
spread over the ranks and short documents fill the rest; under a window each piece borrows at most the window's keys
from the pieces before it, so the pieces cost few bytes (causal, the last piece would borrow the whole document's
keys: the solver cuts only under a window, ``distattn.schedule.placement``).

Every group holds exactly its tokens, so longest-first leaves groups of unequal work where the densest pieces do not
fall evenly: a group that holds one long document's heavy rows may only fill its room with other documents' tokens,
whatever their work. :func:`even_groups` then evens the groups' work by exchanges of equal numbers of tokens between
the heaviest group and the lightest, the heavier giving its densest pieces and taking the lighter's lightest, one
piece of each side cut where the sizes meet (longtail at P = 16, seed 7, window 4096, groups of one rank, pieces of
half a rank's work capped at 2048 tokens: the busiest rank's work from 1.28x of the mean to 1.005x). The solver times
it as a candidate (``distattn.schedule.placement``). Deterministic; pure Python + numpy.
"""

from __future__ import annotations

import heapq

import numpy as np

__all__ = ["RowWork", "assign_groups", "cut_by_work", "even_groups", "group_loads"]

_INF = 1 << 62


class RowWork:
    """Visible keys summed over the rows ``[0, x)`` of each document (closed form, vectorized over documents).

    Row ``i`` of a document of ``L`` tokens sees ``1 + min(i, l) + min(L - 1 - i, r)`` keys, with ``l`` the left
    window (unlimited: ``L``) and ``r`` 0 causal, else the right window (unlimited: ``L``)."""

    def __init__(self, spec, lengths: np.ndarray):
        left, right = spec.window
        self.lengths = lengths
        self.l = _INF if left < 0 else left
        self.r = 0 if spec.causal else (_INF if right < 0 else right)

    @staticmethod
    def _s(m, x):
        """``sum_{i < m} min(i, x)`` for arrays ``m`` (>= 0) and a scalar ``x`` (>= 0)."""
        m = np.asarray(m, dtype=np.int64)
        xs = min(x, 1 << 31)
        small = m * (m - 1) // 2
        big = xs * (xs + 1) // 2 + (m - 1 - xs) * xs
        return np.where(m <= xs + 1, small, big)

    def prefix_one(self, length: int, x: int) -> int:
        """:meth:`prefix` of one document of ``length`` tokens, in plain Python (the solver's inner loop)."""
        def s(m, c):
            return m * (m - 1) // 2 if m <= c + 1 else c * (c + 1) // 2 + (m - 1 - c) * c
        return x + s(x, self.l) + s(length, self.r) - s(length - x, self.r)

    def prefix(self, doc, x):
        """Work of rows ``[0, x)`` of documents ``doc`` (arrays)."""
        length = self.lengths[doc]
        return x + self._s(x, self.l) + self._s(length, self.r) - self._s(length - x, self.r)


def cut_by_work(lengths: np.ndarray, rows: RowWork, cut: float | None,
                tokens: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The items the groups are dealt: ``(doc, lo, hi)`` arrays, rows ``[lo, hi)`` of document ``doc``, in stream
    order. Every document is one item, but one whose work passes ``cut`` (``None``: none is cut) is cut into
    ``ceil(work / cut)`` consecutive pieces of about equal work (cut at whole rows; no piece is empty); with
    ``tokens``, each such piece longer than ``tokens`` rows is cut again every ``tokens`` rows, the last part shorter
    (two parts of half a group's tokens fill it exactly; parts of equal rows leave room no part fits). Under a window
    a document's first rows see few keys, so its first piece of equal work is long: it fills a group's token room with
    little work and leaves that group short of work; capped, it shares the group with heavier pieces."""
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
        raise ValueError(f"tokens={tokens!r} must be a positive number of rows per piece")
    docs = np.arange(len(lengths))
    if cut is None:
        return docs, np.zeros(len(lengths), dtype=np.int64), lengths.astype(np.int64)
    if cut <= 0:
        raise ValueError(f"cut={cut!r} must be a positive amount of work")
    whole = rows.prefix(docs, lengths)
    out = []
    for d in docs.tolist():
        length = int(lengths[d])
        parts = -(-int(whole[d]) // cut) if whole[d] > cut else 1
        if parts <= 1 or length <= 1:
            out.append((d, 0, length))
            continue
        x = np.arange(length + 1)
        done = rows.prefix(np.full(length + 1, d), x)  # work of rows [0, x), non-decreasing in x
        at = np.searchsorted(done, int(whole[d]) * np.arange(1, parts) / parts)
        bounds = np.unique(np.concatenate(([0], np.clip(at, 1, length - 1), [length])))
        if tokens is not None:  # long pieces again, every `tokens` rows
            more = [np.arange(a + tokens, b, tokens) for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]
            bounds = np.unique(np.concatenate([bounds] + more))
        out += [(d, int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]
    doc, lo, hi = (np.asarray(c, dtype=np.int64) for c in zip(*out))
    return doc, lo, hi


def assign_groups(starts, lengths, rows: RowWork, groups: int, cap: int, limit: float = float("inf"),
                  cut: float | None = None, tokens: int | None = None, short_first: bool = False):
    """Documents (their pieces, :func:`cut_by_work`), longest first, to the least loaded group with room for them
    whole; an item no group has room for is cut by room, the most room first, its first rows to the group with the most
    room (``short_first``: to the shortest piece, the last cut; module docstring). Returns ``pieces``
    (``[start, stop, group, doc]`` rows, global positions); ``None`` as soon as a group's load (row work) exceeds
    ``limit`` (loads only grow: the caller's tolerance is already lost). ``cut``, ``tokens``: :func:`cut_by_work`.

    Two heaps, O((items + pieces) log groups): ``ready``, ``(load, group)`` of the groups with room for the current
    item, and ``waiting``, ``(-room, group)`` of the others with any room. The items only get shorter, so a ready
    group stays ready until it takes an item (then it waits, its room smaller), and before each item the waiting
    groups with room enough join the ready ones; a cut takes the top of ``waiting``."""
    doc, lo, hi = cut_by_work(lengths, rows, cut, tokens)
    size = hi - lo
    work = rows.prefix(doc, hi) - rows.prefix(doc, lo)
    if cut is not None:
        return _assign_scan(doc, lo, size, work, starts, lengths, rows, groups, cap, limit, short_first)
    order = np.lexsort((np.arange(len(size)), -size)).tolist()
    work = work.tolist()
    doc_l, lo_l, size_l = doc.tolist(), lo.tolist(), size.tolist()
    length_l, start_l = lengths.tolist(), starts.tolist()
    free, load = [cap] * groups, [0] * groups
    ready, waiting = [], [(-cap, g) for g in range(groups)]
    pieces = []
    for i in order:
        d, length, base, off = doc_l[i], size_l[i], start_l[doc_l[i]] + lo_l[i], 0
        while waiting and -waiting[0][0] >= length:
            g = heapq.heappop(waiting)[1]
            heapq.heappush(ready, (load[g], g))
        if ready:  # the least loaded group with room for the whole item
            _, g = heapq.heappop(ready)
            load[g] += work[i]
            if load[g] > limit:
                return None
            free[g] -= length
            pieces.append((base, base + length, g, d))
            if free[g]:  # a full group leaves the heaps for good
                heapq.heappush(waiting, (-free[g], g))
            continue
        takes = []
        while off < length:  # cut: the most room first (a tie: the first such group)
            g = heapq.heappop(waiting)[1]
            takes.append((g, min(free[g], length - off)))
            off += takes[-1][1]
        if not _cut(pieces, load, free, takes, short_first, d, lo_l[i], base, rows, length_l[d], limit):
            return None
        for g, _ in takes:
            if free[g]:
                heapq.heappush(waiting, (-free[g], g))
    return np.asarray(pieces, dtype=np.int64)


def _cut(pieces: list, load, free, takes: list, short_first: bool, d: int, x: int, at: int, rows: RowWork,
         length: int, limit: float) -> bool:
    """An item cut by room, ``takes`` its ``(group, tokens)`` in the order cut (the most room first): laid out from its
    first row ``x`` (global position ``at``) in that order, or reversed (``short_first``: the last cut, the shortest,
    holds the first rows); ``False`` when a group's load then passes ``limit``."""
    off = 0
    for g, take in (takes[::-1] if short_first else takes):
        if not _put(pieces, load, free, g, take, d, x + off, at + off, rows, length, limit):
            return False
        off += take
    return True


def _put(pieces: list, load, free, g: int, take: int, d: int, x: int, at: int, rows: RowWork, length: int,
         limit: float) -> bool:
    """Rows ``[x, x + take)`` of document ``d`` (``length`` tokens; global position ``at``) to group ``g``; ``False``
    when the group's load then passes ``limit``."""
    load[g] += rows.prefix_one(length, x + take) - rows.prefix_one(length, x)
    free[g] -= take
    pieces.append((at, at + take, g, d))
    return load[g] <= limit


def _assign_scan(doc, lo, size, work, starts, lengths, rows: RowWork, groups: int, cap: int, limit: float,
                 short_first: bool = False):
    """:func:`assign_groups` for documents cut by work: the pieces of cut documents first, heaviest first (they
    carry the balance), then every other document longest first (they fill the room); each to the least loaded group
    with room for it whole, else cut by room, the most room first. A scan over the groups per item."""
    cut_doc = np.bincount(doc)[doc] > 1
    order = np.lexsort((np.arange(len(size)), -size, np.where(cut_doc, -work, 0), ~cut_doc)).tolist()
    free, load = np.full(groups, cap, dtype=np.int64), np.zeros(groups)
    doc_l, lo_l, size_l, work_l = doc.tolist(), lo.tolist(), size.tolist(), work.tolist()
    length_l, start_l = lengths.tolist(), starts.tolist()
    pieces = []
    for i in order:
        d, length, base, off = doc_l[i], size_l[i], start_l[doc_l[i]] + lo_l[i], 0
        room = np.flatnonzero(free >= length)
        if len(room):
            g = int(room[np.argmin(load[room])])  # a tie: the first
            load[g] += work_l[i]
            if load[g] > limit:
                return None
            free[g] -= length
            pieces.append((base, base + length, g, d))
            continue
        takes, room = [], free.copy()
        while off < length:  # cut: the most room first (a tie: the first such group)
            g = int(np.argmax(room))
            takes.append((g, min(int(room[g]), length - off)))
            room[g] -= takes[-1][1]
            off += takes[-1][1]
        if not _cut(pieces, load, free, takes, short_first, d, lo_l[i], base, rows, length_l[d], limit):
            return None
    return np.asarray(pieces, dtype=np.int64)


EVEN_STEP = 16
"""Tokens between the exchange sizes :func:`even_groups` tries inside an item (item boundaries are always tried)."""


def even_groups(pieces: np.ndarray, starts, rows: RowWork, groups: int, tol: float,
                order: str = "dense") -> np.ndarray:
    """``pieces`` (:func:`assign_groups`) with the groups' work evened (module docstring): up to ``2 * groups`` times,
    while the heaviest group passes the mean by more than ``tol``, it and the lightest exchange the same number of
    tokens, the first ``s`` of each one's exchange order (the heavier one's densest pieces first, the lighter one's
    lightest; pieces of documents cut already last, and with ``order="short"`` also pieces longer than a quarter of the
    two groups' tokens), ``s`` the size (every :data:`EVEN_STEP` tokens and every piece boundary) that brings the two
    loads nearest their mean. At most one piece of each side is cut by an exchange, its short side holding the
    document's first rows. Every group keeps its tokens; the heaviest load never grows. Neighbouring pieces of a
    document in one group are joined."""
    pieces = np.asarray(pieces, dtype=np.int64).copy()
    start_l = np.asarray(starts, dtype=np.int64)
    for _ in range(2 * groups):
        work = _piece_work(pieces, start_l, rows)
        load = np.bincount(pieces[:, 2], weights=work, minlength=groups)
        h, lo = int(np.argmax(load)), int(np.argmin(load))
        if load[h] <= load.mean() * (1 + tol):
            break
        new = _exchange(pieces, work, h, lo, start_l, rows, (load[h] + load[lo]) / 2, order)
        if new is None:
            break
        pieces = new
    return _merged(pieces)


def group_loads(pieces: np.ndarray, starts, rows: RowWork, groups: int) -> np.ndarray:
    """Every group's work (its pieces' rows' visible keys)."""
    return np.bincount(pieces[:, 2], weights=_piece_work(pieces, np.asarray(starts, dtype=np.int64), rows),
                       minlength=groups)


def _piece_work(pieces, starts, rows: RowWork):
    """Each piece's work (its rows' visible keys)."""
    d0 = starts[pieces[:, 3]]
    return rows.prefix(pieces[:, 3], pieces[:, 1] - d0) - rows.prefix(pieces[:, 3], pieces[:, 0] - d0)


def _moved(items, work, s, starts, rows: RowWork):
    """Work of the first ``s`` tokens (array) of ``items`` (pieces in exchange order); inside the item cut, its first
    rows when fewer than half of it move, else its last rows (the short side of a cut holds the document's first
    rows)."""
    size = items[:, 1] - items[:, 0]
    end = np.cumsum(size)
    begin = end - size
    before = np.append(0.0, np.cumsum(work))
    i = np.minimum(np.searchsorted(end, s, side="right"), len(items) - 1)
    x = np.clip(s - begin[i], 0, size[i])
    doc = items[i, 3]
    d0 = starts[doc]
    a, b = items[i, 0] - d0, items[i, 1] - d0
    first = rows.prefix(doc, a + x) - rows.prefix(doc, a)
    last = rows.prefix(doc, b) - rows.prefix(doc, b - x)
    return before[i] + np.where(_moves_first_rows(x, size[i]), first, last)


def _moves_first_rows(x, size):
    """Whether ``x`` of a piece's ``size`` tokens moving are its first rows (else its last): the short side of a cut
    holds the document's first rows. One rule for :func:`_moved` (the work) and :func:`_split` (the pieces)."""
    return 2 * x <= size


def _exchange(pieces, work, h: int, lo: int, starts, rows: RowWork, target: float, order: str):
    """``pieces`` with groups ``h`` (the heavier) and ``lo`` exchanging the first ``s`` tokens of each one's exchange
    order (:func:`even_groups`), ``s`` the size that brings ``h``'s load nearest ``target``; ``None`` when no
    exchange lowers the larger of the two loads."""
    cut = np.bincount(pieces[:, 3])[pieces[:, 3]] > 1
    size = pieces[:, 1] - pieces[:, 0]
    density = work / np.maximum(size, 1)
    hi_i = np.flatnonzero(pieces[:, 2] == h)
    lo_i = np.flatnonzero(pieces[:, 2] == lo)
    big = size > (size[hi_i].sum() + size[lo_i].sum()) // 8 if order == "short" else np.zeros(len(size), bool)
    hi_i = hi_i[np.lexsort((hi_i, -density[hi_i], big[hi_i], cut[hi_i]))]
    lo_i = lo_i[np.lexsort((lo_i, density[lo_i], big[lo_i], cut[lo_i]))]
    total = min(size[hi_i].sum(), size[lo_i].sum())
    s = np.unique(np.concatenate([np.arange(0, total + 1, EVEN_STEP), np.cumsum(size[hi_i]), np.cumsum(size[lo_i]),
                                  [total]]))
    s = s[s <= total]
    load_h = work[hi_i].sum()
    out_h = _moved(pieces[hi_i], work[hi_i], s, starts, rows)
    out_l = _moved(pieces[lo_i], work[lo_i], s, starts, rows)
    w = load_h - out_h + out_l  # h's load after the exchange
    best = int(np.argmin(np.abs(w - target)))  # a tie: the fewest tokens moved
    if max(w[best], 2 * target - w[best]) >= load_h * (1 - 1e-9):
        return None
    keep = np.ones(len(pieces), dtype=bool)
    keep[hi_i] = keep[lo_i] = False
    out = [pieces[keep]]
    for items, dest in ((pieces[hi_i], lo), (pieces[lo_i], h)):
        out.append(_split(items, int(s[best]), dest))
    return np.concatenate(out)


def _split(items, s: int, dest: int):
    """``items`` with their first ``s`` tokens (the cut item: its first rows when fewer than half of it move, else
    its last rows) given to group ``dest``."""
    items = items.copy()
    size = items[:, 1] - items[:, 0]
    end = np.cumsum(size)
    full = end <= s
    items[full, 2] = dest
    i = int(np.searchsorted(end, s, side="right"))
    if i >= len(items) or full.all():
        return items
    x = s - (end[i] - size[i])
    if x <= 0:
        return items
    a, b, g, d = items[i].tolist()
    if _moves_first_rows(x, b - a):
        parts = [(a, a + x, dest, d), (a + x, b, g, d)]
    else:
        parts = [(a, b - x, g, d), (b - x, b, dest, d)]
    return np.concatenate([np.delete(items, i, axis=0), np.asarray(parts, dtype=np.int64)])


def _merged(pieces):
    """Neighbouring pieces of one document in one group joined."""
    order = np.lexsort((pieces[:, 0], pieces[:, 2]))
    pieces = pieces[order]
    new = np.ones(len(pieces), dtype=bool)
    new[1:] = (pieces[1:, 2] != pieces[:-1, 2]) | (pieces[1:, 3] != pieces[:-1, 3]) | (pieces[1:, 0] != pieces[:-1, 1])
    first = np.flatnonzero(new)
    out = pieces[first].copy()
    out[:, 1] = np.maximum.reduceat(pieces[:, 1], first)
    return out
