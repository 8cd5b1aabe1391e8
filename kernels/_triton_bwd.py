"""Triton backward kernels for one (query chunk, key/value chunk) pair, FlashAttention-2 style.

Raw ``@triton.jit`` code only; the launchers live in ``_triton.py``.

Legend: b batch, s_q / s_k query / key length of this chunk, h_q / h_kv heads, d head dim; unit stride in d.
``LSE`` and ``DELTA`` (b, h_q, s_q) fp32 are the *final* statistics over all key chunks, so the probabilities
``P = exp(S - lse)`` recomputed here are already the globally normalized ones and chunks simply add up.

Three kernels, each owning its output tiles: every element of an fp32 accumulator receives exactly one add per
launch (dq by load-add-store, dk / dv by one reduction each, ``red.global.add``, which returns nothing and so
keeps registers free), never two programs' adds, so two runs on the same input are bit-identical:
  * ``_bwd_preprocess_kernel``: delta = rowsum(dout * out) in fp32.
  * ``_bwd_dkdv_kernel``: one key block resident, loops over the query blocks that see it and, inside, over the
    query heads of its GQA group, so dk / dv come out with h_kv heads, summed in registers. On sm_90+ q, do,
    lse and delta arrive through TMA tensor descriptors (``TMA``), which is what leaves room for 128-key tiles
    with wide ``wgmma`` at d=128.
  * ``_bwd_dq_kernel``: one query block resident, loops over the key blocks.
A row that saw no key (lse = -inf) gets its lse replaced by +inf, which makes every P of that row exactly 0.
A NaN in a row's delta (a NaN output or dout row) reaches dS of the masked keys of that row's blocks too
(``0 * NaN``): masking dS as well costs a config that spills (bench/compile_report.py), and the NaN pattern of a
gradient inside a block follows the block structure on one device as on several (tests/test_nonfinite.py).
"""
import triton
import triton.language as tl

from ._triton_fwd import LOG2E, _key_range, _load_tile, _logits, _row_bounds, _store_tile, _visible, _visible_t


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
    off_h = tl.program_id(1).to(tl.int64)  # grid (blocks, heads, batch): each axis below CUDA's limits
    off_b = tl.program_id(2).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o_ptrs = OUT + off_b * stride_ob + off_h * stride_oh + offs_m.to(tl.int64)[:, None] * stride_os + offs_d[None, :]
    do_ptrs = DO + off_b * stride_db + off_h * stride_dh + offs_m.to(tl.int64)[:, None] * stride_ds + offs_d[None, :]
    o = _load_tile(o_ptrs, offs_m, S_Q, offs_d, HEAD_DIM, True, MASK_D).to(tl.float32)
    do = _load_tile(do_ptrs, offs_m, S_Q, offs_d, HEAD_DIM, True, MASK_D).to(tl.float32)
    e_ptrs = DELTA + off_b * stride_eb + off_h * stride_eh + offs_m.to(tl.int64) * stride_es
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
def _bwd_dkdv_inner(dk, dv, k, v, Q_src, DO_src, LSE_src, DELTA_src, LO, HI, K_START,
                    stride_qs, stride_qh, stride_ds, stride_dh, stride_ls, stride_lh, stride_es, stride_eh,
                    GROUP, start, stop, offs_m, offs_n, offs_d,
                    S_Q, S_K, DIAG, qk_scale, cap_in, cap_out, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_D: tl.constexpr, MASK: tl.constexpr, MASKED: tl.constexpr, MASK_D: tl.constexpr,
                    SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr):
    """Accumulate dk, dv of one resident key block over query rows [start, stop) of the GROUP query heads that
    read it (GQA). Heads are the inner loop, so a query block's rows and mask are computed once for all of them
    and only dk, dv are carried from head to head.

    Works on transposed tiles (keys on rows): S^T = K Q^T. MASKED: apply the mask (an edge of the visible band).
    ``*_src``: with TMA, tensor descriptors over [S_Q, GROUP, HEAD_DIM] (q, do) and [GROUP, S_Q] (lse, delta)
    that zero-fill past their ends; without, pointers to head 0 of the group.
    """
    if not TMA:
        q_tile = offs_m.to(tl.int64)[:, None] * stride_qs + offs_d[None, :]  # 64-bit: s * stride can pass 2^31
        do_tile = offs_m.to(tl.int64)[:, None] * stride_ds + offs_d[None, :]
        Q_row = Q_src + start.to(tl.int64) * stride_qs  # scalar pointers to the block's first row
        DO_row = DO_src + start.to(tl.int64) * stride_ds
        LSE_row = LSE_src + start.to(tl.int64) * stride_ls
        DELTA_row = DELTA_src + start.to(tl.int64) * stride_es
    for start_m in range(start, stop, BLOCK_M):
        rows = start_m + offs_m
        if MASKED:
            lo_r, hi_r = _row_bounds(LO, HI, K_START, rows, S_Q, MASK)
            keep = _visible_t(rows, offs_n, S_K, DIAG, lo_r, hi_r, MASK)
        if not TMA:  # head g's rows: step a pointer per head (g * stride_h in int32 could pass 2^31)
            Q_g = Q_row
            DO_g = DO_row
            LSE_g = LSE_row
            DELTA_g = DELTA_row
        for g in range(GROUP):
            if TMA:
                q = tl.reshape(Q_src.load([start_m, g, 0]), [BLOCK_M, BLOCK_D])
                do = tl.reshape(DO_src.load([start_m, g, 0]), [BLOCK_M, BLOCK_D])
                lse = tl.reshape(LSE_src.load([g, start_m]), [BLOCK_M])
                # Rows past S_Q read lse 0 and zero q, do: their P is 1 but every product with them is 0.
                lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
                delta = tl.reshape(DELTA_src.load([g, start_m]), [BLOCK_M])
            else:
                q = _load_tile(Q_g + q_tile, rows, S_Q, offs_d, HEAD_DIM, True, MASK_D)
                do = _load_tile(DO_g + do_tile, rows, S_Q, offs_d, HEAD_DIM, True, MASK_D)
                lse2, delta = _load_row_stats(LSE_g + offs_m.to(tl.int64) * stride_ls,
                                              DELTA_g + offs_m.to(tl.int64) * stride_es, rows, S_Q)
                Q_g += stride_qh
                DO_g += stride_dh
                LSE_g += stride_lh
                DELTA_g += stride_eh
            # -- recompute P^T --
            s_t, t_t = _logits(tl.dot(k, tl.trans(q), input_precision=DOT_PREC), qk_scale, cap_in, cap_out,
                               SOFTCAP)
            p_t = tl.math.exp2(s_t - lse2[None, :])  # [BLOCK_N, BLOCK_M]
            if MASKED:
                p_t = tl.where(keep, p_t, 0.0)
            # -- dV += P^T dO --
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PREC)
            # -- dS^T = P^T * (dP^T - delta) (x (1 - tanh^2) when soft-capped), dK += dS^T Q --
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
            ds_t = p_t * (dp_t - delta[None, :])
            if SOFTCAP:
                ds_t = ds_t * (1.0 - t_t * t_t)
            dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PREC)
        if not TMA:
            Q_row += BLOCK_M * stride_qs
            DO_row += BLOCK_M * stride_ds
            LSE_row += BLOCK_M * stride_ls
            DELTA_row += BLOCK_M * stride_es
    return dk, dv


@triton.jit
def _query_range(n0, S_Q, S_K, DIAG, RLO, RHI, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr):
    """Query rows a resident key block (keys ``n0 .. n0+BLOCK_N-1``) must visit, as three segments:
    ``[start, full_lo)`` masked, ``[full_lo, full_hi)`` rows that see the whole block, ``[full_hi, end)`` masked.

    MASK 2: RLO/RHI (s_k,) int32 give per key the first and last row that sees it, both nondecreasing
    (``_masks.transpose_bounds``), so the block's extremes are its first and last keys."""
    if MASK == 2:
        last = tl.minimum(n0 + BLOCK_N, S_K) - 1
        first_row = tl.load(RLO + n0)  # first row that sees the block's first key
        end = tl.maximum(tl.load(RHI + last) + 1, 0)  # one past the last row that sees its last key
        start = tl.minimum(first_row, end) // BLOCK_M * BLOCK_M
        full_lo = (tl.load(RLO + last) + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # rows from here see the last key...
        full_hi = (tl.load(RHI + n0) + 1) // BLOCK_M * BLOCK_M  # ...and rows before here the first one
        none_full = full_hi <= full_lo
        full_lo = tl.where(none_full, end, tl.maximum(full_lo, start))
        full_hi = tl.where(none_full, end, full_hi)
    elif MASK == 1:
        # row i sees key j iff j <= i + DIAG: the first row to see key n0 is n0 - DIAG, and from
        # row n0 + BLOCK_N - 1 - DIAG on a row sees the whole block.
        start = tl.minimum(tl.maximum(n0 - DIAG, 0) // BLOCK_M * BLOCK_M, S_Q)
        full_lo = tl.minimum((tl.maximum(n0 + BLOCK_N - 1 - DIAG, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M, S_Q)
        full_hi = S_Q
        end = S_Q
    else:
        start = tl.minimum(S_Q, 0)
        full_lo = start
        full_hi = S_Q
        end = S_Q
    return start, full_lo, full_hi, end


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, LO, HI, RLO, RHI,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh,
    stride_lb, stride_lh, stride_ls,
    stride_eb, stride_eh, stride_es,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    H_KV, GROUP, S_Q, S_K, DIAG, K_START, qk_scale, sm_scale, cap_in, cap_out,
    LEN_BUCKET,  # autotune key only
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr,
):
    """One program: BLOCK_N keys of one (batch, kv head); adds their dk, dv into DK, DV (fp32).

    TMA: the launcher checked that q, do (16-byte aligned rows and head strides) and lse, delta (unit stride in s,
    16-byte aligned head strides) can be read through tensor descriptors (sm_90+, or the interpreter)."""
    MASK_D: tl.constexpr = BLOCK_D != HEAD_DIM
    off_hk = tl.program_id(1).to(tl.int64)  # grid (blocks, heads, batch): each axis below CUDA's limits
    off_b = tl.program_id(2).to(tl.int64)
    n0 = tl.program_id(0) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    # -- query rows: [start, full_lo) masked, [full_lo, full_hi) see the whole block, [full_hi, end) masked --
    start, full_lo, full_hi, end = _query_range(n0, S_Q, S_K, DIAG, RLO, RHI, BLOCK_M, BLOCK_N, MASK)

    k_ptrs = K + off_b * stride_kb + off_hk * stride_kh + offs_n.to(tl.int64)[:, None] * stride_ks + offs_d[None, :]
    v_ptrs = V + off_b * stride_vb + off_hk * stride_vh + offs_n.to(tl.int64)[:, None] * stride_vs + offs_d[None, :]
    k = _load_tile(k_ptrs, offs_n, S_K, offs_d, HEAD_DIM, True, MASK_D)
    v = _load_tile(v_ptrs, offs_n, S_K, offs_d, HEAD_DIM, True, MASK_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # Keys past S_K were loaded as 0: their rows of dk/dv hold garbage but are never stored.
    off_h0 = off_hk * GROUP  # GQA: query heads off_h0 .. off_h0 + GROUP - 1 read this kv head
    Q_src = Q + off_b * stride_qb + off_h0 * stride_qh
    DO_src = DO + off_b * stride_db + off_h0 * stride_dh
    LSE_src = LSE + off_b * stride_lb + off_h0 * stride_lh
    DELTA_src = DELTA + off_b * stride_eb + off_h0 * stride_eh
    if TMA:  # q, do, lse, delta stream through the tensor memory accelerator: no address registers, no masks
        Q_src = tl.make_tensor_descriptor(Q_src, shape=[S_Q, GROUP, HEAD_DIM], strides=[stride_qs, stride_qh, 1],
                                          block_shape=[BLOCK_M, 1, BLOCK_D])
        DO_src = tl.make_tensor_descriptor(DO_src, shape=[S_Q, GROUP, HEAD_DIM], strides=[stride_ds, stride_dh, 1],
                                           block_shape=[BLOCK_M, 1, BLOCK_D])
        LSE_src = tl.make_tensor_descriptor(LSE_src, shape=[GROUP, S_Q], strides=[stride_lh, 1],
                                            block_shape=[1, BLOCK_M])
        DELTA_src = tl.make_tensor_descriptor(DELTA_src, shape=[GROUP, S_Q], strides=[stride_eh, 1],
                                              block_shape=[1, BLOCK_M])
    inner_args = (LO, HI, K_START, stride_qs, stride_qh, stride_ds, stride_dh, stride_ls, stride_lh, stride_es,
                  stride_eh, GROUP)
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q_src, DO_src, LSE_src, DELTA_src, *inner_args, start, full_lo,
                             offs_m, offs_n, offs_d, S_Q, S_K, DIAG, qk_scale, cap_in, cap_out, HEAD_DIM, BLOCK_M,
                             BLOCK_D, MASK, True, MASK_D, SOFTCAP, DOT_PREC, TMA)
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q_src, DO_src, LSE_src, DELTA_src, *inner_args, full_lo, full_hi,
                             offs_m, offs_n, offs_d, S_Q, S_K, DIAG, qk_scale, cap_in, cap_out, HEAD_DIM, BLOCK_M,
                             BLOCK_D, MASK, False, MASK_D, SOFTCAP, DOT_PREC, TMA)
    if MASK == 2:  # only bounds can end masked: causal and dense blocks are seen by every later row
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q_src, DO_src, LSE_src, DELTA_src, *inner_args, full_hi, end,
                                 offs_m, offs_n, offs_d, S_Q, S_K, DIAG, qk_scale, cap_in, cap_out, HEAD_DIM,
                                 BLOCK_M, BLOCK_D, MASK, True, MASK_D, SOFTCAP, DOT_PREC, TMA)

    # -- add into the fp32 accumulators (this program owns these rows: deterministic) --
    keys64 = offs_n.to(tl.int64)[:, None]
    dk_ptrs = DK + off_b * stride_dkb + off_hk * stride_dkh + keys64 * stride_dks + offs_d[None, :]
    dv_ptrs = DV + off_b * stride_dvb + off_hk * stride_dvh + keys64 * stride_dvs + offs_d[None, :]
    # One fp32 add per element, as a reduction (no value comes back: dk, dv and a loaded tile are never live
    # together); each element is added exactly once per launch, so the result is load + add + store's, bit for bit
    # (deterministic), except that a GPU's red.add.f32 flushes subnormal inputs and sums to zero.
    ok = offs_n[:, None] < S_K
    if MASK_D:
        ok = ok & (offs_d[None, :] < HEAD_DIM)
    tl.atomic_add(dk_ptrs, dk * sm_scale, mask=ok, sem="relaxed")
    tl.atomic_add(dv_ptrs, dv, mask=ok, sem="relaxed")


@triton.jit
def _bwd_dq_inner(dq, q, do, lse2, delta, K_blk, V_blk, stride_ks, stride_vs, start, stop, offs_m, offs_n,
                  offs_d, S_K, DIAG, lo_r, hi_r, qk_scale, cap_in, cap_out, HEAD_DIM: tl.constexpr,
                  BLOCK_N: tl.constexpr, MASK: tl.constexpr, MASKED: tl.constexpr, MASK_D: tl.constexpr,
                  SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr):
    """Accumulate dq of one resident query block over key blocks [start, stop); K_blk/V_blk point at ``start``."""
    k_ptrs = K_blk + offs_n.to(tl.int64)[:, None] * stride_ks + offs_d[None, :]
    v_ptrs = V_blk + offs_n.to(tl.int64)[:, None] * stride_vs + offs_d[None, :]
    for start_n in range(start, stop, BLOCK_N):
        cols = start_n + offs_n
        k = _load_tile(k_ptrs, cols, S_K, offs_d, HEAD_DIM, MASKED, MASK_D)
        v = _load_tile(v_ptrs, cols, S_K, offs_d, HEAD_DIM, MASKED, MASK_D)
        # -- recompute P --
        s, t = _logits(tl.dot(q, tl.trans(k), input_precision=DOT_PREC), qk_scale, cap_in, cap_out, SOFTCAP)
        p = tl.math.exp2(s - lse2[:, None])
        if MASKED:
            # Keys past S_K are zero vectors, but exp2(0 - lse2) can overflow: mask them explicitly.
            p = tl.where(_visible(offs_m, cols, S_K, DIAG, lo_r, hi_r, MASK), p, 0.0)
        # -- dS = P * (dP - delta) (x (1 - tanh^2) when soft-capped), dQ += dS K --
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
        k_ptrs += BLOCK_N * stride_ks
        v_ptrs += BLOCK_N * stride_vs
    return dq


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, LO, HI,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh,
    stride_lb, stride_lh, stride_ls,
    stride_eb, stride_eh, stride_es,
    stride_dqb, stride_dqs, stride_dqh,
    H_Q, GROUP, S_Q, S_K, DIAG, K_START, qk_scale, sm_scale, cap_in, cap_out,
    LEN_BUCKET,  # autotune key only
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, query head); adds their dq into DQ (fp32)."""
    MASK_D: tl.constexpr = BLOCK_D != HEAD_DIM
    off_h = tl.program_id(1).to(tl.int64)  # grid (blocks, heads, batch): each axis below CUDA's limits
    off_b = tl.program_id(2).to(tl.int64)
    off_hk = off_h // GROUP
    m0 = tl.program_id(0) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    # -- key range, as in the forward --
    start, full_lo, full_hi, end = _key_range(m0, S_Q, S_K, DIAG, LO, HI, K_START, BLOCK_M, BLOCK_N, MASK)
    lo_r, hi_r = _row_bounds(LO, HI, K_START, offs_m, S_Q, MASK)

    q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + offs_m.to(tl.int64)[:, None] * stride_qs + offs_d[None, :]
    do_ptrs = DO + off_b * stride_db + off_h * stride_dh + offs_m.to(tl.int64)[:, None] * stride_ds + offs_d[None, :]
    q = _load_tile(q_ptrs, offs_m, S_Q, offs_d, HEAD_DIM, True, MASK_D)
    do = _load_tile(do_ptrs, offs_m, S_Q, offs_d, HEAD_DIM, True, MASK_D)
    rows64 = offs_m.to(tl.int64)
    lse2, delta = _load_row_stats(LSE + off_b * stride_lb + off_h * stride_lh + rows64 * stride_ls,
                                  DELTA + off_b * stride_eb + off_h * stride_eh + rows64 * stride_es, offs_m, S_Q)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    K_head = K + off_b * stride_kb + off_hk * stride_kh
    V_head = V + off_b * stride_vb + off_hk * stride_vh
    if MASK == 2:
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, K_head + start.to(tl.int64) * stride_ks,
                           V_head + start.to(tl.int64) * stride_vs, stride_ks, stride_vs, start, full_lo, offs_m,
                           offs_n, offs_d, S_K, DIAG, lo_r, hi_r, qk_scale, cap_in, cap_out, HEAD_DIM, BLOCK_N,
                           MASK, True, MASK_D, SOFTCAP, DOT_PREC)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, K_head + full_lo.to(tl.int64) * stride_ks,
                       V_head + full_lo.to(tl.int64) * stride_vs, stride_ks, stride_vs, full_lo, full_hi, offs_m,
                       offs_n, offs_d, S_K, DIAG, lo_r, hi_r, qk_scale, cap_in, cap_out, HEAD_DIM, BLOCK_N, MASK,
                       False, MASK_D, SOFTCAP, DOT_PREC)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, K_head + full_hi.to(tl.int64) * stride_ks,
                       V_head + full_hi.to(tl.int64) * stride_vs, stride_ks, stride_vs, full_hi, end, offs_m,
                       offs_n, offs_d, S_K, DIAG, lo_r, hi_r, qk_scale, cap_in, cap_out, HEAD_DIM, BLOCK_N, MASK,
                       True, MASK_D, SOFTCAP, DOT_PREC)

    # -- add into the fp32 accumulator (this program owns these rows: deterministic) --
    dq_ptrs = DQ + off_b * stride_dqb + off_h * stride_dqh + offs_m.to(tl.int64)[:, None] * stride_dqs + offs_d[None, :]
    dq = dq * sm_scale + _load_tile(dq_ptrs, offs_m, S_Q, offs_d, HEAD_DIM, True, MASK_D)
    _store_tile(dq_ptrs, dq, offs_m, S_Q, offs_d, HEAD_DIM, MASK_D)
