"""Triton forward of varlen sink attention; returns the output and the sink-inclusive LSE.

Scores are kept in base 2 (scale folded with log2(e)). The running max starts at the sink logit
and the running sum at exp2(sink - max) = 1, so the sink enters the denominator with no value
vector. The saved LSE is log2-based and +inf for rows with an empty denominator (no sink and
no visible key): every probability recomputed from it in the backward is then exactly 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import (LOG2E, PrefillBlocks, dot_precision, key_block_ranges, load_tile,
                            mma, to_dtype)


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, lo, hi, qpos, lk, window,
               offs_n, offs_d, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
               HAS_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr, STAGES: tl.constexpr):
    d_ok = offs_d[None, :] < HEAD_DIM
    k_ptrs = k_base + offs_n[:, None] * stride_kt + offs_d[None, :]
    v_ptrs = v_base + offs_n[:, None] * stride_vt + offs_d[None, :]
    for start in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
        kpos = start + offs_n
        kv_mask = (kpos[:, None] < lk) & d_ok
        k = load_tile(k_ptrs + start * stride_kt, kv_mask, MASK or HEAD_DIM != BLOCK_D)
        qk = mma(q, tl.trans(k), DOT_PREC) * qk_scale
        if MASK:
            valid = kpos[None, :] < lk
            if CAUSAL:
                valid = valid & (kpos[None, :] <= qpos[:, None])
            if HAS_WINDOW:
                valid = valid & (kpos[None, :] > qpos[:, None] - window)
            qk = tl.where(valid, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        if MASK:
            # A row with nothing visible yet keeps max -inf; shift by 0 so exp2 gives 0, not NaN.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = tl.math.exp2(qk - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_tile(v_ptrs + start * stride_vt, kv_mask, MASK or HEAD_DIM != BLOCK_D)
        acc = acc * alpha[:, None] + mma(to_dtype(p, v.dtype, DOT_PREC), v, DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(Q, K, V, Sinks, Out, Lse, CuQ, CuK,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                stride_ot, stride_oh, stride_lse_h,
                qk_scale, window, num_m_blocks,
                REP, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, DOT_PREC: tl.constexpr,
                STAGES: tl.constexpr):
    head = tl.program_id(0)
    seq = tl.program_id(1)
    # Heaviest (last) query blocks of causal attention launch first.
    m_block = num_m_blocks - 1 - tl.program_id(2)
    q_start = tl.load(CuQ + seq)
    lq = tl.load(CuQ + seq + 1) - q_start
    m0 = m_block * BLOCK_M
    if m0 >= lq:
        return
    k_start = tl.load(CuK + seq)
    lk = tl.load(CuK + seq + 1) - k_start
    off = lk - lq
    kv_head = head // REP

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < lq
    q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=q_mask, other=0.0)
    qpos = off + offs_m

    if HAS_SINKS:
        sink = tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    else:
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + float("-inf")
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    p_min = off + m0
    p_max = off + tl.minimum(m0 + BLOCK_M, lq) - 1
    lo, full_lo, full_hi, hi = key_block_ranges(p_min, p_max, lk, window, BLOCK_N, CAUSAL,
                                                HAS_WINDOW)
    k_base = K + k_start * stride_kt + kv_head * stride_kh
    v_base = V + k_start * stride_vt + kv_head * stride_vh
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, lo,
                               full_lo, qpos, lk, window, offs_n, offs_d, qk_scale, HEAD_DIM,
                               BLOCK_D, BLOCK_N, True, CAUSAL, HAS_WINDOW, DOT_PREC, STAGES)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, full_lo,
                               full_hi, qpos, lk, window, offs_n, offs_d, qk_scale, HEAD_DIM,
                               BLOCK_D, BLOCK_N, False, CAUSAL, HAS_WINDOW, DOT_PREC, STAGES)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, full_hi,
                               hi, qpos, lk, window, offs_n, offs_d, qk_scale, HEAD_DIM,
                               BLOCK_D, BLOCK_N, True, CAUSAL, HAS_WINDOW, DOT_PREC, STAGES)

    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.math.log2(tl.where(nonempty, l_i, 1.0)), float("inf"))
    tl.store(Out + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             to_dtype(out, Out.dtype.element_ty, DOT_PREC), mask=q_mask)
    tl.store(Lse + head * stride_lse_h + q_start + offs_m, lse, mask=row_ok)


def sink_attention_forward(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                           causal: bool, window: int | None, softmax_scale: float,
                           blocks: PrefillBlocks):
    """-> (out [total_q, Hq, D] in q's dtype, lse2 [Hq, total_q] fp32, log2-based)."""
    total_q, num_heads, head_dim = q.shape
    rep = num_heads // k.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty((num_heads, total_q), dtype=torch.float32, device=q.device)
    num_seqs = cu_seqlens_q.numel() - 1
    num_m_blocks = triton.cdiv(max_seqlen_q, blocks.fwd_m)
    if total_q == 0 or num_seqs == 0 or num_m_blocks == 0:
        lse.fill_(float("inf"))
        return out.zero_(), lse
    grid = (num_heads, num_seqs, num_m_blocks)
    _fwd_kernel[grid](
        q, k, v, sinks if sinks is not None else q, out, lse, cu_seqlens_q, cu_seqlens_k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        softmax_scale * LOG2E, window if window is not None else 0, num_m_blocks,
        REP=rep, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(max(head_dim, 16)),
        BLOCK_M=blocks.fwd_m, BLOCK_N=blocks.fwd_n, CAUSAL=causal,
        HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None,
        DOT_PREC=dot_precision(q.dtype), STAGES=blocks.fwd_stages,
        num_warps=blocks.fwd_warps, num_stages=blocks.fwd_stages,
    )
    return out, lse
