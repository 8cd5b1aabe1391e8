"""ring-flash-attention's functions on distattn (the package doc, ``distattn.compat.ring_flash_attn``, has the
layouts, every argument's treatment and the coverage table).

Legend: ``b`` batch, ``n`` this rank's tokens, ``h``/``h_kv`` heads, ``d`` head dim, ``P`` ranks.
"""

from __future__ import annotations

import json
import numbers

import torch
import torch.distributed as dist

from distattn._ops import group_key, group_of, padded_documents
from distattn.api import (check_causal, check_cu_seqlens, check_softcap, check_timeout, check_unsupported,
                          check_window, dist_attn_with_documents, dist_flash_attn_func, dist_flash_attn_varlen_func,
                          validated_everywhere)
from distattn.compat._llama3 import global_cu, prepare
from distattn.compat._relayout import TokenLayout, agree_on_move, gather_call_texts, relayout, relayout_many
from distattn.topology import is_2d

__all__ = [
    "ring_flash_attn_func", "ring_flash_attn_qkvpacked_func", "ring_flash_attn_kvpacked_func",
    "ring_flash_attn_varlen_func", "ring_flash_attn_varlen_qkvpacked_func", "ring_flash_attn_varlen_kvpacked_func",
    "zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_qkvpacked_func", "zigzag_ring_flash_attn_kvpacked_func",
    "zigzag_ring_flash_attn_varlen_func", "zigzag_ring_flash_attn_varlen_qkvpacked_func",
    "zigzag_ring_flash_attn_varlen_kvpacked_func",
    "stripe_flash_attn_func", "stripe_flash_attn_qkvpacked_func", "stripe_flash_attn_kvpacked_func",
    "llama3_flash_attn_varlen_func", "llama3_flash_attn_varlen_qkvpacked_func",
    "llama3_flash_attn_varlen_kvpacked_func", "llama3_flash_attn_prepare_cu_seqlens",
]


# -- shared checks ------------------------------------------------------------------------------------------
def _flat(group):
    if is_2d(group):
        raise TypeError("distattn.compat.ring_flash_attn takes one flat process group (or None), as "
                        "ring-flash-attention; for a two-dimensional (Ulysses x ring) group call "
                        "distattn.dist_flash_attn_func directly")
    return group


def _check_options(dropout_p, alibi_slopes, deterministic, causal, window_size, softcap) -> None:
    check_unsupported(dropout_p, alibi_slopes, deterministic)
    check_causal(causal)
    check_window(window_size)
    check_softcap(softcap)


def _check_tokens(q, k, v, ndim: int, seq_dim: int) -> None:
    """What moving q, k, v in one exchange needs: tensors of ``ndim`` dims, one dtype and device, equal token counts
    along ``seq_dim`` (the remaining shape checks are distattn's own, after the move, on every rank alike)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must share one dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} on "
                         f"{q.device}/{k.device}/{v.device}")
    if not (q.shape[seq_dim] == k.shape[seq_dim] == v.shape[seq_dim]):
        raise ValueError(f"q, k, v must hold the same tokens of this rank (dim {seq_dim}), got {q.shape[seq_dim]}, "
                         f"{k.shape[seq_dim]}, {v.shape[seq_dim]}")


def check_heads_k_stride(heads_k_stride, heads_kv: int | None = None) -> int:
    """llama3's ``heads_k_stride``: an int > 0 dividing the key/value heads (unused by distattn beyond this: it
    bounds llama3's all-gather buffer, and distattn never gathers k/v)."""
    if isinstance(heads_k_stride, bool) or not isinstance(heads_k_stride, numbers.Integral) or heads_k_stride < 1:
        raise ValueError(f"heads_k_stride must be an int >= 1, got {heads_k_stride!r}")
    if heads_kv is not None and heads_kv % heads_k_stride:
        raise ValueError(f"heads_k_stride ({heads_k_stride}) must divide the key/value heads ({heads_kv}), as in "
                         f"ring-flash-attention; distattn does not use it (k/v are never all-gathered), so 1 is fine")
    return int(heads_k_stride)


def _check_max(name: str, given, cu: list[int]) -> int:
    longest = max((b - a for a, b in zip(cu, cu[1:])), default=0)
    if isinstance(given, bool) or not isinstance(given, numbers.Integral) or given < longest:
        raise ValueError(f"{name} ({given!r}) must be an int >= the longest document of this rank ({longest})")
    return longest


def _returns(out, lse, return_attn_probs: bool):
    return (out, lse, None) if return_attn_probs else out


def _distattn_kw(dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, group, softcap,
                 backend, timeout) -> dict:
    return dict(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic, group=_flat(group),
                backend=backend, timeout=timeout)


def _on_contiguous(q, k, v, src: TokenLayout, seq_dim: int, lse_dim: int, run, group, wait, return_attn_probs,
                   what: str):
    """Move q, k, v from ``src`` to the contiguous layout, ``run`` there (-> out, lse), move the results back."""
    dst = TokenLayout("contiguous", src.world, src.n)
    agree_on_move({"q": q, "k": k, "v": v}, src, dst, group, wait, what)
    qc, kc, vc = relayout_many((q, k, v), src, dst, group, wait, dim=seq_dim)
    out, lse = run(qc, kc, vc)
    out = relayout(out, dst, src, group, wait, dim=seq_dim)
    if not return_attn_probs:
        return out
    return out, relayout(lse, dst, src, group, wait, dim=lse_dim), None


# -- contiguous and zigzag: distattn's own layouts ----------------------------------------------------------
def ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                         alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *, softcap=0.0,
                         backend=None, timeout=None):
    """ring-flash-attention's ``ring_flash_attn_func``: rank r holds tokens ``[r*n, (r+1)*n)``.

    Args:
        q: ``(b, n, h, d)``; k, v: ``(b, n, h_kv, d)``, ``h % h_kv == 0``.
        the rest: as in the module doc; ``softcap``, ``backend``, ``timeout``: distattn's.

    Returns:
        ``out (b, n, h, d)``; ``(out, lse (b, h, n), None)`` with ``return_attn_probs``.
    """
    kw = _distattn_kw(dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, group, softcap,
                      backend, timeout)
    return dist_flash_attn_func(q, k, v, schedule="balanced", return_attn_probs=return_attn_probs, **kw)


def ring_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                   alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None,
                                   **extras):
    """``qkv (b, n, 3, h, d)``; see :func:`ring_flash_attn_func`."""
    return ring_flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                                window_size, alibi_slopes, deterministic, return_attn_probs, group, **extras)


def ring_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                  alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None,
                                  **extras):
    """``kv (b, n, 2, h_kv, d)``; see :func:`ring_flash_attn_func`."""
    return ring_flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size,
                                alibi_slopes, deterministic, return_attn_probs, group, **extras)


def zigzag_ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                                softcap=0.0, backend=None, timeout=None):
    """ring-flash-attention's ``zigzag_ring_flash_attn_func``: rank r holds chunks r and 2P-1-r of 2P (``n`` even),
    distattn's zigzag layout (``distattn.shard_sequence(x, schedule="zigzag")`` makes it). Shapes and returns as
    :func:`ring_flash_attn_func`."""
    kw = _distattn_kw(dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, group, softcap,
                      backend, timeout)
    return dist_flash_attn_func(q, k, v, schedule="zigzag", return_attn_probs=return_attn_probs, **kw)


def zigzag_ring_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                          alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None,
                                          **extras):
    """``qkv (b, n, 3, h, d)``; see :func:`zigzag_ring_flash_attn_func`."""
    return zigzag_ring_flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                                       window_size, alibi_slopes, deterministic, return_attn_probs, group, **extras)


def zigzag_ring_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                         alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None,
                                         **extras):
    """``kv (b, n, 2, h_kv, d)``; see :func:`zigzag_ring_flash_attn_func`."""
    return zigzag_ring_flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size,
                                       alibi_slopes, deterministic, return_attn_probs, group, **extras)


# -- stripe: moved to the contiguous layout -----------------------------------------------------------------
def stripe_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                           softcap=0.0, backend=None, timeout=None):
    """ring-flash-attention's ``stripe_flash_attn_func``: token ``i`` of the sequence on rank ``i % P`` (rank r
    holds ``r, r+P, r+2P, ...``). Moved to the contiguous layout and back (module doc, (*)). Shapes and returns
    as :func:`ring_flash_attn_func`."""
    kw = _distattn_kw(dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, group, softcap,
                      backend, timeout)

    def validate():
        _check_options(dropout_p, alibi_slopes, deterministic, causal, window_size, softcap)
        _check_tokens(q, k, v, 4, 1)
        return check_timeout(timeout)

    wait = validated_everywhere(validate, kw["group"], timeout, q)
    src = TokenLayout("stripe", dist.get_world_size(kw["group"]), q.shape[1])
    run = lambda qc, kc, vc: dist_flash_attn_func(qc, kc, vc, schedule="balanced", return_lse=True, **kw)  # noqa: E731
    return _on_contiguous(q, k, v, src, 1, 2, run, kw["group"], wait, return_attn_probs, "stripe_flash_attn_func")


def stripe_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                     alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None,
                                     **extras):
    """``qkv (b, n, 3, h, d)``; see :func:`stripe_flash_attn_func`."""
    return stripe_flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                                  window_size, alibi_slopes, deterministic, return_attn_probs, group, **extras)


def stripe_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None,
                                    **extras):
    """``kv (b, n, 2, h_kv, d)``; see :func:`stripe_flash_attn_func`."""
    return stripe_flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size,
                                  alibi_slopes, deterministic, return_attn_probs, group, **extras)


# -- varlen with every document split per rank: moved to the contiguous layout ------------------------------
def _varlen_chunked(q, k, v, cu_seqlens, max_seqlen, pieces: int, return_attn_probs, kw, timeout, what: str):
    """Each rank holds ``pieces`` (1: ring, 2: zigzag) equal chunks of every document; ``cu_seqlens`` is local."""
    def validate():
        _check_options(kw["dropout_p"], kw["alibi_slopes"], kw["deterministic"], kw["causal"], kw["window_size"],
                       kw["softcap"])
        _check_tokens(q, k, v, 3, 0)
        cu = check_cu_seqlens(cu_seqlens, q.shape[0], "cu_seqlens", q.device)
        odd = next(((i, b - a) for i, (a, b) in enumerate(zip(cu, cu[1:])) if (b - a) % pieces), None)
        if odd is not None:
            raise ValueError(f"{what}: document {odd[0]} has {odd[1]} tokens on this rank, but the zigzag layout "
                             f"gives every rank two equal chunks of every document (an even local length); pad "
                             f"each document to a multiple of 2 x world_size tokens before splitting")
        return tuple(cu), _check_max("max_seqlen", max_seqlen, cu), check_timeout(timeout)

    cu, longest, wait = validated_everywhere(validate, kw["group"], timeout, q)
    world = dist.get_world_size(kw["group"])
    global_cu = tuple(world * c for c in cu)  # every document is world x its local length
    src = TokenLayout("doc_chunks", world, q.shape[0], cu=global_cu, chunks=world * pieces)
    cu_t = torch.tensor(global_cu, dtype=cu_seqlens.dtype, device=cu_seqlens.device)

    def run(qc, kc, vc):
        return dist_flash_attn_varlen_func(qc, kc, vc, cu_t, world * longest, return_lse=True, schedule="balanced",
                                           **kw)

    return _on_contiguous(q, k, v, src, 0, 1, run, kw["group"], wait, return_attn_probs, what)


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                window_size=(-1, -1), alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                group=None, *, softcap=0.0, backend=None, timeout=None):
    """ring-flash-attention's ``ring_flash_attn_varlen_func``: every document is cut into ``P`` equal chunks and
    rank r holds chunk r of each, concatenated; ``cu_seqlens``/``max_seqlen`` are this rank's (the global ones
    divided by ``P``; every document's length a multiple of ``P``). Moved to the contiguous layout and back
    (module doc, (*)).

    Args:
        q: ``(n, h, d)``; k, v: ``(n, h_kv, d)``; cu_seqlens: ``(docs + 1,)`` int32/int64 local cumulative lengths.

    Returns:
        ``out (n, h, d)``; ``(out, lse (h, n), None)`` with ``return_attn_probs``.
    """
    kw = _distattn_kw(dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, group, softcap,
                      backend, timeout)
    return _varlen_chunked(q, k, v, cu_seqlens, max_seqlen, 1, return_attn_probs, kw, timeout,
                           "ring_flash_attn_varlen_func")


def ring_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                          causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                          return_attn_probs=False, group=None, **extras):
    """``qkv (n, 3, h, d)``; see :func:`ring_flash_attn_varlen_func`."""
    return ring_flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, max_seqlen, dropout_p,
                                       softmax_scale, causal, window_size, alibi_slopes, deterministic,
                                       return_attn_probs, group, **extras)


def ring_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                         causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                         return_attn_probs=False, group=None, **extras):
    """``kv (n, 2, h_kv, d)``; see :func:`ring_flash_attn_varlen_func`."""
    return ring_flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens, max_seqlen, dropout_p, softmax_scale,
                                       causal, window_size, alibi_slopes, deterministic, return_attn_probs, group,
                                       **extras)


def zigzag_ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                       causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                       return_attn_probs=False, group=None, *, softcap=0.0, backend=None,
                                       timeout=None):
    """ring-flash-attention's ``zigzag_ring_flash_attn_varlen_func``: every document is cut into ``2P`` equal chunks
    and rank r holds chunks r and 2P-1-r of each; ``cu_seqlens``/``max_seqlen`` local (global / P; every document a
    multiple of 2P). Moved to the contiguous layout and back (module doc, (*)). Shapes and returns as
    :func:`ring_flash_attn_varlen_func`."""
    kw = _distattn_kw(dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, group, softcap,
                      backend, timeout)
    return _varlen_chunked(q, k, v, cu_seqlens, max_seqlen, 2, return_attn_probs, kw, timeout,
                           "zigzag_ring_flash_attn_varlen_func")


def zigzag_ring_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                                 causal=False, window_size=(-1, -1), alibi_slopes=None,
                                                 deterministic=False, return_attn_probs=False, group=None, **extras):
    """``qkv (n, 3, h, d)``; see :func:`zigzag_ring_flash_attn_varlen_func`."""
    return zigzag_ring_flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, max_seqlen, dropout_p,
                                              softmax_scale, causal, window_size, alibi_slopes, deterministic,
                                              return_attn_probs, group, **extras)


def zigzag_ring_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                                causal=False, window_size=(-1, -1), alibi_slopes=None,
                                                deterministic=False, return_attn_probs=False, group=None, **extras):
    """``kv (n, 2, h_kv, d)``; see :func:`zigzag_ring_flash_attn_varlen_func`."""
    return zigzag_ring_flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens, max_seqlen, dropout_p,
                                              softmax_scale, causal, window_size, alibi_slopes, deterministic,
                                              return_attn_probs, group, **extras)


# -- llama3: contiguous shards, local cu_seqlens --------------------------------------------------------------
def llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal, rank, world_size):
    """ring-flash-attention's helper: rank ``rank``'s llama3 arguments from the global ``cu_seqlens``.

    Rank r holds tokens ``[r*n, (r+1)*n)`` of the ``T = cu_seqlens[-1]`` (a multiple of ``world_size``). Its
    queries belong to the documents overlapping that range; ``cu_seqlens_q`` cuts the range at their boundaries,
    and ``cu_seqlens_k`` cuts ``local_k_slice``, the keys they need (from the first such document's start to the
    rank's last token, causal; to the last document's end otherwise), on the same boundaries.

    Returns:
        ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice)``: two tensors of
        ``cu_seqlens``' dtype and device, two ints, a ``slice`` of global token positions.
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor of int32 or int64, got {type(cu_seqlens).__name__}")
    cu = check_cu_seqlens(cu_seqlens, None, "cu_seqlens", cu_seqlens.device)
    causal = check_causal(causal)
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank ({rank}) must be in [0, world_size) = [0, {world_size})")
    if cu[-1] % world_size:
        raise ValueError(f"cu_seqlens[-1] = {cu[-1]} tokens cannot be split evenly over {world_size} ranks; pad the "
                         f"stream (e.g. the last document) to a multiple of {world_size}")
    cu_q, cu_k, max_q, max_k, (start, stop) = prepare(cu, causal, rank, world_size)
    as_tensor = lambda c: torch.tensor(c, dtype=cu_seqlens.dtype, device=cu_seqlens.device)  # noqa: E731
    return as_tensor(cu_q), as_tensor(cu_k), max_q, max_k, slice(start, stop)


def llama3_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride,
                                  local_k_slice, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                  alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                                  softcap=0.0, backend=None, timeout=None):
    """ring-flash-attention's ``llama3_flash_attn_varlen_func``: contiguous shards of a packed stream, with the
    rank's local ``cu_seqlens_q``/``cu_seqlens_k``/``local_k_slice`` from
    :func:`llama3_flash_attn_prepare_cu_seqlens`. The global ``cu_seqlens`` is rebuilt (module doc, (**)), so
    documents may have any length.

    Args:
        q: ``(n, h, d)``; k, v: ``(n, h_kv, d)`` (this rank's tokens).
        heads_k_stride: validated (> 0, divides ``h_kv``), otherwise unused.

    Returns:
        ``out (n, h, d)``; ``(out, lse (h, n), None)`` with ``return_attn_probs``.
    """
    kw = _distattn_kw(dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, group, softcap,
                      backend, timeout)
    if torch.compiler.is_compiling():
        # Traced: the local views are data, read when the graph runs. One opaque op validates them, gathers every
        # rank's and returns the global documents as a tensor (no data-dependent guard, no collective traced);
        # the attention op reads it when it runs, so new document boundaries compile nothing.
        _check_options(dropout_p, alibi_slopes, deterministic, causal, window_size, softcap)  # static: constants
        span = (local_k_slice.start, local_k_slice.stop) if isinstance(local_k_slice, slice) else (None, None)
        documents = _llama3_documents(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride,
                                      span[0], span[1], bool(causal), group_key(kw["group"]), timeout)
        out, lse = dist_attn_with_documents(q[None], k[None], v[None], documents, softmax_scale=softmax_scale,
                                            causal=causal, window_size=window_size, softcap=softcap, group=kw["group"],
                                            schedule="balanced", backend=backend, timeout=timeout, return_lse=True)
        return _returns(out[0], lse[0], return_attn_probs)
    cu = _llama3_global_cu(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride,
                           local_k_slice, causal, kw["group"], timeout,
                           lambda: _check_options(dropout_p, alibi_slopes, deterministic, causal, window_size, softcap))
    cu_t = torch.tensor(cu, dtype=cu_seqlens_q.dtype, device=cu_seqlens_q.device)
    longest = max(b - a for a, b in zip(cu, cu[1:]))
    out, lse = dist_flash_attn_varlen_func(q, k, v, cu_t, longest, return_lse=True, schedule="balanced", **kw)
    return _returns(out, lse, return_attn_probs)


def _llama3_global_cu(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride,
                      local_k_slice, causal, group, timeout, check_options=lambda: None) -> list[int]:
    """The global ``cu_seqlens`` of a llama3 call: this rank's arguments validated (the same error on every rank),
    every rank's gathered, the stream rebuilt and each view checked against it (module doc, (**)). Host work."""
    def validate():
        check_options()
        _check_tokens(q, k, v, 3, 0)
        check_heads_k_stride(heads_k_stride, k.shape[1])
        if not (isinstance(local_k_slice, slice) and all(isinstance(x, numbers.Integral) and not isinstance(x, bool)
                                                         for x in (local_k_slice.start, local_k_slice.stop))):
            raise TypeError(f"local_k_slice must be a slice(start, stop) of ints, as llama3_flash_attn_prepare_"
                            f"cu_seqlens returns it, got {local_k_slice!r}")
        span = [int(local_k_slice.start), int(local_k_slice.stop)]
        cu_q = check_cu_seqlens(cu_seqlens_q, q.shape[0], "cu_seqlens_q", q.device)
        cu_k = check_cu_seqlens(cu_seqlens_k, span[1] - span[0], "cu_seqlens_k", q.device)
        if len(cu_q) != len(cu_k):
            raise ValueError(f"cu_seqlens_q has {len(cu_q) - 1} documents but cu_seqlens_k has {len(cu_k) - 1}; "
                             f"both come from llama3_flash_attn_prepare_cu_seqlens for this rank")
        _check_max("max_seqlen_q", max_seqlen_q, cu_q)
        _check_max("max_seqlen_k", max_seqlen_k, cu_k)
        return json.dumps({"cu_q": cu_q, "cu_k": cu_k, "k_slice": span}), check_timeout(timeout)

    text, wait = validated_everywhere(validate, group, timeout, q)
    texts = gather_call_texts({"q": q, "k": k, "v": v}, text, group, wait, "llama3_flash_attn_varlen_func")
    return global_cu(texts, q.shape[0], causal)


@torch.library.custom_op("distattn::llama3_documents", mutates_args=())
def _llama3_documents(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, heads_k_stride: int,
                      k_start: int | None, k_stop: int | None, causal: bool, group: str,
                      timeout: float | None) -> torch.Tensor:
    """:func:`_llama3_global_cu` as an op for traced callers: the global documents as ``padded_documents``,
    ``(P*n + 1,)`` int64 on the CPU (``group``: the ``distattn._ops.group_key`` of the process group)."""
    span = slice(k_start, k_stop) if k_start is not None and k_stop is not None else None
    cu = _llama3_global_cu(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride, span,
                           causal, group_of(group), timeout)
    return padded_documents(cu, dist.get_world_size(group_of(group)) * q.shape[0])


@_llama3_documents.register_fake
def _llama3_documents_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, *options):
    world = dist.get_world_size(group_of(options[-2]))
    return torch.empty(world * q.shape[0] + 1, dtype=torch.int64, device="cpu")




def llama3_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            heads_k_stride, local_k_slice, dropout_p=0.0, softmax_scale=None,
                                            causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                            return_attn_probs=False, group=None, **extras):
    """``qkv (n, 3, h, d)``; see :func:`llama3_flash_attn_varlen_func`."""
    return llama3_flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, heads_k_stride, local_k_slice, dropout_p, softmax_scale,
                                         causal, window_size, alibi_slopes, deterministic, return_attn_probs, group,
                                         **extras)


def llama3_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                           heads_k_stride, local_k_slice, dropout_p=0.0, softmax_scale=None,
                                           causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                           return_attn_probs=False, group=None, **extras):
    """``kv (n, 2, h_kv, d)``; see :func:`llama3_flash_attn_varlen_func`."""
    return llama3_flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, heads_k_stride, local_k_slice, dropout_p, softmax_scale,
                                         causal, window_size, alibi_slopes, deterministic, return_attn_probs, group,
                                         **extras)
