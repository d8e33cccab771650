"""The fp8 KV cache of SGLang 0.5.23's DeepSeek V4 / V4.1 serving on SM90 (H200).

On a GPU that is not SM100, ``select_dsv4_kv_layout`` ("auto") picks ``KVLayout.V4`` and
``resolve_compressed_kv_layout`` gives every compressed cache the same layout, so the sliding-window
K=V of every layer and every compressed entry (V4 CSA/HCA, V4.1 ratio 1/2) is stored as one row of
448 "nope" values in e4m3 with one ue8m0 (power-of-two) scale per 64 values, plus the 64 RoPE
values in bf16. The attention kernel reads the row back dequantized (exactly, in bf16).

The CUDA stores (``jit/csrc/deepseek_v4/store.cuh`` ``fused_store_flashmla_cache`` and
``main_norm_rope.cuh`` ``fused_k_norm_rope_flashmla``), per 64-value tile of the fp32 input:
  scale = 2 ** ceil(log2(max(amax, 1e-4) / 448))   (on the IEEE bits: exponent + (mantissa != 0))
  code  = e4m3(clamp(x * (1 / scale), -448, 448))   (round to nearest even)
  rope  = bf16(x)                                    (round to nearest even)
and the read is ``bf16(code * scale)``. The stores quantize the float they are given, without a
bf16 step: the window K comes from the fused kernel's fp32 RMSNorm + RoPE of the wkv output (so
``served_window_kv`` norms and ropes in fp32 too), the V4 compressor entries are fp32, and V4.1's
ratio-1/2 latents are bf16 after their FP4 fake quant ("the fp8 FlashMLA caches requantize the
FP4/E4M3 latent", ``deepseek_v4_backend._low_ratio_write_group``). ROCm's Triton twin
(``kvcache/triton_store_cache.py``) floors amax at 1e-8 instead of 1e-4 (``ROCM_AMAX_FLOOR``).

Rows whose nope part is not a multiple of 64 (test presets) use the same rule with a shorter last
tile. Non-finite inputs give unspecified codes, as in the kernels. The round trip is idempotent,
so layers that share one V4.1 kv source may each apply it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .rope import apply_rope
from .v41 import FP8_MAX, _ceil_pow2, _StraightThrough

NOPE_TILE = 64                 # nope values per ue8m0 scale
CUDA_AMAX_FLOOR = 1e-4         # store.cuh / main_norm_rope.cuh: fmaxf(1e-4f, abs_max)
ROCM_AMAX_FLOOR = 1e-8         # triton_store_cache.py: EPS=1e-8
_UE8M0_BIAS = 127


class FP8CacheRows(NamedTuple):
    nope_fp8: torch.Tensor     # [..., nope] float8_e4m3fn codes
    nope_scale: torch.Tensor   # [..., ceil(nope / 64)] uint8 ue8m0: scale = 2 ** (byte - 127)
    rope_bf16: torch.Tensor    # [..., rope_dim] bfloat16


def _split(kv: torch.Tensor, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not kv.is_floating_point() or kv.dim() == 0:
        raise ValueError(f"fp8 KV cache rows must be a float tensor [..., D], got {kv.dtype} "
                         f"{tuple(kv.shape)}")
    nope_dim = kv.shape[-1] - rope_dim
    if rope_dim < 0 or nope_dim <= 0:
        raise ValueError(f"fp8 KV cache rows of width {kv.shape[-1]} cannot keep {rope_dim} RoPE "
                         "channels and a non-empty nope part")
    return kv[..., :nope_dim], kv[..., nope_dim:]


def quantize_ue8m0_tiles(x: torch.Tensor, tile: int, amax_floor: float = CUDA_AMAX_FLOOR
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (e4m3 codes [..., n], ue8m0 exponent bytes [..., ceil(n / tile)]): one
    power-of-two scale per ``tile`` values, rounded up so no code passes 448; a shorter last
    tile. The one fp8 row quantizer of the model (KV cache rows, Engram tables)."""
    n = x.shape[-1]
    tiles = F.pad(x.float(), (0, -n % tile)).unflatten(-1, (-1, tile))
    amax = tiles.abs().amax(dim=-1, keepdim=True).clamp_min(amax_floor)
    scale = _ceil_pow2(amax / FP8_MAX)
    codes = (tiles * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    exponent = (scale.squeeze(-1).view(torch.int32) >> 23) & 0xFF
    return codes.flatten(-2)[..., :n], exponent.to(torch.uint8)


def quantize_kv_rows(kv: torch.Tensor, rope_dim: int,
                     amax_floor: float = CUDA_AMAX_FLOOR) -> FP8CacheRows:
    """kv [..., D] (last rope_dim channels are RoPE) -> the bytes SGLang's V4 cache row holds."""
    nope, rope = _split(kv, rope_dim)
    codes, exponent = quantize_ue8m0_tiles(nope, NOPE_TILE, amax_floor)
    return FP8CacheRows(codes, exponent, rope.to(torch.bfloat16))


def dequantize_kv_rows(rows: FP8CacheRows) -> torch.Tensor:
    """What the attention kernel reads: [..., D] bf16, every value exact."""
    nope_dim = rows.nope_fp8.shape[-1]
    pad = -nope_dim % NOPE_TILE
    codes = F.pad(rows.nope_fp8.float(), (0, pad)).unflatten(-1, (-1, NOPE_TILE))
    scale = (rows.nope_scale.to(torch.int32) << 23).view(torch.float32).unsqueeze(-1)
    nope = (codes * scale).flatten(-2)[..., :nope_dim]
    return torch.cat([nope.to(torch.bfloat16), rows.rope_bf16], dim=-1)


def kv_cache_round_trip(kv: torch.Tensor, rope_dim: int,
                        amax_floor: float = CUDA_AMAX_FLOOR) -> torch.Tensor:
    """kv [..., D] as SGLang's attention reads it back from the fp8 cache, in kv's dtype (the
    values are bf16-exact); the backward passes the gradient straight through."""
    def round_trip(x: torch.Tensor) -> torch.Tensor:
        return dequantize_kv_rows(quantize_kv_rows(x, rope_dim, amax_floor)).to(x.dtype)

    return _StraightThrough.apply(kv, round_trip)


def served_window_kv(latent: torch.Tensor, kv_norm: torch.nn.Module, positions: torch.Tensor,
                     freqs: torch.Tensor,
                     table: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The window K=V of a layer as SGLang serves it: ``fused_k_norm_rope_flashmla`` norms and
    ropes the wkv output ``latent [T, D]`` in fp32 and quantizes those fp32 values into the cache.
    Returned in latent's dtype; gradients flow through the fp32 norm and RoPE. ``table``:
    rope.rope_table(positions, freqs), when the caller has it."""
    kv = apply_rope(kv_norm(latent.float()), positions, freqs, table=table)
    return kv_cache_round_trip(kv, 2 * freqs.shape[0]).to(latent.dtype)
