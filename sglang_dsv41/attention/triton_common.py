"""Shared pieces of the Triton sink-attention kernels: block configs and key/query block ranges.

Positions: sequence b has lq queries and lk keys; query i sits at absolute position
p = lk - lq + i (queries are aligned to the end of their keys). Key j is visible to p when
j <= p (causal) and j > p - window (sliding window). Each loop over blocks is split into masked
edge ranges and an unmasked middle range, so the hot loop carries no mask arithmetic and
blocks that are fully masked are never visited.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class PrefillBlocks:
    """Tile sizes and launch settings of the prefill kernels (forward, dK/dV, dQ)."""

    fwd_m: int = 128
    fwd_n: int = 64
    fwd_warps: int = 4
    fwd_stages: int = 3
    dkdv_n: int = 128
    dkdv_m: int = 32
    dkdv_warps: int = 4
    dkdv_stages: int = 3
    dq_m: int = 128
    dq_n: int = 32
    dq_warps: int = 4
    dq_stages: int = 3
    pre_m: int = 64
    # Programs of one KV head that split its GQA group in the dK/dV pass (0 = pick from the
    # grid size): with few KV heads (MQA) one program per key block leaves most SMs idle.
    dkdv_splits: int = 0

    def __post_init__(self):
        if self.dkdv_splits < 0:
            raise ValueError(f"PrefillBlocks.dkdv_splits={self.dkdv_splits}: must be >= 0")
        for name in ("fwd_m", "fwd_n", "dkdv_n", "dkdv_m", "dq_m", "dq_n", "pre_m"):
            val = getattr(self, name)
            if val < 16 or val & (val - 1):
                raise ValueError(f"PrefillBlocks.{name}={val}: must be a power of two >= 16")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Small tiles keep the CPU interpreter fast; tensor-core tiles on a GPU.
INTERPRET_BLOCKS = PrefillBlocks(16, 16, 1, 1, 16, 16, 1, 1, 16, 16, 1, 1, 16)


def default_prefill_blocks(head_dim: int) -> PrefillBlocks:
    if interpreting():
        return INTERPRET_BLOCKS
    if head_dim <= 64:
        return PrefillBlocks()  # measured best of a small sweep on an H200 (bench/attention.py)
    # Wider heads: shrink the tiles that hold [BLOCK, D] fp32 accumulators and the pipelined
    # K/V stages so registers and shared memory still fit (not tuned).
    if head_dim <= 128:
        return PrefillBlocks(128, 64, 8, 2, 64, 32, 4, 2, 64, 32, 4, 2, 32)
    if head_dim <= 256:
        return PrefillBlocks(64, 32, 4, 2, 32, 16, 4, 1, 32, 16, 4, 1, 16)
    return PrefillBlocks(32, 32, 4, 1, 16, 16, 4, 1, 16, 16, 4, 1, 16)


_SM_COUNT: dict[int, int] = {}


def sm_count(device) -> int:
    """Multiprocessors of a CUDA device (cached); 1 elsewhere (the interpreter)."""
    if device.type != "cuda":
        return 1
    import torch

    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def dot_precision(dtype) -> str:
    """Value for the kernels' DOT_PREC: fp32 inputs must not silently drop to tf32 (1e-3 error
    budget). The CPU interpreter multiplies bf16 tiles as raw uint16 bits (triton 3.9), so there
    bf16 operands are widened to fp32 first, which is exact and matches bf16 MMA with fp32
    accumulation."""
    import torch

    if dtype == torch.float32:
        return "ieee"
    if dtype == torch.bfloat16 and interpreting():
        return "widen"
    return "tf32"


@triton.jit
def mma(a, b, DOT_PREC: tl.constexpr):
    if DOT_PREC == "widen":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PREC)


@triton.jit
def to_dtype(x, dtype: tl.constexpr, DOT_PREC: tl.constexpr):
    """x.to(dtype) with round-to-nearest-even; the interpreter (the "widen" mode) truncates
    fp32 -> bf16, so there the rounding is done on the bits first."""
    if DOT_PREC == "widen" and dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(dtype)
    else:
        return x.to(dtype)


@triton.jit
def load_tile(ptrs, mask, USE_MASK: tl.constexpr):
    # Unmasked loads in the hot loops (full blocks, D a power of two) let the compiler vectorize
    # and pipeline them without predication.
    if USE_MASK:
        return tl.load(ptrs, mask=mask, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def key_block_ranges(p_min, p_max, lk, window, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                     HAS_WINDOW: tl.constexpr):
    """Key ranges for query positions [p_min, p_max]: masked [lo, full_lo), unmasked
    [full_lo, full_hi), masked [full_hi, hi); all starts aligned to BLOCK_N."""
    if CAUSAL:
        hi = tl.maximum(tl.minimum(lk, p_max + 1), 0)
        full_bound = tl.maximum(tl.minimum(lk, p_min + 1), 0)
    else:
        hi = lk
        full_bound = lk
    full_hi = (full_bound // BLOCK_N) * BLOCK_N
    if HAS_WINDOW:
        lo = (tl.maximum(p_min - window + 1, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(p_max - window + 1, 0), BLOCK_N) * BLOCK_N
    else:
        lo = hi * 0
        full_lo = lo
    lo = tl.minimum(lo, hi)
    if full_lo > full_hi:
        full_lo = hi
        full_hi = hi
    return lo, full_lo, full_hi, hi


@triton.jit
def query_block_ranges(k_min, k_max, lq, off, window, BLOCK_M: tl.constexpr,
                       CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Query-index ranges that see keys [k_min, k_max] (same split as key_block_ranges)."""
    if CAUSAL:
        lo = (tl.maximum(k_min - off, 0) // BLOCK_M) * BLOCK_M
        full_lo = tl.cdiv(tl.maximum(k_max - off, 0), BLOCK_M) * BLOCK_M
    else:
        lo = lq * 0
        full_lo = lo
    if HAS_WINDOW:
        hi = tl.maximum(tl.minimum(lq, k_max + window - off), 0)
        full_bound = tl.maximum(tl.minimum(lq, k_min + window - off), 0)
    else:
        hi = lq
        full_bound = lq
    full_hi = (full_bound // BLOCK_M) * BLOCK_M
    lo = tl.minimum(lo, hi)
    if full_lo > full_hi:
        full_lo = hi
        full_hi = hi
    return lo, full_lo, full_hi, hi
