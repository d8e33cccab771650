"""The routed experts' clamped SwiGLU (moe.swiglu) on the grouped GEMM's [rows, 2I] output as
one Triton kernel forward and one backward.

The torch path splits the gate|up rows into two views and runs two clamps, silu and a product
forward (saving their outputs), and about eight kernels backward, the last of which cats the
two halves' gradients back into [rows, 2I]: at 4k tokens of the ``small`` preset (24,576
expert rows, I 512, bf16) ~0.8 GB of traffic a layer. Here the forward reads gate|up and writes
the product (75 MB), and the backward reads gate|up and the output's gradient and writes
gate|up's gradient in place of the cat (125 MB); only gate|up is saved. The arithmetic is
fp32 with one rounding to the output dtype (the torch path rounds silu's output and the
product each; SGLang's fused silu_and_mul rounds once, as here). The CPU keeps the torch path,
the reference tests/test_dsv4_swiglu_triton.py holds this kernel to under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...attention.triton_common import dot_precision, row_block, to_dtype


@triton.jit
def _load_clamped(gu_ptr, row, cols, mask, inter, stride, limit):
    g = tl.load(gu_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    gc = tl.minimum(g, limit)
    uc = tl.minimum(tl.maximum(u, -limit), limit)
    return g, u, gc, uc


@triton.jit
def _swiglu_fwd_kernel(gu_ptr, y_ptr, inter, stride_gu, stride_y, limit, BLOCK: tl.constexpr,
                       ROUND: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    _, _, gc, uc = _load_clamped(gu_ptr, row, cols, mask, inter, stride_gu, limit)
    y = gc * tl.sigmoid(gc) * uc
    tl.store(y_ptr + row * stride_y + cols, to_dtype(y, y_ptr.dtype.element_ty, ROUND),
             mask=mask)


@triton.jit
def _swiglu_bwd_kernel(gu_ptr, dy_ptr, dgu_ptr, inter, stride_gu, stride_dy, stride_dgu, limit,
                       BLOCK: tl.constexpr, ROUND: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g, u, gc, uc = _load_clamped(gu_ptr, row, cols, mask, inter, stride_gu, limit)
    dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(gc)
    # torch's clamp backward: the gradient passes where min <= x <= max (bounds included)
    du = tl.where((u >= -limit) & (u <= limit), dy * gc * s, 0.0)
    dg = tl.where(g <= limit, dy * uc * (s * (1.0 + gc * (1.0 - s))), 0.0)
    out_ty = dgu_ptr.dtype.element_ty
    tl.store(dgu_ptr + row * stride_dgu + cols, to_dtype(dg, out_ty, ROUND), mask=mask)
    tl.store(dgu_ptr + row * stride_dgu + inter + cols, to_dtype(du, out_ty, ROUND), mask=mask)


def _launch(kernel, rows: int, inter: int, dtype: torch.dtype, *args):
    block = row_block(inter)
    # the interpreter truncates fp32 -> bf16: to_dtype rounds on the bits there (the "widen"
    # mode dot_precision gives bf16 under TRITON_INTERPRET=1)
    kernel[(rows, triton.cdiv(inter, block))](*args, BLOCK=block, ROUND=dot_precision(dtype),
                                              num_warps=4)


class _SwiGLUPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, limit: float) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        y = gate_up.new_empty(rows, inter)
        if rows:
            _launch(_swiglu_fwd_kernel, rows, inter, y.dtype, gate_up, y, inter,
                    gate_up.stride(0), y.stride(0), float(limit))
        ctx.save_for_backward(gate_up)
        ctx.limit = float(limit)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gate_up, = ctx.saved_tensors
        dy = dy.contiguous()
        rows, inter = dy.shape
        dgu = torch.empty_like(gate_up)
        if rows:
            _launch(_swiglu_bwd_kernel, rows, inter, dgu.dtype, gate_up, dy, dgu, inter,
                    gate_up.stride(0), dy.stride(0), dgu.stride(0), ctx.limit)
        return dgu, None


def swiglu_packed_triton(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """gate_up [rows, 2I] (gate columns, then up) -> silu(min(gate, limit)) * clamp(up, +-limit)
    [rows, I], in gate_up's dtype (fp32 arithmetic, one rounding)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [rows, 2I], got {tuple(gate_up.shape)}")
    return _SwiGLUPacked.apply(gate_up, limit)
