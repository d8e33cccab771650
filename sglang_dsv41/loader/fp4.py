"""MXFP4 routed experts as DeepSeek V4/V4.1 releases store them.

A logical [out, in] expert weight is stored as ``<name>.weight`` int8 [out, in/2] (two e2m1
codes per byte, low nibble first) plus ``<name>.scale`` float8_e8m0fnu [out, in/32]: one
power-of-two scale per 32 values along the input dimension (OCP MXFP4). The code table and
block come from SGLang 0.5.23 ``layers/quantization/fp8.py`` (DSV4_DEQUANT_FP4_TABLE, and the
expert scale shape ``hidden_size // fp4_block_k`` with fp4_block_k = 32, ~line 1695).
"""

from __future__ import annotations

import torch

from .fp8 import E8M0_BIAS, scale_to_float32

FP4_BLOCK = 32  # values per e8m0 scale along the input dimension
FP4_PACKED_DTYPE = torch.int8  # what the release header says (I8); U8 is accepted on input
FP4_MAX = 6.0
# e2m1 code -> value; bit 3 is the sign.
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
_E2M1_MIDPOINTS = (E2M1_VALUES[1:8] + E2M1_VALUES[:7]) / 2


def fp4_logical_shape(packed_shape: list[int] | tuple[int, ...]) -> list[int]:
    rows, half = packed_shape
    return [rows, 2 * half]


def fp4_scale_shape(logical_shape: list[int] | tuple[int, ...]) -> list[int]:
    rows, cols = logical_shape
    return [rows, -(-cols // FP4_BLOCK)]


def _check(packed: torch.Tensor, scale: torch.Tensor) -> None:
    if packed.dim() != 2 or packed.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"packed FP4 weight must be 2-D int8/uint8, got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    want = fp4_scale_shape(fp4_logical_shape(list(packed.shape)))
    if list(scale.shape) != want:
        raise ValueError(f"FP4 scale has shape {list(scale.shape)}, expected {want} for packed "
                         f"weight {list(packed.shape)} (one scale per {FP4_BLOCK} values)")


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor,
                   dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """int8 [r, c/2] + e8m0 [r, c/32] -> ``dtype`` [r, c] (products in float32: exact, since the
    codes have 2 significant bits and the scales are powers of two)."""
    _check(packed, scale)
    codes = packed.view(torch.uint8)
    low, high = (codes & 0x0F).long(), (codes >> 4).long()
    values = torch.stack([E2M1_VALUES[low], E2M1_VALUES[high]], dim=-1).flatten(1)
    rows, cols = values.shape
    s = scale_to_float32(scale)
    pad = -cols % FP4_BLOCK
    if pad:
        values = torch.nn.functional.pad(values, (0, pad))
    out = (values.view(rows, -1, FP4_BLOCK) * s.unsqueeze(-1)).view(rows, -1)[:, :cols]
    return out.to(dtype)


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[r, c] float (c even) -> (int8 [r, c/2], float8_e8m0fnu [r, ceil(c/32)]).

    Each block's scale is the power of two that brings its largest magnitude to <= 6; values
    round to the nearest e2m1 code (what a release's MXFP4 experts hold, for test checkpoints).
    """
    if w.dim() != 2 or w.shape[1] % 2:
        raise ValueError(f"FP4 packing needs a 2-D weight with an even column count, got "
                         f"{tuple(w.shape)}")
    rows, cols = w.shape
    pad = -cols % FP4_BLOCK
    wf = torch.nn.functional.pad(w.float(), (0, pad)).view(rows, -1, FP4_BLOCK)
    amax = wf.abs().amax(-1).clamp_min(2.0**-126)
    exp = torch.ceil(torch.log2(amax / FP4_MAX)).clamp(-E8M0_BIAS, 127).to(torch.int32)
    scaled = wf / torch.ldexp(torch.ones_like(amax), exp).unsqueeze(-1)
    # Nearest magnitude code; a value halfway between two codes takes the smaller one.
    idx = torch.bucketize(scaled.abs(), _E2M1_MIDPOINTS)
    codes = (idx | ((scaled < 0).long() << 3)).view(rows, -1)[:, :cols].to(torch.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8).contiguous()
    stored = (exp + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu).contiguous()
    return packed, stored
