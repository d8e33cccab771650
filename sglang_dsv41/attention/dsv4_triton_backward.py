"""Triton backward of the DSV4 sparse sink attention, and the autograd Function around both passes.

With P the sink-inclusive probabilities (recomputed from the saved LSE), Delta = rowsum(dO * O):
  dS = P * (dO @ V^T - Delta),  dQ = scale * dS @ K,
  dKV = scale * dS^T @ Q + P^T @ dO   (K = V: the latent gets both roles' gradients),
  dsink_h = -sum_t exp(sink_h - LSE_th) * Delta_th.
Three kernels; the scores are recomputed once, not once per output:
  * P/dS pass: one program per (token, head block) walks the token's keys as the forward does. Each
    key tile's scores and dO @ K^T are summed over D in chunks of ds_bd columns, q, dO and the key
    rows streamed chunk by chunk (q and dO from L2), so the loop pipelines in 3 stages (Triton
    3.6 for sm_90: 80 KB of shared memory at 64 heads, 104 KB since the selection tiles' loops
    were fused, below); held whole (q, dO and a 64-key tile: 192 KB) it fit one stage and
    waited on every gather (H200, 4k CSA: 1.84 ms for the pass then, fwd+bwd 6.30 vs 5.86 ms
    chunked). It stores scale * dS in the operand dtype to a [T, H, W + K] buffer
    and P of the window slots to a [T, H, W] one, both zeroed, invalid slots not written. Window
    slot s of token t holds key window_base(t) + s: the window's first key rounded down to a
    multiple of SLOT_ALIGN, so that W = window_slots(window) = window + SLOT_ALIGN - 1 rounded up
    to SLOT_ALIGN, and every key block that starts at a multiple of SLOT_ALIGN starts at one in
    every token's slots too: the window dKV pass then reads a block's P and dS of any token as
    whole aligned vectors (from the window's own first key, each token's slots started at a
    different offset, read element by element: Triton 3.6 for sm_90 compiled them to 64 scalar
    16-bit loads a thread, the gather of the pass). Slot W + j: the token's j-th selected entry.
    A selection tile's dKV, scale * dS^T @ q + P^T @ dO, is added
    right there, chunk by chunk, into an fp32 buffer with relaxed atomics (a compressed entry is
    picked by arbitrary tokens; the order of those adds is not fixed): as a kernel of its own the
    adds were bound by the atomics in L2 (1.42 ms at 4k CSA, 1.57M (token, pick) pairs x 512
    columns) with the tensor cores idle; inside this pass they overlap its MMAs (fwd+bwd 5.30 vs
    5.86 ms), and P of the selection slots is never stored. The same loop over D computes the
    next selection tile's scores, so each q and dO chunk streams from L2 once a tile, not once
    for the scores and again for the dKV (H200, 4k CSA, 64 heads: the pass 2.32 -> 2.15 ms,
    fwd+bwd 4.87 -> 4.70 ms; it takes 104 KB of shared memory and spills ~130 B a thread at 255
    registers, which it did not before).
  * dQ pass: one program per (token, head block, D columns) sums scale*dS @ K over the token's
    keys from that buffer, transposed (K^T @ dS^T: dS the MMA's B operand, tiles of slots from
    multiples of SLOT_ALIGN, so that its loads go as asynchronous copies; the window's slots in
    whole tiles, then SLOT_ALIGN-wide ones).
  * window dKV, key-major: one program per (block of keys, D columns) loops over the queries
    that see those keys (k .. k + window - 1), a few at a time (DSV4Blocks.dkv_rows rows of
    (query, head)), and sums scale*dS^T @ Q + P^T @ dO over their heads with tensor-core tiles
    [keys x rows] x [rows x D]. Each key is owned by one program: no atomics, fixed summation
    order. Its P and dS loads are masked only by whole aligned groups of slots (the row, and the
    block inside the token's W slots); the zeroed slots of keys a token does not see give 0.
dsink is reduced in torch from per-(token, head) terms: deterministic, no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dsv4_reference import sequence_first_rows
from .dsv4_triton_forward import (DSV4Blocks, _key_rows, _load_keys, default_blocks,
                                  dsv4_forward, selection_or_empty)
from .triton_common import LOG2E, dot_precision, mma, to_dtype

# Window slots start at a multiple of this many keys (module docstring): 16 bf16 are two 16-byte
# vectors; every key tile size (DSV4Blocks: powers of two >= 16) is a multiple of it.
SLOT_ALIGN = tl.constexpr(16)


def window_slots(window: int) -> int:
    """W: slots a token keeps for its window, whose first key is rounded down to SLOT_ALIGN."""
    align = SLOT_ALIGN.value
    return triton.cdiv(window + align - 1, align) * align


@triton.jit
def _window_base(t, window):
    """The key of token t's window slot 0: its window's first key rounded down to SLOT_ALIGN."""
    return (tl.maximum(t + 1 - window, 0) // SLOT_ALIGN) * SLOT_ALIGN


@triton.jit
def _head_cols(ptr, qrow, cols, hmask, cmask):
    """-> [heads, chunk] of a [T, H, D] tensor: token row offsets qrow, columns cols."""
    return tl.load(ptr + qrow[:, None] + cols[None, :], mask=hmask[:, None] & cmask[None, :],
                   other=0.0)


@triton.jit
def _over_d(q_ptr, do_ptr, qrow, hmask, D, ds, p, row, valid, dcomp_ptr, keys, key_valid,
            BH: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr, DKV: tl.constexpr,
            SCORES: tl.constexpr, DOT_PREC: tl.constexpr):
    """One loop over D in chunks of BC columns, each q and dO chunk read once for: with DKV, a
    selection tile's dKV, scale * dS^T @ q + P^T @ dO, added into dcomp (rows row); with SCORES,
    the scores (q @ K^T, dO @ K^T) [heads, keys] of the key tile at row pointers keys. Both: a
    selection tile's dKV and the next tile's scores. -> those scores (zeros without SCORES)."""
    offs_c = tl.arange(0, BC)
    s = tl.zeros([BH, BN], tl.float32)
    dp = tl.zeros([BH, BN], tl.float32)
    for c in range(0, D, BC):
        cols = c + offs_c
        cmask = cols < D
        qc = _head_cols(q_ptr, qrow, cols, hmask, cmask)
        doc = _head_cols(do_ptr, qrow, cols, hmask, cmask)
        if DKV:
            dc = mma(tl.trans(ds), qc, DOT_PREC) + mma(tl.trans(p), doc, DOT_PREC)
            tl.atomic_add(dcomp_ptr + row[:, None].to(tl.int64) * D + cols[None, :], dc,
                          mask=valid[:, None] & cmask[None, :], sem="relaxed")
        if SCORES:
            k = tl.load(keys + cols[None, :], mask=key_valid[:, None] & cmask[None, :],
                        other=0.0)
            s += mma(qc, tl.trans(k), DOT_PREC)
            dp += mma(doc, tl.trans(k), DOT_PREC)
    return s, dp


@triton.jit
def _tile_ds(s, dp, valid, lse, delta, qk_scale, scale, ds_ptr, row_th, ds_row, slot, hmask,
             DOT_PREC: tl.constexpr):
    """-> (P, scale * dS) of a key tile in the operand dtype, dS stored to its slots."""
    p = tl.where(valid[None, :], tl.exp2(s * qk_scale - lse[:, None]), 0.0)
    dtype = ds_ptr.dtype.element_ty
    ds = to_dtype(p * (dp - delta[:, None]) * scale, dtype, DOT_PREC)
    tl.store(ds_ptr + (row_th * ds_row)[:, None] + slot[None, :], ds,
             mask=hmask[:, None] & valid[None, :])
    return to_dtype(p, dtype, DOT_PREC), ds


@triton.jit
def _dsv4_ds_kernel(q_ptr, kv_ptr, comp_ptr, idx_ptr, end_ptr, first_ptr, do_ptr, o_ptr, lse_ptr,
                    delta_ptr, p_ptr, ds_ptr, dcomp_ptr, H, D, window, wslots, ds_row, num_sel,
                    qk_scale, scale, stride_qt, stride_qh, stride_kv, stride_c, stride_idx,
                    BH: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr,
                    DOT_PREC: tl.constexpr):
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    offs_c = tl.arange(0, BC)
    offs_n = tl.arange(0, BN)
    hmask = offs_h < H
    qrow = t.to(tl.int64) * stride_qt + offs_h * stride_qh
    lse = tl.load(lse_ptr + t * H + offs_h, mask=hmask, other=float("inf"))
    # Delta here rather than in torch: saves fp32 copies of dO and O (1.3 ms at 4k on an H200).
    delta = tl.zeros([BH], tl.float32)
    for c in range(0, D, BC):
        cols = c + offs_c
        cmask = cols < D
        do = _head_cols(do_ptr, qrow, cols, hmask, cmask)
        delta += tl.sum(do.to(tl.float32) * _head_cols(o_ptr, qrow, cols, hmask, cmask)
                        .to(tl.float32), 1)
    tl.store(delta_ptr + t * H + offs_h, delta, mask=hmask)
    row_th = t.to(tl.int64) * H + offs_h
    hi = t + 1
    lo = tl.maximum(tl.load(first_ptr + t), t + 1 - window)
    for n in range(lo, hi, BN):
        base, valid, _ = _key_rows(kv_ptr, comp_ptr, idx_ptr, t, n, hi, num_sel, stride_kv,
                                   stride_c, stride_idx, offs_n, True)
        # Scores only (DKV False: its ds, p, row and valid arguments unused).
        s, dp = _over_d(q_ptr, do_ptr, qrow, hmask, D, lse, lse, offs_n, valid, dcomp_ptr, base,
                        valid, BH, BN, BC, False, True, DOT_PREC)
        slot = n + offs_n - _window_base(t, window)
        p, _ = _tile_ds(s, dp, valid, lse, delta, qk_scale, scale, ds_ptr, row_th, ds_row, slot,
                        hmask, DOT_PREC)
        tl.store(p_ptr + (row_th * wslots)[:, None] + slot[None, :], p,
                 mask=hmask[:, None] & valid[None, :])
    # Selection tiles, software-pipelined: tile n's dKV chunks and tile n + BN's scores share
    # one loop over D (_over_d), so q and dO stream through once a tile, not twice.
    sel_end = tl.load(end_ptr + t)
    if sel_end > 0:
        last = ((sel_end - 1) // BN) * BN
        base, valid, row = _key_rows(kv_ptr, comp_ptr, idx_ptr, t, 0, hi, num_sel, stride_kv,
                                     stride_c, stride_idx, offs_n, False)
        s, dp = _over_d(q_ptr, do_ptr, qrow, hmask, D, lse, lse, row, valid, dcomp_ptr, base,
                        valid, BH, BN, BC, False, True, DOT_PREC)
        for n in range(0, last, BN):
            p, ds = _tile_ds(s, dp, valid, lse, delta, qk_scale, scale, ds_ptr, row_th, ds_row,
                             wslots + n + offs_n, hmask, DOT_PREC)
            next_base, next_valid, next_row = _key_rows(
                kv_ptr, comp_ptr, idx_ptr, t, n + BN, hi, num_sel, stride_kv, stride_c,
                stride_idx, offs_n, False)
            s, dp = _over_d(q_ptr, do_ptr, qrow, hmask, D, ds, p, row, valid, dcomp_ptr,
                            next_base, next_valid, BH, BN, BC, True, True, DOT_PREC)
            valid, row = next_valid, next_row
        p, ds = _tile_ds(s, dp, valid, lse, delta, qk_scale, scale, ds_ptr, row_th, ds_row,
                         wslots + last + offs_n, hmask, DOT_PREC)
        _over_d(q_ptr, do_ptr, qrow, hmask, D, ds, p, row, valid, dcomp_ptr, base, valid, BH, BN,
                BC, True, False, DOT_PREC)


@triton.jit
def _dq_tile(acc, k, ds_ptr, prow, slots, hmask, DOT_PREC: tl.constexpr):
    """-> acc + k^T @ ((scale * dS)[heads, slots])^T, dQ^T [D columns, heads]: dS is the MMA's
    B operand, loaded [slots, heads] (contiguous slots, which start at multiples of SLOT_ALIGN
    in every loop), so Triton stages it through shared memory with asynchronous copies. As the A
    operand [heads, slots], from the window's unaligned first slot, it was a plain load in each
    iteration, its latency exposed (ncu: long_scoreboard, the pass's top stall)."""
    ds_t = tl.load(ds_ptr + slots[:, None] + prow[None, :], mask=hmask[None, :], other=0.0)
    return acc + mma(tl.trans(k), ds_t, DOT_PREC)


@triton.jit
def _dq_window_tile(acc, kv_ptr, ds_ptr, prow, base, s, lo, hi, stride_kv, offs_d, dmask, hmask,
                    BW: tl.constexpr, DOT_PREC: tl.constexpr):
    """_dq_tile of window slots s .. s + BW - 1 (keys base + s ..; those outside [lo, hi) zero)."""
    pos = base + s + tl.arange(0, BW)
    valid = (pos >= lo) & (pos < hi)
    k = tl.load(kv_ptr + pos[:, None].to(tl.int64) * stride_kv + offs_d[None, :],
                mask=valid[:, None] & dmask[None, :], other=0.0)
    return _dq_tile(acc, k, ds_ptr, prow, s + tl.arange(0, BW), hmask, DOT_PREC)


@triton.jit
def _dsv4_dq_kernel(ds_ptr, kv_ptr, comp_ptr, idx_ptr, end_ptr, first_ptr, dq_ptr, H, D, window,
                    wslots, ds_row, num_sel, stride_qt, stride_qh, stride_kv, stride_c, stride_idx,
                    BH: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                    DOT_PREC: tl.constexpr):
    """dQ[t, heads, D columns] = (scale * dS)[t, heads, slots] @ keys[slots, D columns],
    accumulated transposed ([D columns, heads]: _dq_tile)."""
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    offs_d = tl.program_id(2) * BD + tl.arange(0, BD)
    offs_n = tl.arange(0, BN)
    hmask = offs_h < H
    dmask = offs_d < D
    prow = (t.to(tl.int64) * H + offs_h) * ds_row
    acc = tl.zeros([BD, BH], tl.float32)
    hi = t + 1
    base = _window_base(t, window)  # the key of window slot 0
    lo = tl.maximum(tl.load(first_ptr + t), t + 1 - window)
    # Window slots from the aligned group holding the first valid one to the token's own: up to
    # window + SLOT_ALIGN - 1 of them (128-key window: 128-143), in whole tiles, then the rest
    # in SLOT_ALIGN-wide ones (three 64-key tiles would read 192 slots).
    s_lo = ((lo - base) // SLOT_ALIGN) * SLOT_ALIGN
    s_full = s_lo + ((hi - base - s_lo) // BN) * BN
    for s in range(s_lo, s_full, BN):
        acc = _dq_window_tile(acc, kv_ptr, ds_ptr, prow, base, s, lo, hi, stride_kv, offs_d,
                              dmask, hmask, BN, DOT_PREC)
    for s in range(s_full, hi - base, SLOT_ALIGN):
        acc = _dq_window_tile(acc, kv_ptr, ds_ptr, prow, base, s, lo, hi, stride_kv, offs_d,
                              dmask, hmask, SLOT_ALIGN, DOT_PREC)
    for n in range(0, tl.load(end_ptr + t), BN):
        k, _, _ = _load_keys(kv_ptr, comp_ptr, idx_ptr, t, n, hi, num_sel, stride_kv,
                             stride_c, stride_idx, offs_n, offs_d, dmask, False)
        acc = _dq_tile(acc, k, ds_ptr, prow, wslots + n + offs_n, hmask, DOT_PREC)
    tl.store(dq_ptr + t.to(tl.int64) * stride_qt + offs_h[None, :] * stride_qh + offs_d[:, None],
             acc.to(dq_ptr.dtype.element_ty), mask=hmask[None, :] & dmask[:, None])


@triton.jit
def _dsv4_dkv_window_kernel(q_ptr, do_ptr, p_ptr, ds_ptr, dkv_ptr, T, H, D, window, wslots,
                            ds_row, stride_qt, stride_qh, BN: tl.constexpr, BHH: tl.constexpr,
                            TB: tl.constexpr, BD: tl.constexpr, DOT_PREC: tl.constexpr):
    offs_k = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    # A step's rows: TB consecutive queries x BHH heads, so its MMAs sum over TB x BHH rows
    # (at 16 heads 4 queries: 64, where a query a step gave 16-deep MMAs and 4x the steps).
    offs_r = tl.arange(0, TB * BHH)
    r_t = offs_r // BHH
    r_h = offs_r % BHH
    kmask = offs_k < T
    dmask = offs_d < D
    acc = tl.zeros([BN, BD], tl.float32)
    k_first = tl.program_id(0) * BN
    t_end = tl.minimum(k_first + BN - 1 + window, T)
    # Query t sees key k when first[t] <= k <= t < k + window; P and dS are 0 in the slots of
    # the keys it does not see, so the loads mask only the block's slots outside t's window
    # slots, in whole groups of SLOT_ALIGN (k_first and window_base both multiples of it).
    for t0 in range(k_first, t_end, TB):
        t = t0 + r_t
        rmask = (t < t_end) & (r_h < H)
        slot = offs_k[None, :] - _window_base(t, window)[:, None]
        in_slots = rmask[:, None] & (slot >= 0) & (slot < wslots)
        row_th = t.to(tl.int64) * H + r_h
        p = tl.load(p_ptr + (row_th * wslots)[:, None] + slot, mask=in_slots, other=0.0)
        ds = tl.load(ds_ptr + (row_th * ds_row)[:, None] + slot, mask=in_slots, other=0.0)
        qrow = t.to(tl.int64) * stride_qt + r_h * stride_qh
        acc += mma(tl.trans(ds), _head_cols(q_ptr, qrow, offs_d, rmask, dmask), DOT_PREC)
        acc += mma(tl.trans(p), _head_cols(do_ptr, qrow, offs_d, rmask, dmask), DOT_PREC)
    tl.store(dkv_ptr + offs_k[:, None].to(tl.int64) * D + offs_d[None, :],
             acc.to(dkv_ptr.dtype.element_ty), mask=kmask[:, None] & dmask[None, :])


def dkv_window_rows(heads: int, blocks: DSV4Blocks) -> tuple[int, int]:
    """-> (BHH, TB) of the window dKV kernel: its head block (all heads, at least the 16 rows
    an MMA needs) and the queries a step of its loop, blocks.dkv_rows rows at least one."""
    bhh = max(16, triton.next_power_of_2(heads))
    return bhh, max(1, blocks.dkv_rows // bhh)


def dsv4_backward(q, kv, sinks, first_rows, window, scale, comp_kv, comp_idx, sel_end, out,
                  lse, dout, blocks: DSV4Blocks):
    """-> (dq, dkv, dsinks or None, dcomp_kv) for contiguous inputs saved by the forward."""
    total, heads, dim = q.shape
    dout = dout.contiguous()
    delta = q.new_empty(total, heads, dtype=torch.float32)  # rowsum(dO * O), by the P/dS pass
    dq = torch.empty_like(q)
    dcomp32 = torch.zeros(comp_kv.shape[0], dim, device=q.device, dtype=torch.float32)
    if total == 0:
        return dq, torch.zeros_like(kv), _dsinks(sinks, lse, delta), dcomp32.to(comp_kv.dtype)
    bd, prec, num_sel = triton.next_power_of_2(dim), dot_precision(q.dtype), comp_idx.shape[1]
    # scale*dS and the window's P in the MMA operand dtype (what the MMAs read), in aligned
    # slots (module docstring). Both zeroed: the P/dS pass writes only the valid slots, and
    # the dQ and window dKV passes read whole aligned groups of slots (so that they go as
    # vectors and asynchronous copies), where the slots of keys a token does not see must be
    # 0 (window dKV) or at least not NaN (dQ: they meet zeroed keys). dS has a tile of slack
    # past its end for the dQ pass's last tile, and rows a multiple of SLOT_ALIGN long.
    wslots = window_slots(window)
    row = triton.cdiv(wslots + num_sel, SLOT_ALIGN.value) * SLOT_ALIGN.value
    ds_buf = torch.zeros(total * heads * row + blocks.dq_bn, device=q.device,
                         dtype=q.dtype)[:total * heads * row].view(total, heads, row)
    p_buf = torch.zeros(total, heads, wslots, device=q.device, dtype=q.dtype)
    _dsv4_ds_kernel[(total, triton.cdiv(heads, blocks.ds_bh))](
        q, kv, comp_kv, comp_idx, sel_end, first_rows, dout, out, lse, delta, p_buf, ds_buf,
        dcomp32, heads, dim, window, wslots, row, num_sel, scale * LOG2E, scale, q.stride(0),
        q.stride(1), kv.stride(0), comp_kv.stride(0), comp_idx.stride(0), BH=blocks.ds_bh,
        BN=blocks.ds_bn, BC=min(blocks.ds_bd, bd), DOT_PREC=prec, num_warps=blocks.ds_warps,
        num_stages=blocks.ds_stages)
    dq_cols = min(blocks.dq_bd, bd)
    _dsv4_dq_kernel[(total, triton.cdiv(heads, blocks.dq_bh), triton.cdiv(dim, dq_cols))](
        ds_buf, kv, comp_kv, comp_idx, sel_end, first_rows, dq, heads, dim, window, wslots, row,
        num_sel, dq.stride(0), dq.stride(1), kv.stride(0), comp_kv.stride(0), comp_idx.stride(0),
        BH=blocks.dq_bh, BN=blocks.dq_bn, BD=dq_cols, DOT_PREC=prec,
        num_warps=blocks.dq_warps, num_stages=blocks.dq_stages)
    dkv = torch.empty_like(kv)
    bhh, tb = dkv_window_rows(heads, blocks)
    cols = min(blocks.dkv_bd, bd)
    launch = dict(BN=blocks.dkv_bn, BHH=bhh, TB=tb, BD=cols, DOT_PREC=prec,
                  num_warps=blocks.dkv_warps, num_stages=blocks.dkv_stages)
    _dsv4_dkv_window_kernel[(triton.cdiv(total, blocks.dkv_bn), triton.cdiv(dim, cols))](
        q, dout, p_buf, ds_buf, dkv, total, heads, dim, window, wslots, row, q.stride(0),
        q.stride(1), **launch)
    return dq, dkv, _dsinks(sinks, lse, delta), dcomp32.to(comp_kv.dtype)


def _dsinks(sinks, lse, delta):
    """dsink_h = -sum_t P_sink[t, h] * Delta[t, h]: a torch reduction, fixed order."""
    if sinks is None:
        return None
    return -(torch.exp2(sinks.float()[None, :] * LOG2E - lse) * delta).sum(0)


class DSV4AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, sinks, comp_kv, cu_seqlens, window, scale, comp_idx, blocks,
                first_rows):
        total, heads, dim = q.shape
        q, kv = q.contiguous(), kv.contiguous()
        if first_rows is None:
            first_rows = sequence_first_rows(cu_seqlens, total)
        ckv, cidx, sel_end = selection_or_empty(comp_kv, comp_idx, total, dim, kv)
        sink32 = sinks.float().contiguous() if sinks is not None else None
        out, lse = dsv4_forward(q, kv, sink32, first_rows, window, scale, ckv, cidx, sel_end,
                                blocks)
        ctx.save_for_backward(q, kv, sink32, ckv, cidx, sel_end, first_rows, out, lse)
        ctx.window, ctx.scale, ctx.blocks = window, scale, blocks
        ctx.has_comp = comp_kv is not None
        ctx.comp_rows = 0 if comp_kv is None else comp_kv.shape[0]
        ctx.sink_dtype = None if sinks is None else sinks.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, sink32, ckv, cidx, sel_end, first_rows, out, lse = ctx.saved_tensors
        dq, dkv, dsinks, dcomp = dsv4_backward(q, kv, sink32, first_rows, ctx.window, ctx.scale,
                                               ckv, cidx, sel_end, out, lse, dout, ctx.blocks)
        if dsinks is not None:
            dsinks = dsinks.to(ctx.sink_dtype)
        dcomp = dcomp[:ctx.comp_rows] if ctx.has_comp else None
        return dq, dkv, dsinks, dcomp, None, None, None, None, None, None


def dsv4_attention_triton(q, kv, sinks, cu_seqlens, window, scale, comp_kv=None, comp_idx=None,
                          blocks: DSV4Blocks | None = None,
                          first_rows: torch.Tensor | None = None):
    """Validated inputs -> [T, H, D]; differentiable in q, kv, sinks and comp_kv. first_rows:
    sequence_first_rows(cu_seqlens, T), int32 [T], when the caller has it."""
    blocks = blocks or default_blocks(q.shape[1])
    return DSV4AttentionFunction.apply(q, kv, sinks, comp_kv, cu_seqlens, window, scale,
                                       comp_idx, blocks, first_rows)
