"""The step machinery every executor shares: one call's plan, exchange, buffers and failure handling.

``Executor`` is what ``distattn.attention``'s forward and backward interpreters stand on: the call's connection to
the library's communicators (``distattn.communicators.open_call``) and the agreement before anything sized by the
inputs, the plan and the per-pair masks, a pool of receive buffers (a fetch slot's reused ``Plan.prefetch + 1`` steps
later, a return slot's ``Plan.return_depth + 1``), and ``run``, which walks the plan step by step (fetching
``Plan.prefetch`` steps ahead; fetch, compute, return partials, absorb those of ``Plan.return_depth`` steps before;
the backward walks the steps in reverse, ``Plan.run_order``, so the local pair comes last and hides the previous
step's return, and computes the local pair's first rows before its first step, while the first fetches travel,
``Plan.head_task``) and, on any failure, aborts the library's communicators so that the peers fail at once.

Legend: ``b`` batch, ``n`` tokens per rank, ``h_q``/``h_kv`` heads, ``d`` head dim.
"""

from __future__ import annotations

import collections
import functools

import numpy as np
import torch

import distattn.agreement as agreement
import distattn.kernels as kernels
from distattn.comm import DistAttnError, PeerExchange
from distattn.communicators import describe, open_call
from distattn.config import DistAttnConfig
from distattn.schedule import Task, Transfer, head_groups, head_rows, local_bounds
from distattn.schedule.pool import slot_rows, transfer_rows

__all__ = ["Executor", "WireCopies", "empty_like_shard", "stats_buffer", "guarded", "packed_bounds", "TRACE"]

TRACE: list | None = None
"""Off (``None``) by default. A list: every executor of this process appends its events to it in the order it issues
them, ``(phase, ("post", kind, step, send peers, receive peers) | ("wait", kind, step) | ("compute", step, q, kv))``,
the order ``distattn.schedule.timeline.rank_events`` replays (``tests/test_timeline.py`` holds them equal). Off, it
costs one ``is None`` test per round."""


class Executor:
    """What the forward and backward interpreters share: plan, exchange, chunk positions, message buffers."""

    def __init__(self, cfg: DistAttnConfig, like: torch.Tensor, phase: str, checked: dict[str, torch.Tensor]):
        """``checked``: the call's input tensors by name, whose shapes and dtype all ranks must agree on."""
        self.cfg, self.phase, self.checked = cfg, phase, checked
        self.n = like.shape[1]
        self.step = None  # the plan step being executed, for error messages
        self.device = like.device
        self._connect(like.device)
        self.rank = self.comm.rank
        self.groups = self._head_groups()
        # Agreement first: nothing sized by the inputs (the plan, per-row key bounds, buffers) exists before every
        # rank has confirmed the same call, so a rank with absurd shapes cannot run out of memory while its
        # peers wait for it.
        self._agree()
        self.plan = cfg.plan(self.n)
        self.spec = cfg.mask_spec()
        self.backend = kernels.get_backend(cfg.backend, like.device)
        self._bounds: dict[object, kernels.KeyBounds] = {}
        self._pool: dict[tuple, list[torch.Tensor]] = {}  # receive buffers, reused across steps (see ``post``)
        if self.plan.layout is not None:
            self.plan.layout.check(self.n)

    def _connect(self, device) -> None:
        """This call's exchange on the library's communicator for the group (built on first use)."""
        self.lib, self.seq = open_call(self.cfg.group, self.cfg.timeout)  # seq: the call's tag number
        self.call = describe(self.lib.position)  # "call k" (of step s): for messages
        self.comm = PeerExchange(self.lib.fetch, device, timeout=self.cfg.timeout, call=self.seq,
                                 return_group=self.lib.ret, gave_up=self.lib.watch)

    def _agree(self) -> None:
        """All ranks make the same call, or all raise the same ``ValueError`` (before any transfer).

        A communicator that the peers abandoned while this rank was away (stalled, or late to this call) fails the
        check at once ("connection closed"): the call was given up by the others, so it raises here, once, saying
        so (pairing it with the peers' next call would pair different batches); the next calls fail at once the
        calls the peers gave up meanwhile, then join their rebuild (``distattn.communicators``: positions and epochs).
        """
        if not agreement.enabled():
            return
        where = f"{self.phase} {self.call}, before step 0"
        fields = agreement.call_fields(self.phase, self.seq, self.checked,
                                       {**self.cfg.fingerprint_fields(), "head_groups": self.groups})
        try:
            agreement.agree(self.lib, fields, self._collective_device(), self.cfg.timeout, where)
        except DistAttnError as exc:
            abandoned = self.lib.abandoned_by_peers()  # read before this rank's own abort marks the epoch
            self._abort(exc)
            if not abandoned:
                raise
            raise DistAttnError(f"distattn: rank {self.rank}, {where}: the other ranks abandoned the library's "
                                f"communicators (epoch {self.lib.epoch}) after a failure or a timeout, e.g. while this "
                                f"rank was stalled; this call fails here, and so will, at once, the later calls they "
                                f"gave up meanwhile; then this rank joins their rebuild, in step") from None

    def _collective_device(self) -> torch.device:
        return self.device if self.lib.nccl else torch.device("cpu")

    def _abort(self, cause: BaseException | None = None) -> None:
        self.comm.abort()
        self.lib.abort(cause)

    def start(self, chunk: int) -> int:
        """Global position of the first token of ``chunk``."""
        return chunk * self.n

    def key_rows(self, q_chunk: int, kv_chunk: int) -> tuple[tuple[int, int], ...]:
        """The local rows of ``kv_chunk``'s k/v that ``q_chunk``'s queries see, as ascending ranges
        (``Plan.key_ranges``): all that travels for an owner task (the ranges packed one after the other), and all
        its dk/dv partial covers."""
        return self.plan.key_ranges(q_chunk, kv_chunk) or ((0, self.n),)

    def rows(self, tr: Transfer) -> int | None:
        """Rows of the k/v rows (``kv``) or dk/dv partial (``dkv``) that ``tr`` carries; ``None``: other kinds."""
        return transfer_rows(self.plan, tr)

    def borrowed(self, task: Task) -> tuple[tuple[int, int], ...] | None:
        """The kv rows ``task`` computes with when they are borrowed (an owner task on another rank's k/v: its
        :meth:`key_rows`, received packed); ``None`` when the rank computes with its own (local and helper tasks)."""
        return self.key_rows(task.q_chunk, task.kv_chunk) if task.rank == task.q_chunk != task.kv_chunk else None

    def mask(self, task: Task, rows: tuple[int, int] | None = None) -> dict:
        """Kernel keywords for ``task``'s (query chunk, kv chunk) pair: the mask and the scale options (keys: the
        rows :meth:`borrowed` says, packed); ``rows=(a, b)``: for the query rows ``[a, b)`` of the pair only (the
        backward's head of a local pair and its rest, :meth:`head_rows`)."""
        kw = self._mask(task)
        if rows is None:
            return kw
        a, b = rows
        if kw["bounds"] is None:
            return dict(kw, q_start=kw["q_start"] + a)
        return dict(kw, bounds=kernels.KeyBounds(kw["bounds"].lo[a:b], kw["bounds"].hi[a:b]))

    def head_rows(self, share: float) -> int:
        """The rows ``[0, h)`` of this rank's local pair that the backward computes before its first step
        (``Plan.head_task``; the rows holding ``share``, ``Plan.head``, of the pair's visible keys,
        ``distattn.schedule.head_rows``), the rest at the last step. Counted from the mask the plan read, once per
        mask and rank (:func:`_head_split`): every layer's backward, and every head group's, reads it back."""
        return _head_split(self.spec, self.plan.layout, self.n, self.plan.world_size, self.rank, self.cfg.causal,
                           share)

    def _mask(self, task: Task) -> dict:
        ranges = self.borrowed(task)
        kw = dict(softmax_scale=self.cfg.scale, q_start=self.start(task.q_chunk), k_start=self.start(task.kv_chunk),
                  softcap=self.cfg.softcap, backend=self.backend)
        if self.plan.layout is not None:  # shards are unions of segments: bounds in the kv shard's local indices
            return dict(kw, q_start=0, k_start=0, causal=False, bounds=self._pair_bounds(task, ranges))
        if not self.spec.dense:  # documents / window: per-row key bounds, from the description the plan read
            a = 0
            if ranges is not None:  # on contiguous shards a pair sees one run of rows: the kv shard's last (causal)
                if len(ranges) != 1:  # or first ones: a plan saying otherwise is a bug, not a mask to guess at
                    raise AssertionError(f"distattn: pair {task.q_chunk, task.kv_chunk} on contiguous shards sees "
                                         f"the rows {ranges}, not one run")
                a = ranges[0][0]
            return dict(kw, k_start=self.start(task.kv_chunk) + a, causal=False, bounds=self._bounds_of(task.q_chunk))
        # Off-diagonal causal pairs always have kv_chunk < q_chunk: every key is visible, no mask to pay for.
        return dict(kw, causal=self.cfg.causal and task.is_diagonal, bounds=None)

    def _bounds_of(self, chunk: int) -> kernels.KeyBounds:
        """Key bounds of query chunk ``chunk``'s rows (host-computed, one small copy to the device, cached)."""
        if chunk not in self._bounds:
            lo, hi = self.spec.bounds(self.n * self.plan.world_size, self.start(chunk), self.start(chunk + 1))
            to_dev = lambda a: torch.from_numpy(a).to(device=self.device, dtype=torch.int32)  # noqa: E731
            self._bounds[chunk] = kernels.KeyBounds(to_dev(lo), to_dev(hi))
        return self._bounds[chunk]

    def _pair_bounds(self, task: Task, ranges: tuple[tuple[int, int], ...] | None = None) -> kernels.KeyBounds:
        """Per query row of ``task.q_chunk``'s shard, the interval of local keys of ``task.kv_chunk``'s shard it
        sees (``distattn.schedule.layouts.local_bounds``: the layout maps the mask's global positions to local
        indices, which stay nondecreasing because every shard keeps its positions in order), as indices into the
        kv rows ``ranges`` packed one after the other (``None``: the whole shard). A row's keys lie in one document,
        so in one range. Cached per pair."""
        key = (task.q_chunk, task.kv_chunk, ranges)
        if key not in self._bounds:
            lo, hi = local_bounds(self.spec, self.plan.layout, self.n, task.q_chunk, task.kv_chunk)  # read-only
            if ranges is not None:
                lo, hi = packed_bounds(lo, hi, ranges)
            to_dev = lambda a: torch.from_numpy(a).to(device=self.device, dtype=torch.int32)  # noqa: E731
            self._bounds[key] = kernels.KeyBounds(to_dev(lo), to_dev(hi))
        return self._bounds[key]

    def partial(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A partial result as it travels: fp32, or ``like``'s dtype with ``partials="input"``."""
        return t if self.cfg.partials == "fp32" else t.to(like.dtype)

    def post(self, slot, ops: tuple[tuple[Transfer, ...], tuple[Transfer, ...]], payload, buffers) -> dict:
        """Post this rank's ``(sends, recvs)`` of a round (``Plan.rank_ops``); returns ``{transfer: receive
        buffers}``.

        Receive buffers come from the executor's pool: one set per (slot, kind, order within the round), made at
        the first use and reused ``prefetch + 1`` steps later (``Plan.prefetch``: double buffering at depth 1; a
        return slot ``Plan.return_depth + 1`` steps later). Reuse
        is safe: a slot is posted again only after the step that read it was enqueued, and the side stream waits for
        that point (``PeerExchange``). A set of k/v or dk/dv buffers holds the most rows any round of the phase
        receives there (``distattn.schedule.pool.slot_rows``: a whole shard on dense plans, the key rows a pair
        borrows on placed ones), and a message of fewer rows (:meth:`rows`) is received into its front, viewed with
        its own shape, so the pool never grows past ``prefetch + 1`` fetch slots (and ``return_depth + 1`` return
        slots) of whole shards, and a placed plan's past what ``distattn.schedule.pool.deepest`` admitted.
        """
        sends = [(tr.dst, payload(tr)) for tr in ops[0]]
        inbox = {}
        for i, tr in enumerate(ops[1]):
            key = (slot, tr.kind, i)
            if key not in self._pool:
                which, phase, at = slot
                depth = self.plan.prefetch if which == "fetch" else self.plan.return_depth
                sized = slot_rows(self.plan.run_order(phase), self.rank, phase, which, depth + 1)
                self._pool[key] = buffers(tr, sized[(at, tr.kind, i)])
            inbox[tr] = _front_rows(self._pool[key], self.rows(tr))
        self.comm.post(slot, sends, [(tr.src, bufs) for tr, bufs in inbox.items()])
        return inbox

    def _head_groups(self) -> int:
        """How many head groups the plan runs for (``distattn.schedule.heads``), from the call's shapes."""
        q, k = self.checked["q"], self.checked["k"]
        b, n, h_q, d = q.shape
        part = 4 if self.cfg.partials == "fp32" else q.element_size()
        return head_groups(b, n, h_q, k.shape[2], d, q.element_size(), part)

    def head_slices(self, q: torch.Tensor, k: torch.Tensor) -> list[tuple[slice, slice]]:
        """``(query heads, kv heads)`` of each head group, in order: kv heads ``[g*h, (g+1)*h)`` with the query heads
        that read them (GQA maps query head ``i`` to kv head ``i // (h_q / h_kv)``)."""
        hq, hk = q.shape[2] // self.groups, k.shape[2] // self.groups
        return [(slice(g * hq, (g + 1) * hq), slice(g * hk, (g + 1) * hk)) for g in range(self.groups)]

    def run(self, *handlers, confirm: bool = True, **named) -> None:
        """Interpret the plan (``_run``; the agreement was checked when the executor was made); on any failure
        abort the library's communicators so that the peers fail at once instead of waiting, and re-raise (the
        next call rebuilds them). ``confirm``: end with the agreement's confirmation (the call's last pass)."""
        try:
            self._run(*handlers, **named)
            if confirm and agreement.enabled():
                agreement.confirm(self.lib, self._collective_device(), self.cfg.timeout,
                                  f"{self.phase} {self.call}, after the last step")
        except BaseException as exc:
            self._abort(exc)
            if not isinstance(exc, DistAttnError):
                exc.add_note(f"distattn: rank {self.rank} failed in the {self.phase} at step {self.step} of "
                             f"{self.plan.num_steps()}; it aborted the library's communicators so that its peers "
                             f"fail with DistAttnError; the next call rebuilds them")
            raise

    def _run(self, compute, fetch_payload, fetch_buffers, return_payload, return_buffers, absorb) -> None:
        """Interpret the plan: for each step, fetch, compute, send partials back, absorb received partials.

        ``compute(task, inbox)`` returns the partial produced by a task (or ``None``); the backward's local pair
        is computed in two calls, ``compute(task, {}, rows=(0, h))`` before step 0 and ``rows=(h, n)`` at the last
        step (:meth:`head_rows`); ``absorb(transfer, buffers)`` adds a received partial into this rank's
        accumulators. Slots are ``(kind, phase, index)``.
        """
        phase = self.phase
        plan = self.plan.run_order(phase)  # the backward walks the steps in reverse (Plan.run_order)
        steps, depth = plan.num_steps(), plan.prefetch
        slots = depth + 1  # fetch slot of step t + depth, posted before step t computes: last read by step t - 1

        def fetch(t):  # post step t's inputs into fetch slot t % slots (double-buffered at depth 1)
            ops = plan.rank_ops(t, self.rank, phase, "fetch")
            if TRACE is not None:
                _trace(phase, "fetch", t, ops)
            return self.post(("fetch", phase, t % slots), ops, fetch_payload, fetch_buffers)

        fetched = {t: fetch(t) for t in range(min(depth, steps))} if self.cfg.overlap else {}
        head = plan.head_task(self.rank)  # the backward: the local pair's first rows now, its rest at the last step
        split = self.head_rows(plan.head) if head is not None else 0
        if head is not None:
            self.step, self.comm.where = 0, f"{phase} {self.call}, the local pair's head before step 0 of {steps}"
            if TRACE is not None:
                TRACE.append((phase, ("head", steps - 1, head.q_chunk, head.kv_chunk)))
            if split:
                compute(head, {}, rows=(0, split))
        returned = collections.deque()  # (step, slot, inbox) of the return rounds posted, not yet absorbed
        keep = plan.return_depth  # step t - keep's partials are absorbed after step t's compute (Plan.return_depth)
        for t in range(steps):
            self.step, self.comm.where = t, f"{phase} {self.call}, step {t} of {steps}"
            if not self.cfg.overlap:
                fetched[t] = fetch(t)
            elif t + depth < steps:  # prefetch: a later step's inputs travel while this step computes
                fetched[t + depth] = fetch(t + depth)
            self.comm.wait(("fetch", phase, t % slots))
            if TRACE is not None:
                TRACE.append((phase, ("wait", "fetch", t)))
            inbox = fetched.pop(t)
            task = plan.task(t, self.rank)
            if TRACE is not None and task is not None:
                TRACE.append((phase, ("compute", t, task.q_chunk, task.kv_chunk)))
            rest = {"rows": (split, self.n)} if head is not None and t == steps - 1 else {}
            produced = compute(task, inbox, **rest) if task is not None else None
            while len(returned) >= keep:
                self._absorb(returned.popleft(), absorb)
            slot, ops = ("return", phase, t % (keep + 1)), plan.rank_ops(t, self.rank, phase, "return")
            if TRACE is not None:
                _trace(phase, "return", t, ops)
            returned.append((t, slot, self.post(slot, ops, lambda tr, parts=produced: return_payload(parts),
                                                return_buffers)))
            if not self.cfg.overlap:
                self._absorb(returned.popleft(), absorb)
        while returned:
            self._absorb(returned.popleft(), absorb)
        self.comm.close()

    def _absorb(self, returned, absorb) -> None:
        t, slot, inbox = returned
        self.comm.wait(slot)
        if TRACE is not None:
            TRACE.append((slot[1], ("wait", "return", t)))
        for tr, bufs in inbox.items():
            absorb(tr, bufs)


@functools.lru_cache(maxsize=64)
def _head_split(spec, layout, n: int, world: int, rank: int, causal: bool, share: float) -> int:
    """``Executor.head_rows``: the visible local keys per query row of ``rank``'s local pair, split by
    ``distattn.schedule.head_rows``."""
    if layout is not None:  # local key indices per query row
        lo, hi = local_bounds(spec, layout, n, rank, rank)
    elif not spec.dense:  # global key positions per query row, of which the local chunk's count
        start = rank * n
        lo, hi = spec.bounds(n * world, start, start + n)
        lo, hi = np.maximum(lo, start), np.minimum(hi, start + n - 1)
    else:
        lo = np.zeros(n, dtype=np.int64)
        hi = np.arange(n, dtype=np.int64) if causal else np.full(n, n - 1, dtype=np.int64)
    return head_rows(np.clip(np.asarray(hi) - np.asarray(lo) + 1, 0, None), share)


def _trace(phase: str, kind: str, step: int, ops) -> None:
    """A posted round in :data:`TRACE`: its send and receive peers, sorted."""
    sends, recvs = ops
    TRACE.append((phase, ("post", kind, step, tuple(sorted(tr.dst for tr in sends)),
                          tuple(sorted(tr.src for tr in recvs)))))


def empty_like_shard(like: torch.Tensor, dtype=None, heads=None, rows: int | None = None) -> torch.Tensor:
    """An empty ``(b, n, h, d)`` tensor shaped like ``like``; ``rows``: ``rows`` sequence rows instead of ``n``."""
    b, n, h, d = like.shape
    return torch.empty(b, n if rows is None else rows, h if heads is None else heads, d, dtype=dtype or like.dtype,
                       device=like.device)


def packed_bounds(lo, hi, ranges: tuple[tuple[int, int], ...]):
    """Key bounds per query row (``[lo, hi]`` inclusive, local rows of the kv shard, numpy, both nondecreasing; ``hi <
    lo``: none) as indices into the rows ``ranges`` packed one after the other: ``lo`` to the packed index of the first
    kept row at or after it, ``hi`` to that of the last kept row at or before it. Both maps are nondecreasing, so the
    bounds stay nondecreasing and an empty row stays empty. Raises ``AssertionError`` if a row's keys are not all kept
    (the plan's ranges must hold every key a row sees)."""
    if not ranges:
        return np.zeros_like(lo), np.full_like(hi, -1)
    starts = np.fromiter((a for a, _ in ranges), dtype=np.int64, count=len(ranges))
    length = np.fromiter((b - a for a, b in ranges), dtype=np.int64, count=len(ranges))
    offset = np.cumsum(length) - length  # where each range starts in the packed rows

    def kept_before(x):  # how many kept rows lie before local row x
        at = np.searchsorted(starts, x, side="right") - 1
        safe = np.clip(at, 0, None)
        return np.where(at >= 0, offset[safe] + np.clip(x - starts[safe], 0, length[safe]), 0)

    lo_p, hi_p = kept_before(lo), kept_before(hi + 1) - 1
    if np.any((hi >= lo) & (hi_p - lo_p != hi - lo)):
        raise AssertionError(f"distattn: a query row's keys lie outside the rows {ranges} its pair borrows")
    return lo_p, hi_p


def _front_rows(buffers: list[torch.Tensor], rows: int | None) -> list[torch.Tensor]:
    """Whole-shard ``(b, n, h, d)`` receive buffers as ``(b, rows, h, d)`` tensors on their first elements
    (contiguous, as a message needs); ``rows=None`` or ``n``: the buffers themselves."""
    if rows is None or rows == buffers[0].shape[1]:
        return buffers
    return [t.view(-1)[:t.shape[0] * rows * t.shape[2] * t.shape[3]].view(t.shape[0], rows, t.shape[2], t.shape[3])
            for t in buffers]


def stats_buffer(like: torch.Tensor) -> torch.Tensor:
    """An fp32 ``(b, h_q, n)`` buffer for lse/delta of queries shaped like ``like``."""
    b, n, h, _ = like.shape
    return torch.empty(b, h, n, dtype=torch.float32, device=like.device)


class WireCopies:
    """Contiguous versions of tensors that are sent (messages need contiguous memory), made at most once each."""

    def __init__(self):
        self._copies: dict[int, torch.Tensor] = {}

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_contiguous():
            return t
        if id(t) not in self._copies:
            self._copies[id(t)] = t.contiguous()
        return self._copies[id(t)]

    def rows(self, tensors: list[torch.Tensor], ranges: tuple[tuple[int, int], ...]) -> list[torch.Tensor]:
        """The sequence rows ``ranges`` of ``tensors`` (dim 1), packed one after the other, as messages: one range is
        a view when contiguous (batch 1), else a copy of the slice only; several are one copy of their rows (never
        cached: a slice is a new object every step)."""
        if len(ranges) == 1:
            a, b = ranges[0]
            return [self(t) if a == 0 and b == t.shape[1] else t[:, a:b].contiguous() for t in tensors]
        return [torch.cat([t[:, a:b] for a, b in ranges], dim=1) for t in tensors]


def guarded(ex: Executor, fn):
    """``fn()``, whose collectives (``distattn.nonfinite``) are part of the call: on a failure abort the library's
    communicators, as :meth:`Executor.run` does, so that the peers fail at once instead of waiting."""
    try:
        return fn()
    except BaseException:
        ex._abort()
        raise
