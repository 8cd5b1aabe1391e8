"""Sequence-parallel attention as a registered PyTorch op: ``torch.ops.distattn.attention``.

Why an op and not only an ``autograd.Function``: PyTorch's selective activation checkpointing decides what to
keep per *dispatcher op* (``torch.utils.checkpoint.create_selective_checkpoint_contexts``), and
``torch.compile`` traces registered ops with a fake (meta) implementation without running them. As an op,
the distributed attention can be marked "must save" — its ``(out, lse)`` kept, its forward (and the
communication inside it) never recomputed — which is what ``distattn.checkpoint`` builds on.

The backward is an op too (``torch.ops.distattn.attention_backward``), called by the forward op's registered
autograd formula, so that tracing a backward graph (``torch.compile``/AOTAutograd) sees one opaque call instead
of stepping into the peer-to-peer communication. Both ops have fake implementations (shapes only).

Layering: ``distattn.api.dist_flash_attn_func`` validates its arguments and calls :func:`dist_attention` here;
the op runs the executors of ``distattn.attention``. Nothing here imports upward.

A ``ProcessGroup`` cannot be an op argument (ops take tensors, scalars and strings), so groups travel as a
string key into a small per-process registry (``group_key``; ``"default"`` is the default group).

Packed documents reach the op in one of two forms: ``cu_seqlens``, a list of ints (what the public varlen function
validated on the host), or ``documents``, a tensor read only when the op runs (``documents_of``). A traced caller
(``torch.compile``) passes the tensor: a list is a constant of the graph, so every new set of document boundaries
would compile a new graph, while a tensor is data, and its fixed length ``P*n + 1`` (padded at the end by
repeating ``P*n``) depends only on the shapes.

Legend: ``b`` batch, ``n`` tokens on this rank, ``h_q``/``h_kv`` heads, ``d`` head dim, ``T = P*n`` tokens in the
stream over ``P`` ranks.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch

from distattn.attention import DistAttnConfig, dist_attn_backward, dist_attn_forward
from distattn.comm import default_timeout
from distattn.schedule.build import placed_window
from distattn.topology import is_2d, topology
from distattn.ulysses import ulysses_backward, ulysses_forward

__all__ = ["OpCounters", "COUNTERS", "reset_counters", "group_key", "group_of", "dist_attention", "OP", "documents_of",
           "padded_documents"]

DEFAULT_GROUP_KEY = "default"


@dataclass
class OpCounters:
    """How many times this process executed the op (cumulative; read them around one training step)."""

    forward: int = 0
    """Forward executions (a checkpoint that recomputes attention adds one per layer)."""
    backward: int = 0
    """Backward executions."""


COUNTERS = OpCounters()


def reset_counters() -> None:
    COUNTERS.forward = 0
    COUNTERS.backward = 0


# -- process-group registry -----------------------------------------------------------------------------
# A process group is held by a weak reference: a job that makes a new group per call must not keep every group
# (and the library's communicators for it, ``distattn.comm``) alive. Pairs of groups are held as given.
_GROUPS: dict[str, object] = {DEFAULT_GROUP_KEY: None}
_NEXT_KEY = itertools.count(1)


def _deref(known):
    return known() if isinstance(known, weakref.ref) else known


def group_key(group) -> str:
    """The registry key of ``group`` (registered on first use; ``None`` is ``"default"``)."""
    if group is None:
        return DEFAULT_GROUP_KEY
    for key, known in list(_GROUPS.items()):
        g = _deref(known)
        if g is None and key != DEFAULT_GROUP_KEY:
            del _GROUPS[key]  # collected
        elif g is group or (isinstance(group, tuple) and g == group):  # a (ulysses, ring) pair: by value
            return key
    key = f"group{next(_NEXT_KEY)}"
    try:
        _GROUPS[key] = weakref.ref(group)
    except TypeError:  # not weakly referenceable (a tuple of groups): held as given
        _GROUPS[key] = group
    return key


def group_of(key: str):
    """The process group registered under ``key`` (``None``: the default group)."""
    if key not in _GROUPS or (key != DEFAULT_GROUP_KEY and _deref(_GROUPS[key]) is None):
        raise ValueError(f"no live process group is registered under {key!r} in this process (known: "
                         f"{sorted(_GROUPS)}); get keys from distattn._ops.group_key(group), and keep the group "
                         f"alive until its calls (and their backward) are done")
    return _deref(_GROUPS[key])


# -- documents as a tensor ----------------------------------------------------------------------------------
def padded_documents(cu_seqlens, total: int) -> torch.Tensor:
    """``cu_seqlens`` (ints, ``None``: one document) as the op's ``documents`` tensor: ``(total + 1,)`` int64 on
    the CPU, the cumulative lengths followed by ``total`` repeated. A ``cu_seqlens`` that ends before ``total``
    gets ``total`` as one more boundary: the tail is a document of its own, as in the varlen functions."""
    cu = list(cu_seqlens) if cu_seqlens is not None else [0, total]
    if cu[-1] != total:
        cu.append(total)
    return torch.tensor(cu + [total] * (total + 1 - len(cu)), dtype=torch.int64)


def documents_of(documents: torch.Tensor, total: int) -> tuple[int, ...] | None:
    """The ``cu_seqlens`` that a ``documents`` tensor (``padded_documents``) holds; ``None`` for one document over
    the whole stream (plain causal attention). Host work is O(T) vectorized, no per-element Python.

    Raises:
        ValueError: not ``(total + 1,)`` cumulative lengths from 0 to ``total``, non-decreasing.
    """
    t = documents.detach().to("cpu", torch.int64)
    if t.shape != (total + 1,) or int(t[0]) != 0 or int(t[-1]) != total or bool((t[1:] < t[:-1]).any()):
        raise ValueError(f"documents must be ({total + 1},) cumulative document lengths from 0 to {total} "
                         f"(padded at the end by repeating {total}), non-decreasing; got shape {tuple(t.shape)} "
                         f"starting {t[:4].tolist()} and ending {t[-4:].tolist()}; build them with "
                         f"distattn._ops.padded_documents(cu_seqlens, total)")
    ends = int(torch.searchsorted(t, total))  # the first entry equal to the total: the stream's end
    cu = tuple(t[:ends + 1].tolist())
    return None if len(cu) == 2 else cu


def _config(causal: bool, scale: float, window_left: int, window_right: int, softcap: float, key: str,
            schedule: str, backend: str | None, overlap: bool, cu_seqlens: tuple, timeout: float,
            partials: str, documents: torch.Tensor | None, n: int) -> DistAttnConfig:
    # Inputs were validated at the public boundary (distattn.api); here only the frozen config is rebuilt.
    timeout = timeout if timeout > 0 else default_timeout()  # 0: the op called directly, without timeout
    group = group_of(key)
    if documents is not None and not cu_seqlens:  # values known only now (a traced caller): read them here
        cu_seqlens = documents_of(documents, n * topology(group).world_size)
    placed_for = None  # placed: its shards' placement, recorded by distattn.sharding.placement (validated at the API)
    if schedule == "placed" and cu_seqlens:
        topo = topology(group)
        placed_for = placed_window(cu_seqlens, topo.R, topo.U * n, (window_left, window_right))
    return DistAttnConfig(causal=causal, scale=scale, window=(window_left, window_right), softcap=softcap,
                          schedule=schedule, backend=backend, group=group, overlap=overlap,
                          cu_seqlens=cu_seqlens or None, timeout=timeout, partials=partials,
                          placement_window=placed_for)


def _op_args(cfg: DistAttnConfig) -> tuple:
    """The op's scalar arguments for ``cfg`` (ops take tensors, scalars and strings, not objects)."""
    return (cfg.causal, cfg.scale, cfg.window[0], cfg.window[1], cfg.softcap, group_key(cfg.group), cfg.schedule,
            cfg.backend, cfg.overlap, list(cfg.cu_seqlens or ()), cfg.timeout, cfg.partials)


# -- the op ---------------------------------------------------------------------------------------------
@torch.library.custom_op("distattn::attention", mutates_args=())
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, window_left: int,
               window_right: int, softcap: float, group_key: str, schedule: str, backend: str | None,
               overlap: bool, cu_seqlens: list[int], timeout: float = 0.0, partials: str = "fp32",
               documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``q (b, n, h_q, d)``, ``k, v (b, n, h_kv, d)`` -> ``out (b, n, h_q, d)``, ``lse (b, h_q, n)`` fp32.

    ``cu_seqlens``: packed documents over the whole stream (empty: none). ``timeout``: seconds per wait; 0 (the
    default): ``DISTATTN_TIMEOUT``, else 300. ``documents``: the documents as a ``(T + 1,)`` tensor instead
    (``padded_documents``; read when the op runs), for a caller whose ``cu_seqlens`` are not known when it is
    traced."""
    COUNTERS.forward += 1
    cfg = _config(causal, scale, window_left, window_right, softcap, group_key, schedule, backend, overlap,
                  tuple(cu_seqlens), timeout, partials, documents, q.shape[1])
    return (ulysses_forward if is_2d(cfg.group) else dist_attn_forward)(q, k, v, cfg)


@_attention.register_fake
def _attention_fake(q, k, v, *options):
    b, n, h_q, _ = q.shape
    # The real forward returns fresh contiguous tensors (kernels.finalize), so the fake does too.
    return q.new_empty(q.shape), q.new_empty((b, h_q, n), dtype=torch.float32)


@torch.library.custom_op("distattn::attention_backward", mutates_args=())
def _attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                           lse: torch.Tensor, causal: bool, scale: float, window_left: int, window_right: int,
                           softcap: float, group_key: str, schedule: str, backend: str | None,
                           overlap: bool, cu_seqlens: list[int], timeout: float = 0.0, partials: str = "fp32",
                           documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of ``distattn::attention`` (an op of its own, so that tracers such as
    ``torch.compile`` see one opaque call instead of tracing into the communication)."""
    COUNTERS.backward += 1
    cfg = _config(causal, scale, window_left, window_right, softcap, group_key, schedule, backend, overlap,
                  tuple(cu_seqlens), timeout, partials, documents, q.shape[1])
    return (ulysses_backward if is_2d(cfg.group) else dist_attn_backward)(dout, q, k, v, out, lse, cfg)


@_attention_backward_op.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, *options):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    # The op's other arguments, in order. ``documents`` (a small CPU tensor, no gradient) rides along here rather
    # than in save_for_backward: saved-tensor hooks (offload, measurement) are for activations, not mask metadata.
    ctx.options = options
    ctx.mark_non_differentiable(lse)


def _attention_backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _attention_backward_op(dout, q, k, v, out, lse, *ctx.options)
    return (dq, dk, dv) + (None,) * len(ctx.options)


_attention.register_autograd(_attention_backward, setup_context=_setup_context)

OP = torch.ops.distattn.attention.default
"""The op overload that checkpoint policies match on."""


def dist_attention(q, k, v, cfg: DistAttnConfig, documents: torch.Tensor | None = None):
    """``(out, lse)`` of the registered op for this rank's shards (validated by ``distattn.api``); ``documents``:
    packed documents read when the op runs (``padded_documents``), for a config without ``cu_seqlens``."""
    return _attention(q, k, v, *_op_args(cfg), documents=documents)
