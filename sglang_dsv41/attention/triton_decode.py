"""Triton split-K decode with sinks over a paged KV cache.

One program reads one key range of one KV head for one sequence and serves every query head of
its GQA group, so each cached K/V byte is read once. Each split writes a partial output and its
log2-sum-exp without the sink; the combine kernel merges the splits and adds the sink to the
denominator (out = sum_s 2^(lse_s - m) o_s / (2^(sink - m) + sum_s 2^(lse_s - m))).
The number of splits comes from the page-table width, not from seq_lens, so there is no host
sync and the launch is CUDA-graph friendly; splits past a sequence's end exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import LOG2E, dot_precision, interpreting, mma, sm_count, to_dtype


@triton.jit
def _decode_split_kernel(Q, KC, VC, PageTable, SeqLens, PartOut, PartLse,
                         stride_qb, stride_qh, stride_kp, stride_ks, stride_kh,
                         stride_vp, stride_vs, stride_vh, stride_ptb,
                         stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
                         qk_scale, window, keys_per_split,
                         REP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                         HAS_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr, STAGES: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    n = tl.load(SeqLens + seq).to(tl.int32)
    if HAS_WINDOW:
        first = tl.maximum(n - window, 0)
    else:
        first = n * 0
    lo = first + split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, n)

    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * REP + offs_h
    h_ok = offs_h < REP
    d_ok = offs_d[None, :] < HEAD_DIM
    q = tl.load(Q + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_ok, other=0.0)
    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) + float("-inf")
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for start in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
        kpos = start + offs_n
        k_ok = kpos < hi
        page = tl.load(PageTable + seq * stride_ptb + kpos // PAGE_SIZE, mask=k_ok, other=0)
        page = page.to(tl.int64)
        slot = kpos % PAGE_SIZE
        kv_mask = k_ok[:, None] & d_ok
        k = tl.load(KC + page[:, None] * stride_kp + slot[:, None] * stride_ks
                    + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(VC + page[:, None] * stride_vp + slot[:, None] * stride_vs
                    + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = mma(q, tl.trans(k), DOT_PREC) * qk_scale
        qk = tl.where(k_ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mma(to_dtype(p, v.dtype, DOT_PREC), v, DOT_PREC)
        m_i = m_new
    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.math.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    tl.store(PartOut + seq * stride_pob + heads[:, None] * stride_poh + split * stride_pos
             + offs_d[None, :], out, mask=h_ok[:, None] & d_ok)
    tl.store(PartLse + seq * stride_plb + heads * stride_plh + split, lse, mask=h_ok)


@triton.jit
def _decode_combine_kernel(PartOut, PartLse, Sinks, Out, num_splits,
                           stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
                           stride_ob, stride_oh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_S: tl.constexpr, HAS_SINKS: tl.constexpr,
                           DOT_PREC: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    lse = tl.load(PartLse + seq * stride_plb + head * stride_plh + offs_s, mask=s_ok,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m_use)
    denom = tl.sum(w, 0)
    if HAS_SINKS:
        denom += tl.math.exp2(sink - m_use)
    o = tl.load(PartOut + seq * stride_pob + head * stride_poh + offs_s[:, None] * stride_pos
                + offs_d[None, :], mask=s_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(Out + seq * stride_ob + head * stride_oh + offs_d,
             to_dtype(out, Out.dtype.element_ty, DOT_PREC),
             mask=offs_d < HEAD_DIM)


def _num_splits(device, batch: int, num_kv_heads: int, num_key_blocks: int) -> int:
    if device.type != "cuda":
        return max(1, min(num_key_blocks, 2))
    # Enough programs for ~4 waves of the SMs; more splits only add combine traffic.
    want = triton.cdiv(4 * sm_count(device), max(batch * num_kv_heads, 1))
    return max(1, min(num_key_blocks, want, 64))


def sink_decode_triton(q, k_cache, v_cache, page_table, seq_lens, sinks, window=None,
                       softmax_scale=None, num_splits: int | None = None,
                       block_n: int | None = None):
    """q [B, Hq, D]; k_cache/v_cache [num_pages, page_size, Hkv, D] -> [B, Hq, D]."""
    batch, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    rep = num_heads // num_kv_heads
    scale = softmax_scale if softmax_scale is not None else head_dim ** -0.5
    out = torch.empty_like(q)
    if batch == 0:
        return out
    if block_n is None:
        block_n = 16 if interpreting() or head_dim > 256 else (64 if head_dim <= 128 else 32)
    stages = 1 if interpreting() else (3 if head_dim <= 128 else 2)
    max_keys = page_table.shape[1] * page_size
    if window is not None:
        max_keys = min(max_keys, window)
    num_key_blocks = max(1, triton.cdiv(max_keys, block_n))
    if num_splits is None:
        num_splits = _num_splits(q.device, batch, num_kv_heads, num_key_blocks)
    num_splits = max(1, min(num_splits, num_key_blocks))
    keys_per_split = triton.cdiv(num_key_blocks, num_splits) * block_n
    num_splits = triton.cdiv(max(max_keys, 1), keys_per_split)
    part_out = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32,
                           device=q.device)
    part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(max(head_dim, 16))
    block_h = max(16, triton.next_power_of_2(rep))  # tl.dot needs at least 16 rows
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, page_table, seq_lens, part_out, part_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), page_table.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0),
        part_lse.stride(1), scale * LOG2E, window if window is not None else 0, keys_per_split,
        REP=rep, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=block_h,
        BLOCK_N=block_n, PAGE_SIZE=page_size, HAS_WINDOW=window is not None,
        DOT_PREC=dot_precision(q.dtype), STAGES=stages,
        num_warps=1 if interpreting() else (4 if block_h * block_d <= 16384 else 8),
        num_stages=stages,
    )
    _decode_combine_kernel[(batch, num_heads)](
        part_out, part_lse, sinks if sinks is not None else part_lse, out, num_splits,
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0),
        part_lse.stride(1), out.stride(0), out.stride(1), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_S=triton.next_power_of_2(num_splits), HAS_SINKS=sinks is not None,
        DOT_PREC=dot_precision(q.dtype),
    )
    return out
