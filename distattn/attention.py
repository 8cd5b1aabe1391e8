"""Sequence-parallel exact attention: the executors that interpret a plan, forward and backward.

Rank ``r`` of the group holds tokens ``[r*n, (r+1)*n)`` of q, k and v. The plan (``distattn.schedule``)
says, step by step, which (query chunk, kv chunk) pair every rank computes:

* an *owner* task (this rank's queries, someone's kv): fetch that kv chunk, fold it into this rank's
  carried softmax state;
* a *helper* task (someone's queries, this rank's kv — DistFlashAttn's load balancing, Sec. 3.1): fetch
  their queries, compute a partial ``(out, lse)`` in fp32 and send it back; the owner merges it.

The fetches of step ``t + 1`` are posted before step ``t`` computes (``overlap=True``), so communication
hides behind compute; partial results of step ``t`` are waited for one step later, just before they are
merged. Backward mirrors the forward with the final ``out``/``lse``: owner tasks add into this rank's
``dq`` and send ``dk, dv`` partials (fp32) back to the kv owner; helper tasks add into this rank's
``dk, dv`` and send a ``dq`` partial (fp32) back. Every accumulator is fp32 and is cast once at the end.

Reliability: every call runs on the library's own communicators (``distattn.comm.communicator``), first
checks that all ranks make the same call (``distattn.agreement``, one all-reduce), bounds every wait by
``cfg.timeout``, and on any exception aborts the library's communicators so that the peers fail at once with
``DistAttnError`` instead of waiting (the next call rebuilds them).

Layering: the public ``distattn.dist_flash_attn_func`` (``distattn.api``) validates and calls the registered op
``torch.ops.distattn.attention`` (``distattn._ops``), whose forward calls ``dist_attn_forward`` and whose registered
backward calls ``dist_attn_backward``. Nothing here imports upward.

Legend: ``b`` batch, ``n`` tokens per rank, ``h_q``/``h_kv`` heads, ``d`` head dim. GQA: only ``h_kv`` heads
of k and v ever travel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from distattn import agreement, kernels, nonfinite
from distattn.comm import DEFAULT_TIMEOUT_S, DistAttnError, PeerExchange
from distattn.communicators import describe, open_call
from distattn.schedule import PARTIALS, SCHEDULES, MaskSpec, Plan, Task, Transfer, local_bounds, make_plan
from distattn.topology import topology

__all__ = ["DistAttnConfig", "dist_attn_forward", "dist_attn_backward", "reject_call"]



@dataclass(frozen=True, kw_only=True)
class DistAttnConfig:
    """Static options of one sequence-parallel attention call (validated by ``distattn.api``)."""

    causal: bool
    """Causal mask on global positions (``k_pos <= q_pos``)."""
    scale: float
    """Softmax scale."""
    window: tuple[int, int] = (-1, -1)
    """flash-attn's ``(left, right)`` sliding window on global positions; -1: unlimited."""
    softcap: float = 0.0
    """Logit soft-capping (0: off)."""
    schedule: str = "balanced"
    """``"ring"``, ``"balanced"`` or ``"zigzag"`` (see ``distattn.schedule``; zigzag needs zigzag-sharded inputs)."""
    backend: str | None = None
    """Kernel backend name (``None``: best available on the tensors' device)."""
    group: object = None
    """Process group (``None``: the default group)."""
    overlap: bool = True
    """Post step ``t + 1``'s fetches before computing step ``t``; ``False`` waits first (ablation)."""
    cu_seqlens: tuple[int, ...] | None = None
    """Packed documents: cumulative lengths over the whole stream (identical on every rank), or None."""
    timeout: float = DEFAULT_TIMEOUT_S
    """Seconds any one wait inside a call may take before the call fails with ``DistAttnError``."""
    partials: str = "fp32"
    """dtype of the partial results sent back (helper outputs, dq/dk/dv partials): ``"fp32"`` or ``"input"``
    (q's dtype: half the bytes). Accumulation is fp32 either way; lse and delta always travel in fp32."""

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not one of {SCHEDULES}; use schedule='balanced'")
        if self.partials not in PARTIALS:
            raise ValueError(f"partials={self.partials!r} is not one of {PARTIALS}; use partials='fp32'")

    def fingerprint_fields(self) -> dict:
        """Everything in the config that shapes the communication, as readable JSON-friendly values: all
        ranks must agree on these (``distattn.agreement``). A new option or mask metadata is checked on every
        call by adding it here; packed documents are checked by a hash of ``cu_seqlens`` and its length."""
        return {"causal": self.causal, "window": list(self.window), "softcap": self.softcap,
                "schedule": self.schedule, "overlap": self.overlap, "scale": self.scale, "backend": self.backend,
                "cu_seqlens": _documents_fingerprint(self.cu_seqlens), "partials": self.partials}

    def mask_spec(self) -> MaskSpec:
        """The call's mask as data: what the plan (pairs, work) and the kernels (per-row bounds) both read."""
        return MaskSpec(causal=self.causal, window=self.window, cu_seqlens=self.cu_seqlens)

    def plan(self, n: int) -> Plan:
        """The plan for ``n`` tokens per rank (masked plans drop pairs that share no visible key)."""
        return make_plan(dist.get_world_size(self.group), self.causal, self.schedule, mask=self.mask_spec(), chunk=n)


def _documents_fingerprint(cu_seqlens) -> str | None:
    """A short, readable digest of the packed documents (None: no packing), for the agreement check."""
    if cu_seqlens is None:
        return None
    import hashlib

    digest = hashlib.blake2b(repr(tuple(cu_seqlens)).encode(), digest_size=8).hexdigest()
    return f"{len(cu_seqlens) - 1} documents, ends at {cu_seqlens[-1]}, #{digest}"


# -- shared step machinery ----------------------------------------------------------------------------------
class _Executor:
    """What the forward and backward interpreters share: plan, exchange, chunk positions, message buffers."""

    def __init__(self, cfg: DistAttnConfig, like: torch.Tensor, phase: str, checked: dict[str, torch.Tensor]):
        """``checked``: the call's input tensors by name, whose shapes and dtype all ranks must agree on."""
        self.cfg, self.phase, self.checked = cfg, phase, checked
        self.n = like.shape[1]
        self.step = None  # the plan step being executed, for error messages
        self.device = like.device
        self._connect(like.device)
        self.rank = self.comm.rank
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
        self.comm = PeerExchange(self.lib.fetch, device, timeout=self.cfg.timeout,
                                 call=self.seq, return_group=self.lib.ret)

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
        fields = agreement.call_fields(self.phase, self.seq, self.checked, self.cfg.fingerprint_fields())
        try:
            agreement.agree(self.lib, fields, self._collective_device(), self.cfg.timeout, where)
        except DistAttnError:
            abandoned = self.lib.abandoned_by_peers()  # read before this rank's own abort marks the epoch
            self._abort()
            if not abandoned:
                raise
            raise DistAttnError(f"distattn: rank {self.rank}, {where}: the other ranks abandoned the library's "
                                f"communicators (epoch {self.lib.epoch}) after a failure or a timeout, e.g. while this "
                                f"rank was stalled; this call fails here, and so will, at once, the later calls they "
                                f"gave up meanwhile; then this rank joins their rebuild, in step") from None

    def _collective_device(self) -> torch.device:
        return self.device if self.lib.nccl else torch.device("cpu")

    def _abort(self) -> None:
        self.comm.abort()
        self.lib.abort()

    def start(self, chunk: int) -> int:
        """Global position of the first token of ``chunk``."""
        return chunk * self.n

    def span(self, q_chunk: int, kv_chunk: int) -> tuple[int, int]:
        """The local rows ``[a, b)`` of ``kv_chunk``'s k/v that ``q_chunk``'s queries see (``Plan.key_span``): all
        that travels for an owner task, and all its dk/dv partial covers."""
        return self.plan.key_span(q_chunk, kv_chunk) or (0, self.n)

    def rows(self, tr: Transfer) -> int | None:
        """Rows of the k/v slice (``kv``) or dk/dv partial (``dkv``) that ``tr`` carries; ``None``: other kinds."""
        if tr.kind == "kv":
            a, b = self.span(tr.dst, tr.src)
        elif tr.kind == "dkv":
            a, b = self.span(tr.src, tr.dst)
        else:
            return None
        return b - a

    def borrowed(self, task: Task) -> int:
        """First local row of the kv slice ``task`` computes with: the span's start for a task on borrowed k/v, 0 when
        the rank computes with its own (local and helper tasks)."""
        return self.span(task.q_chunk, task.kv_chunk)[0] if task.rank == task.q_chunk != task.kv_chunk else 0

    def mask(self, task: Task) -> dict:
        """Kernel keywords for ``task``'s (query chunk, kv chunk) pair: the mask and the scale options (keys: the
        slice :meth:`borrowed` says)."""
        a = self.borrowed(task)
        kw = dict(softmax_scale=self.cfg.scale, q_start=self.start(task.q_chunk), k_start=self.start(task.kv_chunk),
                  softcap=self.cfg.softcap, backend=self.backend)
        if self.plan.layout is not None:  # shards are unions of segments: bounds in the kv shard's local indices
            return dict(kw, q_start=0, k_start=0, causal=False, bounds=self._pair_bounds(task, a))
        if not self.spec.dense:  # documents / window: per-row key bounds, from the description the plan read
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

    def _pair_bounds(self, task: Task, first: int = 0) -> kernels.KeyBounds:
        """Per query row of ``task.q_chunk``'s shard, the interval of local keys of ``task.kv_chunk``'s shard it
        sees (``distattn.schedule.layouts.local_bounds``: the layout maps the mask's global positions to local
        indices, which stay nondecreasing because every shard keeps its positions in order), counted from the
        slice's ``first`` row. Cached per pair."""
        key = (task.q_chunk, task.kv_chunk, first)
        if key not in self._bounds:
            lo, hi = local_bounds(self.spec, self.plan.layout, self.n, task.q_chunk, task.kv_chunk)  # read-only
            to_dev = lambda a: torch.from_numpy(a - first).to(device=self.device, dtype=torch.int32)  # noqa: E731
            self._bounds[key] = kernels.KeyBounds(to_dev(lo), to_dev(hi))
        return self._bounds[key]

    def partial(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A partial result as it travels: fp32, or ``like``'s dtype with ``partials="input"``."""
        return t if self.cfg.partials == "fp32" else t.to(like.dtype)

    def post(self, slot, ops: tuple[tuple[Transfer, ...], tuple[Transfer, ...]], payload, buffers) -> dict:
        """Post this rank's ``(sends, recvs)`` of a round (``Plan.rank_ops``); returns ``{transfer: receive
        buffers}``.

        Receive buffers come from the executor's pool: one set per (slot, kind, order within the round), made at
        the first use and reused two steps later (double buffering). Reuse is safe: a slot is posted again only
        after the step that read it was enqueued, and the side stream waits for that point (``PeerExchange``). A
        k/v slice or dk/dv partial of fewer rows than the shard (:meth:`rows`) is received into the front of the
        whole-shard buffers, viewed with its own shape, so the pool never grows past two slots of whole shards.
        """
        sends = [(tr.dst, payload(tr)) for tr in ops[0]]
        inbox = {}
        for i, tr in enumerate(ops[1]):
            key = (slot, tr.kind, i)
            if key not in self._pool:
                self._pool[key] = buffers(tr)
            inbox[tr] = _front_rows(self._pool[key], self.rows(tr))
        self.comm.post(slot, sends, [(tr.src, bufs) for tr, bufs in inbox.items()])
        return inbox

    def run(self, *handlers, **named) -> None:
        """Interpret the plan (``_run``; the agreement was checked when the executor was made); on any failure
        abort the library's communicators so that the peers fail at once instead of waiting, and re-raise (the
        next call rebuilds them)."""
        try:
            self._run(*handlers, **named)
            if agreement.enabled():
                agreement.confirm(self.lib, self._collective_device(), self.cfg.timeout,
                                  f"{self.phase} {self.call}, after the last step")
        except BaseException as exc:
            self._abort()
            if not isinstance(exc, DistAttnError):
                exc.add_note(f"distattn: rank {self.rank} failed in the {self.phase} at step {self.step} of "
                             f"{self.plan.num_steps()}; it aborted the library's communicators so that its peers "
                             f"fail with DistAttnError; the next call rebuilds them")
            raise

    def _run(self, compute, fetch_payload, fetch_buffers, return_payload, return_buffers, absorb) -> None:
        """Interpret the plan: for each step, fetch, compute, send partials back, absorb received partials.

        ``compute(task, inbox)`` returns the partial produced by a task (or ``None``); ``absorb(transfer,
        buffers)`` adds a received partial into this rank's accumulators. Slots are ``(kind, phase, index)``.
        """
        plan, phase, steps = self.plan, self.phase, self.plan.num_steps()

        def fetch(t):  # post step t's inputs into fetch slot t % 2 (double-buffered)
            return self.post(("fetch", phase, t % 2), plan.rank_ops(t, self.rank, phase, "fetch"), fetch_payload,
                             fetch_buffers)

        fetched = {0: fetch(0)} if self.cfg.overlap else {}
        returned = None  # (slot, inbox) of the previous step's partials, absorbed after this step's compute
        for t in range(steps):
            self.step, self.comm.where = t, f"{phase} {self.call}, step {t} of {steps}"
            if not self.cfg.overlap:
                fetched[t] = fetch(t)
            elif t + 1 < steps:  # prefetch: the next step's inputs travel while this step computes
                fetched[t + 1] = fetch(t + 1)
            self.comm.wait(("fetch", phase, t % 2))
            inbox = fetched.pop(t)
            task = plan.task(t, self.rank)
            produced = compute(task, inbox) if task is not None else None
            if returned is not None:
                self._absorb(returned, absorb)
            slot = ("return", phase, t % 2)
            returned = (slot, self.post(slot, plan.rank_ops(t, self.rank, phase, "return"),
                                        lambda tr, parts=produced: return_payload(parts), return_buffers))
            if not self.cfg.overlap:
                self._absorb(returned, absorb)
                returned = None
        if returned is not None:
            self._absorb(returned, absorb)
        self.comm.close()

    def _absorb(self, returned, absorb) -> None:
        slot, inbox = returned
        self.comm.wait(slot)
        for tr, bufs in inbox.items():
            absorb(tr, bufs)


def _empty(like: torch.Tensor, dtype=None, heads=None) -> torch.Tensor:
    b, n, h, d = like.shape
    return torch.empty(b, n, h if heads is None else heads, d, dtype=dtype or like.dtype, device=like.device)


def _front_rows(buffers: list[torch.Tensor], rows: int | None) -> list[torch.Tensor]:
    """Whole-shard ``(b, n, h, d)`` receive buffers as ``(b, rows, h, d)`` tensors on their first elements
    (contiguous, as a message needs); ``rows=None`` or ``n``: the buffers themselves."""
    if rows is None or rows == buffers[0].shape[1]:
        return buffers
    return [t.view(-1)[:t.shape[0] * rows * t.shape[2] * t.shape[3]].view(t.shape[0], rows, t.shape[2], t.shape[3])
            for t in buffers]


def _stats(like: torch.Tensor) -> torch.Tensor:
    """An fp32 ``(b, h_q, n)`` buffer for lse/delta of queries shaped like ``like``."""
    b, n, h, _ = like.shape
    return torch.empty(b, h, n, dtype=torch.float32, device=like.device)


class _WireCopies:
    """Contiguous versions of tensors that are sent (messages need contiguous memory), made at most once each."""

    def __init__(self):
        self._copies: dict[int, torch.Tensor] = {}

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_contiguous():
            return t
        if id(t) not in self._copies:
            self._copies[id(t)] = t.contiguous()
        return self._copies[id(t)]

    def rows(self, tensors: list[torch.Tensor], a: int, b: int) -> list[torch.Tensor]:
        """The sequence rows ``[a, b)`` of ``tensors`` (dim 1) as messages: views when contiguous (batch 1), else
        copies of the slice only (never cached: a slice is a new object every step)."""
        return [self(t) if a == 0 and b == t.shape[1] else t[:, a:b].contiguous() for t in tensors]


def reject_call(group, phase: str, error: Exception, timeout: float, device: torch.device | None = None):
    """This rank's input failed validation with ``error``: take part in the call's agreement as a failed rank, so
    that every rank of ``group`` raises the same error (naming this rank and ``error``) and every rank uses the
    same call number. Raises that error; with ``DISTATTN_CHECK=0`` (no agreement) raises ``error`` itself.

    ``group``: a flat group; for a 2-D group (``topology(group).two_d``) the Ulysses group's agreement is joined,
    and its ranks carry the failure on to their ring groups (``distattn.ulysses``)."""
    if not agreement.enabled():
        raise error
    topo = topology(group)
    if topo.U == 1:
        _reject_flat(topo.ring_group, phase, error, timeout, device)
    try:  # the Ulysses group first, then this rank's ring (as the ranks that passed validation do)
        _reject_flat(topo.ulysses_group, phase, error, timeout, device)
    except (ValueError, TypeError) as exc:
        _reject_flat(topo.ring_group, phase, exc, timeout, device)


def _reject_flat(group, phase: str, error: Exception, timeout: float, device):
    lib, seq = open_call(group, timeout)
    where = f"{phase} {describe(lib.position)}, before step 0 (this rank's input failed validation)"
    own = agreement.rejected_fields(phase, seq, error)
    collective = device if (device is not None and lib.nccl) else torch.device("cpu")
    try:
        agreement.agree(lib, own, collective, timeout, where)
    except DistAttnError:
        lib.abort()
        raise error from None  # the peers are gone or stalled: this rank's own error is the useful one
    raise error  # every rank's input failed alike: each raises that same error, as one process would


# -- forward ------------------------------------------------------------------------------------------------
def dist_attn_forward(q, k, v, cfg: DistAttnConfig):
    """Execute the plan forward on this rank's shards; returns ``(out (b, n, h_q, d) in q.dtype, lse fp32)``."""
    ex = _Executor(cfg, q, "forward", {"q": q, "k": k, "v": v})
    check = _guarded(ex, lambda: nonfinite.Check(ex, [v]))  # posted now, read after the last step
    # q, k, v stay as given (the kernels need unit stride in d only, e.g. HF's transposed (b, h, n, d) views);
    # a contiguous copy is made once, and only if a tensor is sent to another rank.
    wire = _WireCopies()
    state = kernels.new_state(q)

    def fetch_payload(tr):
        return wire.rows([k, v], *ex.span(tr.dst, tr.src)) if tr.kind == "kv" else [wire(q)]

    def fetch_buffers(tr):
        return [_empty(k), _empty(v)] if tr.kind == "kv" else [_empty(q)]

    def compute(task: Task, inbox):
        bufs = next(iter(inbox.values()), None)  # a task fetches at most one payload
        if task.is_helper:  # their queries against my kv: a partial in fp32, sent back to the owner
            partial = kernels.new_state(bufs[0])
            kernels.fold_(partial, bufs[0], k, v, **ex.mask(task))
            return partial
        kc, vc = (k, v) if task.is_local else bufs
        kernels.fold_(state, q, kc, vc, **ex.mask(task))
        return None

    def absorb(tr, bufs):
        kernels.merge_(state, bufs[0], bufs[1], backend=ex.backend)

    part = torch.float32 if cfg.partials == "fp32" else q.dtype
    ex.run(compute, fetch_payload, fetch_buffers,
           return_payload=lambda partial: [ex.partial(partial.out, q), partial.lse],
           return_buffers=lambda tr: [_empty(q, part), _stats(q)],
           absorb=absorb)
    out, lse = kernels.finalize(state, q.dtype)
    _guarded(ex, lambda: nonfinite.spread_forward(check, out, lse))  # v's NaN/Inf where the plan skipped pairs
    return out, lse


# -- backward -----------------------------------------------------------------------------------------------
def dist_attn_backward(dout, q, k, v, out, lse, cfg: DistAttnConfig, delta=None):
    """Execute the plan backward; returns this rank's ``(dq, dk, dv)`` in the input dtypes.

    ``delta``: ``rowsum(dout * out)`` fp32 ``(b, h_q, n)`` if the caller has it (then ``out`` may be None)."""
    ex = _Executor(cfg, q, "backward", {"q": q, "k": k, "v": v, "dout": dout})
    check = _guarded(ex, lambda: nonfinite.Check(ex, [q, k, dout]))  # posted now, read after the last step
    wire = _WireCopies()  # as in the forward: copies only of what travels, once each
    dout = dout.to(q.dtype)
    if delta is None:
        delta = kernels.attn_delta(dout, out, backend=ex.backend)  # rowsum(dout * out), once, before any step
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros_like(dk)

    def fetch_payload(tr):
        return wire.rows([k, v], *ex.span(tr.dst, tr.src)) if tr.kind == "kv" else [wire(q), wire(dout), wire(lse),
                                                                                      delta]

    def fetch_buffers(tr):
        return [_empty(k), _empty(v)] if tr.kind == "kv" else [_empty(q), _empty(q), _stats(q), _stats(q)]

    def compute(task: Task, inbox):
        bufs = next(iter(inbox.values()), None)  # a task fetches at most one payload
        kw = ex.mask(task)
        if task.is_local:
            kernels.backward_chunk_(dout, q, k, v, lse, delta, dq, dk, dv, **kw)
            return None
        if task.is_helper:  # their queries against my kv: my dk, dv grow; their dq partial goes back
            q_i, dout_i, lse_i, delta_i = bufs
            dq_part = torch.zeros(q_i.shape, dtype=torch.float32, device=q.device)
            kernels.backward_chunk_(dout_i, q_i, k, v, lse_i, delta_i, dq_part, dk, dv, **kw)
            return [ex.partial(dq_part, q)]
        k_j, v_j = bufs  # my queries against their kv slice: my dq grows; their dk, dv partials (the slice) go back
        dk_part = torch.zeros(k_j.shape, dtype=torch.float32, device=k.device)
        dv_part = torch.zeros_like(dk_part)
        kernels.backward_chunk_(dout, q, k_j, v_j, lse, delta, dq, dk_part, dv_part, **kw)
        return [ex.partial(dk_part, k), ex.partial(dv_part, v)]

    fp32 = cfg.partials == "fp32"

    def return_buffers(tr):
        if tr.kind == "dq":
            return [_empty(q, torch.float32 if fp32 else q.dtype)]
        return [_empty(k, torch.float32 if fp32 else k.dtype), _empty(v, torch.float32 if fp32 else v.dtype)]

    def absorb(tr, bufs):
        if tr.kind == "dq":
            dq.add_(bufs[0])
        else:  # the partial of the slice the computing rank borrowed
            a, b = ex.span(tr.src, tr.dst)
            dk[:, a:b].add_(bufs[0])
            dv[:, a:b].add_(bufs[1])

    ex.run(compute, fetch_payload, fetch_buffers, return_payload=lambda parts: parts,
           return_buffers=return_buffers, absorb=absorb)
    _guarded(ex, lambda: nonfinite.spread_backward(check, dq, dk, dv))  # as one device, skipped pairs included
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _guarded(ex: _Executor, fn):
    """``fn()``, whose collectives (``distattn.nonfinite``) are part of the call: on a failure abort the library's
    communicators, as :meth:`_Executor.run` does, so that the peers fail at once instead of waiting."""
    try:
        return fn()
    except BaseException:
        ex._abort()
        raise
