"""norm.RMSNorm as one Triton kernel forward and one backward.

In torch ops the norm was a cast, pow, mean, add, rsqrt, two multiplies and a cast forward
(eight kernels, an fp32 copy of the input kept for the backward) and about fifteen kernels
backward, over [T, D] fp32 each; the model runs ~90 norms a step (attention, q, kv, compressor,
indexer and MoE norms). Here the forward reads x once, writes the output and one fp32 rstd a
row; the backward reads x and the gradient once, writes dx and a per-program partial sum of the
weight's gradient (summed afterwards in a fixed order: deterministic, no atomics).

Same math as norm.RMSNorm in fp32 (statistics and the weight multiply, one cast at the end);
the mean's sum runs in another order (last-bit differences in fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ELEMENTS = 4096  # rows per program = this // the row's power-of-two width


@triton.jit
def _rms_norm_fwd(x_ptr, w_ptr, out_ptr, rstd_ptr, T, D, eps, BR: tl.constexpr,
                  BD: tl.constexpr):
    t = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    d = tl.arange(0, BD)
    mask = (t[:, None] < T) & (d[None, :] < D)
    off = t[:, None] * D + d[None, :]
    x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    tl.store(rstd_ptr + t, rstd, mask=t < T)
    y = w[None, :] * (x * rstd[:, None])
    tl.store(out_ptr + off, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd(g_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, T, D, BR: tl.constexpr,
                  BD: tl.constexpr):
    t = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    d = tl.arange(0, BD)
    mask = (t[:, None] < T) & (d[None, :] < D)
    off = t[:, None] * D + d[None, :]
    x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + off, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + t, mask=t < T, other=0.0)
    h = x * rstd[:, None]
    g_h = g * w[None, :]
    # h = x * rstd, rstd = (mean(x^2) + eps)^-1/2: dx = rstd * (dh - h * mean(dh * h))
    dx = rstd[:, None] * (g_h - h * (tl.sum(g_h * h, axis=1) / D)[:, None])
    tl.store(dx_ptr + off, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_part_ptr + tl.program_id(0) * D + d, tl.sum(g * h, axis=0), mask=d < D)


def _block(d: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(d)
    return max(1, BLOCK_ELEMENTS // block_d), block_d


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float):
        shape, d = x.shape, x.shape[-1]
        x2 = x.reshape(-1, d).contiguous()
        t = x2.shape[0]
        out = torch.empty_like(x2)
        rstd = torch.empty(t, dtype=torch.float32, device=x.device)
        rows, block_d = _block(d)
        if t:
            _rms_norm_fwd[(triton.cdiv(t, rows),)](x2, weight, out, rstd, t, d, eps, BR=rows,
                                                   BD=block_d)
        ctx.save_for_backward(x2, weight, rstd)
        return out.view(shape)

    @staticmethod
    def backward(ctx, grad):
        x2, weight, rstd = ctx.saved_tensors
        t, d = x2.shape
        rows, block_d = _block(d)
        parts = triton.cdiv(t, rows)
        dx = torch.empty_like(x2)
        dw_part = torch.empty(parts, d, dtype=torch.float32, device=x2.device)
        if t:
            _rms_norm_bwd[(parts,)](grad.reshape(t, d).contiguous(), x2, weight, rstd, dx,
                                    dw_part, t, d, BR=rows, BD=block_d)
        return dx.view(grad.shape), dw_part.sum(0).to(weight.dtype), None


def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """norm.RMSNorm's forward: x [..., D], weight [D] -> x's shape and dtype, differentiable
    in x and weight."""
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm_fused: x {tuple(x.shape)} against weight "
                         f"{tuple(weight.shape)}: the weight is one value per last-dim channel")
    return _RMSNorm.apply(x, weight, eps)
