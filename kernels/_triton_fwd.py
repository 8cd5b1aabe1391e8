r"""Triton forward kernels: fold one key/value chunk into a carried softmax state, and merge two states.

Raw ``@triton.jit`` code only; the launchers, autotuning and the backend class live in ``_triton.py``.

Legend: b batch, s_q / s_k query / key length of this chunk, h_q / h_kv query / key-value heads, d head dim.
Every tensor is addressed through explicit strides ``stride_<tensor><dim>`` with unit stride in d. Row (sequence)
offsets are cast to int64 before they multiply a stride: ``s * h * d`` passes 2^31 at ~524k tokens for
``h * d = 4096``, and an int32 product would wrap into an illegal or wrong address (``bench/compile_report.py``
checks the generated IR for it).

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
def _key_range(m0, S_Q, S_K, DIAG, LO, HI, K_START, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               MASK: tl.constexpr):
    """Key blocks a block of queries (rows ``m0 .. m0+BLOCK_M-1``) must visit, as three segments:
    ``[start, full_lo)`` masked, ``[full_lo, full_hi)`` seen whole by every row (no mask), ``[full_hi, end)``
    masked; keys outside ``[start, end)`` are seen by no row and never loaded.

    MASK 0: none. MASK 1: causal, ``j <= i + DIAG``. MASK 2: per-row bounds ``LO[i] <= K_START + j <= HI[i]``,
    nondecreasing in ``i``, so the block's extremes are its first and last rows (O(1) loads)."""
    if MASK == 2:
        last = tl.minimum(m0 + BLOCK_M, S_Q) - 1
        lo_first = tl.load(LO + m0) - K_START
        lo_last = tl.load(LO + last) - K_START
        hi_first = tl.load(HI + m0) - K_START
        hi_last = tl.load(HI + last) - K_START
        start = tl.maximum(lo_first, 0) // BLOCK_N * BLOCK_N
        end = tl.maximum(tl.minimum(hi_last + 1, S_K), start)
        full_lo = (tl.maximum(lo_last, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        full_hi = tl.minimum(hi_first + 1, S_K) // BLOCK_N * BLOCK_N
        none_full = full_hi <= full_lo
        full_lo = tl.where(none_full, end, full_lo)
        full_hi = tl.where(none_full, end, full_hi)
    elif MASK == 1:
        end = tl.maximum(tl.minimum(S_K, DIAG + tl.minimum(m0 + BLOCK_M, S_Q)), 0)
        full_hi = tl.minimum(tl.maximum(tl.minimum(DIAG + m0 + 1, S_K), 0) // BLOCK_N * BLOCK_N, end)
        start = end * 0
        full_lo = start
    else:
        end = S_K
        full_hi = S_K // BLOCK_N * BLOCK_N
        start = S_K * 0
        full_lo = start
    return start, full_lo, full_hi, end


@triton.jit
def _tanh(y):
    """tanh in fp32 without libdevice (the interpreter has none): a series near 0, where 1 - 2/(e^2y + 1)
    would cancel, and the exponential form elsewhere (exact to a few ulps; saturates to +-1, never NaN)."""
    y2 = y * y
    series = y * (1.0 + y2 * (-0.33333333 + y2 * (0.13333333 + y2 * -0.053968254)))
    expo = 1.0 - 2.0 / (tl.math.exp2(y * 2.88539008) + 1.0)  # 2.88539008 = 2/ln 2
    return tl.where(tl.abs(y) < 0.125, series, expo)


@triton.jit
def _logits(qk, qk_scale, cap_in, cap_out, SOFTCAP: tl.constexpr):
    """Base-2 logits of a raw q.k tile, and with SOFTCAP the tanh the backward's chain rule needs.

    qk_scale = scale / ln 2. Soft-capped: ``softcap * tanh(scale * qk / softcap) / ln 2`` with
    cap_in = scale / softcap and cap_out = softcap / ln 2."""
    if SOFTCAP:
        t = _tanh(qk * cap_in)
        return t * cap_out, t
    return qk * qk_scale, qk


@triton.jit
def _visible(rows, cols, S_K, DIAG, lo_r, hi_r, MASK: tl.constexpr):
    """Boolean [rows, cols] tile: key column visible to query row (keys past S_K never are)."""
    keep = cols[None, :] < S_K
    if MASK == 1:
        keep = keep & (cols[None, :] <= rows[:, None] + DIAG)
    if MASK == 2:  # lo_r / hi_r: the rows' bounds relative to the chunk's first key
        keep = keep & (cols[None, :] >= lo_r[:, None]) & (cols[None, :] <= hi_r[:, None])
    return keep


@triton.jit
def _visible_t(rows, cols, S_K, DIAG, lo_r, hi_r, MASK: tl.constexpr):
    """``_visible`` built in the transposed orientation, a Boolean [cols, rows] tile (no tl.trans)."""
    keep = cols[:, None] < S_K
    if MASK == 1:
        keep = keep & (cols[:, None] <= rows[None, :] + DIAG)
    if MASK == 2:
        keep = keep & (cols[:, None] >= lo_r[None, :]) & (cols[:, None] <= hi_r[None, :])
    return keep


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
def _row_bounds(LO, HI, K_START, rows, S_Q, MASK: tl.constexpr):
    """The rows' key bounds relative to the chunk's first key (MASK 2); rows past S_Q see nothing."""
    if MASK == 2:
        ok = rows < S_Q
        lo_r = tl.load(LO + rows, mask=ok, other=1) - K_START
        hi_r = tl.load(HI + rows, mask=ok, other=0) - K_START
        return lo_r, hi_r
    return rows, rows  # unused


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, K_blk, V_blk, stride_ks, stride_vs, start, stop, offs_m, offs_n, offs_d,
               S_K, DIAG, lo_r, hi_r, qk_scale, cap_in, cap_out, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
               MASK: tl.constexpr, MASKED: tl.constexpr, MASK_D: tl.constexpr, SOFTCAP: tl.constexpr,
               DOT_PREC: tl.constexpr):
    """Online softmax over key blocks [start, stop); K_blk/V_blk point at key ``start``. MASKED: apply the mask."""
    k_ptrs = K_blk + offs_n.to(tl.int64)[:, None] * stride_ks + offs_d[None, :]
    v_ptrs = V_blk + offs_n.to(tl.int64)[:, None] * stride_vs + offs_d[None, :]
    for start_n in range(start, stop, BLOCK_N):
        cols = start_n + offs_n
        k = _load_tile(k_ptrs, cols, S_K, offs_d, HEAD_DIM, MASKED, MASK_D)
        s, _ = _logits(tl.dot(q, tl.trans(k), input_precision=DOT_PREC), qk_scale, cap_in, cap_out, SOFTCAP)
        if MASKED:
            s = tl.where(_visible(offs_m, cols, S_K, DIAG, lo_r, hi_r, MASK), s, float("-inf"))
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
    Q, K, V, O_ACC, LSE, OUT, LO, HI,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ab, stride_as, stride_ah,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh, stride_ls,
    H_Q, GROUP, S_Q, S_K, DIAG, K_START, qk_scale, cap_in, cap_out,
    LEN_BUCKET,  # power-of-two bucket of max(s_q, s_k): an autotune key only
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK: tl.constexpr, SOFTCAP: tl.constexpr, FRESH: tl.constexpr, LAST: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, query head); loops over the key blocks its rows see.

    O_ACC (b, s_q, h_q, d) fp32 and LSE (b, h_q, s_q) fp32 are the carried state, read unless FRESH.
    LAST writes the finalized output into OUT (input dtype) and lse into LSE; otherwise the state is
    written back to O_ACC / LSE. LO, HI (s_q,) int32: per-row key bounds (MASK 2 only).
    """
    MASK_D: tl.constexpr = BLOCK_D != HEAD_DIM
    start_m = tl.program_id(0)
    off_h = tl.program_id(1).to(tl.int64)  # grid (blocks, heads, batch): each axis below CUDA's limits
    off_b = tl.program_id(2).to(tl.int64)
    off_hk = off_h // GROUP  # GQA: query head h reads kv head h // (h_q // h_kv)
    m0 = start_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    # -- key range: [start, full_lo) masked, [full_lo, full_hi) unmasked, [full_hi, end) masked --
    start, full_lo, full_hi, end = _key_range(m0, S_Q, S_K, DIAG, LO, HI, K_START, BLOCK_M, BLOCK_N, MASK)
    lo_r, hi_r = _row_bounds(LO, HI, K_START, offs_m, S_Q, MASK)

    # -- load q and the carried state --
    q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + offs_m.to(tl.int64)[:, None] * stride_qs + offs_d[None, :]
    q = _load_tile(q_ptrs, offs_m, S_Q, offs_d, HEAD_DIM, True, MASK_D)
    lse_ptrs = LSE + off_b * stride_lb + off_h * stride_lh + offs_m.to(tl.int64) * stride_ls
    a_ptrs = O_ACC + off_b * stride_ab + off_h * stride_ah + offs_m.to(tl.int64)[:, None] * stride_as + offs_d[None, :]
    if FRESH:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    else:
        m_i = tl.load(lse_ptrs, mask=offs_m < S_Q, other=float("-inf")) * LOG2E
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
        acc = _load_tile(a_ptrs, offs_m, S_Q, offs_d, HEAD_DIM, True, MASK_D).to(tl.float32)

    # Key offsets are advanced in 64-bit pointer arithmetic, never n * stride in int32.
    K_head = K + off_b * stride_kb + off_hk * stride_kh
    V_head = V + off_b * stride_vb + off_hk * stride_vh
    if MASK == 2:  # only bounds can start masked: causal and dense rows all see key 0
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_head + start.to(tl.int64) * stride_ks,
                                   V_head + start.to(tl.int64) * stride_vs, stride_ks, stride_vs, start, full_lo,
                                   offs_m, offs_n, offs_d, S_K, DIAG, lo_r, hi_r, qk_scale, cap_in, cap_out,
                                   HEAD_DIM, BLOCK_N, MASK, True, MASK_D, SOFTCAP, DOT_PREC)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_head + full_lo.to(tl.int64) * stride_ks,
                               V_head + full_lo.to(tl.int64) * stride_vs, stride_ks, stride_vs, full_lo, full_hi,
                               offs_m, offs_n, offs_d, S_K, DIAG, lo_r, hi_r, qk_scale, cap_in, cap_out,
                               HEAD_DIM, BLOCK_N, MASK, False, MASK_D, SOFTCAP, DOT_PREC)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_head + full_hi.to(tl.int64) * stride_ks,
                               V_head + full_hi.to(tl.int64) * stride_vs, stride_ks, stride_vs, full_hi, end,
                               offs_m, offs_n, offs_d, S_K, DIAG, lo_r, hi_r, qk_scale, cap_in, cap_out,
                               HEAD_DIM, BLOCK_N, MASK, True, MASK_D, SOFTCAP, DOT_PREC)

    # -- epilogue: out = acc / l, lse = (m + log2 l) * ln 2; a row with l == 0 saw nothing --
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = tl.where(empty[:, None], 0.0, acc / l_safe[:, None])
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    tl.store(lse_ptrs, lse, mask=offs_m < S_Q)
    if LAST:
        rows64 = offs_m.to(tl.int64)[:, None]
        o_ptrs = OUT + off_b * stride_ob + off_h * stride_oh + rows64 * stride_os + offs_d[None, :]
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
    off_h = tl.program_id(1).to(tl.int64)  # grid (blocks, heads, batch): each axis below CUDA's limits
    off_b = tl.program_id(2).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < S_Q

    l1_ptrs = LSE1 + off_b * stride_l1b + off_h * stride_l1h + offs_m.to(tl.int64) * stride_l1s
    l2_ptrs = LSE2 + off_b * stride_l2b + off_h * stride_l2h + offs_m.to(tl.int64) * stride_l2s
    lse1 = tl.load(l1_ptrs, mask=row_ok, other=float("-inf"))
    lse2 = tl.load(l2_ptrs, mask=row_ok, other=float("-inf"))
    m = tl.maximum(lse1, lse2)
    m = tl.where(m == float("-inf"), 0.0, m)
    w1 = tl.exp(lse1 - m)
    w2 = tl.exp(lse2 - m)
    w = w1 + w2
    empty = w == 0.0
    w_safe = tl.where(empty, 1.0, w)

    o1_ptrs = O1 + off_b * stride_1b + off_h * stride_1h + offs_m.to(tl.int64)[:, None] * stride_1s + offs_d[None, :]
    o2_ptrs = O2 + off_b * stride_2b + off_h * stride_2h + offs_m.to(tl.int64)[:, None] * stride_2s + offs_d[None, :]
    o1 = _load_tile(o1_ptrs, offs_m, S_Q, offs_d, HEAD_DIM, True, MASK_D).to(tl.float32)
    o2 = _load_tile(o2_ptrs, offs_m, S_Q, offs_d, HEAD_DIM, True, MASK_D).to(tl.float32)
    # An empty side (weight exactly 0) may hold anything in its output: select, never multiply by a zero
    # weight. A NaN weight is not zero: its NaN reaches the merged row (never a masked row).
    o1 = tl.where((w1 != 0.0)[:, None], o1 * (w1 / w_safe)[:, None], 0.0)
    o2 = tl.where((w2 != 0.0)[:, None], o2 * (w2 / w_safe)[:, None], 0.0)
    _store_tile(o1_ptrs, o1 + o2, offs_m, S_Q, offs_d, HEAD_DIM, MASK_D)
    tl.store(l1_ptrs, tl.where(empty, float("-inf"), m + tl.log(w_safe)), mask=row_ok)
