"""Triton forward of the DSV4 sparse sink attention (contract: dsv4_reference.py).

One program per (query token, block of heads). All heads of a token share one K=V latent
(MQA), so the heads are the M side of every tile: q [BH, D] against gathered keys [BN, D].
Two key sources per token, walked in order with one online softmax seeded by the sink:
  1. the sliding window, positions (pos - window, pos] of the token's sequence, contiguous rows
     of the packed `kv` (paged decode has its own kernels: dsv4_triton_decode.py);
  2. the token's compressed selection, rows of `comp_kv` listed in comp_idx[t] (-1 = none).
The selection loop stops at the token's last valid pick (sel_end[t], one torch reduction before
the launch; the indexer puts its invalid picks last, so padding costs nothing) and has no branch
in its body, so Triton can software-pipeline its index and key loads (a branch in a loop body
keeps Triton's pipeliner off, and each gathered tile then pays its full load latency).

At 33-64 heads, D 512, bf16 on sm_90 dsv4_forward launches dsv4_gluon's kernel instead (the
decode's, one program a token): with 64 heads a program Triton lays the score MMA on all eight
warps along M, so both warpgroups compute every score (4k CSA on an H200: 1.40 vs 0.99 ms).

Scores use exp2 with log2(e) folded into the scale; the saved LSE is in the same log2 units and
sink-inclusive; a row that sees nothing (and has no sink) stores +inf so the backward's
probabilities are 0 there.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import triton
import triton.language as tl

from .triton_common import (LOG2E, dot_precision, gluon_kernels, interpreting, mma, to_dtype,
                            warn_unbuilt, wgmma_applies)


@dataclass(frozen=True)
class DSV4Blocks:
    """Tile sizes of the DSV4 kernels: heads per program (bh), keys per tile (bn), D columns per
    program (bd; the P/dS pass: D columns per step of its scores' loop), warps, stages. fwd:
    forward; ds: the backward's P/dS pass (which also adds the selection dKV); dq: dQ = dS @ K;
    dkv: window dKV (all heads at once, split over D; dkv_rows: (query, head) rows a step of its
    loop, dkv_rows / heads queries, at least one). narrow_selection: the forward's selection
    tiles narrow when K is small (selection_tile). fwd_wgmma: where it applies (wgmma_applies:
    33-64 heads, D 512, bf16 on an sm_90 GPU) the forward is dsv4_gluon's kernel, not this
    module's (its fwd_ tiles then unused)."""

    fwd_bh: int = 64
    fwd_bn: int = 64
    fwd_warps: int = 8
    fwd_stages: int = 2
    ds_bh: int = 64
    ds_bn: int = 64
    ds_bd: int = 64
    ds_warps: int = 4
    ds_stages: int = 3
    dq_bh: int = 64
    dq_bd: int = 128
    dq_bn: int = 64
    dq_warps: int = 4
    dq_stages: int = 2
    dkv_bd: int = 128
    dkv_bn: int = 64
    dkv_rows: int = 64
    dkv_warps: int = 4
    dkv_stages: int = 2
    narrow_selection: bool = True
    fwd_wgmma: bool = True

    def __post_init__(self):
        for f in fields(self):
            val = getattr(self, f.name)
            if f.name.endswith(("_bh", "_bn", "_bd", "_rows")) and (val < 16 or val & (val - 1)):
                raise ValueError(f"DSV4Blocks.{f.name}={val}: must be a power of two >= 16")


# The interpreter runs programs one by one: small tiles, but the dQ pass split in 32 columns (a
# 48-wide test head still splits in two, with half the programs of 16) and the window dKV's
# steps two queries deep (32 rows of its 16-head blocks).
INTERPRET_BLOCKS = replace(
    DSV4Blocks(**{f.name: 1 if f.name.endswith(("_warps", "_stages")) else 16
                  for f in fields(DSV4Blocks) if f.type == "int"}), dq_bd=32, dkv_rows=32)


def default_blocks(heads: int) -> DSV4Blocks:
    if interpreting():
        return INTERPRET_BLOCKS
    # Best of small sweeps at 64 heads, D 512, 4k CSA on one H200 (bench/dsv4_attention.py
    # --sweep, saved in bench/results/dsv4_attention_h200.txt): forward 64 keys per tile 1.39 ms
    # vs 1.74 ms at 32 (scores summed over D in chunks, as the P/dS pass does: 1.46-1.53 ms);
    # P/dS pass all 64 heads (32-head blocks read every gathered key twice), 64 keys, 64-column
    # steps, 4 warps, 3 stages: fwd+bwd 5.30 ms vs 5.36-6.22 ms for 128-column steps, 32-column
    # steps or 32-key tiles.
    if heads <= 16:
        # 16 heads (the small preset), same sweeps: CSA fwd+bwd 2.49 vs 2.72 ms with the 64-head
        # tiles (forward 32-key tiles on 4 warps, the P/dS pass on 2 warps). The bench's HCA and
        # sliding cores at 16 heads vary 0.98-1.76 ms run to run, too much to decide by.
        return DSV4Blocks(fwd_bh=16, fwd_bn=32, fwd_warps=4, ds_bh=16, ds_warps=2, dq_bh=16)
    bh = min(64, triton.next_power_of_2(heads))
    return DSV4Blocks(fwd_bh=bh, ds_bh=bh, dq_bh=bh)


@triton.jit
def _key_rows(kv_ptr, comp_ptr, idx_ptr, t, n, hi, num_sel, stride_kv, stride_c, stride_idx,
              offs_n, IS_WINDOW: tl.constexpr):
    """-> (row pointers [BN, 1], valid [BN], row [BN]) of tile n of a token's window or
    selection."""
    if IS_WINDOW:
        row = n + offs_n
        valid = row < hi
        base = kv_ptr + row[:, None].to(tl.int64) * stride_kv
    else:
        j = n + offs_n
        row = tl.load(idx_ptr + t * stride_idx + j, mask=j < num_sel, other=-1)
        valid = row >= 0
        base = comp_ptr + row[:, None].to(tl.int64) * stride_c
    return base, valid, row


@triton.jit
def _load_keys(kv_ptr, comp_ptr, idx_ptr, t, n, hi, num_sel, stride_kv, stride_c, stride_idx,
               offs_n, offs_d, dmask, IS_WINDOW: tl.constexpr):
    """-> (keys [BN, BD], valid [BN], row [BN]) of tile n of a token's window or selection."""
    base, valid, row = _key_rows(kv_ptr, comp_ptr, idx_ptr, t, n, hi, num_sel, stride_kv,
                                 stride_c, stride_idx, offs_n, IS_WINDOW)
    keys = tl.load(base + offs_d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
    return keys, valid, row


@triton.jit
def _online_softmax_step(q, k, valid, m_i, l_i, acc, qk_scale, DOT_PREC: tl.constexpr):
    """One key tile of the online softmax (log2 domain): K=V, so the tile is also the values."""
    s = mma(q, tl.trans(k), DOT_PREC) * qk_scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + mma(to_dtype(p, k.dtype, DOT_PREC), k, DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _dsv4_fwd_kernel(q_ptr, kv_ptr, comp_ptr, idx_ptr, end_ptr, sink_ptr, first_ptr, o_ptr,
                     lse_ptr, H, D, window, num_sel, qk_scale, stride_qt, stride_qh, stride_kv,
                     stride_c, stride_idx, stride_ot, stride_oh, HAS_SINK: tl.constexpr,
                     BH: tl.constexpr, BN: tl.constexpr, BNS: tl.constexpr, BD: tl.constexpr,
                     DOT_PREC: tl.constexpr):
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    offs_d = tl.arange(0, BD)
    offs_n = tl.arange(0, BN)
    hmask = offs_h < H
    dmask = offs_d < D
    q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh
                + offs_d[None, :], mask=hmask[:, None] & dmask[None, :], other=0.0)
    if HAS_SINK:
        m_i = tl.load(sink_ptr + offs_h, mask=hmask, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BH], 1.0, tl.float32)
    else:
        m_i = tl.full([BH], -1.0e30, tl.float32)
        l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BD], tl.float32)
    # The window: packed rows [max(first, t + 1 - window), t].
    hi = t + 1
    lo = tl.maximum(tl.load(first_ptr + t), t + 1 - window)
    for n in range(lo, hi, BN):
        k, valid, _ = _load_keys(kv_ptr, comp_ptr, idx_ptr, t, n, hi, num_sel, stride_kv,
                                 stride_c, stride_idx, offs_n, offs_d, dmask, True)
        m_i, l_i, acc = _online_softmax_step(q, k, valid, m_i, l_i, acc, qk_scale, DOT_PREC)
    offs_s = tl.arange(0, BNS)
    for n in range(0, tl.load(end_ptr + t), BNS):
        k, valid, _ = _load_keys(kv_ptr, comp_ptr, idx_ptr, t, n, hi, num_sel, stride_kv,
                                 stride_c, stride_idx, offs_s, offs_d, dmask, False)
        m_i, l_i, acc = _online_softmax_step(q, k, valid, m_i, l_i, acc, qk_scale, DOT_PREC)
    out = acc / tl.maximum(l_i, 1.0e-30)[:, None]
    tl.store(o_ptr + t.to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=hmask[:, None] & dmask[None, :])
    lse = tl.where(l_i > 0, m_i + tl.log2(l_i), float("inf"))
    tl.store(lse_ptr + t * H + offs_h, lse, mask=hmask)


def selection_tile(num_sel: int, bn: int, blocks: DSV4Blocks) -> int:
    """Keys per tile of a selection loop: bn, or the narrowest power of two >= 16 that holds
    every token's picks when that is less (HCA at 4k tokens: 32 picks, so a 64-key tile spends
    half its MMA on padding). Used by the forward only: the P/dS and dQ passes with a second,
    narrower tile shape in one kernel took more registers (dQ: 222 vs 128 per thread) and ran
    slower (H200, 4k HCA: dQ 0.44 vs 0.32 ms; forward 0.52 vs 0.61 ms)."""
    if not blocks.narrow_selection or num_sel == 0:
        return bn
    return max(16, min(bn, triton.next_power_of_2(num_sel)))


def selection_or_empty(comp_kv, comp_idx, total, dim, like):
    """-> (comp_kv [C>=1, D], comp_idx [T, K] int32 contiguous, sel_end [T] int32: one past each
    token's last valid pick), with a dummy row when empty."""
    if comp_idx is None or comp_idx.shape[1] == 0 or comp_kv is None or comp_kv.shape[0] == 0:
        k = 0 if comp_idx is None else comp_idx.shape[1]
        idx = torch.full((total, k), -1, dtype=torch.int32, device=like.device)
        return like.new_zeros(1, dim), idx, idx.new_zeros(total)
    idx = comp_idx.to(torch.int32).contiguous()
    slot = torch.arange(1, idx.shape[1] + 1, device=idx.device, dtype=torch.int32)
    return comp_kv.contiguous(), idx, torch.where(idx >= 0, slot, 0).amax(1)  # int32


def dsv4_forward(q, kv, sinks, first_rows, window, scale, comp_kv, comp_idx, sel_end,
                 blocks: DSV4Blocks):
    """-> (out [T, H, D], lse [T, H] fp32 log2 units). Inputs already validated and contiguous;
    comp_kv/comp_idx/sel_end from selection_or_empty."""
    total, heads, dim = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(total, heads, device=q.device, dtype=torch.float32)
    if total == 0:
        return out, lse
    if blocks.fwd_wgmma and wgmma_applies(q, kv, comp_kv):
        unbuilt = gluon_kernels().launch_forward(q, kv, comp_kv, comp_idx, sel_end, sinks,
                                                 first_rows, out, lse, window, scale * LOG2E)
        if unbuilt is None:
            return out, lse
        warn_unbuilt("forward", unbuilt)
    grid = (total, triton.cdiv(heads, blocks.fwd_bh))
    _dsv4_fwd_kernel[grid](
        q, kv, comp_kv, comp_idx, sel_end, sinks if sinks is not None else q, first_rows, out,
        lse, heads, dim, window, comp_idx.shape[1], scale * LOG2E, q.stride(0), q.stride(1),
        kv.stride(0), comp_kv.stride(0), comp_idx.stride(0), out.stride(0), out.stride(1),
        HAS_SINK=sinks is not None, BH=blocks.fwd_bh, BN=blocks.fwd_bn,
        BNS=selection_tile(comp_idx.shape[1], blocks.fwd_bn, blocks),
        BD=triton.next_power_of_2(dim), DOT_PREC=dot_precision(q.dtype),
        num_warps=blocks.fwd_warps, num_stages=blocks.fwd_stages)
    return out, lse
