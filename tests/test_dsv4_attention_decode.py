"""Paged DSV4 decode (Triton split + combine kernels) against the float64 reference.

CI runs these on the CPU under TRITON_INTERPRET=1 (tiny shapes, 16-wide tiles); on a CUDA
machine they run on the GPU. The reference sees the same rounded inputs upcast to float64.
"""

import os

import pytest
import torch

from sglang_dsv41.attention import dsv4_decode
from sglang_dsv41.attention.dsv4 import dsv4_decode_reference
from sglang_dsv41.attention.dsv4_triton_decode import DecodeTiles, dsv4_decode_triton, split_count

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
           head_major_q=False):
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
        out = dsv4_decode(q, cache, table, lens, sink, WINDOW, dim ** -0.5, comp, idx,
                          backend="triton")
    else:
        out = dsv4_decode_triton(q, cache, table, lens, sink, WINDOW, dim ** -0.5, comp, idx,
                                 tiles=tiles)
    ref = dsv4_decode_reference(q.double(), cache.double(), table, lens,
                                sink.double() if sinks else None, WINDOW, dim ** -0.5,
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
