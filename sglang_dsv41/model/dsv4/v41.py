"""DeepSeek V4.1 numerics and mHC pieces, as SGLang 0.5.23 computes them.

Serving numerics (``DSV4Context.serving_numerics``): SGLang rounds the V4.1 indexer's queries and
keys to FP4 (e2m1, one power-of-two ue8m0 scale per 32 values) after RoPE, and the ratio-1/2
compressed KV to FP4 with one e4m3 scale per 16 values (``kernels/ops/quantization/
fp4_fake_quant.py``; on SM100 the fp4 cache stores exactly these values). Training with the switch
on computes the same forward values; the backward passes the gradient straight through.

mHC with ``hc_pre_from_prev_sublayer`` (``models/deepseek_v4_mhc.py``): every sublayer still
computes its (pre, post, comb) from the streams it receives and writes back
``post * y + comb^T @ streams``, but its input collapses the streams with the PREVIOUS
sublayer's ``pre`` (the very first sublayer takes stream 0), and the model's output is
``mhc_combine(streams, last pre)`` instead of V4's ``hc_head``.
"""

from __future__ import annotations

import torch

from .mhc import StreamGradSum, weighted_stream_sum

FP4_MAX = 6.0
FP8_MAX = 448.0
FP4_BLOCK = 32                # indexer q/k: values per ue8m0 scale
KV_FP4_BLOCK = 16             # compressed KV: values per e4m3 scale
_FP4_AMAX_FLOOR = 6 * 2.0 ** -126


def _ceil_pow2(x: torch.Tensor) -> torch.Tensor:
    """2 ** ceil(log2(x)) for positive fp32 x, on the IEEE bits (exact at powers of two)."""
    bits = x.contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return ((exponent + 127) << 23).view(torch.float32)


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 values in [-6, 6] onto the e2m1 grid, round to nearest even."""
    mag = x.abs()
    step = torch.where(mag < 2.0, 0.5, torch.where(mag < 4.0, 1.0, 2.0))
    return torch.round(mag / step) * step * torch.sign(x)


def _fp4_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"FP4 serving numerics need the last dim ({x.shape[-1]}) to be a "
                         f"multiple of {block}")
    return x.float().unflatten(-1, (-1, block))


def _fq_fp4(x: torch.Tensor) -> torch.Tensor:
    blocks = _fp4_blocks(x, FP4_BLOCK)
    scale = _ceil_pow2(blocks.abs().amax(dim=-1).clamp_min(_FP4_AMAX_FLOOR) * (1.0 / FP4_MAX))
    scale = scale.unsqueeze(-1)
    deq = _round_e2m1((blocks / scale).clamp(-FP4_MAX, FP4_MAX)) * scale
    return deq.flatten(-2).to(x.dtype)


def _fq_compressed_kv(x: torch.Tensor) -> torch.Tensor:
    blocks = _fp4_blocks(x, KV_FP4_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = (amax * (1.0 / FP4_MAX)).clamp(min=2 ** -9, max=FP8_MAX)
    scale = scale.to(torch.float8_e4m3fn).float()
    deq = _round_e2m1((blocks / scale).clamp(-FP4_MAX, FP4_MAX)) * scale
    return deq.flatten(-2).to(x.dtype)


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn):
        return fn(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def fake_quant_fp4(x: torch.Tensor) -> torch.Tensor:
    """SGLang's ``fake_quant_fp4``: e2m1 with a ue8m0 scale per 32 values (indexer q and k)."""
    return _StraightThrough.apply(x, _fq_fp4)


def fake_quant_compressed_kv(x: torch.Tensor) -> torch.Tensor:
    """SGLang's ``fake_quant_compressed_kv``: e2m1 with an e4m3 scale per 16 values."""
    return _StraightThrough.apply(x, _fq_compressed_kv)


# ---- routing --------------------------------------------------------------------------------
def sqrtsoftplus_log1p(logits: torch.Tensor) -> torch.Tensor:
    """V4.1 router scores (SGLang's fused gate with ``sqrtsoftplus_log1p``, used when model_type
    is deepseek_v41): sqrt(x) above 20, sqrt(log1p(exp(x))) below, in fp32. NaN logits stay NaN;
    the gate ranks them above every finite score, which is what ``torch.topk`` does, so the
    caller's top-k needs no extra rule. Hash-routed layers score with plain
    ``softplus(x).sqrt()`` in SGLang (``HashTopK._forward_torch``)."""
    x = logits.float()
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(x))).sqrt()


def renormalize_topk_weights(weights: torch.Tensor) -> torch.Tensor:
    """The fused gate's renormalisation (no epsilon): divide by the row sum when it is positive,
    by 1 otherwise, so a row whose sum is NaN (a NaN logit was picked) keeps its raw scores."""
    total = weights.sum(dim=-1, keepdim=True)
    return weights / torch.where(total > 0, total, torch.ones_like(total))


# ---- mHC with hc_pre_from_prev_sublayer -----------------------------------------------------
def mhc_combine(streams: torch.Tensor, pre: torch.Tensor,
                grad_sum: StreamGradSum | None = None) -> torch.Tensor:
    """streams [T, hc, D], pre [T, hc] -> sum_k pre[:, k] * streams[:, k] [T, D]: fp32
    accumulation in stream order (SGLang's ``mhc_combine`` kernel), cast to the streams' dtype.
    grad_sum: the sublayer's StreamGradSum, if any."""
    if streams.dim() != 3 or pre.shape != streams.shape[:2]:
        raise ValueError(f"mhc_combine: streams {tuple(streams.shape)} and pre "
                         f"{tuple(pre.shape)} must be [T, hc, D] and [T, hc]")
    return weighted_stream_sum(streams, pre, grad_sum)


def hc_input_from_prev(streams: torch.Tensor, prev_pre: torch.Tensor | None,
                       grad_sum: StreamGradSum | None = None) -> torch.Tensor:
    """A sublayer's input before its norm under ``hc_pre_from_prev_sublayer``: the streams
    collapsed with the previous sublayer's ``pre``; stream 0 for the model's first sublayer
    (SGLang's ``mhc.combine``: ``norm(x[:, 0, :])`` while no pre exists). An Engram that
    rewrites the streams between layers keeps the pending ``pre`` (``HcState.with_residual``)."""
    if prev_pre is None:
        return streams[:, 0]
    return mhc_combine(streams, prev_pre, grad_sum)
