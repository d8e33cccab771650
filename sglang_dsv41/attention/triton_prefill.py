"""Autograd wrapper of the Triton prefill kernels (so the trainer can backprop, dsinks included)."""

from __future__ import annotations

import torch

from .triton_backward import sink_attention_backward
from .triton_common import PrefillBlocks, default_prefill_blocks
from .triton_forward import sink_attention_forward


class SinkAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                causal, window, softmax_scale, blocks):
        sinks32 = sinks.detach().float().contiguous() if sinks is not None else None
        out, lse = sink_attention_forward(q, k, v, sinks32, cu_seqlens_q, cu_seqlens_k,
                                          max_seqlen_q, causal, window, softmax_scale, blocks)
        ctx.save_for_backward(q, k, v, out, lse, sinks32, cu_seqlens_q, cu_seqlens_k)
        ctx.meta = (max_seqlen_q, max_seqlen_k, causal, window, softmax_scale, blocks)
        ctx.sinks_dtype = sinks.dtype if sinks is not None else None
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks32, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, causal, window, scale, blocks = ctx.meta
        dq, dk, dv, dsink = sink_attention_backward(dout, q, k, v, out, lse, sinks32, cu_q, cu_k,
                                                    max_q, max_k, causal, window, scale, blocks)
        if dsink is not None:
            dsink = dsink.to(ctx.sinks_dtype)
        return dq, dk, dv, dsink, None, None, None, None, None, None, None, None


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def host_cu_seqlens(cu: torch.Tensor) -> list[int]:
    """cu_seqlens on the host. The grid needs the longest sequence; the value is cached on the
    tensor (keyed by its version counter), so the per-layer calls of one forward sync once."""
    cached = getattr(cu, "_dsv41_host", None)
    if cached is not None and cached[0] == cu._version:
        return cached[1]
    vals = cu.tolist()
    cu._dsv41_host = (cu._version, vals)
    return vals


def sink_attention_triton(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, causal=True, window=None,
                          softmax_scale=None, blocks: PrefillBlocks | None = None):
    """Same contract as sink_attention_reference; `blocks` overrides the tile config."""
    cq = host_cu_seqlens(cu_seqlens_q)
    ck = host_cu_seqlens(cu_seqlens_k)
    if cq and (cq[0] != 0 or cq[-1] != q.shape[0]):
        raise ValueError(f"cu_seqlens_q must run from 0 to total_q={q.shape[0]}, got {cq}")
    if ck and (ck[0] != 0 or ck[-1] != k.shape[0]):
        raise ValueError(f"cu_seqlens_k must run from 0 to total_k={k.shape[0]}, got {ck}")
    lens_q = [b - a for a, b in zip(cq[:-1], cq[1:])]
    lens_k = [b - a for a, b in zip(ck[:-1], ck[1:])]
    if any(n < 0 for n in lens_q + lens_k):
        raise ValueError("cu_seqlens must be non-decreasing")
    max_q, max_k = max(lens_q, default=0), max(lens_k, default=0)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    blocks = blocks or default_prefill_blocks(q.shape[-1])
    cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.int32)
    cu_k = cu_seqlens_k.to(device=q.device, dtype=torch.int32)
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    return SinkAttentionFunction.apply(q, k, v, sinks, cu_q, cu_k, max_q, max_k, causal, window,
                                       float(scale), blocks)
