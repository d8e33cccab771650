"""Triton backward of varlen sink attention: dQ, dK, dV and a deterministic dsink.

Given the sink-corrected output O and the sink-inclusive LSE L, the gradients of Q, K and V are
the plain flash-attention ones (P = exp(S - L) already carries the sink in its denominator).
The sink gradient is dsink_h = -sum_i exp(b_h - L_i) * D_i with D_i = dO_i . O_i: the
preprocess kernel writes one fp32 partial per (head, query block) and a second kernel adds them
in a fixed order, so two runs give bitwise equal dsink (no atomics anywhere).
dK/dV programs own one key block of one KV head and loop over every query head of its GQA
group, so dK/dV need no atomics either; dQ programs own one query block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import (LOG2E, PrefillBlocks, dot_precision, key_block_ranges,
                            load_tile, mma, query_block_ranges, sm_count,
                            to_dtype)


@triton.jit
def _preprocess_kernel(Out, DOut, Lse, Sinks, Delta, Partial,
                       stride_ot, stride_oh, stride_dot, stride_doh, stride_lse_h, stride_part_h,
                       num_m_blocks, CuQ, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_M: tl.constexpr, HAS_SINKS: tl.constexpr):
    head = tl.program_id(0)
    seq = tl.program_id(1)
    m_block = tl.program_id(2)
    q_start = tl.load(CuQ + seq)
    lq = tl.load(CuQ + seq + 1) - q_start
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < lq
    mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    tok = q_start + rows
    o = tl.load(Out + tok[:, None] * stride_ot + head * stride_oh + offs_d[None, :], mask=mask,
                other=0.0).to(tl.float32)
    do = tl.load(DOut + tok[:, None] * stride_dot + head * stride_doh + offs_d[None, :],
                 mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    tl.store(Delta + head * stride_lse_h + tok, delta, mask=row_ok)
    if HAS_SINKS:
        sink = tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634
        lse = tl.load(Lse + head * stride_lse_h + tok, mask=row_ok, other=float("inf"))
        p_sink = tl.math.exp2(sink - lse)
        partial = -tl.sum(tl.where(row_ok, p_sink * delta, 0.0), 0)
        tl.store(Partial + head * stride_part_h + seq * num_m_blocks + m_block, partial)


@triton.jit
def _sum_rows_kernel(Partial, DSink, n, stride_h, BLOCK: tl.constexpr):
    head = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        acc += tl.load(Partial + head * stride_h + idx, mask=idx < n, other=0.0)
    tl.store(DSink + head, tl.sum(acc, 0))


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot,
                lo, hi, kpos, lq, off, window, offs_m, offs_d, qk_scale,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                MASK: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                DOT_PREC: tl.constexpr, STAGES: tl.constexpr):
    d_col = offs_d[:, None] < HEAD_DIM
    d_row = offs_d[None, :] < HEAD_DIM
    for start in tl.range(lo, hi, BLOCK_M, num_stages=STAGES):
        rows = start + offs_m
        row_ok = rows < lq
        if MASK:
            lse = tl.load(lse_base + rows, mask=row_ok, other=float("inf"))
            delta = tl.load(delta_base + rows, mask=row_ok, other=0.0)
        else:
            lse = tl.load(lse_base + rows)
            delta = tl.load(delta_base + rows)
        q_t = load_tile(q_base + rows[None, :] * stride_qt + offs_d[:, None],
                        d_col & row_ok[None, :], MASK or HEAD_DIM != BLOCK_D)
        p_t = tl.math.exp2(mma(k, q_t, DOT_PREC) * qk_scale - lse[None, :])
        if MASK:
            qpos = off + rows
            valid = row_ok[None, :]
            if CAUSAL:
                valid = valid & (kpos[:, None] <= qpos[None, :])
            if HAS_WINDOW:
                valid = valid & (kpos[:, None] > qpos[None, :] - window)
            p_t = tl.where(valid, p_t, 0.0)
        do = load_tile(do_base + rows[:, None] * stride_dot + offs_d[None, :],
                       row_ok[:, None] & d_row, MASK or HEAD_DIM != BLOCK_D)
        dv += mma(to_dtype(p_t, do.dtype, DOT_PREC), do, DOT_PREC)
        dp_t = mma(v, tl.trans(do), DOT_PREC)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += mma(to_dtype(ds_t, q_t.dtype, DOT_PREC), tl.trans(q_t), DOT_PREC)
    return dk, dv


@triton.jit
def _dkdv_kernel(Q, K, V, DOut, Lse, Delta, DK, DV, CuQ, CuK,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                 stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                 stride_dks, stride_dvs, stride_lse_h, sm_scale, qk_scale, window,
                 REP, NUM_SPLITS, HEADS_PER_SPLIT, HEAD_DIM: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr,
                 STAGES: tl.constexpr):
    # With NUM_SPLITS > 1, DK/DV are fp32 partial buffers [NUM_SPLITS, total_k, Hkv, D], one
    # slice per split of the GQA group, summed afterwards in a fixed order (no atomics).
    kv_head = tl.program_id(0) // NUM_SPLITS
    split = tl.program_id(0) % NUM_SPLITS
    seq = tl.program_id(1)
    n0 = tl.program_id(2) * BLOCK_N
    k_start = tl.load(CuK + seq)
    lk = tl.load(CuK + seq + 1) - k_start
    if n0 >= lk:
        return
    q_start = tl.load(CuQ + seq)
    lq = tl.load(CuQ + seq + 1) - q_start
    off = lk - lq
    kpos = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (kpos[:, None] < lk) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(K + (k_start + kpos)[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(V + (k_start + kpos)[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    k_max = tl.minimum(n0 + BLOCK_N, lk) - 1
    lo, full_lo, full_hi, hi = query_block_ranges(n0, k_max, lq, off, window, BLOCK_M, CAUSAL,
                                                  HAS_WINDOW)
    g0 = split * HEADS_PER_SPLIT
    for g in range(g0, tl.minimum(g0 + HEADS_PER_SPLIT, REP)):
        head = kv_head * REP + g
        q_base = Q + q_start * stride_qt + head * stride_qh
        do_base = DOut + q_start * stride_dot + head * stride_doh
        lse_base = Lse + head * stride_lse_h + q_start
        delta_base = Delta + head * stride_lse_h + q_start
        # Masked edge, unmasked middle, masked edge (see query_block_ranges).
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt,
                             stride_dot, lo, full_lo, kpos, lq, off, window, offs_m, offs_d,
                             qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, True, CAUSAL, HAS_WINDOW,
                             DOT_PREC, STAGES)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt,
                             stride_dot, full_lo, full_hi, kpos, lq, off, window, offs_m, offs_d,
                             qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, False, CAUSAL, HAS_WINDOW,
                             DOT_PREC, STAGES)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt,
                             stride_dot, full_hi, hi, kpos, lq, off, window, offs_m, offs_d,
                             qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, True, CAUSAL, HAS_WINDOW,
                             DOT_PREC, STAGES)
    tok = k_start + kpos
    dk_base = DK + split * stride_dks
    dv_base = DV + split * stride_dvs
    tl.store(dk_base + tok[:, None] * stride_dkt + kv_head * stride_dkh + offs_d[None, :],
             to_dtype(dk * sm_scale, DK.dtype.element_ty, DOT_PREC), mask=kv_mask)
    tl.store(dv_base + tok[:, None] * stride_dvt + kv_head * stride_dvh + offs_d[None, :],
             to_dtype(dv, DV.dtype.element_ty, DOT_PREC), mask=kv_mask)


@triton.jit
def _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, lo, hi, qpos, lk,
              window, offs_n, offs_d, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_N: tl.constexpr,
              MASK: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
              DOT_PREC: tl.constexpr, STAGES: tl.constexpr):
    d_col = offs_d[:, None] < HEAD_DIM
    for start in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
        kpos = start + offs_n
        kt_mask = d_col & (kpos[None, :] < lk)
        k_t = load_tile(k_base + kpos[None, :] * stride_kt + offs_d[:, None], kt_mask,
                        MASK or HEAD_DIM != BLOCK_D)
        v_t = load_tile(v_base + kpos[None, :] * stride_vt + offs_d[:, None], kt_mask,
                        MASK or HEAD_DIM != BLOCK_D)
        p = tl.math.exp2(mma(q, k_t, DOT_PREC) * qk_scale - lse[:, None])
        if MASK:
            valid = kpos[None, :] < lk
            if CAUSAL:
                valid = valid & (kpos[None, :] <= qpos[:, None])
            if HAS_WINDOW:
                valid = valid & (kpos[None, :] > qpos[:, None] - window)
            p = tl.where(valid, p, 0.0)
        dp = mma(do, v_t, DOT_PREC)
        ds = p * (dp - delta[:, None])
        dq += mma(to_dtype(ds, k_t.dtype, DOT_PREC), tl.trans(k_t), DOT_PREC)
    return dq


@triton.jit
def _dq_kernel(Q, K, V, DOut, Lse, Delta, DQ, CuQ, CuK,
               stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
               stride_dot, stride_doh, stride_dqt, stride_dqh, stride_lse_h,
               sm_scale, qk_scale, window, num_m_blocks,
               REP, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
               HAS_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr, STAGES: tl.constexpr):
    head = tl.program_id(0)
    seq = tl.program_id(1)
    m0 = (num_m_blocks - 1 - tl.program_id(2)) * BLOCK_M
    q_start = tl.load(CuQ + seq)
    lq = tl.load(CuQ + seq + 1) - q_start
    if m0 >= lq:
        return
    k_start = tl.load(CuK + seq)
    lk = tl.load(CuK + seq + 1) - k_start
    off = lk - lq
    kv_head = head // REP
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < lq
    mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    tok = q_start + rows
    q = tl.load(Q + tok[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=mask,
                other=0.0)
    do = tl.load(DOut + tok[:, None] * stride_dot + head * stride_doh + offs_d[None, :],
                 mask=mask, other=0.0)
    lse = tl.load(Lse + head * stride_lse_h + tok, mask=row_ok, other=float("inf"))
    delta = tl.load(Delta + head * stride_lse_h + tok, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qpos = off + rows
    p_min = off + m0
    p_max = off + tl.minimum(m0 + BLOCK_M, lq) - 1
    lo, full_lo, full_hi, hi = key_block_ranges(p_min, p_max, lk, window, BLOCK_N, CAUSAL,
                                                HAS_WINDOW)
    k_base = K + k_start * stride_kt + kv_head * stride_kh
    v_base = V + k_start * stride_vt + kv_head * stride_vh
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, lo, full_lo, qpos,
                   lk, window, offs_n, offs_d, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, True,
                   CAUSAL, HAS_WINDOW, DOT_PREC, STAGES)
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, full_lo, full_hi,
                   qpos, lk, window, offs_n, offs_d, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, False,
                   CAUSAL, HAS_WINDOW, DOT_PREC, STAGES)
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, full_hi, hi, qpos,
                   lk, window, offs_n, offs_d, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, True,
                   CAUSAL, HAS_WINDOW, DOT_PREC, STAGES)
    tl.store(DQ + tok[:, None] * stride_dqt + head * stride_dqh + offs_d[None, :],
             to_dtype(dq * sm_scale, DQ.dtype.element_ty, DOT_PREC), mask=mask)


def sink_attention_backward(dout, q, k, v, out, lse, sinks, cu_seqlens_q, cu_seqlens_k,
                            max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                            window: int | None, softmax_scale: float, blocks: PrefillBlocks):
    """-> (dq, dk, dv, dsink fp32 [Hq] or None)."""
    total_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rep = num_heads // num_kv_heads
    num_seqs = cu_seqlens_q.numel() - 1
    dout = dout.contiguous()
    # Every row is written: callers guarantee cu_seqlens cover the whole q and k tensors.
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dsink = torch.zeros(num_heads, dtype=torch.float32, device=q.device) if sinks is not None \
        else None
    if num_seqs == 0 or total_q == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), dsink
    block_d = triton.next_power_of_2(max(head_dim, 16))
    prec = dot_precision(q.dtype)
    win = window if window is not None else 0
    qk_scale = softmax_scale * LOG2E

    num_pre_blocks = triton.cdiv(max_seqlen_q, blocks.pre_m)
    delta = torch.empty_like(lse)
    partial = torch.zeros((num_heads, num_seqs * num_pre_blocks), dtype=torch.float32,
                          device=q.device)
    _preprocess_kernel[(num_heads, num_seqs, num_pre_blocks)](
        out, dout, lse, sinks if sinks is not None else lse, delta, partial,
        out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), lse.stride(0),
        partial.stride(0), num_pre_blocks, cu_seqlens_q,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=blocks.pre_m, HAS_SINKS=sinks is not None,
    )
    if sinks is not None:
        _sum_rows_kernel[(num_heads,)](partial, dsink, partial.shape[1], partial.stride(0),
                                       BLOCK=256)

    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               dout.stride(0), dout.stride(1))
    num_n_blocks = triton.cdiv(max_seqlen_k, blocks.dkdv_n)
    if num_n_blocks > 0:
        programs = num_kv_heads * num_seqs * num_n_blocks
        splits = blocks.dkdv_splits or triton.cdiv(4 * sm_count(q.device), programs)
        per_split = triton.cdiv(rep, max(1, min(splits, rep)))
        splits = triton.cdiv(rep, per_split)
        if splits > 1:
            dk_out = torch.empty((splits, *k.shape), dtype=torch.float32, device=k.device)
            dv_out = torch.empty((splits, *v.shape), dtype=torch.float32, device=v.device)
        else:
            dk_out, dv_out = dk.unsqueeze(0), dv.unsqueeze(0)
        _dkdv_kernel[(num_kv_heads * splits, num_seqs, num_n_blocks)](
            q, k, v, dout, lse, delta, dk_out, dv_out, cu_seqlens_q, cu_seqlens_k, *strides,
            dk_out.stride(1), dk_out.stride(2), dv_out.stride(1), dv_out.stride(2),
            dk_out.stride(0), dv_out.stride(0), lse.stride(0), softmax_scale, qk_scale, win,
            REP=rep, NUM_SPLITS=splits, HEADS_PER_SPLIT=per_split, HEAD_DIM=head_dim,
            BLOCK_D=block_d, BLOCK_M=blocks.dkdv_m, BLOCK_N=blocks.dkdv_n, CAUSAL=causal,
            HAS_WINDOW=window is not None, DOT_PREC=prec, STAGES=blocks.dkdv_stages,
            num_warps=blocks.dkdv_warps, num_stages=blocks.dkdv_stages,
        )
        if splits > 1:
            dk.copy_(dk_out.sum(0))
            dv.copy_(dv_out.sum(0))
    num_m_blocks = triton.cdiv(max_seqlen_q, blocks.dq_m)
    _dq_kernel[(num_heads, num_seqs, num_m_blocks)](
        q, k, v, dout, lse, delta, dq, cu_seqlens_q, cu_seqlens_k, *strides,
        dq.stride(0), dq.stride(1), lse.stride(0), softmax_scale, qk_scale, win, num_m_blocks,
        REP=rep, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=blocks.dq_m, BLOCK_N=blocks.dq_n,
        CAUSAL=causal, HAS_WINDOW=window is not None, DOT_PREC=prec, STAGES=blocks.dq_stages,
        num_warps=blocks.dq_warps, num_stages=blocks.dq_stages,
    )
    return dq, dk, dv, dsink
