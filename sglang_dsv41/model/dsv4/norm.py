"""RMSNorm with an fp32 weight: statistics and the weight multiply in fp32, one cast at the end
(transformers' DeepseekV4RMSNorm, SGLang's dsv41_sparse.RMSNorm)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, self.weight, self.eps)


def rms_norm_input_grad(dy: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """The input gradient of y = x * rstd, rstd = (mean(x^2) + eps)^-1/2, from dy = dL/dy (fp32,
    overwritten): rstd * (dy - y mean(dy y)), the mean a batched dot per row (no [.., D]
    temporary). The torch path of RMSNorm's and of mHC's mix backward."""
    d = y.shape[-1]
    dot = torch.bmm(dy.reshape(-1, 1, d), y.reshape(-1, d, 1)).view(*y.shape[:-1], 1)
    return dy.addcmul_(y, dot / d, value=-1.0).mul_(rstd)


def _fused(x: torch.Tensor) -> bool:
    # torch's fused RMSNorm kernels: one kernel each way, but the backward is CUDA-only.
    return x.is_cuda


class _RMSNorm(torch.autograd.Function):
    """The plain expression's values, ``(w.float() * x.float() * rstd).to(x.dtype)``, with a
    hand-written backward: dx = rstd * (g w - y mean(g w y)), dw = sum(g y), y = x rstd.
    Autograd would run about twenty kernels through eight nodes a norm (61 norms a step of the
    small preset: host time in a host-bound step) and keep two fp32 copies of x; this keeps x in
    its own dtype and one fp32 rstd per row, and recomputes y. On CUDA both directions are
    torch's fused RMSNorm kernels (one kernel each way; they compute in fp32 and round once):
    on x and the weight as they are when both have one dtype (FSDP hands the weight over in
    bf16), else on their fp32 upcasts. Their own row reduction gives the plain expression's
    values up to fp32 rounding (one bf16 ulp on about 3 in a million outputs on an H200), at
    about a third of the host time (bench/results/train_h200.txt, run P). A Triton kernel each
    way measured slower (run L): its launch costs more host time than it saves."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        if _fused(x):
            # The kernel computes in fp32 whatever its dtype and rounds once at the end, but
            # takes one dtype: an fp32 weight (or fp64 x) makes both fp32 first.
            native = x.dtype == weight.dtype and x.dtype != torch.float64
            h, w = (x, weight) if native else (x.float(), weight.float())
            y, rstd = torch.ops.aten._fused_rms_norm(h, [h.shape[-1]], w, eps)
        else:
            h, w = x.float(), weight.float()
            rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
            y = w * (h * rstd)
        ctx.save_for_backward(x, weight, rstd)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        if _fused(x):
            native = x.dtype == weight.dtype == grad.dtype and x.dtype != torch.float64
            g, h, w = ((grad, x, weight) if native
                       else (grad.float(), x.float(), weight.float()))
            d_x, d_w = torch.ops.aten._fused_rms_norm_backward(
                g, h, [h.shape[-1]], rstd, w, [need_x, need_w])
            return (d_x.to(x.dtype) if need_x else None,
                    d_w.to(weight.dtype) if need_w else None, None)
        g, w = grad.float(), weight.float()
        y = x.float() * rstd  # not in place: x.float() is x itself when x is fp32
        d_x = d_w = None
        if need_w:
            d_w = (g * y).reshape(-1, y.shape[-1]).sum(0).to(weight.dtype)
        if need_x:
            d_x = rms_norm_input_grad(g * w, y, rstd).to(x.dtype)
        return d_x, d_w, None
