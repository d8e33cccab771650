"""Manifold-constrained hyper-connections (mHC): hc_mult residual streams per token.

Each sublayer reads one collapsed input (the streams weighted by "pre"), and writes back
``post * y + comb^T @ streams`` with comb projected onto doubly-stochastic matrices by Sinkhorn.
The weights are computed in fp32 from fp32 parameters (transformers keeps attn_hc/ffn_hc/hc_head
in fp32). Parameters sit on their owners under SGLang's flat names (``hc_attn_fn`` on a layer,
``hc_head_fn`` on the model), so these are functions over (fn, base, scale).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .norm import rms_norm_input_grad


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_params(owner: nn.Module, prefix: str, hc_mult: int, hidden: int, n_out: int) -> None:
    """Register ``{prefix}_fn [n_out, hc*D]``, ``{prefix}_base [n_out]``, ``{prefix}_scale``."""
    n_scale = 3 if n_out == (2 + hc_mult) * hc_mult else 1
    owner.register_parameter(f"{prefix}_fn", nn.Parameter(
        torch.zeros(n_out, hc_mult * hidden, dtype=torch.float32)))
    owner.register_parameter(f"{prefix}_base", nn.Parameter(torch.zeros(n_out, dtype=torch.float32)))
    owner.register_parameter(f"{prefix}_scale", nn.Parameter(torch.ones(n_scale, dtype=torch.float32)))


class StreamGradSum:
    """The gradient of one sublayer's streams, summed by the backward kernels of its uses (the
    mix, the collapse, the write-back) rather than by autograd. Each use's forward registers;
    its backward adds its gradient into the sum so far (``so_far``: None for the first to run,
    which writes a fresh tensor) and hands it on (``hand_on``): autograd gets None from every
    use but the last to run, which hands it the whole sum. Autograd's own sum would write each
    gradient and then read two and write one per add; here each later use reads the sum once
    as it writes.

    Every registered use's backward must run in the same backward pass (in a sublayer each
    use's output reaches the sublayer's output, so they do); the count starts over after the
    last, so a retained graph can run backward again."""

    def __init__(self):
        self.uses = 0
        self.left = 0
        self.sum: torch.Tensor | None = None

    def register(self) -> "StreamGradSum":
        self.uses += 1
        self.left = self.uses
        return self

    def so_far(self) -> torch.Tensor | None:
        return self.sum

    def hand_on(self, grad: torch.Tensor) -> torch.Tensor | None:
        self.left -= 1
        if self.left > 0:
            self.sum = grad
            return None
        self.sum, self.left = None, self.uses
        return grad


def hc_mix(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float,
           grad_sum: StreamGradSum | None = None) -> torch.Tensor:
    """streams [T, hc, D] -> fn @ rms_norm(flattened streams), fp32 [T, n_out]. On CUDA one
    Triton kernel forward and two backward (hc_mix_triton.py): the torch path's ~17 launches
    and two fp32 copies of the streams a sublayer were host time in a host-bound step."""
    if streams.is_cuda:
        from .hc_mix_triton import hc_mix_fused

        return hc_mix_fused(streams, fn, norm_eps, grad_sum)
    return _HcMix.apply(streams, fn, norm_eps)


class _HcMix(torch.autograd.Function):
    """hc_mix with a backward that keeps only the streams (in their own dtype, which the
    sublayer keeps anyway) and one fp32 scale per token. Autograd would keep the fp32 copy of
    the streams and its normalized copy, two fp32 [T, hc x D] tensors a sublayer (at 64k tokens
    and D=1024, 2 GiB each). The forward values are those of the plain expression; the
    backward recomputes the fp32 copy."""

    @staticmethod
    def forward(ctx, streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
        x = streams.flatten(1).float()
        rstd = torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
        ctx.save_for_backward(streams, fn, rstd)
        return F.linear(x * rstd, fn.float())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        streams, fn, rstd = ctx.saved_tensors
        grad = grad.float()
        y = streams.flatten(1).float() * rstd  # the normalized streams, fp32 [T, K]
        grad_fn = (grad.t() @ y).to(fn.dtype) if ctx.needs_input_grad[1] else None
        grad_streams = None
        if ctx.needs_input_grad[0]:
            dx = rms_norm_input_grad(grad @ fn.float(), y, rstd)
            grad_streams = dx.view(streams.shape).to(streams.dtype)
        return grad_streams, grad_fn, None


def hc_weights(mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
               sinkhorn_iters: int, hc_eps: float):
    """mix [T, (2+hc)*hc] -> pre [T, hc], post [T, hc], comb [T, hc, hc] (fp32). On CUDA one
    Triton kernel forward and one backward (hc_weights_triton.py): eagerly, Sinkhorn alone
    launches 6 x iters tiny kernels per sublayer (and twice that in the backward), and
    torch.compile'd still ~140 kernels and ~3 ms of host time, which made steps host-bound."""
    if mix.is_cuda:
        from .hc_weights_triton import hc_weights_fused, supports

        if supports(hc, scale):
            return hc_weights_fused(mix, base, scale, hc, sinkhorn_iters, hc_eps)
    return _hc_weights(mix, base, scale, hc, sinkhorn_iters, hc_eps)


def _hc_weights(mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
                sinkhorn_iters: int, hc_eps: float):
    pre_w, post_w, comb_w = mix.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    s_pre, s_post, s_comb = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * s_pre + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * s_post + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (hc, hc)) * s_comb + comb_b.view(hc, hc), dim=-1)
    return pre, post, sinkhorn(comb + hc_eps, sinkhorn_iters, hc_eps)


def weighted_stream_sum(streams: torch.Tensor, pre: torch.Tensor,
                        grad_sum: StreamGradSum | None = None) -> torch.Tensor:
    """streams [T, hc, D], pre [T, hc] -> sum_k pre[:, k] * streams[:, k] accumulated in fp32
    in stream order (SGLang's ``mhc_combine`` kernel), cast to the streams' dtype. On CUDA one
    Triton kernel each way (mhc_streams_triton.py)."""
    if streams.is_cuda:
        from .mhc_streams_triton import supports, weighted_stream_sum_fused

        if supports(streams.shape[1]):
            return weighted_stream_sum_fused(streams, pre, grad_sum)
    return weighted_stream_sum_torch(streams, pre)


def weighted_stream_sum_torch(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """weighted_stream_sum in torch ops (the CPU path, and the kernels' reference)."""
    return _WeightedStreamSum.apply(streams, pre)


class _WeightedStreamSum(torch.autograd.Function):
    """Autograd would keep each stream's fp32 copy for pre's gradient (one fp32 [T, hc x D]
    a sublayer); this backward keeps the streams in their own dtype and recomputes them."""

    @staticmethod
    def forward(ctx, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(streams, pre)
        pre = pre.float()
        acc = pre[:, 0:1] * streams[:, 0].float()
        for k in range(1, streams.shape[1]):
            acc = acc + pre[:, k:k + 1] * streams[:, k].float()
        return acc.to(streams.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        streams, pre = ctx.saved_tensors
        grad = grad.float()
        grad_streams = grad_pre = None
        if ctx.needs_input_grad[0]:
            grad_streams = (pre.float().unsqueeze(-1) * grad.unsqueeze(1)).to(streams.dtype)
        if ctx.needs_input_grad[1]:
            # one stream at a time: a single fp32 [T, D] temporary
            grad_pre = torch.stack([(streams[:, k].float() * grad).sum(-1)
                                    for k in range(streams.shape[1])], dim=1).to(pre.dtype)
        return grad_streams, grad_pre


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def hc_expand(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor,
              comb: torch.Tensor, grad_sum: StreamGradSum | None = None) -> torch.Tensor:
    """post * y + comb^T @ streams: comb[j, k] mixes input stream j into output stream k.
    On CUDA one Triton kernel each way (mhc_streams_triton.py): the torch bmm of T tiny
    matrices ran on a slow cuBLAS kernel (~300 us a sublayer at 4k tokens)."""
    if streams.is_cuda and y.dtype == streams.dtype:
        from .mhc_streams_triton import hc_expand_fused, supports

        if supports(streams.shape[1]):
            return hc_expand_fused(streams, y, post, comb, grad_sum)
    return hc_expand_torch(streams, y, post, comb)


def hc_expand_torch(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor,
                    comb: torch.Tensor) -> torch.Tensor:
    """hc_expand in torch ops (the CPU path, and the kernels' reference)."""
    dtype = streams.dtype
    return (post.to(dtype).unsqueeze(-1) * y.unsqueeze(1)
            + torch.matmul(comb.to(dtype).transpose(-1, -2), streams))


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            hc_eps: float, norm_eps: float) -> torch.Tensor:
    """V4's final collapse of the streams before the shared norm (``hc_head_*``)."""
    mix = hc_mix(streams, fn, norm_eps)
    pre = torch.sigmoid(mix * scale.float() + base.float()) + hc_eps
    return hc_collapse(streams, pre)
