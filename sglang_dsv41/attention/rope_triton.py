"""Triton kernel of the DSV4 RoPE copy (contract: model/dsv4/rope.py's torch path).

One pass over x [T, H, D]: the leading D - 2*P channels are copied, the trailing 2*P
(interleaved pairs) rotated in fp32 by per-token cos/sin [T, P]; or, in place, the trailing 2*P
rotated where they are and nothing else touched. The torch path takes ~12
kernels (a clone, fp32 copies of the tail, four products, a stack, a cast and a strided write)
for what is one read and one write of x: on an H200 at 4k tokens, 64 heads, D 512, RoPE of q,
of the output and their backwards took ~2.3 ms of a 9.8 ms sliding attention module.
x may be strided over T and H (the grouped output projection's gradient is); the output is
contiguous. Bit for bit the torch path: the same fp32 products and sums, rounded once each
(no FMA contraction: enable_fp_fusion=False), and round-to-nearest-even to the output dtype.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .triton_common import dot_precision, to_dtype


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, D, KEEP, P, stride_xt, stride_xh,
                 stride_ot, stride_oh, sign, COPY_KEEP: tl.constexpr, BH: tl.constexpr,
                 BD: tl.constexpr, BP: tl.constexpr, DOT_PREC: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = heads < H
    src = x_ptr + t * stride_xt + heads[:, None].to(tl.int64) * stride_xh
    dst = out_ptr + t * stride_ot + heads[:, None].to(tl.int64) * stride_oh
    if COPY_KEEP:  # out of place; in place (out is x) the leading channels stay where they are
        cols = tl.arange(0, BD)
        keep = hmask[:, None] & (cols[None, :] < KEEP)
        tl.store(dst + cols[None, :], tl.load(src + cols[None, :], mask=keep), mask=keep)
    pair = tl.arange(0, BP)
    pmask = pair < P
    cos = tl.load(cos_ptr + t * P + pair, mask=pmask, other=0.0)[None, :]
    sin = (tl.load(sin_ptr + t * P + pair, mask=pmask, other=0.0) * sign)[None, :]
    tail = KEEP + 2 * pair[None, :]
    rot = hmask[:, None] & pmask[None, :]
    even = tl.load(src + tail, mask=rot, other=0.0).to(tl.float32)
    odd = tl.load(src + tail + 1, mask=rot, other=0.0).to(tl.float32)
    out_dtype = out_ptr.dtype.element_ty
    tl.store(dst + tail, to_dtype(even * cos - odd * sin, out_dtype, DOT_PREC), mask=rot)
    tl.store(dst + tail + 1, to_dtype(even * sin + odd * cos, out_dtype, DOT_PREC), mask=rot)


@functools.lru_cache(maxsize=None)
def _launch_shape(h: int, d: int, p: int, dtype: torch.dtype) -> tuple[int, int, int, str]:
    """(BH, BD, BP, DOT_PREC) for h heads of width d with p rotated pairs: computed once per
    shape. The wrapper runs ~140 times a training step, and on a GPU host's slow cores its
    Python was most of a call's host time: 75 us a call against 17 us for the bare Triton
    launch before, 24 against 16 us since (two H200 leases; bench/launch_overhead.py)."""
    bd = triton.next_power_of_2(d)
    bh = max(1, min(triton.next_power_of_2(h), 4096 // bd))
    return bh, bd, triton.next_power_of_2(p), dot_precision(dtype)


def rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                negate_sin: bool = False, in_place: bool = False) -> torch.Tensor:
    """A contiguous copy of x [T, ..., D] whose trailing 2*P channels are rotated by the fp32
    angles of cos/sin (any shape of T * P elements; by -angle when negate_sin). in_place: x
    itself rotated and returned (its last dimension must be contiguous): only the 2*P channels
    are read and written (q of 4k tokens, 16 heads, D 512: 8 of 64 MB each way)."""
    t, d = x.shape[0], x.shape[-1]
    p = cos.shape[-1]
    if x.dim() == 2:
        x3 = x[:, None]
    elif x.dim() == 3:
        x3 = x
    else:
        x3 = x.reshape(t, -1, d)
        if in_place and x3.data_ptr() != x.data_ptr():
            raise ValueError("rope_triton in place: x must fold to [T, H, D] as a view")
    if x3.stride(-1) != 1:
        if in_place:
            raise ValueError("rope_triton in place: x's last dimension must be contiguous")
        x3 = x3.contiguous()
    h = x3.shape[1]
    out = x if in_place else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    # The kernel reads element t * P + i of each: any contiguous fp32 layout of [T, P] will do.
    if cos.dtype != torch.float32 or not cos.is_contiguous():
        cos = cos.float().contiguous()
    if sin.dtype != torch.float32 or not sin.is_contiguous():
        sin = sin.float().contiguous()
    bh, bd, bp, prec = _launch_shape(h, d, p, x.dtype)
    out_t, out_h = (x3.stride(0), x3.stride(1)) if in_place else (h * d, d)
    _rope_kernel[(t, (h + bh - 1) // bh)](
        x3, cos, sin, x3 if in_place else out, h, d, d - 2 * p, p, x3.stride(0), x3.stride(1),
        out_t, out_h, -1.0 if negate_sin else 1.0, COPY_KEEP=not in_place, BH=bh, BD=bd,
        BP=bp, DOT_PREC=prec, num_warps=4, enable_fp_fusion=False)
    return out
