"""mHC's mix (mhc.hc_mix) as Triton kernels: per token, fn [n_out, hc D] times the RMS-normalized
flattened streams, in fp32.

The torch path makes an fp32 copy of the streams ([T, hc D]: 64 MiB a sublayer at 4k tokens,
hc 4, D 1024), runs five elementwise kernels and an fp32 GEMM forward, and about ten kernels
and a second fp32 copy backward: ~17 launches a sublayer, 24 sublayers a step of the small
preset, whose step is host-bound. Here:
  * forward, one program per block of tokens: one pass over its tokens' inputs accumulates
    the sum of squares and the products with fn's rows together; the products are scaled by
    rstd at the end (rstd (x . f) rather than (x rstd) . f: fp32 rounding differences only).
    Spans of columns over more programs with an in-order finish kernel were slower (H200, 4k:
    97-119 vs 77 us);
  * d streams = rstd (g - y mean(g y)), g = grad @ fn, y = x rstd (rms_norm_input_grad's
    formula): the row term sum_k g_k x_k is sum_n grad_n mix_n / rstd (the saved output), so
    one pass per (block of tokens, block of columns) writes the gradient, where a pass over
    each row for the term came first and the columns could not split over programs;
  * d fn = (grad rstd)^T @ x: one program per block of fn's columns and span of tokens sums
    its span in order into a partial of its own; torch adds the partials in a fixed order (no
    atomics: deterministic). One span per MixTiles.fn_tokens tokens (one below twice that), at
    most MixTiles.max_fn_spans: a 64k-token sequence gets spans x K / fn_cols programs, not the
    K / fn_cols that would each walk all 64k tokens.
Products run on TF32 tensor cores as three products of split operands (input_precision
"tf32x3", MixTiles.precision): on an H200 no further from float64 than fp32 FMAs and 1.5-3.5x
faster a kernel (MixTiles). The streams are read in their own dtype. The CPU keeps the torch path
(mhc._HcMix), the reference the tests hold these kernels to under TRITON_INTERPRET=1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class MixTiles:
    """tokens: tokens a program of the forward; k: input columns a step of its loop; warps: its
    warps. dx_tokens, dx_cols, dx_warps: tokens, columns and warps a program of the d streams
    kernel. fn_cols: fn columns a program of the d fn kernel; fn_rows: tokens a step of its
    loop; fn_tokens: its token span a program, at the least; max_fn_spans: at most this many
    spans; fn_warps: its warps. precision: the products' (tl.dot input_precision: ieee, fp32
    FMAs; tf32x3, three TF32 tensor-core products). The autograd Function launches with TILES;
    bench/train_ops.py hc-mix gives the launchers (mix_forward, mix_backward_streams,
    mix_backward_fn) candidates of its own."""

    # One H200, 4k tokens, hc 4, D 1024, bf16 streams (bench/train_ops.py hc-mix; results in
    # bench/results/train_ops_h200.txt), us forward | d streams | d fn: 77 | 51 | 45 here (d
    # streams 122 in two passes over each row; 16 x 128 beat 64 x 128, 128 x 64 and 32 x 256)
    # vs 177.4 | 183.3 | 180.6 for the first tiles (32 tokens a program, 64-column steps, fp32
    # FMA products, d fn spans of 4096 tokens and 32 columns), and errors against float64 no
    # larger (mix 2.3e-7 vs 1.1e-6, d fn 1.6e-7 vs 1.1e-6). The forward at 32 tokens x 64
    # columns rather than 16 x 128: 76-77 vs 77-80 us at 4k, 901-907 vs 1135-1138 at 64k (two
    # runs on one lease, run AB calls 3-4).
    tokens: int = 32
    k: int = 64
    warps: int = 4
    dx_tokens: int = 16
    dx_cols: int = 128
    dx_warps: int = 4
    fn_cols: int = 64
    fn_rows: int = 32
    fn_tokens: int = 512
    max_fn_spans: int = 32
    fn_warps: int = 4
    precision: str = "tf32x3"


TILES = MixTiles()


@triton.jit
def _load_rows(x_ptr, t, tmask, k0, K, BK: tl.constexpr):
    """-> (x [BT, BK] fp32 of tokens t, columns k0 + [0, BK); the column offsets)."""
    k = k0 + tl.arange(0, BK)
    x = tl.load(x_ptr + t[:, None].to(tl.int64) * K + k[None, :],
                mask=tmask[:, None] & (k < K)[None, :], other=0.0)
    return x.to(tl.float32), k


@triton.jit
def _grad_rows(grad_ptr, t, tmask, N, BN: tl.constexpr):
    """grad [BT, BN] fp32 of tokens t (columns past N zero)."""
    n = tl.arange(0, BN)
    return tl.load(grad_ptr + t[:, None] * N + n[None, :],
                   mask=tmask[:, None] & (n < N)[None, :], other=0.0)


@triton.jit
def _fn_cols(fn_ptr, k, K, N, BN: tl.constexpr):
    """fn [BN, BK] (rows past N zero) at columns k."""
    n = tl.arange(0, BN)
    return tl.load(fn_ptr + n[:, None] * K + k[None, :],
                   mask=(n < N)[:, None] & (k < K)[None, :], other=0.0)


@triton.jit
def _hc_mix_fwd(x_ptr, fn_ptr, mix_ptr, rstd_ptr, T, K, N, eps, BT: tl.constexpr,
                BK: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    acc = tl.zeros([BT, BN], tl.float32)
    squares = tl.zeros([BT], tl.float32)
    for k0 in range(0, K, BK):
        x, k = _load_rows(x_ptr, t, tmask, k0, K, BK)
        squares += tl.sum(x * x, axis=1)
        acc += tl.dot(x, tl.trans(_fn_cols(fn_ptr, k, K, N, BN)), input_precision=PREC)
    rstd = tl.rsqrt(squares / K + eps)
    n = tl.arange(0, BN)
    tl.store(mix_ptr + t[:, None] * N + n[None, :], acc * rstd[:, None],
             mask=tmask[:, None] & (n < N)[None, :])
    tl.store(rstd_ptr + t, rstd, mask=tmask)


@triton.jit
def _hc_mix_bwd_streams(x_ptr, fn_ptr, rstd_ptr, mix_ptr, grad_ptr, dx_ptr, T, K, N,
                        BT: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
                        PREC: tl.constexpr):
    """d x of tokens t, columns [k0, k0 + BK). The row term needs sum_k g_k x_k over all K,
    g = grad @ fn: that is sum_n grad_n (fn x)_n = sum_n grad_n mix_n / rstd, from the saved
    output, so no pass over the row comes first and the columns split over programs."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    grad = _grad_rows(grad_ptr, t, tmask, N, BN)
    rstd = tl.load(rstd_ptr + t, mask=tmask, other=0.0)
    # mean(g y) = rstd sum(g x) / K; d x = rstd (g - x rstd mean(g y))
    shift = rstd * tl.sum(grad * _grad_rows(mix_ptr, t, tmask, N, BN), axis=1) / K
    x, k = _load_rows(x_ptr, t, tmask, tl.program_id(1) * BK, K, BK)
    g = tl.dot(grad, _fn_cols(fn_ptr, k, K, N, BN), input_precision=PREC)
    dx = rstd[:, None] * (g - x * shift[:, None])
    tl.store(dx_ptr + t[:, None].to(tl.int64) * K + k[None, :],
             dx.to(dx_ptr.dtype.element_ty), mask=tmask[:, None] & (k < K)[None, :])


@triton.jit
def _hc_mix_bwd_fn(x_ptr, rstd_ptr, grad_ptr, dfn_ptr, T, K, N, span, BT: tl.constexpr,
                   BKF: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
    """Partial d fn of the tokens [s span, (s + 1) span) into dfn_ptr's slice s (span a
    multiple of BT)."""
    k0 = tl.program_id(0) * BKF
    s = tl.program_id(1)
    acc = tl.zeros([BN, BKF], tl.float32)
    for t0 in range(s * span, tl.minimum((s + 1) * span, T), BT):
        t = t0 + tl.arange(0, BT)
        tmask = t < T
        scaled = _grad_rows(grad_ptr, t, tmask, N, BN) * \
            tl.load(rstd_ptr + t, mask=tmask, other=0.0)[:, None]
        x, k = _load_rows(x_ptr, t, tmask, k0, K, BKF)
        acc += tl.dot(tl.trans(scaled), x, input_precision=PREC)
    n = tl.arange(0, BN)
    k = k0 + tl.arange(0, BKF)
    tl.store(dfn_ptr + (s.to(tl.int64) * N + n[:, None]) * K + k[None, :], acc,
             mask=(n < N)[:, None] & (k < K)[None, :])


def fn_spans(tokens: int, tiles: MixTiles) -> int:
    """Token spans of the d fn kernel: one a tiles.fn_tokens tokens, at most tiles.max_fn_spans
    (a function of the token count and the tiles alone: the same sum order every call)."""
    return max(1, min(tiles.max_fn_spans, tokens // tiles.fn_tokens))


def _width(n_out: int) -> int:
    return max(16, triton.next_power_of_2(n_out))


def mix_forward(x: torch.Tensor, fn32: torch.Tensor, norm_eps: float, tiles: MixTiles):
    """x [T, K] (the streams flattened, their dtype), fn32 [n, K] -> (mix [T, n], rstd [T])."""
    t, k = x.shape
    n = fn32.shape[0]
    mix = x.new_empty(t, n, dtype=torch.float32)
    rstd = x.new_empty(t, dtype=torch.float32)
    if t:
        _hc_mix_fwd[(triton.cdiv(t, tiles.tokens),)](
            x, fn32, mix, rstd, t, k, n, norm_eps, BT=tiles.tokens, BK=tiles.k, BN=_width(n),
            PREC=tiles.precision, num_warps=tiles.warps)
    return mix, rstd


def mix_backward_streams(x, fn32, rstd, mix, grad, tiles: MixTiles) -> torch.Tensor:
    """-> d x [T, K] in x's dtype; mix and rstd: mix_forward's; grad [T, n] fp32 contiguous."""
    t, k = x.shape
    dx = torch.empty_like(x)
    if t:
        _hc_mix_bwd_streams[(triton.cdiv(t, tiles.dx_tokens), triton.cdiv(k, tiles.dx_cols))](
            x, fn32, rstd, mix, grad, dx, t, k, fn32.shape[0], BT=tiles.dx_tokens,
            BK=tiles.dx_cols, BN=_width(fn32.shape[0]), PREC=tiles.precision,
            num_warps=tiles.dx_warps)
    return dx


def mix_backward_fn(x, rstd, grad, tiles: MixTiles) -> torch.Tensor:
    """-> d fn [n, K] fp32, the spans' partials added in a fixed order."""
    t, k = x.shape
    n = grad.shape[1]
    spans = fn_spans(t, tiles)
    span = triton.cdiv(triton.cdiv(max(t, 1), spans), tiles.fn_rows) * tiles.fn_rows
    parts = grad.new_empty(spans, n, k)
    _hc_mix_bwd_fn[(triton.cdiv(k, tiles.fn_cols), spans)](
        x, rstd, grad, parts, t, k, n, span, BT=tiles.fn_rows, BKF=tiles.fn_cols, BN=_width(n),
        PREC=tiles.precision, num_warps=tiles.fn_warps)
    return parts[0] if spans == 1 else parts.sum(0)


class _HcMixFused(torch.autograd.Function):
    """Saves the streams (their own dtype), fn, one fp32 rstd a token, as mhc._HcMix does, and
    the mix (n fp32 a token: the d streams kernel's row term)."""

    @staticmethod
    def forward(ctx, streams: torch.Tensor, fn: torch.Tensor, norm_eps: float):
        t, hc, d = streams.shape
        x = streams.contiguous().view(t, hc * d)
        fn32 = fn.float().contiguous()
        tiles = TILES
        mix, rstd = mix_forward(x, fn32, norm_eps, tiles)
        ctx.save_for_backward(x, fn32, rstd, mix)
        ctx.shape, ctx.fn_dtype, ctx.tiles = streams.shape, fn.dtype, tiles
        return mix

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, fn32, rstd, mix = ctx.saved_tensors
        grad = grad.float().contiguous()
        d_streams = d_fn = None
        if ctx.needs_input_grad[0]:
            d_streams = mix_backward_streams(x, fn32, rstd, mix, grad, ctx.tiles).view(ctx.shape)
        if ctx.needs_input_grad[1]:
            d_fn = mix_backward_fn(x, rstd, grad, ctx.tiles).to(ctx.fn_dtype)
        return d_streams, d_fn, None


def hc_mix_fused(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """mhc.hc_mix's contract: streams [T, hc, D] -> fn @ rms_norm(flattened streams), fp32
    [T, n_out]; differentiable in streams and fn."""
    if streams.dim() != 3 or fn.dim() != 2 or fn.shape[1] != streams.shape[1] * streams.shape[2]:
        raise ValueError(f"hc_mix_fused: streams {tuple(streams.shape)} and fn "
                         f"{tuple(fn.shape)}: fn must be [n_out, hc x D]")
    return _HcMixFused.apply(streams, fn, norm_eps)
