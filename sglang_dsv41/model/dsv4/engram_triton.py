"""engram.engram_gate as one Triton kernel each way (CUDA; the CPU keeps the torch expression).

Per token and hc copy k: a = rsqrt(mean_d h^2 + eps), b = rsqrt(mean_d key^2 + eps),
S = sum_d h * w * key (w = q_weight * k_weight), dot = S * a * b / sqrt(D),
g = sigmoid(copysign(sqrt(max(|dot|, clamp)), dot)), out = h + g * value, all in fp32 and
rounded once to the streams' dtype. As torch ops that is some twenty passes over fp32
[T, hc, D] copies forward and backward (~2 ms of a 4k step of the small preset's two Engram
layers on an H200, bench/results/train_ops_h200.txt); here each direction reads its inputs
twice (a pass for the per-copy sums, a pass for the outputs) and writes its outputs once: the
4k step 80.4 -> 78.0 ms (bench/results/train_h200.txt, run AF).

A program takes BT tokens and walks D in BD-column steps. The backward's gradient of w is
reduced over the program's tokens and written per program; torch sums those partials (fixed
order, no atomics). Gradients follow torch's rules at the edges: clamp_min passes where
|dot| >= clamp, abs has gradient sign(dot) (0 at 0), copysign's magnitude gradient is the sign
of dot (of its sign bit at 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_dsv41.attention.triton_common import dot_precision, interpreting, to_dtype

BLOCK_TOKENS = 8
BLOCK_D = 128


@triton.jit
def _sums(s_ptr, kv_ptr, w_ptr, t, valid, h, hmask, D, HC: tl.constexpr, BHC: tl.constexpr,
          BT: tl.constexpr, BD: tl.constexpr):
    """-> sum_d h^2, sum_d key^2, sum_d h * w * key: [BT, BHC] each, fp32."""
    sh = tl.zeros([BT, BHC], tl.float32)
    sk = tl.zeros([BT, BHC], tl.float32)
    dot = tl.zeros([BT, BHC], tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        m = valid[:, None, None] & hmask[None, :, None] & (d < D)[None, None, :]
        x = tl.load(s_ptr + t[:, None, None] * (HC * D) + h[None, :, None] * D + d[None, None, :],
                    mask=m, other=0.0).to(tl.float32)
        key = tl.load(kv_ptr + t[:, None, None] * ((HC + 1) * D) + h[None, :, None] * D
                      + d[None, None, :], mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + h[:, None] * D + d[None, :], mask=hmask[:, None] & (d < D)[None, :],
                    other=0.0)
        sh += tl.sum(x * x, 2)
        sk += tl.sum(key * key, 2)
        dot += tl.sum(x * w[None, :, :] * key, 2)
    return sh, sk, dot


@triton.jit
def _gate(sh, sk, s, D, eps, clamp, scale):
    """-> a, b, dot, root, negative (dot's sign bit, which copysign reads), g: [BT, BHC]."""
    a = tl.math.rsqrt(sh / D + eps)
    b = tl.math.rsqrt(sk / D + eps)
    dot = s * (a * b) * scale
    root = tl.sqrt(tl.maximum(tl.abs(dot), clamp))
    negative = (dot.to(tl.int32, bitcast=True) >> 31) != 0
    g = tl.sigmoid(tl.where(negative, -root, root))
    return a, b, dot, root, negative, g


@triton.jit
def _value(kv_ptr, t, valid, d, D, HC: tl.constexpr):
    """-> the shared value's columns d of tokens t, fp32 [BT, BD]."""
    return tl.load(kv_ptr + t[:, None] * ((HC + 1) * D) + HC * D + d[None, :],
                   mask=valid[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _engram_gate_fwd(s_ptr, kv_ptr, w_ptr, out_ptr, T, D, eps, clamp, scale,
                     HC: tl.constexpr, BHC: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                     ROUND: tl.constexpr):
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    valid = t < T
    h = tl.arange(0, BHC)
    hmask = h < HC
    sh, sk, s = _sums(s_ptr, kv_ptr, w_ptr, t, valid, h, hmask, D, HC, BHC, BT, BD)
    g = _gate(sh, sk, s, D, eps, clamp, scale)[5]
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        m = valid[:, None, None] & hmask[None, :, None] & (d < D)[None, None, :]
        at = t[:, None, None] * (HC * D) + h[None, :, None] * D + d[None, None, :]
        x = tl.load(s_ptr + at, mask=m, other=0.0).to(tl.float32)
        out = x + g[:, :, None] * _value(kv_ptr, t, valid, d, D, HC)[:, None, :]
        tl.store(out_ptr + at, to_dtype(out, out_ptr.dtype.element_ty, ROUND), mask=m)


@triton.jit
def _engram_gate_bwd(g_ptr, s_ptr, kv_ptr, w_ptr, d_s_ptr, d_kv_ptr, d_w_ptr, T, D, eps, clamp,
                     scale, HC: tl.constexpr, BHC: tl.constexpr, BT: tl.constexpr,
                     BD: tl.constexpr, ROUND: tl.constexpr):
    pid = tl.program_id(0)
    t = (pid * BT + tl.arange(0, BT)).to(tl.int64)
    valid = t < T
    h = tl.arange(0, BHC)
    hmask = h < HC
    sh, sk, s = _sums(s_ptr, kv_ptr, w_ptr, t, valid, h, hmask, D, HC, BHC, BT, BD)
    # dL/dg = sum_d dout * value: one more pass before the per-copy chain rule.
    dg = tl.zeros([BT, BHC], tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        m = valid[:, None, None] & hmask[None, :, None] & (d < D)[None, None, :]
        go = tl.load(g_ptr + t[:, None, None] * (HC * D) + h[None, :, None] * D
                     + d[None, None, :], mask=m, other=0.0).to(tl.float32)
        dg += tl.sum(go * _value(kv_ptr, t, valid, d, D, HC)[:, None, :], 2)
    a, b, dot, root, negative, g = _gate(sh, sk, s, D, eps, clamp, scale)
    d_root = dg * g * (1.0 - g) * tl.where(negative, -1.0, 1.0)
    d_mag = tl.where(tl.abs(dot) >= clamp, d_root * 0.5 / root, 0.0)
    d_dot = d_mag * tl.where(dot > 0, 1.0, tl.where(dot < 0, -1.0, 0.0))
    d_s = d_dot * a * b * scale
    da = -d_dot * s * b * scale * a * a * a / D   # times h: through mean(h^2)
    db = -d_dot * s * a * scale * b * b * b / D   # times key
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        dmask = d < D
        m = valid[:, None, None] & hmask[None, :, None] & dmask[None, None, :]
        at = t[:, None, None] * (HC * D) + h[None, :, None] * D + d[None, None, :]
        kv_at = t[:, None, None] * ((HC + 1) * D) + h[None, :, None] * D + d[None, None, :]
        go = tl.load(g_ptr + at, mask=m, other=0.0).to(tl.float32)
        x = tl.load(s_ptr + at, mask=m, other=0.0).to(tl.float32)
        key = tl.load(kv_ptr + kv_at, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + h[:, None] * D + d[None, :], mask=hmask[:, None] & dmask[None, :],
                    other=0.0)[None, :, :]
        dx = go + d_s[:, :, None] * w * key + da[:, :, None] * x
        dkey = d_s[:, :, None] * w * x + db[:, :, None] * key
        tl.store(d_s_ptr + at, to_dtype(dx, d_s_ptr.dtype.element_ty, ROUND), mask=m)
        tl.store(d_kv_ptr + kv_at, to_dtype(dkey, d_kv_ptr.dtype.element_ty, ROUND), mask=m)
        dvalue = tl.sum(go * g[:, :, None], 1)
        tl.store(d_kv_ptr + t[:, None] * ((HC + 1) * D) + HC * D + d[None, :],
                 to_dtype(dvalue, d_kv_ptr.dtype.element_ty, ROUND),
                 mask=valid[:, None] & dmask[None, :])
        dw = tl.sum(d_s[:, :, None] * x * key, 0)
        tl.store(d_w_ptr + pid * (HC * D) + h[:, None] * D + d[None, :], dw,
                 mask=hmask[:, None] & dmask[None, :])


def _launch(t: int, d: int, hc: int, dtype: torch.dtype) -> dict:
    # The interpreter's tiles are small so that the tests' few tokens and narrow D still take
    # several token blocks and several column steps.
    bt, bd = (4, 32) if interpreting() else (BLOCK_TOKENS, min(BLOCK_D, triton.next_power_of_2(d)))
    return dict(grid=(triton.cdiv(t, bt),), BHC=triton.next_power_of_2(hc), BT=bt, BD=bd,
                ROUND=dot_precision(dtype))


class _EngramGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, streams, kv, q_weight, k_weight, eps: float, clamp: float):
        t, hc, d = streams.shape
        streams, kv = streams.contiguous(), kv.contiguous()
        w = (q_weight.float() * k_weight.float()).contiguous()
        out = torch.empty_like(streams)
        if t:
            launch = _launch(t, d, hc, streams.dtype)
            _engram_gate_fwd[launch.pop("grid")](streams, kv, w, out, t, d, eps, clamp,
                                                 d ** -0.5, HC=hc, **launch)
        ctx.save_for_backward(streams, kv, q_weight, k_weight, w)
        ctx.eps, ctx.clamp = eps, clamp
        return out

    @staticmethod
    def backward(ctx, grad):
        streams, kv, q_weight, k_weight, w = ctx.saved_tensors
        t, hc, d = streams.shape
        d_streams, d_kv = torch.empty_like(streams), torch.empty_like(kv)
        launch = _launch(t, d, hc, streams.dtype)
        grid = launch.pop("grid")
        d_w = torch.zeros(grid[0], hc, d, device=w.device, dtype=torch.float32)
        if t:
            _engram_gate_bwd[grid](grad.contiguous(), streams, kv, w, d_streams, d_kv, d_w, t, d,
                                   ctx.eps, ctx.clamp, d ** -0.5, HC=hc, **launch)
        d_w = d_w.sum(0)
        d_q = (d_w * k_weight.float()).to(q_weight.dtype) if ctx.needs_input_grad[2] else None
        d_k = (d_w * q_weight.float()).to(k_weight.dtype) if ctx.needs_input_grad[3] else None
        return d_streams, d_kv, d_q, d_k, None, None


def engram_gate_fused(streams: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor,
                      k_weight: torch.Tensor, eps: float, clamp: float) -> torch.Tensor:
    """engram.engram_gate in two kernels (module docstring); streams [T, hc, D], kv
    [T, (hc+1)*D] in one dtype, q_weight and k_weight [hc, D]."""
    if kv.dtype != streams.dtype or kv.shape != (streams.shape[0],
                                                  (streams.shape[1] + 1) * streams.shape[2]):
        raise ValueError(f"engram_gate_fused: kv {tuple(kv.shape)} {kv.dtype} does not match "
                         f"streams {tuple(streams.shape)} {streams.dtype}")
    return _EngramGate.apply(streams, kv, q_weight, k_weight, eps, clamp)
