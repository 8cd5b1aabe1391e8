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

Autograd: ``dist_flash_attn_func`` runs as the registered op ``torch.ops.distattn.attention`` (``distattn._ops``),
whose forward calls ``dist_attn_forward`` and whose registered backward calls ``dist_attn_backward``.

Legend: ``b`` batch, ``n`` tokens per rank, ``h_q``/``h_kv`` heads, ``d`` head dim. GQA: only ``h_kv`` heads
of k and v ever travel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distattn import kernels
from distattn._validate import check_qkv, resolve_scale
from distattn.comm import PeerExchange
from distattn.schedule import SCHEDULES, Plan, Task, Transfer, make_plan

__all__ = ["DistAttnConfig", "make_config", "dist_attn_forward", "dist_attn_backward", "dist_flash_attn_func"]


@dataclass(frozen=True, kw_only=True)
class DistAttnConfig:
    """Static options of one sequence-parallel attention call."""

    causal: bool
    """Causal mask on global positions (``k_pos <= q_pos``)."""
    scale: float
    """Softmax scale."""
    schedule: str
    """``"ring"`` or ``"balanced"`` (see ``distattn.schedule``)."""
    backend: str | None
    """Kernel backend name (``None``: best available on the tensors' device)."""
    group: object = None
    """Process group (``None``: the default group)."""
    overlap: bool = True
    """Post step ``t + 1``'s fetches before computing step ``t``; ``False`` waits first (ablation)."""

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not one of {SCHEDULES}; use schedule='balanced'")

    def plan(self) -> Plan:
        return make_plan(dist.get_world_size(self.group), self.causal, self.schedule)


def make_config(q, k, v, causal=True, softmax_scale=None, group=None, schedule="balanced", backend=None,
                overlap=True) -> DistAttnConfig:
    """Validate this rank's shards and build the config. Raises before any communication.

    Every check reads only local shapes/dtypes/devices and arguments, so ranks that agree on them raise the
    same error. A mismatch between ranks that local shapes cannot show (e.g. a different ``n`` on one rank)
    is caught only with ``DISTATTN_DEBUG=1``, which all-gathers the shapes first (one small collective).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("dist_flash_attn_func needs an initialized process group: call "
                           "torch.distributed.init_process_group(...) first, or use flash_attn_func on one device")
    check_qkv(q, k, v, same_seq=True)
    if q.is_cuda and q.device.index != torch.cuda.current_device():
        raise ValueError(f"q is on {q.device} but the current CUDA device is cuda:{torch.cuda.current_device()}; "
                         f"call torch.cuda.set_device({q.device.index}) on this rank (NCCL hangs otherwise)")
    if "nccl" in str(dist.get_backend(group)) and not q.is_cuda and "gloo" not in str(dist.get_backend(group)):
        raise ValueError(f"the process group's backend is {dist.get_backend(group)!r}, which cannot send tensors "
                         f"on {q.device}; move q, k, v to this rank's CUDA device or use a gloo group")
    kernels.get_backend(backend, q.device)  # unknown/unavailable backend: same error on every rank
    cfg = DistAttnConfig(causal=bool(causal), scale=resolve_scale(softmax_scale, q.shape[-1]), schedule=schedule,
                         backend=backend, group=group, overlap=bool(overlap))
    if os.environ.get("DISTATTN_DEBUG", "0") == "1":
        _check_ranks_agree(q, k, cfg)
    return cfg


def _check_ranks_agree(q, k, cfg: DistAttnConfig) -> None:
    mine = (tuple(q.shape), tuple(k.shape), str(q.dtype), cfg.causal, cfg.schedule, round(cfg.scale, 12))
    world = dist.get_world_size(cfg.group)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine, group=cfg.group)
    if any(x != everyone[0] for x in everyone):
        lines = "; ".join(f"rank {r}: q{x[0]} k{x[1]} {x[2]} causal={x[3]} schedule={x[4]}"
                          for r, x in enumerate(everyone))
        raise ValueError(f"ranks disagree on the attention call ({lines}); every rank must pass equal shard "
                         f"shapes and the same options")


# -- shared step machinery ----------------------------------------------------------------------------------
class _Executor:
    """What the forward and backward interpreters share: plan, exchange, chunk positions, message buffers."""

    def __init__(self, cfg: DistAttnConfig, like: torch.Tensor, phase: str):
        self.cfg, self.phase = cfg, phase
        self.plan = cfg.plan()
        self.comm = PeerExchange(cfg.group, like.device)
        self.rank = self.comm.rank
        self.n = like.shape[1]
        self.backend = kernels.get_backend(cfg.backend, like.device)

    def start(self, chunk: int) -> int:
        """Global position of the first token of ``chunk``."""
        return chunk * self.n

    def mask(self, task: Task) -> bool:
        # Off-diagonal causal pairs always have kv_chunk < q_chunk: every key is visible, no mask to pay for.
        return self.cfg.causal and task.is_diagonal

    def post(self, slot, transfers: tuple[Transfer, ...], payload, buffers) -> dict:
        """Post this rank's part of ``transfers``; returns ``{transfer: receive buffers}``."""
        sends = [(tr.dst, payload(tr)) for tr in transfers if tr.src == self.rank]
        inbox = {tr: buffers(tr) for tr in transfers if tr.dst == self.rank}
        self.comm.post(slot, sends, [(tr.src, bufs) for tr, bufs in inbox.items()])
        return inbox

    def run(self, compute, fetch_payload, fetch_buffers, return_payload, return_buffers, absorb) -> None:
        """Interpret the plan: for each step, fetch, compute, send partials back, absorb received partials.

        ``compute(task, inbox)`` returns the partial produced by a task (or ``None``); ``absorb(transfer,
        buffers)`` adds a received partial into this rank's accumulators. Slots are ``(kind, phase, index)``.
        """
        plan, phase, steps = self.plan, self.phase, self.plan.num_steps()

        def fetch(t):  # post step t's inputs into fetch slot t % 2 (double-buffered)
            return self.post(("fetch", phase, t % 2), plan.fetches(t, phase), fetch_payload, fetch_buffers)

        fetched = {0: fetch(0)} if self.cfg.overlap else {}
        returned = None  # (slot, inbox) of the previous step's partials, absorbed after this step's compute
        for t in range(steps):
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
            returned = (slot, self.post(slot, plan.returns(t, phase), lambda tr, parts=produced: return_payload(parts),
                                        return_buffers))
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


def _stats(like: torch.Tensor) -> torch.Tensor:
    """An fp32 ``(b, h_q, n)`` buffer for lse/delta of queries shaped like ``like``."""
    b, n, h, _ = like.shape
    return torch.empty(b, h, n, dtype=torch.float32, device=like.device)


# -- forward ------------------------------------------------------------------------------------------------
def dist_attn_forward(q, k, v, cfg: DistAttnConfig):
    """Execute the plan forward on this rank's shards; returns ``(out (b, n, h_q, d) in q.dtype, lse fp32)``."""
    ex = _Executor(cfg, q, "forward")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    state = kernels.new_state(q)

    def fetch_payload(tr):
        return [k, v] if tr.kind == "kv" else [q]

    def fetch_buffers(tr):
        return [_empty(k), _empty(v)] if tr.kind == "kv" else [_empty(q)]

    def compute(task: Task, inbox):
        bufs = next(iter(inbox.values()), None)  # a task fetches at most one payload
        if task.is_helper:  # their queries against my kv: a partial in fp32, sent back to the owner
            partial = kernels.new_state(bufs[0])
            kernels.fold_(partial, bufs[0], k, v, softmax_scale=cfg.scale, q_start=ex.start(task.q_chunk),
                          k_start=ex.start(task.kv_chunk), causal=ex.mask(task), backend=ex.backend)
            return partial
        kc, vc = (k, v) if task.is_local else bufs
        kernels.fold_(state, q, kc, vc, softmax_scale=cfg.scale, q_start=ex.start(task.q_chunk),
                      k_start=ex.start(task.kv_chunk), causal=ex.mask(task), backend=ex.backend)
        return None

    def absorb(tr, bufs):
        kernels.merge_(state, bufs[0], bufs[1], backend=ex.backend)

    ex.run(compute, fetch_payload, fetch_buffers,
           return_payload=lambda partial: [partial.out, partial.lse],
           return_buffers=lambda tr: [_empty(q, torch.float32), _stats(q)],
           absorb=absorb)
    return kernels.finalize(state, q.dtype)


# -- backward -----------------------------------------------------------------------------------------------
def dist_attn_backward(dout, q, k, v, out, lse, cfg: DistAttnConfig):
    """Execute the plan backward; returns this rank's ``(dq, dk, dv)`` in the input dtypes."""
    ex = _Executor(cfg, q, "backward")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    dout = dout.to(q.dtype).contiguous()
    lse = lse.contiguous()
    delta = kernels.attn_delta(dout, out, backend=ex.backend)  # rowsum(dout * out), once, before any step
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros_like(dk)

    def fetch_payload(tr):
        return [k, v] if tr.kind == "kv" else [q, dout, lse, delta]

    def fetch_buffers(tr):
        return [_empty(k), _empty(v)] if tr.kind == "kv" else [_empty(q), _empty(q), _stats(q), _stats(q)]

    def compute(task: Task, inbox):
        bufs = next(iter(inbox.values()), None)  # a task fetches at most one payload
        kw = dict(softmax_scale=cfg.scale, q_start=ex.start(task.q_chunk), k_start=ex.start(task.kv_chunk),
                  causal=ex.mask(task), backend=ex.backend)
        if task.is_local:
            kernels.backward_chunk_(dout, q, k, v, lse, delta, dq, dk, dv, **kw)
            return None
        if task.is_helper:  # their queries against my kv: my dk, dv grow; their dq partial goes back
            q_i, dout_i, lse_i, delta_i = bufs
            dq_part = torch.zeros(q_i.shape, dtype=torch.float32, device=q.device)
            kernels.backward_chunk_(dout_i, q_i, k, v, lse_i, delta_i, dq_part, dk, dv, **kw)
            return [dq_part]
        k_j, v_j = bufs  # my queries against their kv: my dq grows; their dk, dv partials go back
        dk_part = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv_part = torch.zeros_like(dk_part)
        kernels.backward_chunk_(dout, q, k_j, v_j, lse, delta, dq, dk_part, dv_part, **kw)
        return [dk_part, dv_part]

    def return_buffers(tr):
        if tr.kind == "dq":
            return [_empty(q, torch.float32)]
        return [_empty(k, torch.float32), _empty(v, torch.float32)]

    def absorb(tr, bufs):
        if tr.kind == "dq":
            dq.add_(bufs[0])
        else:
            dk.add_(bufs[0])
            dv.add_(bufs[1])

    ex.run(compute, fetch_payload, fetch_buffers, return_payload=lambda parts: parts,
           return_buffers=return_buffers, absorb=absorb)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# -- public API -------------------------------------------------------------------------------------------
def dist_flash_attn_func(q, k, v, causal: bool = True, softmax_scale: float | None = None, group=None,
                         schedule: str = "balanced", backend: str | None = None, return_lse: bool = False, *,
                         overlap: bool = True):
    """Exact attention over a sequence split across the ranks of ``group``; differentiable.

    Args:
        q: ``(batch, n, heads_q, head_dim)``, this rank's shard: rank ``r`` holds tokens ``[r*n, (r+1)*n)``.
        k, v: ``(batch, n, heads_kv, head_dim)``, this rank's shards; ``heads_q % heads_kv == 0``.
        causal: causal mask on global positions (``k_pos <= q_pos``).
        softmax_scale: defaults to ``head_dim ** -0.5``.
        group: process group (``None``: the default group).
        schedule: ``"balanced"`` (DistFlashAttn load balancing, ``1 + P//2`` steps causal) or ``"ring"``.
        backend: kernel backend, ``"triton"``/``"torch"``/``None`` (best available).
        return_lse: also return this rank's ``lse (batch, heads_q, n)``, fp32 (not differentiable).
        overlap: prefetch the next step's chunks while computing (``False`` only for ablations).

    Returns:
        This rank's ``out (batch, n, heads_q, head_dim)`` in the input dtype, or ``(out, lse)``.
    """
    # Autograd goes through the registered op torch.ops.distattn.attention (distattn._ops), whose forward
    # and backward run the two executors above: one code path that selective activation checkpointing
    # (distattn.checkpoint) and torch.compile can see as a single op. Imported here: _ops imports this module.
    from distattn._ops import dist_flash_attn_op

    return dist_flash_attn_op(q, k, v, causal, softmax_scale, group, schedule, backend, return_lse,
                              overlap=overlap)
