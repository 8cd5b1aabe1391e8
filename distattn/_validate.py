"""Input validation at the public boundary: clear ``TypeError``/``ValueError`` before any work starts.

Every check reads only shapes, dtypes and devices, so ranks that agree on shapes raise the same error
before any communication (see ``distattn.attention``).
"""

from __future__ import annotations

import math
import numbers

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def check_qkv(q, k, v, *, same_seq: bool = False, allow_empty: bool = False) -> None:
    """Validate ``q (b, s_q, h_q, d)``, ``k, v (b, s_k, h_kv, d)``.

    Args:
        same_seq: require ``s_q == s_k`` (the sequence-parallel op, where every rank holds equal shards).
        allow_empty: accept zero tokens (a packed batch whose documents are all empty).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dims (batch, seq, heads, head_dim), got {t.dim()} dims with shape "
                f"{tuple(t.shape)}; add the missing dims (e.g. x.unsqueeze(0) for batch 1)")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}.dtype is {t.dtype}; supported dtypes are float16, bfloat16, float32 — "
                            f"cast with {name}.to(torch.bfloat16)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}; cast them "
                        f"to one dtype")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got q={q.device}, k={k.device}, v={v.device}; move "
                         f"them with .to(device)")
    if q.device.type == "meta":
        raise ValueError("q, k, v are on the meta device (shapes without data), where attention cannot be computed; "
                         "distattn runs on CUDA (triton backend) and CPU (sdpa and torch backends) tensors: move them "
                         "with .to('cuda') or .to('cpu'), or materialize a meta-initialized model first "
                         "(model.to_empty(device=...), then load or initialize its weights)")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k={tuple(k.shape)}, v={tuple(v.shape)}")
    b, s_q, h_q, d = q.shape
    if b < 1:
        raise ValueError(f"batch size must be >= 1, got q of shape {tuple(q.shape)}; skip the call for an empty "
                         f"batch (every rank of a group must then skip it)")
    if h_q < 1:
        raise ValueError(f"q must have >= 1 head, got q of shape {tuple(q.shape)} (batch, seq, heads, head_dim)")
    if k.shape[0] != b:
        raise ValueError(f"batch size of q ({b}) and k/v ({k.shape[0]}) must match")
    if k.shape[3] != d:
        raise ValueError(f"head_dim of q ({d}) and k/v ({k.shape[3]}) must match")
    if d > MAX_HEAD_DIM or d < 1:
        raise ValueError(f"head_dim ({d}) must be between 1 and {MAX_HEAD_DIM}; split heads of dim {d} into "
                         f"more heads of a smaller dim")
    h_kv = k.shape[2]
    if h_kv < 1 or h_q % h_kv != 0:
        raise ValueError(f"heads_q ({h_q}) must be a multiple of heads_kv ({h_kv}) (GQA/MQA); choose heads_kv "
                         f"among the divisors of {h_q}")
    if min(s_q, k.shape[1]) < 1 and not allow_empty:
        raise ValueError(f"sequence lengths must be >= 1, got s_q={s_q}, s_k={k.shape[1]}")
    if same_seq and s_q != k.shape[1]:
        raise ValueError(f"q holds {s_q} tokens of this rank's shard but k/v hold {k.shape[1]}; every rank "
                         f"must pass equal q/k/v shards of the sequence")


def resolve_scale(softmax_scale, head_dim: int) -> float:
    """``softmax_scale`` or the default ``head_dim ** -0.5``."""
    if softmax_scale is None:
        return head_dim ** -0.5
    if isinstance(softmax_scale, torch.Tensor) and softmax_scale.numel() == 1:
        softmax_scale = softmax_scale.item()
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a number or None (head_dim ** -0.5), got {softmax_scale!r} of "
                        f"type {type(softmax_scale).__name__}")
    scale = float(softmax_scale)
    if not (0 < scale < math.inf):  # comparisons, not math.isfinite: a traced scale may be symbolic (torch.compile)
        raise ValueError(f"softmax_scale ({softmax_scale}) must be a finite positive number, or None for "
                         f"head_dim ** -0.5")
    return scale


def check_global_documents(documents, n: int, world: int) -> None:
    """The local-``cu_seqlens`` mistake: ring-flash-attention's varlen functions take each rank's LOCAL
    ``cu_seqlens``, which end at the rank's own ``n`` tokens; distattn takes the whole stream's, the same tensor on
    every rank.

    The rule (README, ``dist_flash_attn_varlen_func``): with ``P > 1`` ranks, ``cu_seqlens`` ending exactly at
    ``n`` is refused; a stream ending anywhere else before ``P*n`` is a short stream, padded at its tail (the tail
    is a document of its own that nothing sees), even one ending inside rank 0's shard. What can be told apart:
    the agreement before any transfer already refuses ``cu_seqlens`` that differ between ranks (local ones of
    ranks holding different documents), so what reaches here is the same tensor everywhere, and local ones are
    then ranks whose shards look alike: they end exactly at ``n`` (a rank's local documents cover its tokens).
    A whole stream ending exactly at ``n`` is legitimate only when ``shard_batch``'s padding explains it (to a
    multiple of ``P``, ``2P`` for zigzag: a stream of ``n`` tokens padded to ``P*n``); those never raise.

    Raise, not warn: a warning on every rank at every step is easy to miss while the model trains on wrong
    attention, and the rare legitimate call (a stream of exactly ``n`` tokens padded far beyond what the layout
    needs) has an equivalent spelling that passes: the padding as an explicit last document (``P*n`` appended to
    ``cu_seqlens``). Decided from ``cu_seqlens``, ``n`` and ``P`` alone, inside the call's agreement, so a rank that
    raises makes every rank raise."""
    end = documents[-1]
    if world > 1 and end == n and -(-end // (2 * world)) * (2 * world) < world * n:
        raise ValueError(f"cu_seqlens ends at {end}, exactly at the end of rank 0's shard ({n} tokens per rank), but "
                         f"the {world} ranks hold a stream of {world * n} tokens: ranks 1..{world - 1} would hold only "
                         f"padding. These look like per-rank LOCAL cu_seqlens (ring-flash-attention's convention: each "
                         f"ends at its rank's own {n} tokens); dist_flash_attn_varlen_func wants the cu_seqlens of the "
                         f"WHOLE stream, the same tensor on every rank (ring-flash-attention's calls translate with "
                         f"distattn.compat.ring_flash_attn). If the stream really ends at token {n}, append "
                         f"{world * n} to cu_seqlens (the padding as an explicit last document); a stream ending "
                         f"anywhere else is padded at its tail without it")


# -- flash-attn's options (moved from distattn.api, which hands them on) --------------------------------------
def check_causal(causal) -> bool:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool (True or False), got {causal!r} of type {type(causal).__name__}")
    return causal


def check_window(window_size) -> tuple[int, int]:
    """flash-attn's ``window_size=(left, right)``: -1 means unlimited on that side. A tuple or list of two ints, or
    a 1-D integer tensor of two elements (what flash-attn's own tests pass; read on the host, one sync)."""
    if isinstance(window_size, torch.Tensor):
        if window_size.shape != (2,) or window_size.dtype.is_floating_point or window_size.dtype.is_complex \
                or window_size.dtype == torch.bool or window_size.device.type == "meta":
            raise TypeError(f"window_size as a tensor must be a 1-D integer tensor of 2 elements (left, right) with "
                            f"values, got shape {tuple(window_size.shape)}, dtype {window_size.dtype} on "
                            f"{window_size.device}; e.g. torch.tensor([left, right]) or a tuple (left, right)")
        window_size = tuple(window_size.tolist())
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right) of ints, -1 meaning unlimited: a tuple, a list "
                        f"or a 2-element integer tensor, got {window_size!r}")
    for name, w in zip(("left", "right"), window_size):
        if isinstance(w, bool) or not isinstance(w, numbers.Integral) or w < -1:
            raise ValueError(f"window_size {name} must be an int >= -1 (-1: unlimited), got {w!r}")
    return int(window_size[0]), int(window_size[1])


def check_softcap(softcap) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a number (0.0: no soft-capping), got {softcap!r}")
    softcap = float(softcap)
    if not (softcap >= 0.0 and math.isfinite(softcap)):
        raise ValueError(f"softcap must be a finite number >= 0 (0.0: off; Gemma-2 uses 50.0), got {softcap}")
    return softcap


def check_unsupported(dropout_p, alibi_slopes, deterministic) -> None:
    """flash-attn options distattn does not compute: a clear error instead of a silently different result."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if dropout_p > 0.0:
        raise ValueError(f"dropout_p={dropout_p}: distattn does not implement attention dropout (its kernels keep "
                         f"no dropout mask); pass dropout_p=0.0 (e.g. model.eval()-style configs set "
                         f"attention_dropout=0), or apply dropout to the attention output instead")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes: distattn does not implement ALiBi position biases; use a RoPE model, or "
                         "flash-attn's own flash_attn_func on one device")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r} (distattn's backward is always "
                        f"deterministic)")
