"""FP8 (e4m3) block quantization as in DeepSeek releases: ``w ~= q * scale_inv`` per block.

A 2-D weight [r, c] is stored as ``<name>.weight`` (float8_e4m3fn) plus
``<name>.weight_scale_inv`` [ceil(r/br), ceil(c/bc)] holding each block's multiplier. The scale
is float32 (any value) or an e8m0 exponent (``float8_e8m0fnu``, or raw uint8 bytes e meaning
2^(e-127)); the ue8m0 convention of DeepSeek-V3.1 (float32 powers of two) is plain float32.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
E8M0_BIAS = 127
SCALE_SUFFIX = "_scale_inv"
SCALE_FORMATS = ("float32", "ue8m0")
# Conversions work on chunks this size (float32) so temporaries stay small next to a shard.
CHUNK_BYTES = 2 << 20


# DeepSeek FP8 release format: one scale per 128 x 128 block of a weight.
FP8_BLOCK: tuple[int, int] = (128, 128)

def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...] | list[int], block: tuple[int, int]) -> tuple[int, int]:
    r, c = shape
    return (-(-r // block[0]), -(-c // block[1]))


def scale_row_range(lo: int, hi: int, block_rows: int) -> tuple[int, int]:
    """Scale rows [a, b) whose blocks cover weight rows lo..hi-1."""
    return lo // block_rows, -(-hi // block_rows)


def scale_to_float32(scale: torch.Tensor) -> torch.Tensor:
    """Any stored scale encoding -> float32 multipliers."""
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    if scale.dtype == torch.uint8:
        e = scale.to(torch.int32)
        if bool((e == 255).any()):
            raise ValueError("e8m0 scale holds 0xFF (NaN)")
        return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - E8M0_BIAS)
    if scale.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        return scale.float()
    raise ValueError(f"unsupported scale dtype {scale.dtype}")


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK,
                        scale_fmt: str = "float32") -> tuple[torch.Tensor, torch.Tensor]:
    """[r, c] float weight -> (fp8 e4m3 [r, c], scale_inv [ceil(r/br), ceil(c/bc)]).

    ``scale_fmt="ue8m0"`` rounds each block's scale up to a power of two (so no value overflows
    448) and stores its exponent as float8_e8m0fnu.
    """
    if w.dim() != 2:
        raise ValueError(f"FP8 block quantization needs a 2-D weight, got shape {tuple(w.shape)}")
    if scale_fmt not in SCALE_FORMATS:
        raise ValueError(f"scale_fmt must be one of {SCALE_FORMATS}, got {scale_fmt!r}")
    (r, c), (br, bc) = w.shape, block
    nr, nc = scale_shape((r, c), block)
    wf = torch.zeros(nr * br, nc * bc, dtype=torch.float32)
    wf[:r, :c] = w.float()
    blocks = wf.view(nr, br, nc, bc)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12)
    if scale_fmt == "ue8m0":
        exp = torch.ceil(torch.log2(amax / FP8_MAX)).clamp(-E8M0_BIAS, 127).to(torch.int32)
        scale = torch.ldexp(torch.ones_like(amax), exp)
        stored = (exp + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)
    else:
        scale = amax / FP8_MAX
        stored = scale
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(nr * br, nc * bc)[:r, :c].contiguous(), stored.contiguous()


def apply_column_scales(values: torch.Tensor, s: torch.Tensor, block_cols: int) -> torch.Tensor:
    """float32 ``values [n, c] * scale``, where s [n, ceil(c/block_cols)] holds each row's scale
    per column block. Every dequantization (full load and Engram lookups) multiplies here, so
    the two agree bit for bit."""
    n, c = values.shape
    if c % block_cols == 0:  # broadcast over each column block: the same products, no copy
        return (values.float().view(n, c // block_cols, block_cols) * s.unsqueeze(-1)).view(n, c)
    return values.float() * s.repeat_interleave(block_cols, 1)[:, :c]


def dequantize_fp8_rows(q_rows: torch.Tensor, scale_rows: torch.Tensor, block: tuple[int, int],
                        dtype: torch.dtype) -> torch.Tensor:
    """Dequantize whole block-rows: q_rows [n, c] with the matching float32 scale rows
    [ceil(n/br), ceil(c/bc)]."""
    s = scale_rows.repeat_interleave(block[0], 0)[:q_rows.shape[0]]
    return apply_column_scales(q_rows, s, block[1]).to(dtype)


def iter_dequantized_rows(read_rows: Callable[[int, int], torch.Tensor], shape: list[int],
                          scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype,
                          rows_per_chunk: int | None = None) -> Iterator[torch.Tensor]:
    """Dequantize a [r, c] FP8 weight one chunk of block-rows at a time, so a conversion never
    holds a whole weight in float32. ``read_rows(a, b)`` returns fp8 rows a..b-1."""
    r, c = shape
    expect = scale_shape((r, c), block)
    if tuple(scale.shape) != expect:
        raise ValueError(f"scale has shape {tuple(scale.shape)}, expected {expect} for weight "
                         f"{r}x{c} with blocks {block[0]}x{block[1]}")
    scale = scale_to_float32(scale)
    if rows_per_chunk is None:  # whole block-rows, ~CHUNK_BYTES of float32 per chunk
        rows_per_chunk = max(1, CHUNK_BYTES // (4 * max(c, 1) * block[0])) * block[0]
    rows_per_chunk = max(block[0], rows_per_chunk // block[0] * block[0])
    for a in range(0, r, rows_per_chunk):
        b = min(r, a + rows_per_chunk)
        q = read_rows(a, b)
        if q.dtype != FP8_DTYPE:
            raise ValueError(f"expected {FP8_DTYPE} rows, got {q.dtype}")
        yield dequantize_fp8_rows(q, scale[slice(*scale_row_range(a, b, block[0]))], block, dtype)


def dequantize_fp8_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = FP8_BLOCK,
                          dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    if q.dim() != 2:
        raise ValueError(f"FP8 block weights are 2-D, got shape {tuple(q.shape)}")
    chunks = iter_dequantized_rows(lambda a, b: q[a:b], list(q.shape), scale, block, dtype)
    return torch.cat(list(chunks), 0) if q.shape[0] else torch.empty(q.shape, dtype=dtype)
