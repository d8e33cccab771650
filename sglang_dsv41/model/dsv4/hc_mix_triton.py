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
  * backward, one kernel for both gradients, x read once: one program per (block of columns,
    span of tokens) walks its span in steps of rows;
    - d streams = rstd (g - y mean(g y)), g = grad @ fn, y = x rstd (rms_norm_input_grad's
      formula): the row term sum_k g_k x_k is sum_n grad_n mix_n / rstd (the saved output), so
      no pass over each row comes first and the columns split over programs (H200, 4k: 51 us
      as a kernel of its own vs 122 with that pass first);
    - d fn = (grad rstd)^T @ x: each program sums its span in order into a partial of its own;
      torch adds the partials in a fixed order (no atomics: deterministic). One span per
      MixTiles.bwd_tokens tokens (one below twice that), at most MixTiles.max_bwd_spans: a
      64k-token sequence gets spans x K / bwd_cols programs, not the K / bwd_cols that would
      each walk all 64k tokens.
    As two kernels (d streams, then d fn) they read x twice: 51 + 45 us at 4k.
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

from .mhc import StreamGradSum
from .mhc_streams_triton import hand_on, registered


@dataclass(frozen=True)
class MixTiles:
    """tokens: tokens a program of the forward; k: input columns a step of its loop; warps: its
    warps. bwd_cols: columns a program of the backward; bwd_rows: tokens a step of its loop;
    bwd_tokens: its token span a program, at the least; max_bwd_spans: at most this many spans;
    bwd_warps: its warps. precision: the products' (tl.dot input_precision: ieee, fp32 FMAs;
    tf32x3, three TF32 tensor-core products). The autograd Function launches with TILES;
    bench/train_ops.py hc-mix gives the launchers (mix_forward, mix_backward) candidates of its
    own."""

    # One H200, 4k tokens, hc 4, D 1024, bf16 streams (bench/train_ops.py hc-mix; results in
    # bench/results/train_ops_h200.txt), us forward | d streams | d fn: 77 | 51 | 45 with d
    # streams and d fn as kernels of their own (d streams 16 tokens x 128 columns a program;
    # d fn 64 columns, 32-token steps, spans of 512 tokens) vs 177.4 | 183.3 | 180.6 for the
    # first tiles (32 tokens a program, 64-column steps, fp32 FMA products, d fn spans of 4096
    # tokens and 32 columns), and errors against float64 no larger (mix 2.3e-7 vs 1.1e-6, d fn
    # 1.6e-7 vs 1.1e-6). The forward at 32 tokens x 64 columns rather than 16 x 128: 76-77 vs
    # 77-80 us at 4k, 901-907 vs 1135-1138 at 64k (two runs on one lease, run AB calls 3-4).
    # The one-kernel backward (d streams and d fn from one read of x), run AC call 1: 108-109 us
    # at 4k and 1452-1462 at 64k on 4 warps, 103.6-104.0 and 1370.5-1370.6 on 2 (the default);
    # the two kernels it replaced took 98-135 (runs AB, AC) and 1283-1293: even at 4k, 87 us a
    # mix slower at 64k (~2 ms of a 2.2 s step). Compiled for sm_90 they do not spill.
    tokens: int = 32
    k: int = 64
    warps: int = 4
    bwd_cols: int = 128
    bwd_rows: int = 16
    bwd_tokens: int = 256
    max_bwd_spans: int = 32
    bwd_warps: int = 2
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
def _hc_mix_bwd(x_ptr, fn_ptr, rstd_ptr, mix_ptr, grad_ptr, dx_ptr, dfn_ptr, T, K, N, span,
                BT: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
                DX: tl.constexpr, DFN: tl.constexpr, ACC: tl.constexpr):
    """Columns [k0, k0 + BK) of the tokens [s span, (s + 1) span) (span a multiple of BT): their
    d x (DX) and their partial of d fn into dfn_ptr's slice s (DFN), x read once for both. d x's
    row term needs sum_k g_k x_k over all K, g = grad @ fn: that is sum_n grad_n (fn x)_n =
    sum_n grad_n mix_n / rstd, from the saved output, so no pass over the row comes first and
    the columns split over programs. ACC: d x is added to what dx_ptr holds (StreamGradSum)."""
    k0 = tl.program_id(0) * BK
    s = tl.program_id(1)
    k = k0 + tl.arange(0, BK)
    fn = _fn_cols(fn_ptr, k, K, N, BN)
    acc = tl.zeros([BN, BK], tl.float32)
    for t0 in range(s * span, tl.minimum((s + 1) * span, T), BT):
        t = t0 + tl.arange(0, BT)
        tmask = t < T
        grad = _grad_rows(grad_ptr, t, tmask, N, BN)
        rstd = tl.load(rstd_ptr + t, mask=tmask, other=0.0)
        x, _ = _load_rows(x_ptr, t, tmask, k0, K, BK)
        if DX:
            # mean(g y) = rstd sum(g x) / K; d x = rstd (g - x rstd mean(g y))
            shift = rstd * tl.sum(grad * _grad_rows(mix_ptr, t, tmask, N, BN), axis=1) / K
            g = tl.dot(grad, fn, input_precision=PREC)
            dx = rstd[:, None] * (g - x * shift[:, None])
            dx_at = dx_ptr + t[:, None].to(tl.int64) * K + k[None, :]
            dx_mask = tmask[:, None] & (k < K)[None, :]
            if ACC:
                dx += tl.load(dx_at, mask=dx_mask, other=0.0).to(tl.float32)
            tl.store(dx_at, dx.to(dx_ptr.dtype.element_ty), mask=dx_mask)
        if DFN:
            acc += tl.dot(tl.trans(grad * rstd[:, None]), x, input_precision=PREC)
    if DFN:
        n = tl.arange(0, BN)
        tl.store(dfn_ptr + (s.to(tl.int64) * N + n[:, None]) * K + k[None, :], acc,
                 mask=(n < N)[:, None] & (k < K)[None, :])


def bwd_spans(tokens: int, tiles: MixTiles) -> int:
    """Token spans of the backward kernel: one a tiles.bwd_tokens tokens, at most
    tiles.max_bwd_spans (a function of the token count and the tiles alone: the same sum order
    every call)."""
    return max(1, min(tiles.max_bwd_spans, tokens // tiles.bwd_tokens))


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


def mix_backward(x, fn32, rstd, mix, grad, tiles: MixTiles, streams: bool = True,
                 fn: bool = True, dx_into: torch.Tensor | None = None):
    """-> (d x [T, K] in x's dtype or None, d fn [n, K] fp32 or None), as asked; mix and rstd:
    mix_forward's; grad [T, n] fp32 contiguous. d fn's span partials are added in a fixed
    order. dx_into: d x is added into it (and it is returned) instead of a new tensor."""
    t, k = x.shape
    n = grad.shape[1]
    spans = bwd_spans(t, tiles)
    span = triton.cdiv(triton.cdiv(max(t, 1), spans), tiles.bwd_rows) * tiles.bwd_rows
    dx = None if not streams else torch.empty_like(x) if dx_into is None else dx_into
    parts = grad.new_empty(spans, n, k) if fn else None
    if (t and streams) or fn:
        _hc_mix_bwd[(triton.cdiv(k, tiles.bwd_cols), spans)](
            x, fn32, rstd, mix, grad, x if dx is None else dx, grad if parts is None else parts,
            t, k, n, span, BT=tiles.bwd_rows, BK=tiles.bwd_cols, BN=_width(n),
            PREC=tiles.precision, DX=streams, DFN=fn, ACC=streams and dx_into is not None,
            num_warps=tiles.bwd_warps)
    dfn = None if parts is None else parts[0] if spans == 1 else parts.sum(0)
    return dx, dfn


class _HcMixFused(torch.autograd.Function):
    """Saves the streams (their own dtype), fn, one fp32 rstd a token, as mhc._HcMix does, and
    the mix (n fp32 a token: the d streams kernel's row term)."""

    @staticmethod
    def forward(ctx, streams: torch.Tensor, fn: torch.Tensor, norm_eps: float, grad_sum):
        ctx.grad_sum = registered(grad_sum, ctx)
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
        so_far = None if ctx.grad_sum is None else ctx.grad_sum.so_far()
        d_streams, d_fn = mix_backward(x, fn32, rstd, mix, grad, ctx.tiles,
                                       *ctx.needs_input_grad[:2],
                                       dx_into=None if so_far is None else so_far.view_as(x))
        if d_streams is not None:
            d_streams = hand_on(ctx.grad_sum, d_streams.view(ctx.shape))
        return d_streams, None if d_fn is None else d_fn.to(ctx.fn_dtype), None, None


def hc_mix_fused(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float,
                 grad_sum: StreamGradSum | None = None) -> torch.Tensor:
    """mhc.hc_mix's contract: streams [T, hc, D] -> fn @ rms_norm(flattened streams), fp32
    [T, n_out]; differentiable in streams and fn; the streams' gradient summed in grad_sum
    when given."""
    if streams.dim() != 3 or fn.dim() != 2 or fn.shape[1] != streams.shape[1] * streams.shape[2]:
        raise ValueError(f"hc_mix_fused: streams {tuple(streams.shape)} and fn "
                         f"{tuple(fn.shape)}: fn must be [n_out, hc x D]")
    return _HcMixFused.apply(streams, fn, norm_eps, grad_sum)
