"""FP8 e4m3 block (de)quantization against a naive per-block loop, both scale encodings."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv41.loader.fp8 import (dequantize_fp8_blocks, iter_dequantized_rows,
                                     quantize_fp8_blocks, scale_to_float32)


def naive_dequant(q: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float32)
    s = scale_to_float32(scale)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rows = slice(i * block[0], (i + 1) * block[0])
            cols = slice(j * block[1], (j + 1) * block[1])
            out[rows, cols] = q[rows, cols].float() * s[i, j]
    return out


@pytest.mark.parametrize("scale_fmt", ["float32", "ue8m0"])
def test_round_trip_matches_naive_blocks(scale_fmt):
    gen = torch.Generator().manual_seed(0)
    # Partial blocks in both dimensions, and blocks with very different magnitudes.
    w = torch.randn(300, 200, generator=gen) * torch.logspace(-3, 1, 200)[None, :]
    block = (128, 64)
    q, s = quantize_fp8_blocks(w, block, scale_fmt)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.shape == (3, 4)
    assert s.dtype == (torch.float8_e8m0fnu if scale_fmt == "ue8m0" else torch.float32)
    deq = dequantize_fp8_blocks(q, s, block, torch.float32)
    assert torch.equal(deq, naive_dequant(q, s, block))
    # e4m3 keeps 3 mantissa bits: each value within 1/16 of itself, plus subnormal slack
    # relative to its block's scale.
    s32 = scale_to_float32(s).repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    s32 = s32[:300, :200]
    err = (deq - w).abs()
    assert bool((err <= w.abs() / 16 + s32 * 2**-9 * 2).all())
    bf16 = dequantize_fp8_blocks(q, s, block, torch.bfloat16)
    assert torch.equal(bf16, naive_dequant(q, s, block).to(torch.bfloat16))
    if scale_fmt == "ue8m0":  # power-of-two scales: fp8 * 2^k is exact in bf16
        assert torch.equal(bf16.float(), deq)
        assert bool((scale_to_float32(s).log2() == scale_to_float32(s).log2().round()).all())


def test_chunked_rows_equal_whole_tensor():
    w = torch.randn(700, 96)
    q, s = quantize_fp8_blocks(w, (128, 128))
    whole = dequantize_fp8_blocks(q, s, (128, 128), torch.float32)
    chunks = list(iter_dequantized_rows(lambda a, b: q[a:b], [700, 96], s, (128, 128),
                                        torch.float32, rows_per_chunk=256))
    assert [c.shape[0] for c in chunks] == [256, 256, 188]
    assert torch.equal(torch.cat(chunks), whole)


def test_scale_encodings_and_errors():
    raw = torch.tensor([[127, 130], [120, 0]], dtype=torch.uint8)
    want = torch.tensor([[1.0, 8.0], [2.0**-7, 2.0**-127]])
    assert torch.equal(scale_to_float32(raw), want)
    assert torch.equal(scale_to_float32(raw.view(torch.float8_e8m0fnu)), want)
    with pytest.raises(ValueError, match="NaN"):
        scale_to_float32(torch.tensor([255], dtype=torch.uint8))
    q, s = quantize_fp8_blocks(torch.randn(130, 10), (128, 128))
    with pytest.raises(ValueError, match=r"scale has shape \(1, 1\), expected \(2, 1\)"):
        dequantize_fp8_blocks(q, s[:1], (128, 128))
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8_blocks(torch.randn(4, 4, 4))
    with pytest.raises(ValueError, match="scale_fmt"):
        quantize_fp8_blocks(torch.randn(4, 4), scale_fmt="e5m2")


def test_fp4_round_trip_and_scale_checks():
    from sglang_dsv41.loader.fp4 import E2M1_VALUES, dequantize_fp4, quantize_fp4

    g = torch.Generator().manual_seed(0)
    # Values already on the e2m1 grid times a power of two come back exactly.
    codes = torch.randint(0, 16, (8, 64), generator=g)
    base = E2M1_VALUES[codes]
    base[:, ::32] = 6.0  # each block's amax is 6 x its power-of-two scale
    w = base * 2.0 ** torch.randint(-3, 3, (8, 2), generator=g).repeat_interleave(32, 1)
    packed, scale = quantize_fp4(w)
    assert packed.dtype == torch.int8 and list(packed.shape) == [8, 32]
    assert scale.dtype == torch.float8_e8m0fnu and list(scale.shape) == [8, 2]
    assert torch.equal(dequantize_fp4(packed, scale, torch.float32), w)
    with pytest.raises(ValueError, match="expected \\[8, 2\\]"):
        dequantize_fp4(packed, scale[:, :1])
