"""mHC's two passes over the streams as Triton kernels, one forward and one backward each:
the write-back (mhc.hc_expand) and the pre-weighted stream sum (mhc.weighted_stream_sum).

hc_expand: out[t, k] = post[t, k] * y[t] + sum_j comb[t, j, k] * streams[t, j], per token an
hc x hc mix of hc rows of D. As torch ops the mix was a bmm of T tiny [hc, hc] x [hc, D]
products, which cuBLAS runs on an sm80 wmma kernel at ~300 us a call for 4k tokens, hc 4,
D 1024 on an H200 (and two such bmms in the backward; 24 sublayers: ~16 ms of a ~170 ms
step), plus the broadcast multiply, the add and the casts. Here one pass reads the streams and
y and writes the output; the backward reads the gradient once, writes the gradients of the
streams and y, and reduces those of post and comb over D inside each program.

weighted_stream_sum: out[t] = sum_k pre[t, k] * streams[t, k], accumulated in fp32 in stream
order (SGLang's mhc_combine; fused multiply-adds, so not bit-identical to the torch path), one
pass instead of hc casts, multiplies and adds; its backward, one pass instead of a cast, a
multiply and a sum per stream.

A sublayer's streams feed three kernels (the mix, the collapse, the write-back): autograd would
give each use's gradient a tensor of its own and add them (two [T, hc, D] adds a sublayer, ~1.1
ms of a 4k step of the small preset on an H200). With a StreamGradSum the backward kernels add
into one buffer as they write (mhc.StreamGradSum): that step 77.7 -> 76.9 ms
(bench/results/train_h200.txt, run AG).

Reductions stay inside a program (no atomics: deterministic). Every product and sum is in fp32,
rounded once to the streams' dtype (torch's hc_expand rounded post to the streams' dtype, the
bmm's output and the sum: bf16 roundings apart). hc must be a power of two (the block shape).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .mhc import StreamGradSum

BLOCK_TOKENS = 8
BLOCK_D = 128


def registered(grad_sum: StreamGradSum | None, ctx) -> StreamGradSum | None:
    """In a Function's forward whose input 0 is the streams: grad_sum registered for this use
    when its backward will give the streams a gradient."""
    return grad_sum.register() if grad_sum is not None and ctx.needs_input_grad[0] else None


def streams_grad_out(grad_sum: StreamGradSum | None, like: torch.Tensor
                     ) -> tuple[torch.Tensor, bool]:
    """-> (the tensor a backward kernel writes the streams' gradient to, whether it adds to
    it): the sum so far, or a fresh tensor like ``like``."""
    so_far = None if grad_sum is None else grad_sum.so_far()
    return (torch.empty_like(like), False) if so_far is None else (so_far, True)


def hand_on(grad_sum: StreamGradSum | None, d_streams: torch.Tensor) -> torch.Tensor | None:
    return d_streams if grad_sum is None else grad_sum.hand_on(d_streams)


@triton.jit
def _hc_expand_fwd(s_ptr, y_ptr, post_ptr, comb_ptr, out_ptr, T, D,
                   HC: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    valid = t < T
    h = tl.arange(0, HC)
    post = tl.load(post_ptr + t[:, None] * HC + h[None, :], mask=valid[:, None], other=0.0)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        rows = valid[:, None] & (d[None, :] < D)                                # [BT, BD]
        y = tl.load(y_ptr + t[:, None] * D + d[None, :], mask=rows, other=0.0).to(tl.float32)
        acc = post[:, :, None] * y[:, None, :]                                  # [BT, HC, BD]
        for j in tl.static_range(HC):
            comb_j = tl.load(comb_ptr + t[:, None] * (HC * HC) + j * HC + h[None, :],
                             mask=valid[:, None], other=0.0)                    # comb[t, j, :]
            s_j = tl.load(s_ptr + t[:, None] * (HC * D) + j * D + d[None, :], mask=rows,
                          other=0.0).to(tl.float32)
            acc += comb_j[:, :, None] * s_j[:, None, :]
        out = t[:, None, None] * (HC * D) + h[None, :, None] * D + d[None, None, :]
        tl.store(out_ptr + out, acc.to(out_ptr.dtype.element_ty), mask=rows[:, None, :])


@triton.jit
def _hc_expand_bwd(g_ptr, s_ptr, y_ptr, post_ptr, comb_ptr, d_s_ptr, d_y_ptr, d_post_ptr,
                   d_comb_ptr, T, D, HC: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                   ACC: tl.constexpr):
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    valid = t < T
    h = tl.arange(0, HC)
    post = tl.load(post_ptr + t[:, None] * HC + h[None, :], mask=valid[:, None], other=0.0)
    d_post = tl.zeros((BT, HC), dtype=tl.float32)
    d_comb = tl.zeros((BT, HC, HC), dtype=tl.float32)                          # [t, j, k]
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        rows = valid[:, None] & (d[None, :] < D)
        g_off = t[:, None, None] * (HC * D) + h[None, :, None] * D + d[None, None, :]
        g = tl.load(g_ptr + g_off, mask=rows[:, None, :], other=0.0).to(tl.float32)
        y = tl.load(y_ptr + t[:, None] * D + d[None, :], mask=rows, other=0.0).to(tl.float32)
        tl.store(d_y_ptr + t[:, None] * D + d[None, :],
                 tl.sum(post[:, :, None] * g, axis=1).to(d_y_ptr.dtype.element_ty), mask=rows)
        d_post += tl.sum(g * y[:, None, :], axis=2)
        for j in tl.static_range(HC):
            comb_j = tl.load(comb_ptr + t[:, None] * (HC * HC) + j * HC + h[None, :],
                             mask=valid[:, None], other=0.0)
            s_off = t[:, None] * (HC * D) + j * D + d[None, :]
            s_j = tl.load(s_ptr + s_off, mask=rows, other=0.0).to(tl.float32)
            d_s = tl.sum(comb_j[:, :, None] * g, axis=1)
            if ACC:  # the other uses' gradient so far (StreamGradSum)
                d_s += tl.load(d_s_ptr + s_off, mask=rows, other=0.0).to(tl.float32)
            tl.store(d_s_ptr + s_off, d_s.to(d_s_ptr.dtype.element_ty), mask=rows)
            d_comb_j = tl.sum(g * s_j[:, None, :], axis=2)                      # [BT, HC]: k
            d_comb += tl.where(h[None, :, None] == j, d_comb_j[:, None, :], 0.0)
    tl.store(d_post_ptr + t[:, None] * HC + h[None, :], d_post, mask=valid[:, None])
    mat = t[:, None, None] * (HC * HC) + h[None, :, None] * HC + h[None, None, :]
    tl.store(d_comb_ptr + mat, d_comb, mask=valid[:, None, None])


class _HcExpand(torch.autograd.Function):
    @staticmethod
    def forward(ctx, streams, y, post, comb, grad_sum):
        ctx.grad_sum = registered(grad_sum, ctx)
        streams, y = streams.contiguous(), y.contiguous()
        post32, comb32 = post.float().contiguous(), comb.float().contiguous()
        t, hc, d = streams.shape
        out = torch.empty_like(streams)
        if t:
            _hc_expand_fwd[(triton.cdiv(t, BLOCK_TOKENS),)](
                streams, y, post32, comb32, out, t, d, HC=hc, BT=BLOCK_TOKENS, BD=BLOCK_D)
        ctx.save_for_backward(streams, y, post32, comb32)
        ctx.dtypes = (post.dtype, comb.dtype)
        return out

    @staticmethod
    def backward(ctx, grad):
        streams, y, post32, comb32 = ctx.saved_tensors
        t, hc, d = streams.shape
        d_streams, acc = streams_grad_out(ctx.grad_sum, streams)
        d_y = torch.empty_like(y)
        d_post, d_comb = torch.empty_like(post32), torch.empty_like(comb32)
        if t:
            _hc_expand_bwd[(triton.cdiv(t, BLOCK_TOKENS),)](
                grad.contiguous(), streams, y, post32, comb32, d_streams, d_y, d_post, d_comb,
                t, d, HC=hc, BT=BLOCK_TOKENS, BD=BLOCK_D, ACC=acc)
        post_dtype, comb_dtype = ctx.dtypes
        return (hand_on(ctx.grad_sum, d_streams), d_y, d_post.to(post_dtype),
                d_comb.to(comb_dtype), None)


@triton.jit
def _weighted_sum_fwd(s_ptr, pre_ptr, out_ptr, T, D, HC: tl.constexpr, BT: tl.constexpr,
                      BD: tl.constexpr):
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    valid = t < T
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        rows = valid[:, None] & (d[None, :] < D)
        acc = tl.zeros((BT, BD), dtype=tl.float32)
        for k in tl.static_range(HC):
            pre_k = tl.load(pre_ptr + t * HC + k, mask=valid, other=0.0)
            s_k = tl.load(s_ptr + t[:, None] * (HC * D) + k * D + d[None, :], mask=rows,
                          other=0.0).to(tl.float32)
            acc += pre_k[:, None] * s_k
        tl.store(out_ptr + t[:, None] * D + d[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=rows)


@triton.jit
def _weighted_sum_bwd(g_ptr, s_ptr, pre_ptr, d_s_ptr, d_pre_ptr, T, D, HC: tl.constexpr,
                      BT: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr):
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    valid = t < T
    h = tl.arange(0, HC)
    d_pre = tl.zeros((BT, HC), dtype=tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        rows = valid[:, None] & (d[None, :] < D)
        g = tl.load(g_ptr + t[:, None] * D + d[None, :], mask=rows, other=0.0).to(tl.float32)
        for k in tl.static_range(HC):
            pre_k = tl.load(pre_ptr + t * HC + k, mask=valid, other=0.0)
            s_off = t[:, None] * (HC * D) + k * D + d[None, :]
            s_k = tl.load(s_ptr + s_off, mask=rows, other=0.0).to(tl.float32)
            d_s = pre_k[:, None] * g
            if ACC:  # the other uses' gradient so far (StreamGradSum)
                d_s += tl.load(d_s_ptr + s_off, mask=rows, other=0.0).to(tl.float32)
            tl.store(d_s_ptr + s_off, d_s.to(d_s_ptr.dtype.element_ty), mask=rows)
            d_pre += tl.where(h[None, :] == k, tl.sum(s_k * g, axis=1)[:, None], 0.0)
    tl.store(d_pre_ptr + t[:, None] * HC + h[None, :], d_pre, mask=valid[:, None])


class _WeightedStreamSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, streams, pre, grad_sum):
        ctx.grad_sum = registered(grad_sum, ctx)
        streams, pre32 = streams.contiguous(), pre.float().contiguous()
        t, hc, d = streams.shape
        out = streams.new_empty(t, d)
        if t:
            _weighted_sum_fwd[(triton.cdiv(t, BLOCK_TOKENS),)](
                streams, pre32, out, t, d, HC=hc, BT=BLOCK_TOKENS, BD=BLOCK_D)
        ctx.save_for_backward(streams, pre32)
        ctx.pre_dtype = pre.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        streams, pre32 = ctx.saved_tensors
        t, hc, d = streams.shape
        d_streams, acc = streams_grad_out(ctx.grad_sum, streams)
        d_pre = torch.empty_like(pre32)
        if t:
            _weighted_sum_bwd[(triton.cdiv(t, BLOCK_TOKENS),)](
                grad.contiguous(), streams, pre32, d_streams, d_pre, t, d, HC=hc,
                BT=BLOCK_TOKENS, BD=BLOCK_D, ACC=acc)
        return hand_on(ctx.grad_sum, d_streams), d_pre.to(ctx.pre_dtype), None


def supports(hc: int) -> bool:
    """The kernels' block shape: hc a power of two."""
    return hc > 0 and hc & (hc - 1) == 0


def hc_expand_fused(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor,
                    comb: torch.Tensor, grad_sum: StreamGradSum | None = None) -> torch.Tensor:
    """mhc.hc_expand's contract: streams [T, hc, D], y [T, D], post [T, hc], comb [T, hc, hc]
    -> [T, hc, D] in the streams' dtype, differentiable in all four; the streams' gradient
    summed in grad_sum when given."""
    t, hc, d = streams.shape
    if not supports(hc) or y.shape != (t, d) or post.shape != (t, hc) or \
            comb.shape != (t, hc, hc) or y.dtype != streams.dtype:
        raise ValueError(f"hc_expand_fused: streams {tuple(streams.shape)} {streams.dtype}, "
                         f"y {tuple(y.shape)} {y.dtype}, post {tuple(post.shape)}, comb "
                         f"{tuple(comb.shape)}: hc a power of two, y of the streams' dtype")
    return _HcExpand.apply(streams, y, post, comb, grad_sum)


def weighted_stream_sum_fused(streams: torch.Tensor, pre: torch.Tensor,
                              grad_sum: StreamGradSum | None = None) -> torch.Tensor:
    """mhc.weighted_stream_sum's contract: streams [T, hc, D], pre [T, hc] -> [T, D] in the
    streams' dtype, differentiable in both; the streams' gradient summed in grad_sum when
    given."""
    t, hc, d = streams.shape
    if not supports(hc) or pre.shape != (t, hc):
        raise ValueError(f"weighted_stream_sum_fused: streams {tuple(streams.shape)}, pre "
                         f"{tuple(pre.shape)}: hc a power of two")
    return _WeightedStreamSum.apply(streams, pre, grad_sum)
