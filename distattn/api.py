"""distattn's public attention functions: flash-attn's names, positional order and keywords.

Swap one import: ``from flash_attn import flash_attn_func`` -> ``from distattn import flash_attn_func``. Every
function here takes flash-attn's exact arguments in flash-attn's order; distattn's own options (``group``,
``schedule``, ``backend``, ``return_lse``, ...) come after them and are keyword-only. Validation happens here,
at the public boundary, before any work or communication; the way down is one way:

    api (this module)  ->  single.py (autograd, one device) / _ops.py (registered ops)  ->  attention.py
    (plan executors)  ->  schedule + comm  ->  kernels

What flash-attn offers and distattn does not compute raises a ``ValueError`` naming the alternative:
``dropout_p > 0`` (use dropout outside attention, or 0 - most LLM pre-training uses none) and ALiBi
(``alibi_slopes``; use RoPE models). ``deterministic`` is accepted: every distattn backward is deterministic.
``return_attn_probs=True`` returns ``(out, lse, None)``: like flash-attn's third value, the probabilities are
for testing only, and distattn never materializes them.

Legend: ``b`` batch, ``s`` sequence, ``h_q``/``h_kv`` heads, ``d`` head dim.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch
import torch.distributed as dist

import distattn.kernels as kernels
from distattn._ops import dist_attention, documents_of
from distattn._validate import (check_causal, check_global_documents, check_qkv, check_softcap, check_unsupported,
                                check_window, resolve_scale)
from distattn.choose import choose_schedule, resolve_auto
from distattn.attention import DistAttnConfig, reject_call
from distattn.comm import DEFAULT_TIMEOUT_S, backend_name, default_timeout
from distattn.schedule import PARTIALS, SCHEDULES, layout_of, ulysses_heads
from distattn.schedule.build import placed_window
from distattn.topology import split as split_group
from distattn.topology import topology
from distattn.single import attention, attention_with_bounds

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "dist_flash_attn_func", "dist_flash_attn_varlen_func",
           "choose_schedule"]
# Handed on for the modules that validate flash-attn's options as this one does (compat, integrations):
# check_causal, check_window, check_softcap, check_unsupported (distattn._validate).


def _returns(out, lse, return_attn_probs: bool, return_lse: bool):
    """flash-attn's return convention, plus distattn's ``return_lse``."""
    if return_attn_probs:
        return out, lse, None  # flash-attn's S_dmask: distattn never materializes probabilities
    return (out, lse) if return_lse else out


# -- one device -------------------------------------------------------------------------------------------
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, return_lse=False,
                    backend=None):
    """Exact attention on one device, differentiable in ``q, k, v``; flash-attn's ``flash_attn_func``.

    With ``s_q != s_k`` the causal mask and the window are aligned bottom-right, as flash-attn >= 2.1 (the last
    query sees the last key)::

        s_q=2, s_k=5, causal       keys 0 1 2 3 4
                              q 0:      x x x x .      (position 3)
                              q 1:      x x x x x      (position 4)

    A query row that sees no key (``s_q > s_k`` causal) gets output 0 and lse -inf, never NaN. flash-attn reports
    +inf for such a row (a sentinel for its backward); distattn keeps -inf, the log of an empty sum, which merges
    with other partial results as weight 0: test such rows with ``torch.isinf``, not ``== inf``.

    Args:
        q: ``(b, s_q, h_q, d)``, fp16/bf16/fp32.
        k, v: ``(b, s_k, h_kv, d)``; ``h_q % h_kv == 0`` (GQA/MQA; k/v are never repeated).
        dropout_p: must be 0.0 (distattn computes no attention dropout).
        softmax_scale: defaults to ``d ** -0.5``.
        causal: mask keys after the query (bottom-right aligned).
        window_size: ``(left, right)``: the query at position ``p`` sees keys in ``[p - left, p + right]``;
            -1 is unlimited. ``causal=True`` implies ``right = 0``.
        softcap: > 0 soft-caps the scores: ``softcap * tanh(scale * q.k / softcap)`` (Gemma-2).
        alibi_slopes: must be None (no ALiBi).
        deterministic: accepted; distattn's backward is always deterministic.
        return_attn_probs: return ``(out, lse, None)`` as flash-attn does (no probabilities materialized).
        return_lse: (distattn) return ``(out, lse)``; ``lse (b, h_q, s_q)`` fp32, natural log, not differentiable.
        backend: (distattn) ``"triton"``, ``"torch"`` or ``None`` (triton on CUDA, torch elsewhere).

    Returns:
        ``out (b, s_q, h_q, d)`` in the input dtype; or the tuples described above.
    """
    check_unsupported(dropout_p, alibi_slopes, deterministic)
    check_qkv(q, k, v)
    causal = check_causal(causal)
    window = check_window(window_size)
    softcap = check_softcap(softcap)
    be = kernels.check_backend(backend, q.device)  # a name: the op builds the backend when it runs
    out, lse = attention(q, k, v, scale=resolve_scale(softmax_scale, q.shape[-1]), causal=causal, window=window,
                         softcap=softcap, backend=be)
    return _returns(out, lse, return_attn_probs, return_lse)


def check_cu_seqlens(cu_seqlens, total: int | None, name: str, device) -> list[int]:
    """Validate a ``cu_seqlens`` tensor against the ``total`` tokens it must cover; returns it as a host list.

    Reading it to the host costs one device sync per call; it buys a clear error instead of a wrong result.
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32 or int64, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {cu_seqlens.dtype}; build it with "
                        f"torch.tensor([0, len0, len0 + len1, ...], dtype=torch.int32)")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must be 1-D with batch + 1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise ValueError(f"{name} is on {cu_seqlens.device} but the tokens are on {device}; move it with .to()")
    if cu_seqlens.device.type == "meta":
        raise ValueError(f"{name} is on the meta device (a shape without values), but distattn reads the document "
                         f"lengths; pass a CPU or CUDA tensor, e.g. torch.tensor([0, len0, ...], dtype=torch.int32)")
    cu = cu_seqlens.tolist()
    if cu[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {cu[0]}")
    bad = next((i for i in range(1, len(cu)) if cu[i] < cu[i - 1]), None)
    if bad is not None:
        raise ValueError(f"{name} must be non-decreasing (cumulative lengths), but {name}[{bad}] = {cu[bad]} < "
                         f"{name}[{bad - 1}] = {cu[bad - 1]}")
    if total is not None and cu[-1] != total:
        raise ValueError(f"{name}[-1] = {cu[-1]} must equal the number of packed tokens ({total}); pass the "
                         f"cumulative lengths of exactly the documents in the tensor")
    return cu


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, return_lse=False,
                           backend=None):
    """Exact attention over packed documents of varied length on one device; flash-attn's ``flash_attn_varlen_func``.

    Document ``i`` holds query rows ``cu_seqlens_q[i] .. cu_seqlens_q[i+1]-1`` and key rows
    ``cu_seqlens_k[i] .. cu_seqlens_k[i+1]-1``; a query sees only its own document's keys (no padding, no
    attention across documents). Causal mask and window are aligned bottom-right inside each document when its
    query and key lengths differ. Work is proportional to the visible pairs: key blocks of other documents are
    never loaded.

    Args:
        q: ``(total_q, h_q, d)``, the documents' queries concatenated.
        k, v: ``(total_k, h_kv, d)``; ``h_q % h_kv == 0``.
        cu_seqlens_q, cu_seqlens_k: ``(batch + 1,)`` int32/int64 cumulative lengths starting at 0.
        max_seqlen_q, max_seqlen_k: the longest document (flash-attn sizes its grid with them); must be at
            least the real maximum (checked), distattn does not otherwise need them.
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs:
            as in :func:`flash_attn_func`.
        block_table: must be None (paged key/value caches are an inference feature).
        return_lse, backend: (distattn) as in :func:`flash_attn_func`; ``lse`` is ``(h_q, total_q)`` as flash-attn's.

    Returns:
        ``out (total_q, h_q, d)`` in the input dtype; or ``(out, lse)`` / ``(out, lse, None)``.
    """
    check_unsupported(dropout_p, alibi_slopes, deterministic)
    if block_table is not None:
        raise ValueError("block_table (a paged key/value cache) is not supported by distattn, which computes "
                         "attention for training; pass block_table=None")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.dim() != 3:
            raise ValueError(f"{name} must have 3 dims (total_tokens, heads, head_dim) for the varlen function, got "
                             f"shape {tuple(t.shape)}; use flash_attn_func for (batch, seq, heads, head_dim)")
    q4, k4, v4 = (t.unsqueeze(0) if isinstance(t, torch.Tensor) else t for t in (q, k, v))
    check_qkv(q4, k4, v4, allow_empty=True)
    cu_q = check_cu_seqlens(cu_seqlens_q, q.shape[0], "cu_seqlens_q", q.device)
    cu_k = check_cu_seqlens(cu_seqlens_k, k.shape[0], "cu_seqlens_k", k.device)
    if len(cu_q) != len(cu_k):
        raise ValueError(f"cu_seqlens_q has {len(cu_q) - 1} documents but cu_seqlens_k has {len(cu_k) - 1}; both "
                         f"must describe the same batch of documents")
    for name, given, lens in (("max_seqlen_q", max_seqlen_q, cu_q), ("max_seqlen_k", max_seqlen_k, cu_k)):
        longest = max(b - a for a, b in zip(lens, lens[1:]))
        if isinstance(given, bool) or not isinstance(given, numbers.Integral) or given < longest:
            raise ValueError(f"{name} ({given!r}) must be an int >= the longest document ({longest})")
    causal, window, softcap = check_causal(causal), check_window(window_size), check_softcap(softcap)
    be = kernels.check_backend(backend, q.device)  # a name: the op builds the backend when it runs
    bounds = kernels.varlen_bounds(cu_seqlens_q, cu_seqlens_k, (0, q.shape[0]), causal=causal, window=window)
    out, lse = attention_with_bounds(q4, k4, v4, bounds, scale=resolve_scale(softmax_scale, q.shape[-1]),
                                     softcap=softcap, backend=be)
    return _returns(out[0], lse[0], return_attn_probs, return_lse)


# -- across ranks -----------------------------------------------------------------------------------------
def dist_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                         softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                         group=None, schedule="balanced", backend=None, return_lse=False, overlap=True, timeout=None,
                         partials="fp32"):
    """Exact attention over a sequence split across the ranks of ``group``; differentiable.

    flash-attn's arguments, for this rank's shards: rank ``r`` of ``P`` holds tokens ``[r*n, (r+1)*n)`` of q, k
    and v, or with ``schedule="zigzag"`` chunks ``r`` and ``2P-1-r`` of ``2P`` (``distattn.shard_sequence(x,
    schedule=...)`` makes either). The causal mask is on global positions.

    Args:
        q: ``(b, n, h_q, d)``, this rank's shard.
        k, v: ``(b, n, h_kv, d)``, this rank's shards; ``h_q % h_kv == 0``.
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs:
            as in :func:`flash_attn_func`.
        group: (distattn) the sequence-parallel process group (``None``: the default group); or two groups for
            two-dimensional sequence parallelism, ``(ulysses_group, ring_group)`` or a 2-D ``DeviceMesh`` named
            ``("ring", "ulysses")`` (``distattn.make_2d_groups``): heads are split over the Ulysses group by an
            all-to-all and the sequence runs around the ring (``distattn.ulysses``).
        schedule: (distattn) ``"balanced"`` (DistFlashAttn load balancing: ``1 + P//2`` steps causal), ``"zigzag"``
            (balanced by layout: only k/v travel, the choice for GQA; inputs sharded with
            ``shard_sequence(x, schedule="zigzag")``), ``"placed"`` (packed documents, the varlen call: inputs
            sharded with ``shard_sequence(x, layout=distattn.sharding.placement(cu_seqlens, n, group,
            window=window_size))``, the placement balanced for the window; the call runs on the placement its
            documents were placed for, ``distattn.sharding.placed_window``; on a 2-D group the ring level runs on
            it), ``"ring"``, or ``"auto"``: the cost model's best among the
            schedules for contiguous shards (``distattn.schedule.cost``; to let it pick the zigzag layout or a
            2-D group, choose before sharding: ``distattn.choose_schedule``).
        backend: (distattn) kernel backend, ``"triton"``/``"torch"``/``None``.
        return_lse: (distattn) also return this rank's ``lse (b, h_q, n)`` fp32.
        overlap: (distattn) prefetch the next step's chunks (a placed plan's: up to 12 steps ahead, ``Plan.prefetch``)
            while computing (``False`` only for ablations).
        timeout: (distattn) seconds any one wait inside the call (and inside its backward) may take, > 0;
            ``None``: the ``DISTATTN_TIMEOUT`` environment variable, else 300.
        partials: (distattn) dtype of the partial results sent back between ranks (helper outputs, dq/dk/dv
            partials): ``"fp32"`` (default) or ``"input"`` (q's dtype, half the bytes; accumulation stays fp32;
            ``bench/results/partials-cpu`` has the error at P = 2..8).

    Returns:
        This rank's ``out (b, n, h_q, d)`` in the input dtype; or the tuples of :func:`flash_attn_func`.

    Raises:
        ValueError: the ranks of ``group`` disagree on the call (shard shapes, dtype, device type, causal,
            window, softcap, schedule, overlap, scale, backend, forward vs backward, call count). Checked on
            every call, forward and backward, before any transfer, with one all-reduce of a 63-bit hash (well
            under 1% of a call, ``bench/agreement.py``); every rank raises the same message listing each rank's
            values. ``DISTATTN_CHECK=0`` turns the check off (then a disagreement is undefined behaviour:
            a crash, a hang until the timeout, or wrong numbers).
        distattn.DistAttnError: another rank failed or stopped responding: no message within ``timeout``,
            or a peer that raised inside its call aborted the library's communicators (then this rank fails
            within milliseconds on gloo). The message names this rank, the phase, the step and the peers
            waited for. A rank whose call raises (any exception) aborts them itself and re-raises its own
            error. The next call on every rank rebuilds the communicators, so a training loop that catches
            the error and skips the batch on every rank goes on.

    Communication never uses ``group`` itself: distattn creates its own groups with the same ranks at the
    first call (``dist.new_group``, a collective, so every rank of ``group`` must make that first call) and
    rebuilds them after a failure; user collectives on ``group`` can never interleave with attention traffic.

    Gradients: ``out.backward(...)`` gives this rank's ``q, k, v`` the gradient of the *whole* sequence's loss
    with respect to this rank's shards, provided every rank runs the backward (each rank's loss term
    reaches the others' keys and values through the exchange). Parameters upstream of q/k/v get only this
    rank's share: sum them over the group before an optimizer step (``distattn.reduce_gradients``). DDP and
    FSDP *average* over their ranks, which gives ``1/P`` of the gradient: register
    ``distattn.register_ddp_gradient_hook`` / ``distattn.set_fsdp_gradient_divide_factor`` on the wrapped model
    (``distattn.gradients``; they also average over data-parallel replicas).
    """
    def validate():
        check_unsupported(dropout_p, alibi_slopes, deterministic)
        return make_config(q, k, v, causal=check_causal(causal), softmax_scale=softmax_scale,
                           window=check_window(window_size), softcap=check_softcap(softcap), group=group,
                           schedule=schedule, backend=backend, overlap=overlap, timeout=timeout, partials=partials)

    cfg = validated_everywhere(validate, group, timeout, q)
    out, lse = dist_attention(q, k, v, cfg)
    return _returns(out, lse, return_attn_probs, return_lse)


def dist_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                return_attn_probs=False, *, group=None, schedule="balanced", backend=None,
                                return_lse=False, overlap=True, timeout=None, partials="fp32"):
    """Exact attention over a stream of packed documents split across the ranks of ``group``; differentiable.

    The padding-free layout of long-context training: the documents of a batch are concatenated into one
    stream of ``T`` tokens, and rank ``r`` of ``P`` holds tokens ``[r*n, (r+1)*n)`` of it (``T = P*n``). Documents
    may have any length (1 included) and straddle any number of rank boundaries. A query sees only keys of its
    own document (causal and window on positions within the stream, which are the document's positions
    shifted). If the documents fill fewer than ``P*n`` tokens (pad the stream's tail to a multiple of ``P``; one
    short document inside rank 0's shard is fine), the tail is one extra document of its own: no real token sees
    it; ignore its outputs (labels -100).

    The plan is built from ``cu_seqlens`` on every rank alike, without communication: (query chunk, kv chunk)
    pairs that share no visible (query, key) pair are never computed nor communicated, and the balanced
    schedule assigns the remaining pairs by their work (``distattn.schedule``; ``python -m distattn.schedule
    --docs ...`` simulates a length distribution).

    Args:
        q: ``(n, h_q, d)``, this rank's tokens of the packed stream.
        k, v: ``(n, h_kv, d)``; ``h_q % h_kv == 0``.
        cu_seqlens: ``(documents + 1,)`` int32/int64 cumulative lengths over the WHOLE stream (the same tensor on
            every rank), starting at 0, ending at ``<= P*n``. Per-rank LOCAL ``cu_seqlens`` (ring-flash-attention's
            convention) end exactly at ``n``: with ``P > 1`` that end raises a ``ValueError`` with the fix (append
            ``P*n`` if the stream really ends there), unless padding ``n`` tokens to a multiple of ``2P`` reaches
            ``P*n`` (``shard_batch``'s padding); any other end short of ``P*n`` is padded at its tail.
        max_seqlen: the longest document (as flash-attn; checked, not otherwise needed).
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs:
            as in :func:`flash_attn_func`.
        group, schedule, backend, return_lse, overlap, timeout, partials: as in :func:`dist_flash_attn_func`;
            ``lse`` is ``(h_q, n)``.

    Returns:
        This rank's ``out (n, h_q, d)``; or ``(out, lse)`` / ``(out, lse, None)``.
    """
    q4, k4, v4 = (t.unsqueeze(0) if isinstance(t, torch.Tensor) and t.dim() == 3 else t for t in (q, k, v))

    def validate():
        check_unsupported(dropout_p, alibi_slopes, deterministic)
        for name, t in (("q", q), ("k", k), ("v", v)):
            if isinstance(t, torch.Tensor) and t.dim() != 3:
                raise ValueError(f"{name} must have 3 dims (tokens of this rank, heads, head_dim) for the varlen "
                                 f"function, got shape {tuple(t.shape)}; use dist_flash_attn_func for 4-D tensors")
        return _varlen_config(q4, k4, v4, cu_seqlens, max_seqlen, causal=causal, softmax_scale=softmax_scale,
                              window_size=window_size, softcap=softcap, group=group, schedule=schedule,
                              backend=backend, overlap=overlap, timeout=timeout, partials=partials)

    cfg = validated_everywhere(validate, group, timeout, q)
    out, lse = dist_attention(q4, k4, v4, cfg)
    return _returns(out[0], lse[0], return_attn_probs, return_lse)


def dist_attn_with_documents(q, k, v, documents, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, group=None, schedule="balanced", backend=None, overlap=True, timeout=None,
                             partials="fp32", return_lse=False):
    """:func:`dist_flash_attn_func` whose packed documents are a tensor read only when the op runs, so that a
    traced caller (``torch.compile``) keeps one graph for every set of document boundaries (the Hugging Face
    integration's path; ``distattn._ops.padded_documents`` makes the tensor).

    Args:
        q, k, v: ``(b, n, h, d)`` shards, as :func:`dist_flash_attn_func`; ``b = 1`` when there are documents.
        documents: ``(P*n + 1,)`` int64: the whole stream's cumulative document lengths, padded at the end by
            repeating ``P*n``; one document over the stream is plain attention (``causal`` as given).
        The rest: as :func:`dist_flash_attn_func`. ``schedule="auto"`` reads the documents in eager mode; traced,
            it resolves from the shapes alone (their values are not known yet).

    Returns:
        This rank's ``out (b, n, h_q, d)``; ``(out, lse (b, h_q, n))`` with ``return_lse``.
    """
    def validate():
        if not isinstance(documents, torch.Tensor) or documents.dtype != torch.int64 or documents.dim() != 1:
            raise TypeError(f"documents must be a 1-D int64 tensor (distattn._ops.padded_documents), got "
                            f"{getattr(documents, 'dtype', type(documents).__name__)}")
        traced = torch.compiler.is_compiling()  # values unknown until the op runs
        known = documents_of(documents, len(documents) - 1) if schedule == "auto" and not traced else None
        return make_config(q, k, v, causal=check_causal(causal), softmax_scale=softmax_scale,
                           window=check_window(window_size), softcap=check_softcap(softcap), group=group,
                           schedule=schedule, backend=backend, overlap=overlap, timeout=timeout, partials=partials,
                           documents=known)

    cfg = validated_everywhere(validate, group, timeout, q)
    out, lse = dist_attention(q, k, v, cfg, documents)
    return (out, lse) if return_lse else out


def _varlen_config(q4, k4, v4, cu_seqlens, max_seqlen, *, causal, softmax_scale, window_size, softcap, group,
                   schedule, backend, overlap, timeout, partials) -> DistAttnConfig:
    """``make_config`` for a packed stream, with ``cu_seqlens`` and ``max_seqlen`` checked."""
    # cu_seqlens first: schedule="auto" reads it in make_config (its cost model builds the masked plans)
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor of int32 or int64, got {type(cu_seqlens).__name__}")
    cu = tuple(check_cu_seqlens(cu_seqlens, None, "cu_seqlens", cu_seqlens.device))
    cfg = make_config(q4, k4, v4, causal=check_causal(causal), softmax_scale=softmax_scale,
                      window=check_window(window_size), softcap=check_softcap(softcap), group=group,
                      schedule=schedule, backend=backend, overlap=overlap, timeout=timeout, partials=partials,
                      documents=cu)
    longest = max(b - a for a, b in zip(cu, cu[1:]))
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, numbers.Integral) or max_seqlen < longest:
        raise ValueError(f"max_seqlen ({max_seqlen!r}) must be an int >= the longest document ({longest})")
    return dataclasses.replace(cfg, cu_seqlens=cu)


def validated_everywhere(validate, group, timeout, like):
    """``validate()`` (this rank's checks, which return the call's config); if they raise ``ValueError`` or
    ``TypeError``, this rank still joins the call's agreement (``reject_call``), so every rank of the group raises
    the same error naming this rank and its reason, and call numbers stay aligned (a rank that skipped the
    agreement alone would pair its next batch with its peers' current one). Errors that leave no group to agree
    on (no process group, not a member) are raised here only."""
    check_group(group)
    try:
        return validate()
    except (ValueError, TypeError) as exc:
        try:
            wait = check_timeout(timeout)
        except (ValueError, TypeError):
            wait = DEFAULT_TIMEOUT_S
        device = like.device if isinstance(like, torch.Tensor) and like.is_cuda else None
        reject_call(group, "forward", exc, wait, device)


def check_timeout(timeout) -> float:
    """``timeout`` in seconds (a finite number > 0), or ``None`` for ``DISTATTN_TIMEOUT`` / 300 s."""
    if timeout is None:
        return default_timeout()
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout must be a number of seconds or None (DISTATTN_TIMEOUT, else 300), got "
                        f"{timeout!r}")
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout}; a wait without a bound "
                         f"is what the timeout prevents (use a large value, e.g. 3600, for very slow steps)")
    return float(timeout)


def make_config(q, k, v, *, causal, softmax_scale, window, softcap, group, schedule, backend, overlap,
                timeout=None, partials="fp32", documents=None):
    """Validate this rank's shards and options; the frozen ``DistAttnConfig``. Raises before any communication.

    ``documents``: the call's ``cu_seqlens`` (varlen) as validated ints, checked against the stream's length here,
    before ``schedule="auto"``'s cost model reads them."""
    check_group(group)
    ring_group = split_group(group)[1]
    check_qkv(q, k, v, same_seq=True)
    if q.is_cuda and q.device.index != torch.cuda.current_device():
        raise ValueError(f"q is on {q.device} but the current CUDA device is cuda:{torch.cuda.current_device()}; "
                         f"call torch.cuda.set_device({q.device.index}) on this rank (NCCL hangs otherwise)")
    group_backend = backend_name(ring_group)  # a constant to torch.compile (comm.backend_name)
    if "nccl" in group_backend and not q.is_cuda and "gloo" not in group_backend:
        raise ValueError(f"the process group's backend is {group_backend!r}, which cannot send tensors on "
                         f"{q.device}; move q, k, v to this rank's CUDA device or use a gloo group")
    kernels.check_backend(backend, q.device)  # unknown/unavailable backend: same error on every rank
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be a bool, got {overlap!r}")
    if partials not in PARTIALS:
        raise ValueError(f"partials={partials!r} is not one of {PARTIALS}: 'fp32' (default) sends partial results "
                         f"in fp32, 'input' in the inputs' dtype (half the bytes)")
    topo = topology(group)
    total = q.shape[1] * topo.world_size
    if documents is not None and documents[-1] > total:
        raise ValueError(f"cu_seqlens[-1] = {documents[-1]} is more than the stream holds ({total} = "
                         f"{topo.world_size} ranks x {q.shape[1]} tokens); every rank must pass its n = T / P tokens "
                         f"and the global cu_seqlens")
    if documents is not None:
        check_global_documents(documents, q.shape[1], topo.world_size)
    if topo.two_d:
        ulysses_heads(q.shape[2], k.shape[2], topo.U)  # heads that cannot be split raise here, on every rank
    if schedule == "auto":
        schedule = resolve_auto(q, k, topo, causal=causal, window=window, documents=documents, partials=partials)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {SCHEDULES + ('auto',)}; use schedule='balanced'")
    # placed takes any n: its layout is solved by the ring's plan from the documents (R ring ranks of U * n tokens)
    lay = layout_of("balanced" if schedule == "placed" else schedule, topo.R, topo.U)
    if q.shape[1] % lay.divisor():
        raise ValueError(f"schedule='zigzag' splits every rank's shard into 2 chunks, so tokens per rank "
                         f"({q.shape[1]}) must be even: pad the sequence to a multiple of {2 * topo.world_size} "
                         f"and shard it with shard_sequence(x, schedule='zigzag')")
    placed_for = None  # placed: the window its shards were placed for (distattn.sharding records it)
    if schedule == "placed" and documents is not None:
        placed_for = placed_window(documents, topo.R, topo.U * q.shape[1], window)
    return DistAttnConfig(causal=causal, scale=resolve_scale(softmax_scale, q.shape[-1]), window=window,
                          softcap=softcap, schedule=schedule, backend=backend, group=group, overlap=overlap,
                          timeout=check_timeout(timeout), partials=partials, placement_window=placed_for)


def check_group(group) -> None:
    """An initialized process group of which this process is a member (else no call can be agreed on)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("dist_flash_attn_func needs an initialized process group: call "
                           "torch.distributed.init_process_group(...) first, or use flash_attn_func on one device")
    ulysses_group, ring_group = split_group(group)
    for g in (ulysses_group, ring_group):
        if (g is not None or ulysses_group is None) and dist.get_rank(g) < 0:
            raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the group passed as "
                             f"group=; call dist_flash_attn_func only on the ranks of that group (the group's ranks: "
                             f"torch.distributed.get_process_group_ranks(group))")
