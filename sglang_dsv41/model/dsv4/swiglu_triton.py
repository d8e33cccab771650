"""moe.swiglu (DeepSeek V4's clamped SwiGLU) as one Triton kernel forward and one backward.

silu(min(gate, limit)) * clamp(up, -limit, limit) in torch ops is two clamps, a silu and a
multiply forward (each a pass over [rows, I]) and about ten kernels backward (the multiply's two
products, silu's backward, the clamps' masks and wheres), autograd keeping the clamped copies
and the silu output. Here the forward reads gate and up once (strided row views: the grouped
GEMM's [rows, 2I] output split in halves is read in place) and writes the product; the backward
recomputes from gate and up and writes both gradients in one pass.

Same math in fp32, rounded once (torch rounded the silu output and the product to the inputs'
dtype: bf16 roundings apart). The clamps' gradients pass where torch's do: gate <= limit,
-limit <= up <= limit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS, BLOCK_COLS = 16, 256


@triton.jit
def _swiglu_fwd(g_ptr, u_ptr, out_ptr, M, N, g_stride, u_stride, limit, BM: tl.constexpr,
                BN: tl.constexpr):
    m = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (m[:, None] < M) & (n[None, :] < N)
    g = tl.load(g_ptr + m[:, None] * g_stride + n[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + m[:, None] * u_stride + n[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    out = g * tl.sigmoid(g) * u
    tl.store(out_ptr + m[:, None] * N + n[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(grad_ptr, g_ptr, u_ptr, d_g_ptr, d_u_ptr, M, N, g_stride, u_stride, limit,
                BM: tl.constexpr, BN: tl.constexpr):
    m = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (m[:, None] < M) & (n[None, :] < N)
    off = m[:, None] * N + n[None, :]
    grad = tl.load(grad_ptr + off, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + m[:, None] * g_stride + n[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + m[:, None] * u_stride + n[None, :], mask=mask, other=0.0).to(tl.float32)
    g_c = tl.minimum(g, limit)
    u_c = tl.minimum(tl.maximum(u, -limit), limit)
    sig = tl.sigmoid(g_c)
    d_g = grad * u_c * (sig * (1 + g_c * (1 - sig)))
    d_u = grad * g_c * sig
    tl.store(d_g_ptr + off, tl.where(g <= limit, d_g, 0.0).to(d_g_ptr.dtype.element_ty),
             mask=mask)
    tl.store(d_u_ptr + off, tl.where((u >= -limit) & (u <= limit), d_u, 0.0)
             .to(d_u_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as a 2-D view whose rows are contiguous (a copy only where they are not)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, limit: float):
        g2, u2 = _rows(gate), _rows(up)
        m, n = g2.shape
        out = torch.empty(m, n, dtype=gate.dtype, device=gate.device)
        if m and n:
            grid = (triton.cdiv(m, BLOCK_ROWS), triton.cdiv(n, BLOCK_COLS))
            _swiglu_fwd[grid](g2, u2, out, m, n, g2.stride(0), u2.stride(0), limit,
                              BM=BLOCK_ROWS, BN=BLOCK_COLS)
        ctx.save_for_backward(g2, u2)
        ctx.limit, ctx.shape = limit, gate.shape
        return out.view(gate.shape)

    @staticmethod
    def backward(ctx, grad):
        g2, u2 = ctx.saved_tensors
        m, n = g2.shape
        d_g = torch.empty(m, n, dtype=g2.dtype, device=g2.device)
        d_u = torch.empty(m, n, dtype=u2.dtype, device=u2.device)
        if m and n:
            grid = (triton.cdiv(m, BLOCK_ROWS), triton.cdiv(n, BLOCK_COLS))
            _swiglu_bwd[grid](grad.reshape(m, n).contiguous(), g2, u2, d_g, d_u, m, n,
                              g2.stride(0), u2.stride(0), ctx.limit, BM=BLOCK_ROWS,
                              BN=BLOCK_COLS)
        return d_g.view(ctx.shape), d_u.view(ctx.shape), None


def swiglu_fused(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """moe.swiglu's contract: gate and up of one shape and dtype -> that shape and dtype,
    differentiable in both."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dim() == 0:
        raise ValueError(f"swiglu_fused: gate {tuple(gate.shape)} {gate.dtype} and up "
                         f"{tuple(up.shape)} {up.dtype} must match (at least 1-D)")
    return _SwiGLU.apply(gate, up, float(limit))
