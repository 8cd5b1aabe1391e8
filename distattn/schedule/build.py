"""Which plan and layout a schedule runs on: :func:`make_plan` (the schedule, causal flag and mask to a cached
:class:`~distattn.schedule.plan.Plan`) and :func:`layout_of` (a schedule to its
:class:`~distattn.schedule.layouts.Layout`).

The registry above the rooms it picks from: the plan object and dense runs (``plan``), the masked plans (``masked``),
the placement solver (``placement``) and the layouts (``layouts``) never import it, so nothing here closes an import
circle. Pure Python + numpy.
"""

from __future__ import annotations

import collections
import dataclasses

from distattn.schedule.layouts import Layout
from distattn.schedule.masked import make_masked_plan
from distattn.schedule.masks import MaskSpec
from distattn.schedule.pairs import PlanTooLarge, out_of_memory
from distattn.schedule.placement import place
from distattn.schedule.plan import SCHEDULES, Plan, _make_plan_cached, _make_zigzag_plan

__all__ = ["make_plan", "make_placed_plan", "layout_of", "placement_mask", "record_placement", "placed_window"]


def _validate(world_size, causal, schedule) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(
            f"world_size={world_size!r} must be an int (the sequence-parallel group size); "
            f"pass e.g. world_size=dist.get_world_size(group)"
        )
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1; pass the number of ranks in the group")
    if not isinstance(causal, bool):
        raise TypeError(f"causal={causal!r} must be a bool; pass causal=True or causal=False")
    if schedule not in SCHEDULES:
        raise ValueError(
            f"schedule={schedule!r} is not one of {SCHEDULES}; pass schedule='balanced' for the "
            f"load-balanced plan, 'zigzag' for the balanced layout, 'placed' for packed documents, or 'ring' "
            f"for the unbalanced baseline"
        )


def make_plan(world_size: int, causal: bool = True, schedule: str = "balanced", *, mask: MaskSpec | None = None,
              chunk: int | None = None, placement_window: tuple[int, int] | None = None, stride: int = 1) -> Plan:
    """Build (and cache) the plan for ``world_size`` ranks.

    Args:
        world_size: P, the number of ranks in the sequence-parallel group (>= 1).
        causal: whether only pairs ``kv_chunk <= q_chunk`` are needed (dense plans).
        schedule: one of :data:`SCHEDULES`. "balanced" equals "ring" for non-causal dense attention; "zigzag"
            runs on the zigzag layout (the plan's ``layout``; shard with ``shard_sequence(..., schedule="zigzag")``).
        mask: packed documents and/or a sliding window (``MaskSpec``); ``None`` or a dense spec gives the dense
            plans. A masked plan drops every pair with no visible (query, key) pair and, balanced, assigns
            each remaining pair to its query owner or its kv owner (helper) so that the work is balanced.
        chunk: tokens per rank; needed with a non-dense ``mask`` (zigzag: default 2, even).
        placement_window: ``"placed"`` only: the window the placement (the shards) was solved for, when it is not
            the mask's own (a model whose layers differ in window shares one sharding; :func:`make_placed_plan`).
        stride: ``"placed"`` only: global ranks between neighbouring ranks of this plan (the Ulysses degree ``U`` of
            a 2-D group, whose ring ranks are ``U`` apart): which links the placement is timed on.

    ``"placed"`` runs on the work-balanced placement of the mask's documents (``distattn.schedule.placement``;
    the plan's ``layout``; shard with ``shard_sequence(x, layout=plan.layout)``) with the balanced assignment of
    the remaining pairs; where the placement falls back to contiguous shards (a dense mask, a stream too short for
    blocks; ``layout.note`` says why) it is the balanced plan.

    Returns:
        An immutable :class:`Plan`; dense causal "balanced" has 1 + P//2 steps, causal "ring" P, non-causal P,
        "zigzag" P (every step half a pair of work on every rank when causal).

    Raises:
        PlanTooLarge: (a ``MemoryError``) the plan would pass a bound of memory or time
            (``distattn.schedule.pairs``) or ran out of memory; the message names the size and what to do.
    """
    _validate(world_size, causal, schedule)
    try:
        if schedule == "placed":
            return make_placed_plan(world_size, causal, mask, chunk, placement_window, stride)
        return _make_plan(world_size, causal, schedule, mask, chunk)
    except MemoryError as exc:
        if isinstance(exc, PlanTooLarge):
            raise
        docs = "" if mask is None or mask.cu_seqlens is None else f" of {len(mask.cu_seqlens) - 1} documents"
        raise out_of_memory(f"the {schedule!r} plan of {world_size} ranks x {chunk} tokens{docs}", exc) from exc


def _make_plan(world_size: int, causal: bool, schedule: str, mask: MaskSpec | None, chunk: int | None) -> Plan:
    if schedule == "zigzag":
        chunk = 2 if chunk is None else chunk
        mask = mask if mask is not None else MaskSpec(causal=causal)
    if mask is None or (mask.dense and schedule != "zigzag"):
        return _make_plan_cached(world_size, mask.causal if mask is not None else causal, schedule)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk={chunk!r} must be the positive number of tokens per rank for a masked plan")
    if schedule == "zigzag":
        Layout("zigzag", world_size).check(chunk)
        if mask.dense:  # every shard pair has work: the ring order over all P * P pairs, work in closed form
            return _make_zigzag_plan(world_size, mask.causal, chunk)
    return make_masked_plan(world_size, schedule, mask, chunk)


def make_placed_plan(p: int, causal: bool, mask: MaskSpec | None, chunk: int | None,
                     placement_window: tuple[int, int] | None = None, stride: int = 1) -> Plan:
    """The plan of ``mask`` on the placement of its documents solved for ``placement_window`` (``None``: the mask's
    own window), weighed by :func:`placement_mask`: the documents, causal, and the window's left side. The shards must
    follow the same placement: ``distattn.sharding.placement(cu_seqlens, n, group, window=...)`` with the window given
    here (the attention call finds it there: ``distattn.sharding.placed_window``). The plan is exact for any window
    on any placement; the window the placement was solved for only moves which rank holds which blocks. ``stride``:
    global ranks between neighbouring ranks (a 2-D group's ring: ``U``), as :func:`layout_of` solves the shards'."""
    mask = mask if mask is not None else MaskSpec(causal=causal)
    if mask.cu_seqlens is None:  # no documents: contiguous shards and the balanced plan (dense: the optimum)
        plan = make_plan(p, mask.causal, "balanced", mask=mask, chunk=chunk)
        return dataclasses.replace(plan, schedule="placed")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk={chunk!r} must be the positive number of tokens per rank for a masked plan")
    window = mask.window if placement_window is None else placement_window
    layout = place(placement_mask(mask.cu_seqlens, window), p, chunk, stride=stride)
    return make_masked_plan(p, "placed", mask, chunk, layout)


def placement_mask(cu_seqlens, window: tuple[int, int] = (-1, -1)) -> MaskSpec:
    """The mask a placement is solved for: the documents, causal, and the window's left side only (``(left, -1)``;
    a right window or a non-causal call moves no block: the solver weighs causal rows), so every window with the same
    left side has one placement and one cache entry."""
    return MaskSpec(causal=True, window=(int(window[0]), -1), cu_seqlens=None if cu_seqlens is None
                    else tuple(int(c) for c in cu_seqlens))


def layout_of(schedule: str, world_size: int, ulysses: int = 1, *, mask=None, n: int | None = None) -> Layout:
    """The layout a schedule's plan runs on (``zigzag``: zigzag; ``placed``: the placement of ``mask``'s documents
    and window (:func:`placement_mask`) for ``n`` tokens per rank, solved by ``distattn.schedule.placement.place``
    over the ``world_size`` ring ranks of ``ulysses * n`` tokens each, timed on links ``ulysses`` global ranks apart;
    every other schedule: contiguous). ``world_size``: ring ranks, ``ulysses``: ranks per ring rank."""
    if schedule == "placed":
        if n is None:
            raise ValueError("the placed layout depends on the documents and the tokens per rank: pass mask= "
                             "(MaskSpec with cu_seqlens) and n= (tokens per rank)")
        # the mask's documents and window, weighed as the plan weighs them (placement_mask), so shards made from
        # this layout match make_placed_plan's for the same window
        spec = MaskSpec(causal=True) if mask is None or mask.cu_seqlens is None else placement_mask(mask.cu_seqlens,
                                                                                                    mask.window)
        ring = place(spec, world_size, ulysses * n, stride=ulysses)
        return dataclasses.replace(ring, ulysses=ulysses) if ulysses > 1 else ring
    return Layout("zigzag" if schedule == "zigzag" else "contiguous", world_size, ulysses)


_PLACED: collections.OrderedDict = collections.OrderedDict()
"""``(cu_seqlens, ring ranks, tokens per ring rank)`` -> the placement windows ``distattn.sharding.placement`` solved
for them, in the order first asked; the most recently used :data:`_PLACED_KEEP` keys only (one per batch of a
training loop).
Process-local: every rank shards its own inputs, so every rank's record matches its shards; the window a call
resolves is in its agreement fingerprint (``DistAttnConfig.fingerprint_fields``)."""
_PLACED_KEEP = 64


def record_placement(cu_seqlens: tuple[int, ...], ring: int, ring_n: int, window: tuple[int, int]) -> None:
    """Note that shards of ``cu_seqlens`` over ``ring`` ring ranks of ``ring_n`` tokens follow the placement solved
    for ``window`` (normalized, :func:`placement_mask`; ``distattn.sharding.placement`` calls it)."""
    key = _key(cu_seqlens, ring, ring_n)
    windows = _PLACED.pop(key, ())
    _PLACED[key] = windows if window in windows else windows + (window,)
    while len(_PLACED) > _PLACED_KEEP:
        _PLACED.popitem(last=False)


def placed_window(cu_seqlens, ring: int, ring_n: int, window) -> tuple[int, int]:
    """The window whose placement a ``schedule="placed"`` call with ``window`` runs on, for documents ``cu_seqlens``
    over ``ring`` ring ranks of ``ring_n`` tokens: the shards' (as ``distattn.sharding.placement`` recorded them in
    this process, :func:`record_placement`), normalized as :func:`placement_mask`. The call's own window when the
    documents were placed for it or not recorded at all (a layout made otherwise, e.g. ``make_plan(..., "placed",
    mask=).layout`` for the call's mask); else the one window they were placed for.

    Raises:
        ValueError: the documents were placed for several windows, none of them the call's: the shards could follow
            either, and a plan on the other placement would compute with the wrong tokens.
    """
    key = _key(cu_seqlens, ring, ring_n)
    own = placement_mask(key[0], window).window
    windows = _PLACED.get(key, ())
    if not windows or own in windows:
        return own
    if len(windows) == 1:
        return windows[0]
    raise ValueError(f"the documents of this schedule='placed' call ({len(key[0]) - 1} documents, {ring} ring ranks x "
                     f"{ring_n} tokens) were placed for the windows {list(windows)} (distattn.sharding.placement), "
                     f"and this call's window_size={tuple(window)} is none of them, so which placement its inputs "
                     f"follow is ambiguous: shard them with distattn.sharding.placement(cu_seqlens, n, group, "
                     f"window={tuple(window)}) (or with one window only for these documents)")


def _key(cu_seqlens, ring: int, ring_n: int) -> tuple:
    """The record's key: the documents as ints, a short stream's padding document added (``MaskSpec.documents``), so
    the hook's ``cu_seqlens`` and ``shard_batch``'s name one stream alike."""
    return MaskSpec(causal=True, cu_seqlens=tuple(int(c) for c in cu_seqlens)).documents(ring * ring_n), ring, ring_n
