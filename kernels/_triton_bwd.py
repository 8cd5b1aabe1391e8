"""Triton backward kernels for one (query chunk, key/value chunk) pair, FlashAttention-2 style.

Raw ``@triton.jit`` code only; the launchers live in ``_triton.py``.

Legend: b batch, s_q / s_k query / key length of this chunk, h_q / h_kv heads, d head dim; unit stride in d.
``LSE`` and ``DELTA`` (b, h_q, s_q) fp32 are the *final* statistics over all key chunks, so the probabilities
``P = exp(S - lse)`` recomputed here are already the globally normalized ones and chunks simply add up.

Three kernels, each owning its output tiles (load-add-store into fp32 accumulators, no atomics, so two
runs on the same input are bit-identical):
  * ``_bwd_preprocess_kernel``: delta = rowsum(dout * out) in fp32.
  * ``_bwd_dkdv_kernel``: one key block resident, loops over the query heads of its GQA group and over
    their query blocks, so dk / dv come out with h_kv heads, summed in registers.
  * ``_bwd_dq_kernel``: one query block resident, loops over the key blocks.
A row that saw no key (lse = -inf) gets its lse replaced by +inf, which makes every P of that row exactly 0.
"""
import triton
import triton.language as tl

from ._triton_fwd import LOG2E, _key_range, _load_tile, _store_tile


@triton.jit
def _bwd_preprocess_kernel(
    OUT, DO, DELTA,
    stride_ob, stride_os, stride_oh,
    stride_db, stride_ds, stride_dh,
    stride_eb, stride_eh, stride_es,
    H_Q, S_Q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """DELTA[b, h, i] = sum_d OUT[b, i, h, d] * DO[b, i, h, d], accumulated in fp32."""
    MASK_D: tl.constexpr = BLOCK_D != HEAD_DIM
    off_bh = tl.program_id(1)
    off_b = (off_bh // H_Q).to(tl.int64)
    off_h = (off_bh % H_Q).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o_ptrs = OUT + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :]
    do_ptrs = DO + off_b * stride_db + off_h * stride_dh + offs_m[:, None] * stride_ds + offs_d[None, :]
    o = _load_tile(o_ptrs, offs_m, S_Q, offs_d, HEAD_DIM, True, MASK_D).to(tl.float32)
    do = _load_tile(do_ptrs, offs_m, S_Q, offs_d, HEAD_DIM, True, MASK_D).to(tl.float32)
    e_ptrs = DELTA + off_b * stride_eb + off_h * stride_eh + offs_m * stride_es
    tl.store(e_ptrs, tl.sum(o * do, 1), mask=offs_m < S_Q)


@triton.jit
def _load_row_stats(LSE_ptrs, DELTA_ptrs, rows, S_Q):
    """Row statistics in base 2; rows out of range or with no visible key get lse2 = +inf (so P = 0)."""
    ok = rows < S_Q
    lse = tl.load(LSE_ptrs, mask=ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    delta = tl.load(DELTA_ptrs, mask=ok, other=0.0)
    return lse2, delta


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, Q_head, DO_head, LSE_head, DELTA_head,
                    stride_qs, stride_ds, stride_ls, stride_es, start, stop, offs_m, offs_n, offs_d,
                    S_Q, DIAG, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    MASKED: tl.constexpr, MASK_D: tl.constexpr, DOT_PREC: tl.constexpr):
    """Accumulate dk, dv of one resident key block over query blocks [start, stop) of one query head.

    Works on transposed tiles (keys on rows): S^T = K Q^T. MASKED: the causal diagonal band.
    """
    q_ptrs = Q_head + start.to(tl.int64) * stride_qs + offs_m[:, None] * stride_qs + offs_d[None, :]
    do_ptrs = DO_head + start.to(tl.int64) * stride_ds + offs_m[:, None] * stride_ds + offs_d[None, :]
    for start_m in range(start, stop, BLOCK_M):
        rows = start_m + offs_m
        q = _load_tile(q_ptrs, rows, S_Q, offs_d, HEAD_DIM, True, MASK_D)
        do = _load_tile(do_ptrs, rows, S_Q, offs_d, HEAD_DIM, True, MASK_D)
        lse2, delta = _load_row_stats(LSE_head + rows * stride_ls, DELTA_head + rows * stride_es, rows, S_Q)
        # -- recompute P^T --
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale  # [BLOCK_N, BLOCK_M]
        p_t = tl.math.exp2(s_t - lse2[None, :])
        if MASKED:
            p_t = tl.where(offs_n[:, None] <= rows[None, :] + DIAG, p_t, 0.0)
        # -- dV += P^T dO --
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PREC)
        # -- dS^T = P^T * (dP^T - delta), dK += dS^T Q --
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PREC)
        q_ptrs += BLOCK_M * stride_qs
        do_ptrs += BLOCK_M * stride_ds
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh,
    stride_lb, stride_lh, stride_ls,
    stride_eb, stride_eh, stride_es,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    H_KV, GROUP, S_Q, S_K, DIAG, qk_scale, sm_scale,
    LEN_BUCKET,  # autotune key only
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One program: BLOCK_N keys of one (batch, kv head); adds their dk, dv into DK, DV (fp32)."""
    MASK_D: tl.constexpr = BLOCK_D != HEAD_DIM
    off_bh = tl.program_id(1)
    off_b = (off_bh // H_KV).to(tl.int64)
    off_hk = (off_bh % H_KV).to(tl.int64)
    n0 = tl.program_id(0) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    # -- query range: [m_lo, m_full) causal band (masked), [m_full, S_Q) every row sees every key --
    if CAUSAL:
        # row i sees key j iff j <= i + DIAG: the first row to see key n0 is n0 - DIAG, and from
        # row n0 + BLOCK_N - 1 - DIAG on a row sees the whole block.
        m_lo = tl.maximum(n0 - DIAG, 0) // BLOCK_M * BLOCK_M
        m_full = (tl.maximum(n0 + BLOCK_N - 1 - DIAG, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        m_lo = tl.minimum(m_lo, S_Q)
        m_full = tl.minimum(m_full, S_Q)
    else:
        m_lo = tl.minimum(S_Q, 0)
        m_full = m_lo

    k_ptrs = K + off_b * stride_kb + off_hk * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :]
    v_ptrs = V + off_b * stride_vb + off_hk * stride_vh + offs_n[:, None] * stride_vs + offs_d[None, :]
    k = _load_tile(k_ptrs, offs_n, S_K, offs_d, HEAD_DIM, True, MASK_D)
    v = _load_tile(v_ptrs, offs_n, S_K, offs_d, HEAD_DIM, True, MASK_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # Keys past S_K were loaded as 0: their rows of dk/dv are garbage-free but never stored.
    for g in range(GROUP):
        off_h = off_hk * GROUP + g  # GQA: the query heads that read this kv head
        Q_head = Q + off_b * stride_qb + off_h * stride_qh
        DO_head = DO + off_b * stride_db + off_h * stride_dh
        LSE_head = LSE + off_b * stride_lb + off_h * stride_lh
        DELTA_head = DELTA + off_b * stride_eb + off_h * stride_eh
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q_head, DO_head, LSE_head, DELTA_head,
                                 stride_qs, stride_ds, stride_ls, stride_es, m_lo, m_full, offs_m, offs_n,
                                 offs_d, S_Q, DIAG, qk_scale, HEAD_DIM, BLOCK_M, CAUSAL, MASK_D, DOT_PREC)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q_head, DO_head, LSE_head, DELTA_head,
                                 stride_qs, stride_ds, stride_ls, stride_es, m_full, S_Q, offs_m, offs_n,
                                 offs_d, S_Q, DIAG, qk_scale, HEAD_DIM, BLOCK_M, False, MASK_D, DOT_PREC)

    # -- add into the fp32 accumulators (this program owns these rows: deterministic) --
    dk_ptrs = DK + off_b * stride_dkb + off_hk * stride_dkh + offs_n[:, None] * stride_dks + offs_d[None, :]
    dv_ptrs = DV + off_b * stride_dvb + off_hk * stride_dvh + offs_n[:, None] * stride_dvs + offs_d[None, :]
    dk = dk * sm_scale + _load_tile(dk_ptrs, offs_n, S_K, offs_d, HEAD_DIM, True, MASK_D)
    dv = dv + _load_tile(dv_ptrs, offs_n, S_K, offs_d, HEAD_DIM, True, MASK_D)
    _store_tile(dk_ptrs, dk, offs_n, S_K, offs_d, HEAD_DIM, MASK_D)
    _store_tile(dv_ptrs, dv, offs_n, S_K, offs_d, HEAD_DIM, MASK_D)


@triton.jit
def _bwd_dq_inner(dq, q, do, lse2, delta, K_blk, V_blk, stride_ks, stride_vs, start, stop, offs_m, offs_n,
                  offs_d, S_K, DIAG, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAUSAL: tl.constexpr, MASKED: tl.constexpr, MASK_D: tl.constexpr, DOT_PREC: tl.constexpr):
    """Accumulate dq of one resident query block over key blocks [start, stop)."""
    k_ptrs = K_blk + offs_n[:, None] * stride_ks + offs_d[None, :]
    v_ptrs = V_blk + offs_n[:, None] * stride_vs + offs_d[None, :]
    for start_n in range(start, stop, BLOCK_N):
        cols = start_n + offs_n
        k = _load_tile(k_ptrs, cols, S_K, offs_d, HEAD_DIM, MASKED, MASK_D)
        v = _load_tile(v_ptrs, cols, S_K, offs_d, HEAD_DIM, MASKED, MASK_D)
        # -- recompute P --
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        p = tl.math.exp2(s - lse2[:, None])
        if MASKED:
            # Keys past S_K are zero vectors, but exp2(0 - lse2) can overflow: mask them explicitly.
            keep = cols[None, :] < S_K
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + DIAG)
            p = tl.where(keep, p, 0.0)
        # -- dS = P * (dP - delta), dQ += dS K --
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
        k_ptrs += BLOCK_N * stride_ks
        v_ptrs += BLOCK_N * stride_vs
    return dq


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh,
    stride_lb, stride_lh, stride_ls,
    stride_eb, stride_eh, stride_es,
    stride_dqb, stride_dqs, stride_dqh,
    H_Q, GROUP, S_Q, S_K, DIAG, qk_scale, sm_scale,
    LEN_BUCKET,  # autotune key only
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, query head); adds their dq into DQ (fp32)."""
    MASK_D: tl.constexpr = BLOCK_D != HEAD_DIM
    off_bh = tl.program_id(1)
    off_b = (off_bh // H_Q).to(tl.int64)
    off_h = (off_bh % H_Q).to(tl.int64)
    off_hk = off_h // GROUP
    m0 = tl.program_id(0) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    # -- key range, as in the forward: [0, n_full) unmasked, [n_full, hi) masked --
    n_full, hi = _key_range(m0, S_Q, S_K, DIAG, BLOCK_M, BLOCK_N, CAUSAL)

    q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :]
    do_ptrs = DO + off_b * stride_db + off_h * stride_dh + offs_m[:, None] * stride_ds + offs_d[None, :]
    q = _load_tile(q_ptrs, offs_m, S_Q, offs_d, HEAD_DIM, True, MASK_D)
    do = _load_tile(do_ptrs, offs_m, S_Q, offs_d, HEAD_DIM, True, MASK_D)
    lse2, delta = _load_row_stats(LSE + off_b * stride_lb + off_h * stride_lh + offs_m * stride_ls,
                                  DELTA + off_b * stride_eb + off_h * stride_eh + offs_m * stride_es, offs_m, S_Q)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    K_head = K + off_b * stride_kb + off_hk * stride_kh
    V_head = V + off_b * stride_vb + off_hk * stride_vh
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, K_head, V_head, stride_ks, stride_vs, 0, n_full, offs_m, offs_n,
                       offs_d, S_K, DIAG, qk_scale, HEAD_DIM, BLOCK_N, CAUSAL, False, MASK_D, DOT_PREC)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta,
                       K_head + n_full.to(tl.int64) * stride_ks, V_head + n_full.to(tl.int64) * stride_vs,
                       stride_ks, stride_vs, n_full, hi, offs_m, offs_n, offs_d, S_K, DIAG, qk_scale,
                       HEAD_DIM, BLOCK_N, CAUSAL, True, MASK_D, DOT_PREC)

    # -- add into the fp32 accumulator (this program owns these rows: deterministic) --
    dq_ptrs = DQ + off_b * stride_dqb + off_h * stride_dqh + offs_m[:, None] * stride_dqs + offs_d[None, :]
    dq = dq * sm_scale + _load_tile(dq_ptrs, offs_m, S_Q, offs_d, HEAD_DIM, True, MASK_D)
    _store_tile(dq_ptrs, dq, offs_m, S_Q, offs_d, HEAD_DIM, MASK_D)
