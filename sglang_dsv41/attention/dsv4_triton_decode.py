"""Paged decode of the DSV4 sparse sink attention over the engine's cache (Triton).

One query token per request. The request's window is its last `window` cached positions, read
through the page table of a paged latent cache [num_pages, page_size, D] (one K=V head); its
compressed selection is a list of rows of a flat compressed pool [C, D] (-1 = none), exactly as
in prefill (contract: dsv4_reference.py; repeats count as often as they are listed).

Flash-decoding: a request's keys are numbered as tiles, first the window's cdiv(window, BN)
tiles, then the selection's cdiv(K, BN); the split kernel gives each program one (request, split
of those tiles, head block) and one online softmax without the sink. With one split it adds the
sink and writes the output itself; with more, it writes an unnormalised partial output with its
running max and sum, and the combine kernel merges a request's splits with the sink by
log-sum-exp. Heads are the M side of every tile (MQA: one K=V head), so with all heads in one
block each key is read once; the head block is the fastest grid axis, so smaller blocks of one
request run side by side and share its keys through L2.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .dsv4_triton_forward import _online_softmax_step, selection_or_empty
from .triton_common import (LOG2E, dot_precision, gluon_kernels, interpreting,
                            unbuilt_message, warn_unbuilt, wgmma_applies)


@dataclass(frozen=True)
class DecodeTiles:
    """Tile sizes of the decode kernels: heads per program (bh), keys per tile (bn), warps,
    pipeline stages, and key splits per request (0 = as many as fill the GPU: split_count).
    wgmma: the split kernel is dsv4_gluon's (Hopper, bf16, D 512, 33-64 heads; all 64
    heads a program, 8 warps; stages = key buffers in flight) instead of this module's."""

    bh: int
    bn: int
    warps: int
    stages: int
    splits: int = 0
    wgmma: bool = False

    def __post_init__(self):
        for name in ("bh", "bn"):
            val = getattr(self, name)
            if val < 16 or val & (val - 1):
                raise ValueError(f"DecodeTiles.{name}={val}: must be a power of two >= 16")
        if self.splits < 0:
            raise ValueError(f"DecodeTiles.splits={self.splits}: must be >= 0")
        if self.wgmma and (self.bh != 64 or self.warps != 8 or self.stages < 2):
            raise ValueError(f"DecodeTiles(wgmma=True): bh 64, warps 8 and stages >= 2, not "
                             f"{self.bh}, {self.warps}, {self.stages}")


INTERPRET_TILES = DecodeTiles(bh=16, bn=16, warps=1, stages=1)


def default_tiles(heads: int, wgmma: bool = False) -> DecodeTiles:
    """Best of `bench/dsv4_attention.py --decode-sweep` on one H200 (batch 512, 8k tokens,
    page 64; bench/results/dsv4_attention_h200.txt). wgmma: wgmma_applies."""
    if interpreting():
        return INTERPRET_TILES
    if wgmma:
        return WGMMA_TILES
    # 64 heads: one block of all heads, 64-key tiles: 82 / 117 / 270 us sliding / HCA / CSA vs
    # 92 / 128 / 319 us for two 32-head blocks sharing keys through L2, 89 / 125 / 324 with
    # 32-key and 114 / 163 / 452 with 16-key tiles. 8 heads: one split (a second one costs
    # 30-40%: partial outputs and the combine); 2 warps, 16-key tiles, 2 stages: 34 / 52 / 128
    # us vs 38 / 57 / 132 us for 4 warps and 32-key tiles (by registers four 2-warp programs
    # fit a multiprocessor, two 4-warp ones; 3-5 stages time the same or worse). Other designs
    # that lost: see the window loop's comment in _dsv4_decode_split_kernel.
    if heads > 16:
        return DecodeTiles(bh=64, bn=64, warps=8, stages=2)
    return DecodeTiles(bh=16, bn=16, warps=2, stages=2)


WGMMA_TILES = DecodeTiles(bh=64, bn=64, warps=8, stages=2, wgmma=True)
# Why the wgmma decode did not build, once it failed on the default path: from then on that path
# takes the Triton kernel without preparing (and failing) the wgmma launch on every call.
_UNBUILT: list[str] = []


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_count(tiles: DecodeTiles, batch: int, head_blocks: int, key_tiles: int,
                device: torch.device) -> int:
    """Splits per request: tiles.splits, or, only when the batch gives fewer programs than
    multiprocessors, enough for two a multiprocessor (at batch 512 with 8 heads a second split
    cost 40% more time: the partial outputs and the combine outweigh the extra programs),
    rounded down to a power of two. SPLITS is a compile-time constant of both kernels: without
    the rounding every small batch size a server meets would compile them anew. The count is
    then trimmed so that no split is left without a key tile."""
    if tiles.splits:
        wanted = tiles.splits
    elif device.type != "cuda":
        wanted = 1
    else:
        sms = _multiprocessors(device.index if device.index is not None else
                               torch.cuda.current_device())
        programs = batch * head_blocks
        wanted = 1 if programs >= sms else 1 << (triton.cdiv(2 * sms, programs).bit_length() - 1)
    wanted = max(1, min(wanted, key_tiles))
    return triton.cdiv(key_tiles, triton.cdiv(key_tiles, wanted))


@triton.jit
def _dsv4_decode_split_kernel(q_ptr, kv_ptr, comp_ptr, idx_ptr, end_ptr, sink_ptr, len_ptr,
                              page_ptr, o_ptr, part_ptr, ml_ptr, H, D, window, qk_scale,
                              stride_kv, stride_c, stride_idx, stride_page, tiles_per_split,
                              HAS_SINK: tl.constexpr, PAGE: tl.constexpr, BH: tl.constexpr,
                              BN: tl.constexpr, BD: tl.constexpr, SPLITS: tl.constexpr,
                              DOT_PREC: tl.constexpr):
    hb = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    offs_h = hb * BH + tl.arange(0, BH)
    offs_d = tl.arange(0, BD)
    offs_n = tl.arange(0, BN)
    hmask = offs_h < H
    dmask = offs_d < D
    hd_mask = hmask[:, None] & dmask[None, :]
    # A 64-bit request base plus 32-bit tile offsets: 64-bit offset tiles [BH, BD] would take
    # twice the registers next to the fp32 accumulator.
    hd_offs = offs_h[:, None] * D + offs_d[None, :]
    q = tl.load(q_ptr + b.to(tl.int64) * H * D + hd_offs, mask=hd_mask, other=0.0)
    m_i = tl.full([BH], -1.0e30, tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BD], tl.float32)
    t0 = split * tiles_per_split
    t1 = t0 + tiles_per_split
    hi = tl.load(len_ptr + b)
    lo = tl.maximum(hi - window, 0)
    win_tiles = tl.cdiv(window, BN)
    sel_end = tl.load(end_ptr + b)
    sel_tiles = tl.cdiv(sel_end, BN)
    i_end = tl.minimum(t1, tl.cdiv(hi - lo, BN))
    j0 = tl.maximum(t0 - win_tiles, 0)
    j_end = tl.minimum(t1 - win_tiles, sel_tiles)
    # Window tiles: positions [lo, hi) through the page table. Neither loop body branches, so
    # Triton pipelines the key loads, but only one tile ahead: as Triton 3.6 compiles the
    # defaults for sm_90 (bench/dsv4_attention.py --decode-compile), an iteration waits for
    # every copy in flight (async_wait num=0), runs the score MMA and softmax, issues the value
    # MMA, then loads the next tile's page entries and issues its key copy. That copy overlaps
    # at most the value MMA. That wait is not what limits it, though: five stages, at which
    # Triton double-buffers the key tile and keeps copies in flight across the wait, were
    # slower at both head counts, and two stages (no prefetch) time as three. A hand rotation
    # through registers, a persistent grid and value splits lost too (all in
    # bench/results/dsv4_attention_h200.txt).
    for i in range(t0, i_end):
        pos = lo + i * BN + offs_n
        valid = pos < hi
        if PAGE >= BN:
            # A tile spans at most two pages: two scalar loads. A [BN] load of the page entries
            # takes the key tile's row layout, where every lane of a warp loads its rows again
            # (as many load instructions as the key copies; ncu, dsv4_attention_h200.txt).
            first = lo + i * BN
            page_row = page_ptr + b * stride_page
            p0 = tl.load(page_row + first // PAGE)
            p1 = tl.load(page_row + (tl.minimum(first + BN, hi) - 1) // PAGE)  # last valid
            page = tl.where(pos // PAGE == first // PAGE, p0, p1)
        else:
            page = tl.load(page_ptr + b * stride_page + pos // PAGE, mask=valid, other=0)
        row = page.to(tl.int64) * PAGE + pos % PAGE
        k = tl.load(kv_ptr + row[:, None] * stride_kv + offs_d[None, :],
                    mask=valid[:, None] & dmask[None, :], other=0.0)
        m_i, l_i, acc = _online_softmax_step(q, k, valid, m_i, l_i, acc, qk_scale, DOT_PREC)
    # Selection tiles, numbered after the window's cdiv(window, BN); they stop at the
    # request's last valid pick (sel_end), so -1 padding at the end costs nothing.
    for j in range(j0, j_end):
        sel = j * BN + offs_n
        row = tl.load(idx_ptr + b * stride_idx + sel, mask=sel < sel_end, other=-1)
        valid = row >= 0
        k = tl.load(comp_ptr + row[:, None].to(tl.int64) * stride_c + offs_d[None, :],
                    mask=valid[:, None] & dmask[None, :], other=0.0)
        m_i, l_i, acc = _online_softmax_step(q, k, valid, m_i, l_i, acc, qk_scale, DOT_PREC)
    if SPLITS == 1:
        if HAS_SINK:
            sink = tl.load(sink_ptr + offs_h, mask=hmask, other=0.0).to(tl.float32)
            sink = sink * 1.4426950408889634  # log2 units, as the scores
            m_new = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.exp2(sink - m_new)
            acc = acc * alpha[:, None]
        out = acc / tl.maximum(l_i, 1.0e-30)[:, None]
        tl.store(o_ptr + b.to(tl.int64) * H * D + hd_offs, out.to(o_ptr.dtype.element_ty),
                 mask=hd_mask)
    else:
        base = (b.to(tl.int64) * SPLITS + split) * H
        tl.store(part_ptr + base * D + hd_offs, acc, mask=hd_mask)
        tl.store(ml_ptr + (base + offs_h) * 2, m_i, mask=hmask)
        tl.store(ml_ptr + (base + offs_h) * 2 + 1, l_i, mask=hmask)


@triton.jit
def _dsv4_decode_combine_kernel(part_ptr, ml_ptr, sink_ptr, o_ptr, H, D,
                                HAS_SINK: tl.constexpr, SPLITS: tl.constexpr, BH: tl.constexpr,
                                BD: tl.constexpr):
    """out = (sum_s 2^(m_s - M) acc_s) / (sum_s 2^(m_s - M) l_s + 2^(sink - M)), M the max of
    the splits' maxima and the sink."""
    hb = tl.program_id(0)
    b = tl.program_id(1)
    offs_h = hb * BH + tl.arange(0, BH)
    offs_d = tl.arange(0, BD)
    hmask = offs_h < H
    hd_mask = hmask[:, None] & (offs_d < D)[None, :]
    hd_offs = offs_h[:, None] * D + offs_d[None, :]
    big_m = tl.full([BH], -1.0e30, tl.float32)
    for s in tl.static_range(SPLITS):
        row = (b.to(tl.int64) * SPLITS + s) * H + offs_h
        big_m = tl.maximum(big_m, tl.load(ml_ptr + row * 2, mask=hmask, other=-1.0e30))
    if HAS_SINK:
        sink = tl.load(sink_ptr + offs_h, mask=hmask, other=0.0).to(tl.float32)
        sink = sink * 1.4426950408889634  # log2 units, as the splits' maxima
        big_m = tl.maximum(big_m, sink)
        total = tl.exp2(sink - big_m)
    else:
        total = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BD], tl.float32)
    for s in tl.static_range(SPLITS):
        row = (b.to(tl.int64) * SPLITS + s) * H + offs_h
        w = tl.exp2(tl.load(ml_ptr + row * 2, mask=hmask, other=-1.0e30) - big_m)
        total += w * tl.load(ml_ptr + row * 2 + 1, mask=hmask, other=0.0)
        acc += w[:, None] * tl.load(part_ptr + (b.to(tl.int64) * SPLITS + s) * H * D + hd_offs,
                                    mask=hd_mask, other=0.0)
    out = acc / tl.maximum(total, 1.0e-30)[:, None]
    tl.store(o_ptr + b.to(tl.int64) * H * D + hd_offs, out.to(o_ptr.dtype.element_ty),
             mask=hd_mask)


def dsv4_decode_triton(q, kv_cache, page_table, seq_lens, sinks, window, scale, comp_kv=None,
                       comp_idx=None, tiles: DecodeTiles | None = None) -> torch.Tensor:
    """q [B, H, D]; kv_cache [pages, page_size, D]; page_table [B, max_pages] int32;
    seq_lens [B] (tokens cached, the query's own included) -> [B, H, D]. Inputs validated by
    dsv4_decode; sinks fp32 or None."""
    batch, heads, dim = q.shape
    if kv_cache.dtype != q.dtype or (comp_kv is not None and comp_kv.dtype != q.dtype):
        raise ValueError(f"the Triton decode takes q, kv_cache and comp_kv in one dtype; got "
                         f"{q.dtype}, {kv_cache.dtype}, "
                         f"{None if comp_kv is None else comp_kv.dtype}")
    wgmma = wgmma_applies(q, kv_cache)
    chosen = tiles is not None
    tiles = tiles or default_tiles(heads, wgmma and not _UNBUILT)
    if tiles.wgmma and not wgmma:
        raise ValueError("DecodeTiles(wgmma=True) needs bf16 on an sm_90 GPU, D 512 and 33-64 "
                         f"heads; got {q.dtype}, {q.device}, D {dim}, {heads} heads")
    q = q.contiguous()  # before out: empty_like keeps a non-contiguous q's strides
    out = torch.empty_like(q)
    if batch == 0:
        return out
    kv = kv_cache.reshape(-1, dim)
    comp, cidx, sel_end = selection_or_empty(comp_kv, comp_idx, batch, dim, kv_cache)
    lens = seq_lens.to(torch.int32).contiguous()
    table = page_table.to(torch.int32).contiguous()
    head_blocks = triton.cdiv(heads, tiles.bh)
    key_tiles = triton.cdiv(window, tiles.bn) + triton.cdiv(cidx.shape[1], tiles.bn)
    splits = split_count(tiles, batch, head_blocks, key_tiles, q.device)
    part = ml = out  # unused with one split
    if splits > 1:
        part = torch.empty(batch, splits, heads, dim, device=q.device, dtype=torch.float32)
        ml = torch.empty(batch, splits, heads, 2, device=q.device, dtype=torch.float32)
    has_sink = sinks is not None
    bd = triton.next_power_of_2(dim)
    if tiles.wgmma:
        unbuilt = gluon_kernels().launch(q, kv, comp, cidx, sel_end, sinks, lens, table, out,
                                         part, ml, window, scale * LOG2E, kv_cache.shape[1],
                                         tiles, splits, triton.cdiv(key_tiles, splits))
        if unbuilt is not None:
            if chosen:
                raise RuntimeError(unbuilt_message("decode", unbuilt))
            _UNBUILT.append(warn_unbuilt("decode", unbuilt))
            return dsv4_decode_triton(q, kv_cache, page_table, seq_lens, sinks, window, scale,
                                      comp_kv, comp_idx, default_tiles(heads))
    else:
        _dsv4_decode_split_kernel[(head_blocks, splits, batch)](
            q, kv, comp, cidx, sel_end, sinks if has_sink else q, lens, table, out, part, ml,
            heads, dim, window, scale * LOG2E, kv.stride(0), comp.stride(0), cidx.stride(0),
            table.stride(0), triton.cdiv(key_tiles, splits), HAS_SINK=has_sink,
            PAGE=kv_cache.shape[1], BH=tiles.bh, BN=tiles.bn, BD=bd, SPLITS=splits,
            DOT_PREC=dot_precision(q.dtype), num_warps=tiles.warps, num_stages=tiles.stages)
    if splits > 1:
        bh = min(16, tiles.bh)
        _dsv4_decode_combine_kernel[(triton.cdiv(heads, bh), batch)](
            part, ml, sinks if has_sink else q, out, heads, dim, HAS_SINK=has_sink,
            SPLITS=splits, BH=bh, BD=bd, num_warps=4)
    return out
