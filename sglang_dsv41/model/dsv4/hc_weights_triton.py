"""mHC weights (mhc._hc_weights) as one Triton kernel forward and one backward.

Per token, from mix [(2 + hc) x hc] and the shared base/scale: pre = sigmoid(.) + eps,
post = 2 sigmoid(.), comb = Sinkhorn(softmax(.) + eps) over an hc x hc matrix: a few hundred
flops per token. Eagerly that is 6 x iters tiny kernels per sublayer and twice that in the
backward; torch.compile'd it was still ~140 kernels and ~3.4 ms of host time per sublayer and
step (24 sublayers: ~80 ms of a 290 ms step on an H200, the step being host-bound). Here each
program keeps a block of tokens' matrices in registers for all the iterations. The backward
runs the Sinkhorn steps forward once more, parking each step's input in a scratch buffer of its
own program (read back only by the thread that wrote it: no barrier), then walks them back:
2 x (2 iters - 1) normalizations. Recomputing each step's input from the start instead (the
first version: (2 iters - 1) iters normalizations, 741 at 20 iterations) took 200 us a call at
4k tokens on an H200, 4.8 ms of a training step's GPU time; forward + backward at 64k tokens
went from 2243 to 1165 us (bench/train_ops.py hc-weights, bench/results/train_ops_h200.txt).
The scratch is the forward's iterates of one call, [T, 2 iters - 1, hc, hc] fp32 (10 MB at 4k
tokens, hc 4, 20 iterations), freed when the call returns. Per-program partial sums of the base
and scale gradients are summed afterwards in a fixed order (deterministic, no atomics).

Same math as mhc._hc_weights in fp32; sums over hc = 4 values may round in another order
(last-bit differences). hc must be a power of two (the kernels' block shape).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_TOKENS = 32


@triton.jit
def _normalize(x, axis: tl.constexpr, eps):
    """x / (sum over axis + eps); axis 1: Sinkhorn's column step (torch dim -2), 2: row step."""
    return x / (tl.expand_dims(tl.sum(x, axis=axis), axis) + eps)


@triton.jit
def _normalize_backward(x, g, axis: tl.constexpr, eps):
    """Gradient through y = x / (s + eps), s = sum(x, axis): (g - sum(g * y, axis)) / (s + eps)."""
    s = tl.expand_dims(tl.sum(x, axis=axis), axis) + eps
    return (g - tl.expand_dims(tl.sum(g * x, axis=axis), axis) / s) / s


@triton.jit
def _sinkhorn_step(x, k, eps):
    """Step k of the 2 x iters - 1 alternating normalizations: even k columns, odd k rows."""
    if k % 2 == 0:
        x = _normalize(x, 1, eps)
    else:
        x = _normalize(x, 2, eps)
    return x


@triton.jit
def _load_block(mix_ptr, base_ptr, scale_ptr, T, HC: tl.constexpr, BLOCK: tl.constexpr):
    n_mix: tl.constexpr = (2 + HC) * HC
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = t < T
    h = tl.arange(0, HC)
    vec = t[:, None] * n_mix + h[None, :]                                   # [B, HC]
    mat_off = 2 * HC + h[:, None] * HC + h[None, :]                         # [HC, HC]
    mat = t[:, None, None] * n_mix + mat_off[None, :, :]                    # [B, HC, HC]
    pre_w = tl.load(mix_ptr + vec, mask=valid[:, None], other=0.0)
    post_w = tl.load(mix_ptr + vec + HC, mask=valid[:, None], other=0.0)
    comb_w = tl.load(mix_ptr + mat, mask=valid[:, None, None], other=0.0)
    pre_b = tl.load(base_ptr + h)
    post_b = tl.load(base_ptr + HC + h)
    comb_b = tl.load(base_ptr + mat_off)
    s_pre = tl.load(scale_ptr)
    s_post = tl.load(scale_ptr + 1)
    s_comb = tl.load(scale_ptr + 2)
    return (t, valid, vec, mat, mat_off, pre_w, post_w, comb_w, pre_b, post_b, comb_b,
            s_pre, s_post, s_comb)


@triton.jit
def _softmax_rows(z):
    e = tl.exp(z - tl.expand_dims(tl.max(z, axis=2), 2))
    return e / tl.expand_dims(tl.sum(e, axis=2), 2)


@triton.jit
def _hc_weights_fwd(mix_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, T, n_steps,
                    hc_eps, HC: tl.constexpr, BLOCK: tl.constexpr):
    (t, valid, vec, mat, mat_off, pre_w, post_w, comb_w, pre_b, post_b, comb_b,
     s_pre, s_post, s_comb) = _load_block(mix_ptr, base_ptr, scale_ptr, T, HC, BLOCK)
    out_vec = t[:, None] * HC + tl.arange(0, HC)[None, :]
    pre = tl.sigmoid(pre_w * s_pre + pre_b[None, :]) + hc_eps
    post = 2 * tl.sigmoid(post_w * s_post + post_b[None, :])
    tl.store(pre_ptr + out_vec, pre, mask=valid[:, None])
    tl.store(post_ptr + out_vec, post, mask=valid[:, None])
    comb = _softmax_rows(comb_w * s_comb + comb_b[None, :, :]) + hc_eps
    for k in range(n_steps):
        comb = _sinkhorn_step(comb, k, hc_eps)
    out_mat = t[:, None, None] * (HC * HC) + (mat_off - 2 * HC)[None, :, :]
    tl.store(comb_ptr + out_mat, comb, mask=valid[:, None, None])


@triton.jit
def _hc_weights_bwd(mix_ptr, base_ptr, scale_ptr, d_pre_ptr, d_post_ptr, d_comb_ptr,
                    d_mix_ptr, d_base_part_ptr, d_scale_part_ptr, steps_ptr, T, n_steps, hc_eps,
                    HC: tl.constexpr, BLOCK: tl.constexpr):
    n_mix: tl.constexpr = (2 + HC) * HC
    (t, valid, vec, mat, mat_off, pre_w, post_w, comb_w, pre_b, post_b, comb_b,
     s_pre, s_post, s_comb) = _load_block(mix_ptr, base_ptr, scale_ptr, T, HC, BLOCK)
    h = tl.arange(0, HC)
    out_vec = t[:, None] * HC + h[None, :]
    out_mat = t[:, None, None] * (HC * HC) + (mat_off - 2 * HC)[None, :, :]
    # Rows past T load zero gradients: they add nothing to the partial sums.
    d_pre = tl.load(d_pre_ptr + out_vec, mask=valid[:, None], other=0.0)
    d_post = tl.load(d_post_ptr + out_vec, mask=valid[:, None], other=0.0)
    g = tl.load(d_comb_ptr + out_mat, mask=valid[:, None, None], other=0.0)

    sig = tl.sigmoid(pre_w * s_pre + pre_b[None, :])
    dz_pre = d_pre * sig * (1 - sig)
    sig = tl.sigmoid(post_w * s_post + post_b[None, :])
    dz_post = d_post * 2 * sig * (1 - sig)

    p = _softmax_rows(comb_w * s_comb + comb_b[None, :, :])
    # This program's scratch: the input of every Sinkhorn step, [n_steps, BLOCK, HC, HC].
    block_mat: tl.constexpr = BLOCK * HC * HC
    local = tl.arange(0, BLOCK)[:, None, None] * (HC * HC) + (mat_off - 2 * HC)[None, :, :]
    steps = steps_ptr + tl.program_id(0).to(tl.int64) * n_steps * block_mat + local
    x = p + hc_eps
    for k in range(n_steps):
        tl.store(steps + k * block_mat, x)
        x = _sinkhorn_step(x, k, hc_eps)
    for back in range(n_steps):  # steps n_steps-1 .. 0, each from its stored input
        k = n_steps - 1 - back
        x = tl.load(steps + k * block_mat)
        if k % 2 == 0:
            g = _normalize_backward(x, g, 1, hc_eps)
        else:
            g = _normalize_backward(x, g, 2, hc_eps)
    dz_comb = p * (g - tl.expand_dims(tl.sum(g * p, axis=2), 2))  # softmax backward

    tl.store(d_mix_ptr + vec, dz_pre * s_pre, mask=valid[:, None])
    tl.store(d_mix_ptr + vec + HC, dz_post * s_post, mask=valid[:, None])
    tl.store(d_mix_ptr + mat, dz_comb * s_comb, mask=valid[:, None, None])
    part = tl.program_id(0)
    tl.store(d_base_part_ptr + part * n_mix + h, tl.sum(dz_pre, axis=0))
    tl.store(d_base_part_ptr + part * n_mix + HC + h, tl.sum(dz_post, axis=0))
    tl.store(d_base_part_ptr + part * n_mix + mat_off, tl.sum(dz_comb, axis=0))
    tl.store(d_scale_part_ptr + part * 3, tl.sum(tl.sum(dz_pre * pre_w, axis=1), axis=0))
    tl.store(d_scale_part_ptr + part * 3 + 1, tl.sum(tl.sum(dz_post * post_w, axis=1), axis=0))
    tl.store(d_scale_part_ptr + part * 3 + 2,
             tl.sum(tl.sum(tl.sum(dz_comb * comb_w, axis=2), axis=1), axis=0))


class _HcWeights(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mix, base, scale, hc: int, sinkhorn_iters: int, hc_eps: float):
        mix32 = mix.float().contiguous()
        base32, scale32 = base.float().contiguous(), scale.float().contiguous()
        t = mix32.shape[0]
        pre = mix32.new_empty(t, hc)
        post = mix32.new_empty(t, hc)
        comb = mix32.new_empty(t, hc, hc)
        n_steps = 2 * sinkhorn_iters - 1
        grid = (triton.cdiv(t, BLOCK_TOKENS),)
        if t:
            _hc_weights_fwd[grid](mix32, base32, scale32, pre, post, comb, t, n_steps, hc_eps,
                                  HC=hc, BLOCK=BLOCK_TOKENS)
        ctx.save_for_backward(mix32, base32, scale32)
        ctx.hc, ctx.n_steps, ctx.hc_eps = hc, n_steps, hc_eps
        ctx.dtypes = (mix.dtype, base.dtype, scale.dtype)
        return pre, post, comb

    @staticmethod
    def backward(ctx, d_pre, d_post, d_comb):
        mix32, base32, scale32 = ctx.saved_tensors
        t, n_mix = mix32.shape
        parts = triton.cdiv(t, BLOCK_TOKENS)
        d_mix = torch.empty_like(mix32)
        d_base_part = mix32.new_empty(parts, n_mix)
        d_scale_part = mix32.new_empty(parts, 3)
        if t:
            steps = mix32.new_empty(parts, ctx.n_steps, BLOCK_TOKENS, ctx.hc, ctx.hc)
            _hc_weights_bwd[(parts,)](mix32, base32, scale32, d_pre.float().contiguous(),
                                      d_post.float().contiguous(), d_comb.float().contiguous(),
                                      d_mix, d_base_part, d_scale_part, steps, t, ctx.n_steps,
                                      ctx.hc_eps, HC=ctx.hc, BLOCK=BLOCK_TOKENS)
        mix_dtype, base_dtype, scale_dtype = ctx.dtypes
        return (d_mix.to(mix_dtype), d_base_part.sum(0).to(base_dtype),
                d_scale_part.sum(0).to(scale_dtype), None, None, None)


def supports(hc: int, scale: torch.Tensor) -> bool:
    """The kernels' shapes: hc a power of two, the three scales of a sublayer."""
    return hc > 0 and hc & (hc - 1) == 0 and scale.numel() == 3


def hc_weights_fused(mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
                     sinkhorn_iters: int, hc_eps: float):
    """mhc._hc_weights' contract: mix [T, (2+hc)*hc] -> pre [T, hc], post [T, hc],
    comb [T, hc, hc], fp32, differentiable in mix, base and scale."""
    if sinkhorn_iters < 1:
        raise ValueError(f"sinkhorn_iters must be >= 1, got {sinkhorn_iters}")
    if not supports(hc, scale) or mix.dim() != 2 or mix.shape[1] != (2 + hc) * hc or \
            base.shape != (mix.shape[1],):
        raise ValueError(f"hc_weights_fused: mix {tuple(mix.shape)}, base {tuple(base.shape)}, "
                         f"scale {tuple(scale.shape)} for hc={hc} (a power of two)")
    return _HcWeights.apply(mix, base, scale, hc, sinkhorn_iters, hc_eps)
