"""The DSV4 attention of one query row at 64 heads on Hopper, written in Gluon (Triton's
layout-explicit dialect): paged decode, and the training forward.

Decode: same contract and split/combine scheme as dsv4_triton_decode.py. The training forward
(PAGED False): dsv4_triton_forward.py's contract, one program a token, out and the LSE written.
For the one shape where Triton cannot lay the kernel out well: 33-64 heads, D 512, bf16, sm_90.
There a program's query tile is [64 heads, 512] and each key tile feeds two MMAs, the scores
S = Q K^T [64, BN] and the values O += P K [64, 512]. Triton gives a dot whose result feeds
another dot all its warps on M, so with two warpgroups both compute the same 64-row scores
(bench/dsv4_attention.py --decode-compile: warpsPerCTA [8, 1]; 35-41% of copy bandwidth in
decode; the training forward, 4k CSA on an H200: 1.40 ms against this kernel's 0.99). Here both
MMAs split their N over the warpgroups ([4, 2] warps): each computes half of a tile's scores and
half of the output columns, exchanging P through shared memory, so no MMA is done twice.

The key tiles (a row's window, through its page table in decode, then its selected compressed
rows: one numbering, window tiles first) are gathered with cp.async into a ring of STAGES
buffers, STAGES - 1 tiles ahead of the MMAs. A tile's page entries / picks are loaded STAGES
tiles ahead, one entry a thread (in the copies' row layout every lane of a warp would load its
warp's rows again), turned into row offsets under the current tile's MMAs and kept in an index
ring in shared memory with their validity, which the copy (one iteration later) and the tile's
score mask read back. Invalid rows (past the request's length, -1 picks) are zero-filled by the
masked copy and their scores set to -inf. Measured on an H200: bench/results/
dsv4_attention_h200.txt.

GPU only: Gluon kernels do not run under TRITON_INTERPRET. The Triton kernels remain the path
everywhere else and the CPU-tested ones; tests/test_dsv4_attention_decode.py and
tests/test_dsv4_attention.py check this one against the float64 reference on a GPU and build it
for sm_90 on the CPU.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

# cp.async of a pointer tile into shared memory: async_copy_global_to_shared in Triton 3.6 (the
# GPU machines' image), async_load in 3.9 (CI's, which refuses the old name).
async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
# A barrier of the CTA's threads: thread_barrier in 3.6, barrier in 3.9.
cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

BH = gl.constexpr(64)  # heads a program: one wgmma M tile
DIM = gl.constexpr(512)  # the real model's latent width (448 nope + 64 rope)


@gluon.jit
def _tile_index(i, n_win, lo, hi, sel_end, t1, b, idx_ptr, page_ptr, stride_idx, stride_page,
                offs_n, PAGE: gl.constexpr, BN: gl.constexpr, PAGED: gl.constexpr):
    """-> (page entries, picks) of a request's key tile i (window tiles first; -1 where none),
    one entry a thread: in the copies' row layout every lane of a warp would load its warp's
    rows again, as many load instructions as the tile's copies (ncu). Not PAGED (the training
    forward: the window's rows are kv's own): 0 for a window row in range, -1 where none."""
    live = i < t1
    pos = lo + i * BN + offs_n
    in_window = live & (i < n_win) & (pos < hi)
    if PAGED:
        page = gl.load(page_ptr + b * stride_page + pos // PAGE, mask=in_window, other=-1)
    else:
        page = gl.where(in_window, 0, -1)
    sel = (i - n_win) * BN + offs_n
    pick = gl.load(idx_ptr + b * stride_idx + sel, mask=live & (i >= n_win) & (sel < sel_end),
                   other=-1)
    return page, pick


@gluon.jit
def _tile_offsets(i, n_win, lo, page, pick, stride_kv, stride_c, offs_n, PAGE: gl.constexpr,
                  BN: gl.constexpr, PAGED: gl.constexpr):
    """-> (row offsets [BN], in elements from kv (a window tile) or comp (a selection tile),
    valid [BN]) of tile i from _tile_index's loads."""
    is_win = i < n_win
    pos = lo + i * BN + offs_n
    if PAGED:
        win_row = page.to(gl.int64) * PAGE + pos % PAGE
    else:
        win_row = pos.to(gl.int64)
    offs = gl.where(is_win, win_row * stride_kv, pick.to(gl.int64) * stride_c)
    return offs, gl.where(is_win, page, pick) >= 0


@gluon.jit
def _issue(k_buf, i, n_win, kv_ptr, comp_ptr, offs_buf, flag_buf, offs_d,
           rows_l: gl.constexpr):
    """The copy of tile i's rows (offsets and validity from the index ring) into k_buf."""
    base = gl.where(i < n_win, kv_ptr, comp_ptr)
    offs = offs_buf.load(rows_l)
    async_load(k_buf, _row_tile(base + offs, offs_d), mask=(flag_buf.load(rows_l) != 0)[:, None])


@gluon.jit
def _row_tile(base, offs_d):
    """[BN, DIM] pointers of the rows at base: 16-byte runs (the rows are 16-byte aligned, which
    the offsets loaded from shared memory hide from the compiler's alignment analysis)."""
    return gl.max_contiguous(gl.multiple_of(base[:, None] + offs_d[None, :], [1, 16]), [1, 8])


@gluon.jit
def _dsv4_wgmma_kernel(q_ptr, kv_ptr, comp_ptr, idx_ptr, end_ptr, sink_ptr, len_ptr, page_ptr,
                       o_ptr, part_ptr, ml_ptr, H, window, qk_scale, stride_kv, stride_c,
                       stride_idx, stride_page, tiles_per_split, HAS_SINK: gl.constexpr,
                       PAGE: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                       SPLITS: gl.constexpr, PARTS: gl.constexpr = 0,
                       PAGED: gl.constexpr = True):
    """PAGED: decode, program (split, request); len_ptr the requests' lengths, ml_ptr the
    splits' running max and sum. Not PAGED: the training forward, program (token,); len_ptr the
    tokens' sequence first rows, ml_ptr the LSE [T, H], page_ptr and part_ptr unused."""
    NW: gl.constexpr = gl.num_warps()
    WG: gl.constexpr = NW // 4  # warpgroups, each takes 1/WG of every MMA's columns
    load_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NW, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, load_l)
    cols_l: gl.constexpr = gl.SliceLayout(0, load_l)
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                  instr_shape=[16, BN // WG, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                  instr_shape=[16, DIM // WG, 16])
    flag_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])

    if PAGED:
        split = gl.program_id(0)
        b = gl.program_id(1)
        hi = gl.load(len_ptr + b)
        lo = gl.maximum(hi - window, 0)
    else:
        # The training forward: program b is token b, whose window is kv's rows
        # [max(first row of its sequence, b + 1 - window), b] (len_ptr: the first rows).
        split = 0
        b = gl.program_id(0)
        hi = b + 1
        lo = gl.maximum(gl.load(len_ptr + b), hi - window)
    n_win = gl.cdiv(hi - lo, BN)
    sel_end = gl.load(end_ptr + b)
    t0 = split * tiles_per_split
    t1 = gl.minimum(t0 + tiles_per_split, n_win + gl.cdiv(sel_end, BN))

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, DIM],
                                       gl.NVMMASharedLayout.get_default_for([BH, DIM], gl.bfloat16))
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, DIM],
                                       gl.NVMMASharedLayout.get_default_for([BN, DIM], gl.bfloat16))
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, BN],
                                       gl.NVMMASharedLayout.get_default_for([BH, BN], gl.bfloat16))
    # The index ring: each tile's row offsets and validity, computed STAGES tiles ahead of its
    # MMAs (one entry a thread) and read one iteration later, in the copies' layout, to issue
    # its copy; a tile's validity is read again for its scores' mask.
    RING: gl.constexpr = STAGES + 1
    offs_ring = gl.allocate_shared_memory(gl.int64, [RING, BN], flag_l)
    flags = gl.allocate_shared_memory(gl.int8, [RING, BN], flag_l)

    offs_d = gl.arange(0, DIM, layout=cols_l)
    offs_h = gl.arange(0, BH, layout=rows_l)
    offs_n = gl.arange(0, BN, layout=gl.BlockedLayout([1], [32], [NW], [0]))
    # The query rides in the first copy group (rows past H zero-filled), issued before the
    # first tiles' index loads so that its latency and theirs overlap.
    async_load(
        q_smem, q_ptr + b.to(gl.int64) * H * DIM + offs_h[:, None] * DIM + offs_d[None, :],
        mask=(offs_h < H)[:, None])
    for st in gl.static_range(STAGES):
        page, pick = _tile_index(t0 + st, n_win, lo, hi, sel_end, t1, b, idx_ptr, page_ptr,
                                 stride_idx, stride_page, offs_n, PAGE, BN, PAGED)
        offs, valid = _tile_offsets(t0 + st, n_win, lo, page, pick, stride_kv, stride_c, offs_n,
                                    PAGE, BN, PAGED)
        offs_ring.index(st).store(offs)
        flags.index(st).store(valid.to(gl.int8))
    cta_barrier()
    for st in gl.static_range(STAGES - 1):
        if PARTS != 2:
            _issue(k_smem.index(st), t0 + st, n_win, kv_ptr, comp_ptr, offs_ring.index(st),
                   flags.index(st), offs_d, rows_l)
        cp.commit_group()

    m_i = gl.full([BH], -1.0e30, gl.float32, gl.SliceLayout(1, s_l))
    l_i = gl.zeros([BH], gl.float32, gl.SliceLayout(1, s_l))
    acc = gl.zeros([BH, DIM], gl.float32, o_l)
    for i in range(t0, t1):
        j = i - t0
        # Every warp is past the previous tile's value MMA: its buffer and P may be rewritten.
        cta_barrier()
        x = j + STAGES - 1
        if PARTS != 2:
            _issue(k_smem.index(x % STAGES), i + STAGES - 1, n_win, kv_ptr, comp_ptr,
                   offs_ring.index(x % RING), flags.index(x % RING), offs_d, rows_l)
        cp.commit_group()
        # Tile i + STAGES's page entries / picks: loaded now, used after this tile's MMAs.
        page, pick = _tile_index(i + STAGES, n_win, lo, hi, sel_end, t1, b, idx_ptr, page_ptr,
                                 stride_idx, stride_page, offs_n, PAGE, BN, PAGED)
        cp.wait_group(STAGES - 1)
        fence_async_shared()  # cp.async's writes, read next by wgmma (the async proxy)
        cta_barrier()
        if PARTS != 1:
            k = k_smem.index(j % STAGES)
            sc = warpgroup_mma(q_smem, k.permute((1, 0)), gl.zeros([BH, BN], gl.float32, s_l),
                               use_acc=False)
            ok = flags.index(j % RING).load(gl.SliceLayout(0, s_l)) != 0
            sc = gl.where(ok[None, :], sc * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(sc, 1))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(sc - m_new[:, None])
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
            p_smem.store(p.to(gl.bfloat16))
            fence_async_shared()
            cta_barrier()  # each warpgroup wrote half of P's columns; both need all of it
            acc = warpgroup_mma(p_smem, k, acc)
        offs, valid = _tile_offsets(i + STAGES, n_win, lo, page, pick, stride_kv, stride_c,
                                    offs_n, PAGE, BN, PAGED)
        offs_ring.index((j + STAGES) % RING).store(offs)
        flags.index((j + STAGES) % RING).store(valid.to(gl.int8))
    cp.wait_group(0)  # the masked copies issued past the last tile
    if PARTS == 1:
        # Without the MMAs nothing reads the query's buffer, and the compiler would lend its
        # space to scratch (reductions, layout conversions) while the query's copy lands.
        acc += q_smem.load(o_l).to(gl.float32)

    hs = gl.arange(0, BH, layout=gl.SliceLayout(1, s_l))
    hmask_s = hs < H
    oh = gl.arange(0, BH, layout=gl.SliceLayout(1, o_l))
    od = gl.arange(0, DIM, layout=gl.SliceLayout(0, o_l))
    o_offs = oh[:, None] * DIM + od[None, :]
    o_mask = (oh < H)[:, None]
    if SPLITS == 1:
        if HAS_SINK:
            sink = gl.load(sink_ptr + hs, mask=hmask_s, other=0.0).to(gl.float32) \
                * 1.4426950408889634
            m_new = gl.maximum(m_i, sink)
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha + gl.exp2(sink - m_new)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
            m_i = m_new
        inv = gl.convert_layout(1.0 / gl.maximum(l_i, 1.0e-30), gl.SliceLayout(1, o_l))
        gl.store(o_ptr + b.to(gl.int64) * H * DIM + o_offs,
                 (acc * inv[:, None]).to(o_ptr.dtype.element_ty), mask=o_mask)
        if not PAGED:
            # The training forward's LSE (log2 units, sink-inclusive; +inf where the row saw
            # nothing, so that the backward's probabilities are 0 there): into ml_ptr [T, H].
            gl.store(ml_ptr + b.to(gl.int64) * H + hs,
                     gl.where(l_i > 0, m_i + gl.log2(l_i), float("inf")), mask=hmask_s)
    else:
        row = (b.to(gl.int64) * SPLITS + split) * H
        gl.store(part_ptr + row * DIM + o_offs, acc, mask=o_mask)
        gl.store(ml_ptr + (row + hs) * 2, m_i, mask=hmask_s)
        gl.store(ml_ptr + (row + hs) * 2 + 1, l_i, mask=hmask_s)


# Per compile-time configuration: None once the kernel built, else why it did not.
_BUILD_ERRORS: dict[tuple, str | None] = {}


def _launch(args, grid, consts) -> str | None:
    """Builds the kernel for consts once (before its first launch), then launches it -> None, or,
    launching nothing, why this Triton does not build it (Gluon is experimental and its API
    moves between releases)."""
    key = tuple(sorted(consts.items()))
    if key not in _BUILD_ERRORS:
        try:
            _dsv4_wgmma_kernel.warmup(*args, grid=grid, **consts)
            _BUILD_ERRORS[key] = None
        except Exception as err:  # any failure to build: nothing has run on the GPU yet
            _BUILD_ERRORS[key] = f"{type(err).__name__}: {str(err)[-2000:]}"
    if _BUILD_ERRORS[key] is None:
        _dsv4_wgmma_kernel[grid](*args, **consts)
    return _BUILD_ERRORS[key]


def launch(q, kv, comp, cidx, sel_end, sinks, lens, table, out, part, ml, window, scale_log2,
           page: int, tiles, splits: int, tiles_per_split: int, parts: int = 0) -> str | None:
    """One decode launch over (splits, batch) with dsv4_decode_triton's prepared arguments
    (tiles: a DecodeTiles with wgmma=True) -> None, or why the kernel does not build (_launch).
    parts, for bench/dsv4_attention.py --decode-parts only: 1 issues the key copies without the
    MMAs and softmax, 2 the MMAs and softmax without the key copies (the output is then not the
    attention)."""
    batch, heads, _ = q.shape
    args = (q, kv, comp, cidx, sel_end, sinks if sinks is not None else q, lens, table, out, part,
            ml, heads, window, scale_log2, kv.stride(0), comp.stride(0), cidx.stride(0),
            table.stride(0), tiles_per_split)
    return _launch(args, (splits, batch), dict(
        HAS_SINK=sinks is not None, PAGE=page, BN=tiles.bn, STAGES=tiles.stages, SPLITS=splits,
        PARTS=parts, num_warps=tiles.warps))


# The training forward's build: decode's tiles (64 keys, two buffers, 8 warps), one split, no
# pages (PAGE unused). bench/dsv4_attention.py --training-compile and the sm_90 build test
# compile exactly this.
FORWARD_WARPS = 8


def forward_constants(has_sink: bool) -> dict:
    """The training forward's compile-time arguments of _dsv4_wgmma_kernel."""
    return dict(HAS_SINK=has_sink, PAGE=64, BN=64, STAGES=2, SPLITS=1, PARTS=0, PAGED=False)


def launch_forward(q, kv, comp, cidx, sel_end, sinks, first_rows, out, lse, window,
                   scale_log2) -> str | None:
    """The training forward over T tokens, one program each (the grid's first axis: T may pass
    65,535), with dsv4_forward's contiguous inputs (first_rows: each token's sequence's first
    row): out [T, H, 512] and lse [T, H] written -> None, or why the kernel does not build."""
    total, heads, _ = q.shape
    consts = forward_constants(sinks is not None)
    key_tiles = triton.cdiv(window, consts["BN"]) + triton.cdiv(cidx.shape[1], consts["BN"])
    args = (q, kv, comp, cidx, sel_end, sinks if sinks is not None else q, first_rows, cidx,
            out, out, lse, heads, window, scale_log2, kv.stride(0), comp.stride(0),
            cidx.stride(0), 0, key_tiles)
    return _launch(args, (total,), dict(consts, num_warps=FORWARD_WARPS))
