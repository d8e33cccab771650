"""Paged DSV4 decode (Triton split + combine kernels) against the float64 reference.

CI runs these on the CPU under TRITON_INTERPRET=1 (tiny shapes, 16-wide tiles); on a CUDA
machine they run on the GPU. The reference sees the same rounded inputs upcast to float64.
"""

import os
import re
from dataclasses import replace

import pytest
import torch

from sglang_dsv41.attention import dsv4_decode
from sglang_dsv41.attention.dsv4 import dsv4_decode_reference
from sglang_dsv41.attention.dsv4_triton_decode import (WGMMA_TILES, DecodeTiles,
                                                       dsv4_decode_triton, split_count)
from sglang_dsv41.attention.triton_common import wgmma_applies

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                reason="Triton needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cpu" if INTERPRET else "cuda"
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-3}
WINDOW = 24  # two 16-key tiles, the second part full: tiles straddle the window's start


def _rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300)).item()


def _cache(seq_lens, page_size, dim, dtype, spare_pages=3):
    """A shuffled paged cache: each request's pages are scattered among the others'."""
    need = [-(-n // page_size) for n in seq_lens]
    pages = sum(need) + spare_pages
    cache = torch.randn(pages, page_size, dim, device=DEVICE).to(dtype)
    order = torch.randperm(pages, device=DEVICE)
    table = torch.zeros(len(seq_lens), max(need) + 1, dtype=torch.int32, device=DEVICE)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = order[start:start + n]
        start += n
    return cache, table


def _check(seq_lens, heads, dim, idx, dtype, tiles=None, sinks=True, page_size=8, comp_rows=40,
           head_major_q=False, window=WINDOW):
    lens = torch.tensor(seq_lens, device=DEVICE)
    cache, table = _cache(seq_lens, page_size, dim, dtype)
    q = (torch.randn(len(seq_lens), heads, dim, device=DEVICE) * 0.5).to(dtype)
    if head_major_q:  # the same values in [H, B, D] memory: a non-contiguous [B, H, D] view
        q = q.transpose(0, 1).contiguous().transpose(0, 1)
    sink = torch.randn(heads, device=DEVICE) if sinks else None
    comp = torch.randn(comp_rows, dim, device=DEVICE).to(dtype) if idx is not None else None
    if idx is not None:
        idx = torch.tensor(idx, dtype=torch.int32, device=DEVICE).view(len(seq_lens),
                                                                        len(idx[0]))
    if tiles is None:
        out = dsv4_decode(q, cache, table, lens, sink, window, dim ** -0.5, comp, idx,
                          backend="triton")
    else:
        out = dsv4_decode_triton(q, cache, table, lens, sink, window, dim ** -0.5, comp, idx,
                                 tiles=tiles)
    ref = dsv4_decode_reference(q.double(), cache.double(), table, lens,
                                sink.double() if sinks else None, window, dim ** -0.5,
                                comp.double() if comp is not None else None, idx)
    assert out.dtype == dtype and out.shape == q.shape
    err = _rel(out, ref)
    assert err <= TOL[dtype], f"relative error {err:.2e} > {TOL[dtype]}"


# CSA-like picks: -1 padding in the middle and at the end, a repeat (counted twice, as in
# prefill), a row with no pick at all.
PICKS = [[5, -1, 33, 5, 17, 2, -1, -1, 39, 0, 11, 8, 30, -1, 21, 6, 12, 3, -1, -1],
         [-1] * 20,
         [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
         [38, 37, -1, 36, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1]]
# Sequences shorter than the window, exactly one page, and longer than the window.
LENS = [5, 8, 24, 61]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 2, 5])
def test_decode_matches_reference_over_splits(seed, dtype, splits):
    """One split writes the output itself; 2 and 5 go through the combine (5 > the 3 key tiles
    of this shape is clamped to 3, one tile each)."""
    tiles = DecodeTiles(bh=16, bn=16, warps=1, stages=1, splits=splits)
    _check(LENS, 4, 32, PICKS, dtype, tiles)


@pytest.mark.parametrize("sinks", [True, False])
def test_decode_without_selection_and_head_blocks(seed, sinks):
    """Sliding layers (no selection; K = 0 too), 20 heads in two 16-head blocks."""
    tiles = DecodeTiles(bh=16, bn=16, warps=1, stages=1, splits=2)
    _check(LENS, 20, 32, None, torch.float32, tiles, sinks=sinks)
    _check(LENS, 20, 32, [[] for _ in LENS], torch.float32, tiles, sinks=sinks)


@pytest.mark.parametrize("page_size", [4, 16])
def test_decode_public_entry_default_tiles(seed, page_size):
    """dsv4_decode's own path (default tiles), HCA-like picks (ready blocks first, then -1)."""
    picks = [[c if c < n // 4 else -1 for c in range(16)] for n in LENS]
    _check(LENS, 4, 32, picks, torch.bfloat16, page_size=page_size)
    _check(LENS, 4, 32, PICKS, torch.float32, sinks=False, page_size=page_size)


@pytest.mark.parametrize("page_size", [16, 32])
def test_decode_window_tiles_across_page_ends(seed, page_size):
    """Pages at least a key tile wide: a window tile spans one or two pages (the page entries
    loaded as two scalars), the second one partly past the request's length or not."""
    lens = [70, 47, 33, 64, 65, 17]
    tiles = DecodeTiles(bh=16, bn=16, warps=1, stages=1)
    _check(lens, 4, 32, None, torch.float32, tiles, page_size=page_size, window=40)
    _check(lens, 4, 32, [[1, -1, 3]] * len(lens), torch.float32, tiles, page_size=page_size,
           window=40)


def test_decode_takes_a_non_contiguous_q(seed):
    """The output is written [B, H, D]-contiguous whatever q's strides are."""
    _check(LENS, 4, 32, PICKS, torch.float32, head_major_q=True)


def test_decode_empty_pool_and_no_keys_without_sink(seed):
    """A selection into an empty pool sees only the window; a request whose window is its one
    token still attends it."""
    lens = torch.tensor([1, 3], device=DEVICE)
    cache, table = _cache([1, 3], 4, 16, torch.float32)
    q = torch.randn(2, 2, 16, device=DEVICE)
    idx = torch.full((2, 4), -1, dtype=torch.int32, device=DEVICE)
    out = dsv4_decode(q, cache, table, lens, None, WINDOW, 0.25, cache.new_zeros(0, 16), idx,
                      backend="triton")
    ref = dsv4_decode_reference(q.double(), cache.double(), table, lens, None, WINDOW, 0.25)
    assert _rel(out, ref) <= 1e-3


def test_decode_refuses_mixed_dtypes():
    q = torch.zeros(1, 4, 32, device=DEVICE)
    cache = torch.zeros(2, 8, 32, device=DEVICE)
    table = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="one dtype"):
        dsv4_decode(q, cache.bfloat16(), table, lens, None, 4, 1.0, backend="triton")
    with pytest.raises(ValueError, match="one dtype"):
        dsv4_decode(q, cache, table, lens, None, 4, 1.0, cache.new_zeros(3, 32).bfloat16(),
                    torch.zeros(1, 2, dtype=torch.int32, device=DEVICE), backend="triton")


def test_decode_hostile_inputs_get_clear_errors():
    """Refused at the entry, before any kernel reads out of bounds: picks outside the pool, a
    page table entry the window would read that is no page of the cache, lengths without the
    query's own latent or past the table's row, bad sinks, window, widths and index dtypes.
    Entries the windows do not read (past a request's length) may be anything."""
    cache = torch.randn(4, 8, 16, device=DEVICE)
    table = torch.tensor([[2, 0, -1], [3, -7, 99]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([12, 5], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 2, 16, device=DEVICE)
    comp = torch.randn(3, 16, device=DEVICE)
    picks = torch.tensor([[0, -1], [2, 1]], dtype=torch.int32, device=DEVICE)
    for backend in ("reference", "triton"):
        ok = dsv4_decode(q, cache, table, lens, None, 6, 0.25, comp, picks, backend=backend)
        assert torch.isfinite(ok).all()
        cases = [
            (dict(comp_idx=picks.masked_fill(picks == 2, 3)), r"lie in \[-1, 3\)"),
            (dict(comp_idx=picks.masked_fill(picks == 0, -2)), r"lie in \[-1, 3\)"),
            (dict(comp_idx=picks[:1]), r"comp_idx must be \[2, K\]"),
            (dict(comp_idx=picks.float()), "int32"),
            (dict(comp_kv=None), "without comp_kv"),
            (dict(comp_kv=comp[:, :8]), r"comp_kv must be \[C, 16\]"),
            (dict(page_table=table.masked_fill(table == 0, 4)), "entry 1 = 4, not a page"),
            (dict(seq_lens=lens.masked_fill(lens == 5, 9)), "entry 1 = -7, not a page"),
            (dict(seq_lens=lens.masked_fill(lens == 5, 0)), r"seq_lens must lie in \[1, 24\]"),
            (dict(seq_lens=lens.masked_fill(lens == 5, 25)), r"seq_lens must lie in \[1, 24\]"),
            (dict(page_table=table.float()), "int32"),
            (dict(sinks=torch.zeros(3, device=DEVICE)), r"sinks must have shape \[2\]"),
            (dict(window=0), "window must be >= 1"),
        ]
        for change, message in cases:
            args = dict(q=q, kv_cache=cache, page_table=table, seq_lens=lens, sinks=None,
                        window=6, scale=0.25, comp_kv=comp, comp_idx=picks)
            args.update(change)
            with pytest.raises(ValueError, match=message):
                dsv4_decode(**args, backend=backend)


def test_decode_tiles_refuse_bad_sizes():
    with pytest.raises(ValueError, match="power of two"):
        DecodeTiles(bh=24, bn=16, warps=4, stages=2)
    with pytest.raises(ValueError, match="splits"):
        DecodeTiles(bh=16, bn=16, warps=4, stages=2, splits=-1)


def test_split_count_never_leaves_a_split_without_key_tiles():
    for key_tiles in range(1, 20):
        for wanted in range(1, 24):
            tiles = DecodeTiles(bh=16, bn=16, warps=1, stages=1, splits=wanted)
            splits = split_count(tiles, 4, 1, key_tiles, torch.device("cpu"))
            per_split = -(-key_tiles // splits)
            assert 1 <= splits <= min(wanted, key_tiles)
            assert (splits - 1) * per_split < key_tiles, (key_tiles, wanted, splits)


# The Gluon wgmma kernel (dsv4_gluon.py): 33-64 heads, D 512, bf16 on an sm_90 GPU.
HOPPER = (not INTERPRET and torch.cuda.is_available()
          and wgmma_applies(torch.empty(1, 64, 512, device="cuda", dtype=torch.bfloat16),
                            torch.empty(1, 1, 512, device="cuda", dtype=torch.bfloat16)))


@pytest.mark.skipif(not HOPPER, reason="the wgmma decode needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize("heads", [64, 48])
@pytest.mark.parametrize("splits", [0, 1, 3])
@pytest.mark.parametrize("sinks", [True, False])
def test_wgmma_decode_matches_reference(seed, heads, splits, sinks):
    """A 128-token window in 64-key tiles (lengths short of one tile, at a tile edge, past the
    window) and 150 picks (-1 in the middle and at the end, a repeat, a row with none) over
    64-key tiles, split or not; 48 heads leave 16 of a program's rows masked."""
    lens = [1, 64, 129, 500]
    picks = [[(7 * j) % 300 if j % 9 else -1 for j in range(150)],
             [-1] * 150,
             [5] * 2 + list(range(148)),
             list(range(40)) + [-1] * 110]
    tiles = DecodeTiles(bh=64, bn=64, warps=8, stages=2, splits=splits, wgmma=True)
    for idx in (picks, None):
        _check(lens, heads, 512, idx, torch.bfloat16, tiles, sinks=sinks, page_size=16,
               comp_rows=300, window=128)


@pytest.mark.skipif(not HOPPER, reason="the wgmma decode needs an sm_90 GPU and Gluon")
def test_wgmma_decode_is_the_default_at_64_heads(seed):
    """dsv4_decode at V4-Flash's 64 heads takes the wgmma kernel; three 32-key buffers too."""
    _check([3, 200, 700], 64, 512, [[1, 2, -1] + list(range(30, 90))] * 3, torch.bfloat16,
           page_size=64, comp_rows=100, window=128)
    _check([3, 200, 700], 64, 512, None, torch.bfloat16, replace(WGMMA_TILES, bn=32, stages=3),
           page_size=64, window=128)


@pytest.mark.skipif(not HOPPER, reason="the wgmma decode needs an sm_90 GPU and Gluon")
def test_wgmma_decode_runs_are_bitwise_equal(seed):
    """One split a request: no atomics and a fixed order of sums, so repeated runs agree to the
    bit, which a tile read before all of its copies landed (a wait on the wrong copy group)
    breaks. 300 requests (more than two waves of programs), 3 and 10 key tiles a request."""
    batch, page, pages = 300, 64, 16
    cache = torch.randn(batch * pages, page, 512, device=DEVICE).to(torch.bfloat16)
    table = torch.randperm(batch * pages, device=DEVICE).int().view(batch, pages)
    lens = torch.randint(129, page * pages, (batch,), device=DEVICE, dtype=torch.int32)
    q = torch.randn(batch, 64, 512, device=DEVICE).to(torch.bfloat16)
    comp = torch.randn(4096, 512, device=DEVICE).to(torch.bfloat16)
    sinks = torch.randn(64, device=DEVICE)
    tiles = replace(WGMMA_TILES, splits=1)
    for k in (64, 512):
        picks = torch.randint(0, comp.shape[0], (batch, k), device=DEVICE, dtype=torch.int32)
        runs = [dsv4_decode_triton(q, cache, table, lens, sinks, 128, 512 ** -0.5, comp, picks,
                                   tiles=tiles) for _ in range(4)]
        for other in runs[1:]:
            assert torch.equal(runs[0], other), f"{k} picks: runs differ"


def test_wgmma_tiles_refused_where_they_do_not_apply():
    with pytest.raises(ValueError, match="wgmma"):
        DecodeTiles(bh=16, bn=16, warps=8, stages=2, wgmma=True)
    q = torch.zeros(1, 64, 512, dtype=torch.bfloat16)
    assert not wgmma_applies(q, q.new_zeros(1, 4, 512))
    with pytest.raises(ValueError, match="sm_90"):
        dsv4_decode_triton(q, q.new_zeros(1, 4, 512), torch.zeros(1, 1, dtype=torch.int32),
                           torch.ones(1, dtype=torch.int32), None, 4, 1.0, tiles=WGMMA_TILES)


def test_a_wgmma_decode_this_triton_cannot_build_falls_back(seed, monkeypatch, caplog):
    """Gluon's API moves between Triton releases: where the kernel does not build, the default
    path warns once and decodes with the Triton kernel; tiles that ask for wgmma get the error."""
    from types import SimpleNamespace

    from sglang_dsv41.attention import dsv4_triton_decode as decode, triton_common

    fallback = decode.default_tiles(4)
    monkeypatch.setattr(decode, "_UNBUILT", [])
    monkeypatch.setattr(triton_common, "_warned", set())
    monkeypatch.setattr(decode, "wgmma_applies", lambda q, kv: True)
    monkeypatch.setattr(decode, "default_tiles",
                        lambda heads, wgmma=False: WGMMA_TILES if wgmma else fallback)
    monkeypatch.setattr(decode, "gluon_kernels", lambda: SimpleNamespace(
        launch=lambda *args, **kwargs: "CompilationError: no such builtin"))
    with caplog.at_level("WARNING", logger=triton_common.__name__):
        _check(LENS, 4, 32, PICKS, torch.float32)
        _check(LENS, 4, 32, PICKS, torch.float32)
    warned = [r for r in caplog.records if "does not build" in r.getMessage()]
    assert len(warned) == 1 and "no such builtin" in warned[0].getMessage()
    with pytest.raises(RuntimeError, match="does not build"):
        _check(LENS, 4, 32, PICKS, torch.float32, tiles=WGMMA_TILES)


def test_wgmma_kernel_compiles_for_the_h200():
    """Without a GPU: the Gluon kernel builds for sm_90 with this Triton, as decode (one split
    or two) and as the training forward, its score MMA split over the two warpgroups (m64n32
    for a 64-key tile: each computes half the scores) and the values' too (m64n256: half the
    512 columns each), the keys gathered by cp.async."""
    from triton_compile import compile_many_sm90

    from sglang_dsv41.attention import dsv4_gluon

    types = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "comp_ptr": "*bf16", "o_ptr": "*bf16",
             "sink_ptr": "*fp32", "part_ptr": "*fp32", "ml_ptr": "*fp32", "qk_scale": "fp32",
             "idx_ptr": "*i32", "end_ptr": "*i32", "len_ptr": "*i32", "page_ptr": "*i32"}
    types.update({n: "i32" for n in ("H", "window", "stride_kv", "stride_c", "stride_idx",
                                     "stride_page", "tiles_per_split")})
    module = "sglang_dsv41.attention.dsv4_gluon"
    decode = [(dict(HAS_SINK=True, PAGE=64, BN=64, STAGES=2, SPLITS=splits, PARTS=0,
                    PAGED=True), 8) for splits in (1, 2)]
    forward = [(dsv4_gluon.forward_constants(True), dsv4_gluon.FORWARD_WARPS)]
    ptx = compile_many_sm90([(module, "_dsv4_wgmma_kernel", types, consts, warps)
                             for consts, warps in decode + forward])
    for p in ptx:
        shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+)", p))
        assert shapes == {"m64n32", "m64n256"}, shapes
        assert "cp.async.cg.shared.global" in p
