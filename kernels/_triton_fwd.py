r"""Triton forward kernels: fold one key/value chunk into a carried softmax state, and merge two states.

Raw ``@triton.jit`` code only; the launchers, autotuning and the backend class live in ``_triton.py``.

Legend: b batch, s_q / s_k query / key length of this chunk, h_q / h_kv query / key-value heads, d head dim.
Every tensor is addressed through explicit strides ``stride_<tensor><dim>`` with unit stride in d.

The carried state is the *normalized* fp32 partial ``(out, lse)`` of the kernel contract. In the kernel it is
the FlashAttention-2 triple ``(acc, m, l)`` with ``acc = out``, ``m = lse`` (kept in base 2 inside the kernel)
and ``l = 1``; an empty state (``lse = -inf``) starts as ``acc = 0, m = -inf, l = 0``. The softmax scale is
pre-multiplied by ``1/ln 2`` so that the inner loop uses ``exp2``; the epilogue converts ``lse`` back to the
natural log, which is the only base that crosses the API boundary.

Causal alignment uses global positions: query row ``i`` sits at ``q_start + i``, key ``j`` at ``k_start + j``,
and ``j`` is visible to ``i`` iff ``k_start + j <= q_start + i``, i.e. ``j <= i + DIAG`` with
``DIAG = q_start - k_start``::

            keys j ->        one query block (rows m0 .. m0+BLOCK_M-1)
           +-----------+
      m0 > |xxxxx\     |     x: key blocks left of n_full run without a mask (every row sees them)
           |xxxxxx\    |     \: the diagonal band [n_full, hi) pays for the mask
           |xxxxxxx\   |     blank: blocks at or beyond hi are never loaded
           +-----------+
"""
import triton
import triton.language as tl

# Globals read inside @triton.jit must be tl.constexpr (the compiler rejects plain floats; the interpreter does not).
LOG2E = tl.constexpr(1.44269504)  # 1/ln 2
LN2 = tl.constexpr(0.69314718)  # ln 2


@triton.jit
def _key_range(m0, S_Q, S_K, DIAG, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Keys a block of queries starting at row ``m0`` must visit: ``[0, n_full)`` unmasked, ``[n_full, hi)``
    masked (the diagonal band); keys from ``hi`` on lie above the diagonal and are skipped."""
    if CAUSAL:
        hi = tl.maximum(tl.minimum(S_K, DIAG + tl.minimum(m0 + BLOCK_M, S_Q)), 0)
        n_full = tl.maximum(tl.minimum(DIAG + m0 + 1, S_K), 0) // BLOCK_N * BLOCK_N
    else:
        hi = S_K
        n_full = S_K // BLOCK_N * BLOCK_N
    return tl.minimum(n_full, hi), hi


@triton.jit
def _load_tile(ptrs, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, MASK_ROWS: tl.constexpr,
               MASK_D: tl.constexpr):
    """Load a [rows, BLOCK_D] tile, zero-filling rows >= n_rows and columns >= HEAD_DIM."""
    if MASK_ROWS:
        if MASK_D:
            return tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        else:
            return tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    else:
        if MASK_D:
            return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            return tl.load(ptrs)


@triton.jit
def _store_tile(ptrs, val, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, MASK_D: tl.constexpr):
    """Store a [rows, BLOCK_D] tile, skipping rows >= n_rows and padded columns."""
    if MASK_D:
        tl.store(ptrs, val, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))
    else:
        tl.store(ptrs, val, mask=rows[:, None] < n_rows)


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, K_blk, V_blk, stride_ks, stride_vs, start, stop, offs_m, offs_n, offs_d,
               S_K, DIAG, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
               MASKED: tl.constexpr, MASK_D: tl.constexpr, DOT_PREC: tl.constexpr):
    """Online softmax over key blocks [start, stop). MASKED: the diagonal band / key tail (mask needed)."""
    k_ptrs = K_blk + offs_n[:, None] * stride_ks + offs_d[None, :]
    v_ptrs = V_blk + offs_n[:, None] * stride_vs + offs_d[None, :]
    for start_n in range(start, stop, BLOCK_N):
        cols = start_n + offs_n
        k = _load_tile(k_ptrs, cols, S_K, offs_d, HEAD_DIM, MASKED, MASK_D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # base-2 logits [BLOCK_M, BLOCK_N]
        if MASKED:
            keep = cols[None, :] < S_K
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + DIAG)
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:
            # A row that has seen no key yet keeps m = -inf; subtract 0 instead so that
            # exp2(-inf - -inf) never produces NaN (alpha and p are then exactly 0).
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_sub = m_new  # every row sees every key of this block, so m_new is finite
        # -- rescale acc --
        alpha = tl.math.exp2(m_i - m_sub)
        p = tl.math.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        # -- acc += P @ V (P in the input dtype, as FlashAttention-2) --
        v = _load_tile(v_ptrs, cols, S_K, offs_d, HEAD_DIM, MASKED, MASK_D)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
        m_i = m_new
        k_ptrs += BLOCK_N * stride_ks
        v_ptrs += BLOCK_N * stride_vs
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(
    Q, K, V, O_ACC, LSE, OUT,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ab, stride_as, stride_ah,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh, stride_ls,
    H_Q, GROUP, S_Q, S_K, DIAG, qk_scale,
    LEN_BUCKET,  # power-of-two bucket of max(s_q, s_k): an autotune key only
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, FRESH: tl.constexpr, LAST: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, query head); loops over the chunk's key blocks.

    O_ACC (b, s_q, h_q, d) fp32 and LSE (b, h_q, s_q) fp32 are the carried state, read unless FRESH.
    LAST writes the finalized output into OUT (input dtype) and lse into LSE; otherwise the state is
    written back to O_ACC / LSE. qk_scale = softmax scale * 1/ln 2.
    """
    MASK_D: tl.constexpr = BLOCK_D != HEAD_DIM
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = (off_bh // H_Q).to(tl.int64)
    off_h = (off_bh % H_Q).to(tl.int64)
    off_hk = off_h // GROUP  # GQA: query head h reads kv head h // (h_q // h_kv)
    m0 = start_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    # -- key range: [0, n_full) unmasked, [n_full, hi) masked --
    n_full, hi = _key_range(m0, S_Q, S_K, DIAG, BLOCK_M, BLOCK_N, CAUSAL)

    # -- load q and the carried state --
    q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :]
    q = _load_tile(q_ptrs, offs_m, S_Q, offs_d, HEAD_DIM, True, MASK_D)
    lse_ptrs = LSE + off_b * stride_lb + off_h * stride_lh + offs_m * stride_ls
    a_ptrs = O_ACC + off_b * stride_ab + off_h * stride_ah + offs_m[:, None] * stride_as + offs_d[None, :]
    if FRESH:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    else:
        m_i = tl.load(lse_ptrs, mask=offs_m < S_Q, other=float("-inf")) * LOG2E
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
        acc = _load_tile(a_ptrs, offs_m, S_Q, offs_d, HEAD_DIM, True, MASK_D).to(tl.float32)

    K_head = K + off_b * stride_kb + off_hk * stride_kh
    V_head = V + off_b * stride_vb + off_hk * stride_vh
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_head, V_head, stride_ks, stride_vs, 0, n_full,
                               offs_m, offs_n, offs_d, S_K, DIAG, qk_scale,
                               HEAD_DIM, BLOCK_N, CAUSAL, False, MASK_D, DOT_PREC)
    # Pointer offsets from here on are advanced in 64-bit pointer arithmetic, never n * stride in int32.
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q,
                               K_head + n_full.to(tl.int64) * stride_ks, V_head + n_full.to(tl.int64) * stride_vs,
                               stride_ks, stride_vs, n_full, hi, offs_m, offs_n, offs_d, S_K, DIAG, qk_scale,
                               HEAD_DIM, BLOCK_N, CAUSAL, True, MASK_D, DOT_PREC)

    # -- epilogue: out = acc / l, lse = (m + log2 l) * ln 2; a row with l == 0 saw nothing --
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = tl.where(empty[:, None], 0.0, acc / l_safe[:, None])
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    tl.store(lse_ptrs, lse, mask=offs_m < S_Q)
    if LAST:
        o_ptrs = OUT + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :]
        _store_tile(o_ptrs, out.to(OUT.dtype.element_ty), offs_m, S_Q, offs_d, HEAD_DIM, MASK_D)
    else:
        _store_tile(a_ptrs, out, offs_m, S_Q, offs_d, HEAD_DIM, MASK_D)


@triton.jit
def _merge_kernel(
    O1, LSE1, O2, LSE2,
    stride_1b, stride_1s, stride_1h,
    stride_2b, stride_2s, stride_2h,
    stride_l1b, stride_l1h, stride_l1s,
    stride_l2b, stride_l2h, stride_l2s,
    H, S_Q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """State (O1, LSE1) <- merge(state, partial (O2, LSE2)), in place, fp32.

    Both partials are normalized softmax averages over disjoint key sets K1, K2 with
    lse_i = log sum_{j in K_i} exp(s_j). Over K1 u K2 the normalizer is exp(lse1) + exp(lse2), so
        lse = m + log(w1 + w2),  out = (w1 * o1 + w2 * o2) / (w1 + w2),  w_i = exp(lse_i - m), m = max(lse1, lse2)
    (FlashAttention-2, Dao 2023, Sec. 3.1.1, "online softmax" rescaling; equal to the logsigmoid/sigmoid form
    lse = lse1 - logsigmoid(lse1 - lse2) of ring-flash-attention). Subtracting m keeps every w_i in [0, 1]:
    no overflow. Both empty (lse1 = lse2 = -inf): m is replaced by 0, both weights are 0 -> out 0, lse -inf.
    """
    MASK_D: tl.constexpr = BLOCK_D != HEAD_DIM
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = (off_bh // H).to(tl.int64)
    off_h = (off_bh % H).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < S_Q

    l1_ptrs = LSE1 + off_b * stride_l1b + off_h * stride_l1h + offs_m * stride_l1s
    l2_ptrs = LSE2 + off_b * stride_l2b + off_h * stride_l2h + offs_m * stride_l2s
    lse1 = tl.load(l1_ptrs, mask=row_ok, other=float("-inf"))
    lse2 = tl.load(l2_ptrs, mask=row_ok, other=float("-inf"))
    m = tl.maximum(lse1, lse2)
    m = tl.where(m == float("-inf"), 0.0, m)
    w1 = tl.exp(lse1 - m)
    w2 = tl.exp(lse2 - m)
    w = w1 + w2
    empty = w == 0.0
    w_safe = tl.where(empty, 1.0, w)

    o1_ptrs = O1 + off_b * stride_1b + off_h * stride_1h + offs_m[:, None] * stride_1s + offs_d[None, :]
    o2_ptrs = O2 + off_b * stride_2b + off_h * stride_2h + offs_m[:, None] * stride_2s + offs_d[None, :]
    o1 = _load_tile(o1_ptrs, offs_m, S_Q, offs_d, HEAD_DIM, True, MASK_D).to(tl.float32)
    o2 = _load_tile(o2_ptrs, offs_m, S_Q, offs_d, HEAD_DIM, True, MASK_D).to(tl.float32)
    # An empty side may hold anything (even NaN) in its output: select, never multiply by a zero weight.
    o1 = tl.where((w1 > 0.0)[:, None], o1 * (w1 / w_safe)[:, None], 0.0)
    o2 = tl.where((w2 > 0.0)[:, None], o2 * (w2 / w_safe)[:, None], 0.0)
    _store_tile(o1_ptrs, o1 + o2, offs_m, S_Q, offs_d, HEAD_DIM, MASK_D)
    tl.store(l1_ptrs, tl.where(empty, float("-inf"), m + tl.log(w_safe)), mask=row_ok)
