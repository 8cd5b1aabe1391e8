"""Sequence-parallel exact attention: the executors that interpret a plan, forward and backward.

Rank ``r`` of the group holds tokens ``[r*n, (r+1)*n)`` of q, k and v. The plan (``distattn.schedule``)
says, step by step, which (query chunk, kv chunk) pair every rank computes:

* an *owner* task (this rank's queries, someone's kv): fetch that kv chunk, fold it into this rank's
  carried softmax state;
* a *helper* task (someone's queries, this rank's kv — DistFlashAttn's load balancing, Sec. 3.1): fetch
  their queries, compute a partial ``(out, lse)`` in fp32 and send it back; the owner merges it.

The fetches of step ``t + 1`` (``t + Plan.prefetch``: a placed plan may fetch up to 12 steps ahead) are posted before
step ``t`` computes (``overlap=True``), so communication hides behind compute; partial results of step ``t`` are waited
for one step later, just before they are merged. Backward mirrors the forward with the final ``out``/``lse``: owner
tasks add into this rank's ``dq`` and send ``dk, dv`` partials (fp32) back to the kv owner; helper tasks add into this
rank's ``dk, dv`` and send a ``dq`` partial (fp32) back. Every accumulator is fp32 and is cast once at the end.

Reliability: every call runs on the library's own communicators (``distattn.comm.communicator``), first
checks that all ranks make the same call (``distattn.agreement``, one all-reduce), bounds every wait by
``cfg.timeout``, and on any exception aborts the library's communicators so that the peers fail at once with
``DistAttnError`` instead of waiting (the next call rebuilds them).

Layering: the public ``distattn.dist_flash_attn_func`` (``distattn.api``) validates and calls the registered op
``torch.ops.distattn.attention`` (``distattn._ops``), whose forward calls ``dist_attn_forward`` and whose registered
backward calls ``dist_attn_backward``. The step machinery they share (plan walk, exchange, buffer pool, abort) is
``distattn.executor``; the call's options are ``distattn.config``. Nothing here imports upward.

Legend: ``b`` batch, ``n`` tokens per rank, ``h_q``/``h_kv`` heads, ``d`` head dim. GQA: only ``h_kv`` heads
of k and v ever travel.
"""

from __future__ import annotations

import torch

import distattn.agreement as agreement
import distattn.kernels as kernels
import distattn.nonfinite as nonfinite
from distattn.comm import DistAttnError
from distattn.communicators import describe, open_call
from distattn.config import DistAttnConfig
from distattn.executor import Executor, WireCopies, empty_like_shard, guarded, stats_buffer
from distattn.schedule import Task
from distattn.topology import topology

__all__ = ["DistAttnConfig", "dist_attn_forward", "dist_attn_backward", "reject_call"]


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
    """Execute the plan forward on this rank's shards; returns ``(out (b, n, h_q, d) in q.dtype, lse fp32)``.

    The plan runs once per head group (``Executor.head_groups``: one group unless the call's working memory would
    pass the budget), so the fp32 state, the receive pool and the partials in flight are one group's."""
    ex = Executor(cfg, q, "forward", {"q": q, "k": k, "v": v})
    check = guarded(ex, lambda: nonfinite.Check(ex, [v]))  # posted now, read after the last step
    groups = ex.head_slices(q, k)
    if len(groups) == 1:
        out, lse = _forward_group(ex, q, k, v, cfg, last=True)
    else:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
        for i, (hq, hk) in enumerate(groups):
            out[:, :, hq], lse[:, hq] = _forward_group(ex, q[:, :, hq], k[:, :, hk], v[:, :, hk], cfg,
                                                       last=i == len(groups) - 1)
    guarded(ex, lambda: nonfinite.spread_forward(check, out, lse))  # v's NaN/Inf where the plan skipped pairs
    return out, lse


def _forward_group(ex: Executor, q, k, v, cfg: DistAttnConfig, *, last: bool):
    """The plan's forward over one head group's ``q, k, v`` (views of the call's heads); ``(out, lse)``."""
    # q, k, v stay as given (the kernels need unit stride in d only, e.g. HF's transposed (b, h, n, d) views);
    # a contiguous copy is made once, and only if a tensor is sent to another rank.
    wire = WireCopies()
    state = kernels.new_state(q)

    def fetch_payload(tr):
        return wire.rows([k, v], ex.key_rows(tr.dst, tr.src)) if tr.kind == "kv" else [wire(q)]

    def fetch_buffers(tr, rows):
        if tr.kind == "kv":
            return [empty_like_shard(k, rows=rows), empty_like_shard(v, rows=rows)]
        return [empty_like_shard(q)]

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
           return_buffers=lambda tr, rows: [empty_like_shard(q, part), stats_buffer(q)],
           absorb=absorb, confirm=last)
    return kernels.finalize(state, q.dtype)


# -- backward -----------------------------------------------------------------------------------------------
def dist_attn_backward(dout, q, k, v, out, lse, cfg: DistAttnConfig, delta=None):
    """Execute the plan backward; returns this rank's ``(dq, dk, dv)`` in the input dtypes.

    ``delta``: ``rowsum(dout * out)`` fp32 ``(b, h_q, n)`` if the caller has it (then ``out`` may be None). Head
    groups as in the forward: the fp32 accumulators, receive pool and partials are one group's at a time."""
    ex = Executor(cfg, q, "backward", {"q": q, "k": k, "v": v, "dout": dout})
    check = guarded(ex, lambda: nonfinite.Check(ex, [q, k, dout]))  # posted now, read after the last step
    dout = dout.to(q.dtype)
    if delta is None:
        delta = kernels.attn_delta(dout, out, backend=ex.backend)  # rowsum(dout * out), once, before any step
    groups = ex.head_slices(q, k)
    if len(groups) == 1:
        dq, dk, dv = (g.to(t.dtype) for g, t in zip(_backward_group(ex, dout, q, k, v, lse, delta, cfg, last=True),
                                                    (q, k, v)))
    else:
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        for i, (hq, hk) in enumerate(groups):
            dq[:, :, hq], dk[:, :, hk], dv[:, :, hk] = _backward_group(
                ex, dout[:, :, hq], q[:, :, hq], k[:, :, hk], v[:, :, hk], lse[:, hq], delta[:, hq], cfg,
                last=i == len(groups) - 1)
    guarded(ex, lambda: nonfinite.spread_backward(check, dq, dk, dv))  # as one device, skipped pairs included
    return dq, dk, dv


def _backward_group(ex: Executor, dout, q, k, v, lse, delta, cfg: DistAttnConfig, *, last: bool):
    """The plan's backward over one head group (views of the call's heads); its fp32 ``(dq, dk, dv)``."""
    wire = WireCopies()  # as in the forward: copies only of what travels, once each
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros_like(dk)

    def fetch_payload(tr):
        if tr.kind == "kv":
            return wire.rows([k, v], ex.key_rows(tr.dst, tr.src))
        return [wire(q), wire(dout), wire(lse), wire(delta)]

    def fetch_buffers(tr, rows):
        if tr.kind == "kv":
            return [empty_like_shard(k, rows=rows), empty_like_shard(v, rows=rows)]
        return [empty_like_shard(q), empty_like_shard(q), stats_buffer(q), stats_buffer(q)]

    def compute(task: Task, inbox, rows=None):
        bufs = next(iter(inbox.values()), None)  # a task fetches at most one payload
        kw = ex.mask(task, rows)
        if task.is_local:  # rows: the head before step 0 or the rest at the last step (Executor.head_rows)
            a, b = rows if rows is not None else (0, q.shape[1])
            kernels.backward_chunk_(dout[:, a:b], q[:, a:b], k, v, lse[:, :, a:b], delta[:, :, a:b], dq[:, a:b], dk,
                                    dv, **kw)
            return None
        if task.is_helper:  # their queries against my kv: my dk, dv grow; their dq partial goes back
            q_i, dout_i, lse_i, delta_i = bufs
            dq_part = torch.zeros(q_i.shape, dtype=torch.float32, device=q.device)
            kernels.backward_chunk_(dout_i, q_i, k, v, lse_i, delta_i, dq_part, dk, dv, **kw)
            return [ex.partial(dq_part, q)]
        k_j, v_j = bufs  # my queries against their kv rows: my dq grows; their dk, dv partials (those rows) go back
        dk_part = torch.zeros(k_j.shape, dtype=torch.float32, device=k.device)
        dv_part = torch.zeros_like(dk_part)
        kernels.backward_chunk_(dout, q, k_j, v_j, lse, delta, dq, dk_part, dv_part, **kw)
        return [ex.partial(dk_part, k), ex.partial(dv_part, v)]

    part = torch.float32 if cfg.partials == "fp32" else None

    def return_buffers(tr, rows):
        if tr.kind == "dq":
            return [empty_like_shard(q, part or q.dtype)]
        return [empty_like_shard(k, part or k.dtype, rows=rows), empty_like_shard(v, part or v.dtype, rows=rows)]

    def absorb(tr, bufs):
        if tr.kind == "dq":
            dq.add_(bufs[0])
        else:  # the partial of the rows the computing rank borrowed, packed
            at = 0
            for a, b in ex.key_rows(tr.src, tr.dst):
                dk[:, a:b].add_(bufs[0][:, at:at + b - a])
                dv[:, a:b].add_(bufs[1][:, at:at + b - a])
                at += b - a

    ex.run(compute, fetch_payload, fetch_buffers, return_payload=lambda parts: parts,
           return_buffers=return_buffers, absorb=absorb, confirm=last)
    return dq, dk, dv
