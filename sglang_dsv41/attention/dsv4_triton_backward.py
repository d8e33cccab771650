"""Triton backward of the DSV4 sparse sink attention, and the autograd Function around both passes.

With P the sink-inclusive probabilities (recomputed from the saved LSE), Delta = rowsum(dO * O):
  dS = P * (dO @ V^T - Delta),  dQ = scale * dS @ K,
  dKV = scale * dS^T @ Q + P^T @ dO   (K = V: the latent gets both roles' gradients),
  dsink_h = -sum_t exp(sink_h - LSE_th) * Delta_th.
Two query-major kernels walk each token's keys exactly as the forward does:
  * dQ: one program per (token, head block), dQ accumulated in registers; no atomics.
  * dKV: one program per token; per key tile it sums dKV over all head blocks in registers,
    then adds the tile (relaxed atomics: ordering is not needed, only the sum) into fp32 buffers for the window rows and the selected compressed rows
    (atomics: a key is seen by many tokens). Summation order of those adds is not fixed.
dsink is reduced in torch from per-(token, head) terms: deterministic, no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dsv4_triton_forward import (DSV4Blocks, _load_keys, default_blocks, dsv4_forward,
                                  selection_or_empty, sequence_first_rows)
from .triton_common import LOG2E, dot_precision, mma, to_dtype


@triton.jit
def _tile_grads(q, do, k, valid, lse, delta, qk_scale, DOT_PREC: tl.constexpr):
    """-> (p, ds) [BH, BN] fp32 for one key tile; invalid keys get 0."""
    s = mma(q, tl.trans(k), DOT_PREC) * qk_scale
    p = tl.where(valid[None, :], tl.exp2(s - lse[:, None]), 0.0)
    dp = mma(do, tl.trans(k), DOT_PREC)
    return p, p * (dp - delta[:, None])


@triton.jit
def _dsv4_dq_kernel(q_ptr, kv_ptr, comp_ptr, idx_ptr, first_ptr, do_ptr, lse_ptr, delta_ptr,
                    dq_ptr, H, D, window, num_sel, qk_scale, scale, stride_qt, stride_qh,
                    stride_kv, stride_c, stride_idx, BH: tl.constexpr, BN: tl.constexpr,
                    BD: tl.constexpr, DOT_PREC: tl.constexpr):
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    offs_d = tl.arange(0, BD)
    offs_n = tl.arange(0, BN)
    hmask = offs_h < H
    dmask = offs_d < D
    qo = t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    qmask = hmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + qo, mask=qmask, other=0.0)
    do = tl.load(do_ptr + qo, mask=qmask, other=0.0)
    lse = tl.load(lse_ptr + t * H + offs_h, mask=hmask, other=float("inf"))
    delta = tl.load(delta_ptr + t * H + offs_h, mask=hmask, other=0.0)
    acc = tl.zeros([BH, BD], tl.float32)
    hi = t + 1
    lo = tl.maximum(tl.load(first_ptr + t), t + 1 - window)
    for n in range(lo, hi, BN):
        k, valid, _ = _load_keys(kv_ptr, comp_ptr, idx_ptr, idx_ptr, t, n, lo, hi, num_sel,
                                 stride_kv, stride_c, stride_idx, 0, offs_n, offs_d, dmask,
                                 True, False, 1)
        p, ds = _tile_grads(q, do, k, valid, lse, delta, qk_scale, DOT_PREC)
        acc += mma(to_dtype(ds, k.dtype, DOT_PREC), k, DOT_PREC)
    for n in range(0, num_sel, BN):
        k, valid, row = _load_keys(kv_ptr, comp_ptr, idx_ptr, idx_ptr, t, n, lo, hi, num_sel,
                                   stride_kv, stride_c, stride_idx, 0, offs_n, offs_d, dmask,
                                   False, False, 1)
        if tl.max(row, 0) >= 0:
            p, ds = _tile_grads(q, do, k, valid, lse, delta, qk_scale, DOT_PREC)
            acc += mma(to_dtype(ds, k.dtype, DOT_PREC), k, DOT_PREC)
    tl.store(dq_ptr + qo, (acc * scale).to(dq_ptr.dtype.element_ty), mask=qmask)


@triton.jit
def _dkv_tile(q_ptr, do_ptr, lse_ptr, delta_ptr, k, valid, t, H, qk_scale, scale, stride_qt,
              stride_qh, offs_d, dmask, BH: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
              DOT_PREC: tl.constexpr):
    """-> dKV [BN, BD] fp32 of one key tile, summed over all heads of token t."""
    dkv = tl.zeros([BN, BD], tl.float32)
    for h0 in range(0, H, BH):
        offs_h = h0 + tl.arange(0, BH)
        hmask = offs_h < H
        qo = t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
        qmask = hmask[:, None] & dmask[None, :]
        q = tl.load(q_ptr + qo, mask=qmask, other=0.0)
        do = tl.load(do_ptr + qo, mask=qmask, other=0.0)
        lse = tl.load(lse_ptr + t * H + offs_h, mask=hmask, other=float("inf"))
        delta = tl.load(delta_ptr + t * H + offs_h, mask=hmask, other=0.0)
        p, ds = _tile_grads(q, do, k, valid, lse, delta, qk_scale, DOT_PREC)
        dkv += mma(tl.trans(to_dtype(ds * scale, k.dtype, DOT_PREC)), q, DOT_PREC)
        dkv += mma(tl.trans(to_dtype(p, k.dtype, DOT_PREC)), do, DOT_PREC)
    return dkv


@triton.jit
def _dsv4_dkv_kernel(q_ptr, kv_ptr, comp_ptr, idx_ptr, first_ptr, do_ptr, lse_ptr, delta_ptr,
                     dkv_ptr, dcomp_ptr, H, D, window, num_sel, qk_scale, scale, stride_qt,
                     stride_qh, stride_kv, stride_c, stride_idx, BH: tl.constexpr,
                     BN: tl.constexpr, BD: tl.constexpr, DOT_PREC: tl.constexpr):
    t = tl.program_id(0)
    offs_d = tl.arange(0, BD)
    offs_n = tl.arange(0, BN)
    dmask = offs_d < D
    hi = t + 1
    lo = tl.maximum(tl.load(first_ptr + t), t + 1 - window)
    for n in range(lo, hi, BN):
        k, valid, row = _load_keys(kv_ptr, comp_ptr, idx_ptr, idx_ptr, t, n, lo, hi, num_sel,
                                   stride_kv, stride_c, stride_idx, 0, offs_n, offs_d, dmask,
                                   True, False, 1)
        dkv = _dkv_tile(q_ptr, do_ptr, lse_ptr, delta_ptr, k, valid, t, H, qk_scale, scale,
                        stride_qt, stride_qh, offs_d, dmask, BH, BN, BD, DOT_PREC)
        tl.atomic_add(dkv_ptr + row[:, None].to(tl.int64) * D + offs_d[None, :], dkv,
                      mask=valid[:, None] & dmask[None, :], sem="relaxed")
    for n in range(0, num_sel, BN):
        k, valid, row = _load_keys(kv_ptr, comp_ptr, idx_ptr, idx_ptr, t, n, lo, hi, num_sel,
                                   stride_kv, stride_c, stride_idx, 0, offs_n, offs_d, dmask,
                                   False, False, 1)
        if tl.max(row, 0) >= 0:
            dkv = _dkv_tile(q_ptr, do_ptr, lse_ptr, delta_ptr, k, valid, t, H, qk_scale, scale,
                            stride_qt, stride_qh, offs_d, dmask, BH, BN, BD, DOT_PREC)
            tl.atomic_add(dcomp_ptr + row[:, None].to(tl.int64) * D + offs_d[None, :], dkv,
                          mask=valid[:, None] & dmask[None, :], sem="relaxed")


def dsv4_backward(q, kv, sinks, first_rows, window, scale, comp_kv, comp_idx, out, lse, dout,
                  blocks: DSV4Blocks):
    """-> (dq, dkv, dsinks or None, dcomp_kv) for contiguous inputs saved by the forward."""
    total, heads, dim = q.shape
    dout = dout.contiguous()
    delta = (dout.float() * out.float()).sum(-1)                                  # [T, H]
    dsinks = None
    if sinks is not None:
        p_sink = torch.exp2(sinks.float()[None, :] * LOG2E - lse)
        dsinks = -(p_sink * delta).sum(0)
    dq = torch.empty_like(q)
    dkv32 = torch.zeros(total, dim, device=q.device, dtype=torch.float32)
    dcomp32 = torch.zeros(comp_kv.shape[0], dim, device=q.device, dtype=torch.float32)
    if total == 0:
        return dq, dkv32.to(kv.dtype), dsinks, dcomp32.to(comp_kv.dtype)
    bd, prec, num_sel = triton.next_power_of_2(dim), dot_precision(q.dtype), comp_idx.shape[1]
    common = (q.stride(0), q.stride(1), kv.stride(0), comp_kv.stride(0), comp_idx.stride(0))
    _dsv4_dq_kernel[(total, triton.cdiv(heads, blocks.dq_bh))](
        q, kv, comp_kv, comp_idx, first_rows, dout, lse, delta, dq, heads, dim, window, num_sel,
        scale * LOG2E, scale, *common, BH=blocks.dq_bh, BN=blocks.dq_bn, BD=bd, DOT_PREC=prec,
        num_warps=blocks.dq_warps, num_stages=blocks.dq_stages)
    _dsv4_dkv_kernel[(total,)](
        q, kv, comp_kv, comp_idx, first_rows, dout, lse, delta, dkv32, dcomp32, heads, dim,
        window, num_sel, scale * LOG2E, scale, *common, BH=blocks.dkv_bh, BN=blocks.dkv_bn,
        BD=bd, DOT_PREC=prec, num_warps=blocks.dkv_warps, num_stages=blocks.dkv_stages)
    return dq, dkv32.to(kv.dtype), dsinks, dcomp32.to(comp_kv.dtype)


class DSV4AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, sinks, comp_kv, cu_seqlens, window, scale, comp_idx, blocks):
        total, heads, dim = q.shape
        q, kv = q.contiguous(), kv.contiguous()
        first_rows = sequence_first_rows(cu_seqlens, total)
        ckv, cidx = selection_or_empty(comp_kv, comp_idx, total, dim, kv)
        sink32 = sinks.float().contiguous() if sinks is not None else None
        out, lse = dsv4_forward(q, kv, sink32, first_rows, window, scale, ckv, cidx, blocks)
        ctx.save_for_backward(q, kv, sink32, ckv, cidx, first_rows, out, lse)
        ctx.window, ctx.scale, ctx.blocks = window, scale, blocks
        ctx.has_comp = comp_kv is not None
        ctx.comp_rows = 0 if comp_kv is None else comp_kv.shape[0]
        ctx.sink_dtype = None if sinks is None else sinks.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, sink32, ckv, cidx, first_rows, out, lse = ctx.saved_tensors
        dq, dkv, dsinks, dcomp = dsv4_backward(q, kv, sink32, first_rows, ctx.window, ctx.scale,
                                               ckv, cidx, out, lse, dout, ctx.blocks)
        if dsinks is not None:
            dsinks = dsinks.to(ctx.sink_dtype)
        dcomp = dcomp[:ctx.comp_rows] if ctx.has_comp else None
        return dq, dkv, dsinks, dcomp, None, None, None, None, None


def dsv4_attention_triton(q, kv, sinks, cu_seqlens, window, scale, comp_kv=None, comp_idx=None,
                          blocks: DSV4Blocks | None = None):
    """Validated inputs -> [T, H, D]; differentiable in q, kv, sinks and comp_kv."""
    blocks = blocks or default_blocks(q.shape[1])
    return DSV4AttentionFunction.apply(q, kv, sinks, comp_kv, cu_seqlens, window, scale,
                                       comp_idx, blocks)
