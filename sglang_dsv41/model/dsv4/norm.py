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


class _RMSNorm(torch.autograd.Function):
    """The plain expression's values, ``(w.float() * x.float() * rstd).to(x.dtype)``, with a
    hand-written backward: dx = rstd * (g w - y mean(g w y)), dw = sum(g y), y = x rstd.
    Autograd would run about twenty kernels through eight nodes a norm (61 norms a step of the
    small preset: host time in a host-bound step) and keep two fp32 copies of x; this keeps x in
    its own dtype and one fp32 rstd per row, and recomputes y. A Triton kernel each way measured
    slower on an H200 (bench/results/train_h200.txt, run L): its launch costs more host time."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        h = x.float()
        rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (weight.float() * (h * rstd)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        g = grad.float()
        y = x.float() * rstd  # not in place: x.float() is x itself when x is fp32
        d_x = d_w = None
        if ctx.needs_input_grad[1]:
            d_w = (g * y).reshape(-1, y.shape[-1]).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            gw = g * weight.float()
            mean_gwy = (gw * y).mean(-1, keepdim=True)
            d_x = gw.addcmul_(y, mean_gwy, value=-1.0).mul_(rstd).to(x.dtype)
        return d_x, d_w, None
