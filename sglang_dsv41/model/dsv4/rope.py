"""DeepSeek V4 RoPE: interleaved pairs on the trailing rope slice of each head, from positions.

Frequencies follow SGLang's ``precompute_freqs_cis`` (kernels/ops/attention/dsv4/rope.py): plain
RoPE with ``rope_theta`` on sliding-only layers; on layers with a compressor, ``compress_rope_theta``
with YaRN's frequency blend and no attention scaling (transformers forces attention_factor 1.0 for
the same reason). Computed from position ids, so no table bounds the sequence length.
"""

from __future__ import annotations

import math

import torch

from .config import DSV4Config


def inv_freq(dim: int, base: float, original_seq_len: int = 0, factor: float = 1.0,
             beta_fast: float = 32, beta_slow: float = 1) -> torch.Tensor:
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if original_seq_len > 0:
        def correction_dim(rotations: float) -> float:
            return dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


def layer_inv_freq(cfg: DSV4Config, compressed: bool) -> torch.Tensor:
    """Frequencies of a layer: compressed layers (ratio > 0) use the YaRN "compress" RoPE."""
    if not compressed:
        return inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta)
    s = cfg.rope_scaling or {}
    return inv_freq(cfg.qk_rope_head_dim, cfg.compress_rope_theta,
                    int(s.get("original_max_position_embeddings", 0)), float(s.get("factor", 1.0)),
                    float(s.get("beta_fast", 32)), float(s.get("beta_slow", 1)))


def _rotate_pairs(tail: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs (2i, 2i+1) of tail rotated by the angles of cos/sin, in fp32."""
    pairs = tail.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class _Rope(torch.autograd.Function):
    """RoPE on the trailing slice with a hand-written backward: autograd's own backward of the
    slice + cat materialises two zero-filled full-size gradients and adds them (5 passes over
    a [T, H, D] tensor); this one is a copy and a rotated tail, both ways. A clone plus a tail
    write rather than torch.cat: cat of the strided head and tail slices ran at a quarter of
    copy bandwidth (0.56 ms for q of 4k tokens, 64 heads, D 512 on an H200).
    Bitwise the same gradient: the transpose of a rotation is the rotation by -angle, and each
    gradient element is the same two fp32 products summed (IEEE addition commutes).
    overwrite_grad: the backward rotates the incoming gradient where it is (a caller whose
    result's gradient nothing else reads): only its tail moves, 1/8 of the bytes at D 512.
    The forward always copies: its input may be a matmul output that selective activation
    checkpointing keeps (and refuses to see changed)."""

    @staticmethod
    def forward(ctx, x, cos, sin, inverse: bool, overwrite_grad: bool):
        ctx.save_for_backward(cos, sin)
        ctx.inverse, ctx.overwrite_grad = inverse, overwrite_grad
        return _with_rotated_tail(x, cos, sin, negate_sin=inverse)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        in_place = ctx.overwrite_grad and grad.stride(-1) == 1
        return (_with_rotated_tail(grad, cos, sin, negate_sin=not ctx.inverse, in_place=in_place),
                None, None, None, None)


def _with_rotated_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       negate_sin: bool = False, in_place: bool = False) -> torch.Tensor:
    """A copy of x (or x itself, in_place) whose trailing 2*cos.shape[-1] channels are rotated
    (by -angle when negate_sin). On CUDA one Triton pass (attention/rope_triton.py, the same
    bits)."""
    if x.is_cuda:
        from ...attention.rope_triton import rope_triton

        return rope_triton(x, cos, sin, negate_sin, in_place=in_place)
    sin = -sin if negate_sin else sin
    rope_dim = 2 * cos.shape[-1]
    out = x if in_place else x.clone()
    out[..., -rope_dim:] = _rotate_pairs(x[..., -rope_dim:], cos, sin).to(x.dtype)
    return out


def rope_table(positions: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, len(freqs)] (fp32) of the angles positions x freqs. A layer computes it
    once a forward for all three of its rotations (q, kv, the output's de-rotation), where each
    computed its own (five kernels a table)."""
    angles = positions.to(torch.float32)[:, None] * freqs.to(positions.device)[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor,
               inverse: bool = False,
               table: tuple[torch.Tensor, torch.Tensor] | None = None,
               overwrite_grad: bool = False) -> torch.Tensor:
    """Rotate the last 2*len(freqs) channels of x [T, ..., D] by positions [T] (interleaved
    pairs (2i, 2i+1)); inverse rotates by -position (the output de-rotation). ``table``:
    rope_table(positions, freqs), when the caller already has it. overwrite_grad: the
    backward rotates the incoming gradient in place (for a result whose gradient nothing else
    reads)."""
    cos, sin = rope_table(positions, freqs) if table is None else table
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    return _Rope.apply(x, cos.view(shape), sin.view(shape), inverse, overwrite_grad)
