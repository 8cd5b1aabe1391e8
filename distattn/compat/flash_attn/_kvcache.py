"""flash-attn's ``flash_attn_with_kvcache`` on one device: append to a key/value cache in place, rotate, attend.

A translation onto ``distattn.flash_attn_varlen_func``: batch row ``i`` is one document whose queries are its
``s_q`` new queries and whose keys are its cache row ``[leftpad_i, cache_seqlens_i + s_new)`` after the append
(causal mask and window bottom-right aligned inside the document, as flash-attn's). The append and the rotary
embedding are plain PyTorch; no attention code of its own.

Legend: ``b`` batch, ``s_q`` new queries, ``s_new`` new keys, ``h``/``h_kv`` heads, ``d`` head dim, ``r`` rotary dim.
"""

from __future__ import annotations

import numbers

import torch

from distattn.api import check_causal, check_softcap, check_window, flash_attn_varlen_func

__all__ = ["flash_attn_with_kvcache", "apply_rotary"]


def apply_rotary(x, cos, sin, positions, interleaved: bool):
    """Rotary embedding of ``x (b, s, h, d)`` at ``positions (b, s)`` (flash-attn's ``apply_rotary_emb``): the first
    ``r = 2 * cos.shape[1]`` dims rotate, the rest pass through; ``interleaved`` pairs dims (0, 1), (2, 3), ...
    (GPT-J), otherwise (i, i + r/2) (GPT-NeoX). Computed in fp32, returned in ``x``'s dtype."""
    half = cos.shape[1]
    c, s = (t.float()[positions].unsqueeze(2) for t in (cos, sin))  # (b, s, 1, r/2)
    xr = x[..., :2 * half].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., 2 * half:]), dim=-1)


def _ints(t, name: str, b: int) -> list[int]:
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64) or t.shape != (b,):
        raise TypeError(f"{name} must be an int32 tensor of shape ({b},) (one entry per batch row), got "
                        f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__} "
                        f"{tuple(t.shape) if isinstance(t, torch.Tensor) else ''}")
    return t.tolist()


def _check_tensors(q, k_cache, v_cache, k, v):
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dim() != 4):
            raise ValueError(f"{name} must be a 4-D tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if (k is None) != (v is None):
        raise ValueError("pass k and v together (the new keys and values to append), or neither")
    if k_cache.shape != v_cache.shape or (k is not None and k.shape != v.shape):
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} (and k, v) must have "
                         f"one shape")
    new = [] if k is None else [k, v]
    if any(t.dtype != q.dtype or t.device != q.device for t in [k_cache, v_cache] + new):
        raise ValueError("q, k_cache, v_cache (and k, v) must share one dtype and device")
    if k_cache.shape[3] != q.shape[3] or q.shape[2] % k_cache.shape[2]:
        raise ValueError(f"head_dim must agree (q {q.shape[3]}, cache {k_cache.shape[3]}) and the query heads "
                         f"({q.shape[2]}) must be a multiple of the cache's key/value heads ({k_cache.shape[2]})")
    if k is not None and (k.shape[0] != q.shape[0] or k.shape[2:] != k_cache.shape[2:]):
        raise ValueError(f"k {tuple(k.shape)} must be (batch {q.shape[0]}, seqlen_new, {k_cache.shape[2]}, "
                         f"{k_cache.shape[3]})")


def _rows(q, k_cache, k, cache_seqlens, cache_batch_idx, cache_leftpad, block_table):
    """Per batch row: (cache row or block list, start of its keys, cache length before the append); the page size
    (None: not paged) and the logical length of a cache row."""
    b, s_new = q.shape[0], 0 if k is None else k.shape[1]
    if block_table is not None:
        if cache_batch_idx is not None or cache_leftpad is not None:
            raise ValueError("block_table (a paged cache) with cache_batch_idx or cache_leftpad is not supported, "
                             "as in flash-attn: index the batch through block_table's rows instead")
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.shape[0] != b \
                or block_table.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"block_table must be an int32 tensor (batch {b}, max_blocks_per_seq)")
        rows, page = block_table.tolist(), k_cache.shape[1]
        if any(not 0 <= x < k_cache.shape[0] for r in rows for x in r):
            raise ValueError(f"block_table names blocks outside the cache's {k_cache.shape[0]} blocks")
        capacity = len(rows[0]) * page
    else:
        rows = _ints(cache_batch_idx, "cache_batch_idx", b) if cache_batch_idx is not None else list(range(b))
        if any(not 0 <= r < k_cache.shape[0] for r in rows):
            raise ValueError(f"cache_batch_idx must index the cache's {k_cache.shape[0]} rows, got {rows}")
        page, capacity = None, k_cache.shape[1]
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("appending k, v needs cache_seqlens (where each row's new tokens go), as in flash-attn")
        lens = [capacity] * b
    elif isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        lens = [int(cache_seqlens)] * b
    else:
        lens = _ints(cache_seqlens, "cache_seqlens", b)
    starts = _ints(cache_leftpad, "cache_leftpad", b) if cache_leftpad is not None else [0] * b
    for i, (lo, n) in enumerate(zip(starts, lens)):
        if not 0 <= lo <= n or n + s_new > capacity:
            raise ValueError(f"row {i}: cache_leftpad {lo} <= cache_seqlens {n} and cache_seqlens + seqlen_new "
                             f"({n} + {s_new}) <= the cache's {capacity} positions must hold; allocate a longer cache")
    return rows, starts, lens, page


def _positions(row, page, lo, hi, device):
    """Where positions ``[lo, hi)`` of a cache row live: (index into dim 0, index into dim 1) tensors on ``device``."""
    pos = torch.arange(lo, hi, device=device)
    if page is None:
        return torch.full_like(pos, row), pos
    return torch.tensor(row, dtype=torch.long, device=device)[pos // page], pos % page


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False, *,
                            backend=None):
    """flash-attn's ``flash_attn_with_kvcache`` (2.x, its arguments in its order): incremental decoding on one device.

    With ``k, v``: they are rotated (``rotary_cos``/``rotary_sin``, at positions ``cache_seqlens + j``) and written
    into the caches IN PLACE at ``cache_seqlens``; then ``q`` (rotated at ``cache_seqlens + j`` when causal or
    windowed, at ``cache_seqlens`` otherwise) attends to each row's keys ``[cache_leftpad, cache_seqlens +
    seqlen_new)``, the causal mask and window aligned bottom-right::

        s_q=2, 5 keys, causal     keys 0 1 2 3 4
                             q 0:      x x x x .
                             q 1:      x x x x x

    Args:
        q: ``(b, s_q, h, d)``.
        k_cache, v_cache: ``(b_cache, seqlen_cache, h_kv, d)``; with ``block_table`` (paged)
            ``(num_blocks, page_block_size, h_kv, d)``, any page size. ``h % h_kv == 0``.
        k, v: ``(b, s_new, h_kv, d)`` to append, or None.
        rotary_cos, rotary_sin: ``(seqlen_ro, r / 2)``, only with ``k, v``; ``rotary_interleaved`` as flash-attn's.
        cache_seqlens: an int or ``(b,)`` int32: each row's cache length before the append (None: the whole cache,
            only without ``k, v``).
        cache_batch_idx: ``(b,)`` int32, the cache row of each batch row (not with ``block_table``).
        cache_leftpad: ``(b,)`` int32, where each row's keys start (not with ``block_table``).
        block_table: ``(b, max_blocks_per_seq)`` int32, the cache blocks of each row in order.
        softmax_scale, causal, window_size, softcap: as ``distattn.flash_attn_func``.
        alibi_slopes: must be None (no ALiBi: flash-attn's own function computes it).
        num_splits: accepted (a kernel tuning knob of flash-attn's).
        return_softmax_lse: also return ``lse (b, h, s_q)``, fp32 (-inf for a row that sees no key; flash-attn +inf).
        backend: (distattn) the kernel backend, as ``distattn.flash_attn_func``.

    Returns:
        ``out (b, s_q, h, d)``, or ``(out, lse)``. No backward (flash-attn's has none either).
    """
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes: distattn does not implement ALiBi position biases; use flash-attn's own "
                         "flash_attn_with_kvcache, or a RoPE model (rotary_cos/rotary_sin here)")
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0, got {num_splits!r}")
    _check_tensors(q, k_cache, v_cache, k, v)
    causal, window, softcap = check_causal(causal), check_window(window_size), check_softcap(softcap)
    rows, starts, lens, page = _rows(q, k_cache, k, cache_seqlens, cache_batch_idx, cache_leftpad, block_table)
    b, s_q = q.shape[:2]
    with torch.no_grad():
        if k is not None:
            q, k = _rotate(q, k, rotary_cos, rotary_sin, lens, causal or window != (-1, -1), rotary_interleaved)
            for i, (row, n) in enumerate(zip(rows, lens)):  # append in place
                where = _positions(row, page, n, n + k.shape[1], k_cache.device)
                k_cache[where], v_cache[where] = k[i], v[i]
        elif rotary_cos is not None or rotary_sin is not None:
            raise ValueError("rotary_cos/rotary_sin apply with new keys only (pass k and v), as in flash-attn; "
                             "rotate q yourself otherwise")
        ends = [n + (0 if k is None else k.shape[1]) for n in lens]
        where = [_positions(row, page, lo, hi, k_cache.device) for row, lo, hi in zip(rows, starts, ends)]
        keys = torch.cat([k_cache[w] for w in where])  # (sum of row lengths, h_kv, d)
        values = torch.cat([v_cache[w] for w in where])
        cu_q = torch.arange(0, (b + 1) * s_q, s_q, dtype=torch.int32, device=q.device)
        lengths = [hi - lo for lo, hi in zip(starts, ends)]
        cu_k = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=q.device)
        out, lse = flash_attn_varlen_func(q.reshape(b * s_q, *q.shape[2:]), keys, values, cu_q, cu_k, s_q,
                                          max(lengths), softmax_scale=softmax_scale, causal=causal,
                                          window_size=window, softcap=softcap, return_lse=True, backend=backend)
    out = out.reshape(q.shape)
    lse = lse.reshape(lse.shape[0], b, s_q).transpose(0, 1)  # (h, b * s_q) -> (b, h, s_q)
    return (out, lse) if return_softmax_lse else out


def _rotate(q, k, cos, sin, lens, per_token_q: bool, interleaved: bool):
    """flash-attn's rotary placement: k at ``cache_seqlens + j``; q there too when causal or windowed, else every
    query at ``cache_seqlens``."""
    if (cos is None) != (sin is None):
        raise ValueError("pass rotary_cos and rotary_sin together")
    if cos is None:
        return q, k
    if cos.dim() != 2 or cos.shape != sin.shape or not 0 < 2 * cos.shape[1] <= q.shape[3]:
        raise ValueError(f"rotary_cos and rotary_sin must be (seqlen_ro, rotary_dim / 2) with rotary_dim <= head_dim "
                         f"({q.shape[3]}), got {tuple(cos.shape)} and {tuple(sin.shape)}")
    base = torch.tensor(lens, device=cos.device)[:, None]
    k_pos = base + torch.arange(k.shape[1], device=cos.device)
    q_pos = base + torch.arange(q.shape[1], device=cos.device) if per_token_q else base.expand(-1, q.shape[1])
    if int(max(k_pos.max(), q_pos.max())) >= cos.shape[0]:
        raise ValueError(f"rotary_cos has {cos.shape[0]} positions, but the new tokens reach position "
                         f"{int(max(k_pos.max(), q_pos.max()))}; pass tables covering the whole cache")
    return apply_rotary(q, cos, sin, q_pos, interleaved), apply_rotary(k, cos, sin, k_pos, interleaved)
