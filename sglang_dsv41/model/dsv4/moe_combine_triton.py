"""The routed experts' outputs back on their tokens (MoE.routed_grouped's last step) as one Triton
kernel forward and one backward:

  out[t] = sum_j weights[t, j] * y[inverse[t * k + j]]

y holds the expert rows in expert order (the grouped GEMM's output), ``inverse`` maps each
(token, slot) pair to its row; a row index past y's rows is another rank's expert (expert
parallelism) and adds nothing. The torch path gathers y into (token, slot) order, multiplies by
the weights and sums over the slots, and its backward runs those three again (five kernels and
~0.5 GB of traffic a layer at 4k tokens x top-6 x 1024 in bf16); here the forward reads y once
and writes the tokens, the backward writes each row's gradient ``weights[t, j] * dout[t]``
straight to its row (every row is one pair's: no accumulation, deterministic) and the weights'
gradients as per-column-block partial dot products, summed in torch in a fixed order.

Arithmetic in fp32 with one rounding to the output dtype, the weights unrounded (the torch path
rounds them and each product to the compute dtype; SGLang's fused MoE applies the fp32 routing
weights to the fp32 GEMM accumulator). The CPU keeps the torch path; tests/
test_dsv4_moe_combine_triton.py holds this kernel to float64 under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...attention.triton_common import dot_precision, row_block, to_dtype


@triton.jit
def _combine_fwd_kernel(y_ptr, w_ptr, inv_ptr, out_ptr, n_rows, hidden, stride_y, stride_out,
                        K: tl.constexpr, BLOCK: tl.constexpr, ROUND: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(K):
        row = tl.load(inv_ptr + t * K + j)
        w = tl.load(w_ptr + t * K + j).to(tl.float32)
        # no columns of a row past y's (another rank's expert); a comparison, not a scalar
        # and-ed into the mask (Triton 3.9's interpreter makes that int32, which load refuses)
        here = cols < tl.where(row < n_rows, hidden, 0)
        y = tl.load(y_ptr + row * stride_y + cols, mask=here, other=0.0)
        acc += w * y.to(tl.float32)
    tl.store(out_ptr + t * stride_out + cols, to_dtype(acc, out_ptr.dtype.element_ty, ROUND),
             mask=mask)


@triton.jit
def _combine_bwd_kernel(dout_ptr, y_ptr, w_ptr, inv_ptr, dy_ptr, dw_ptr, n_rows, hidden,
                        stride_dout, stride_y, stride_dy, n_col_blocks, K: tl.constexpr,
                        NEED_DW: tl.constexpr, BLOCK: tl.constexpr, ROUND: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    dout = tl.load(dout_ptr + t * stride_dout + cols, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(K):
        row = tl.load(inv_ptr + t * K + j)
        w = tl.load(w_ptr + t * K + j).to(tl.float32)
        here = cols < tl.where(row < n_rows, hidden, 0)
        tl.store(dy_ptr + row * stride_dy + cols, to_dtype(w * dout, dy_ptr.dtype.element_ty,
                                                            ROUND), mask=here)
        if NEED_DW:
            y = tl.load(y_ptr + row * stride_y + cols, mask=here, other=0.0).to(tl.float32)
            tl.store(dw_ptr + (t * K + j) * n_col_blocks + block, tl.sum(dout * y, 0))


class _CombineSlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, weights: torch.Tensor, inverse: torch.Tensor,
                n_tok: int, k: int) -> torch.Tensor:
        y, weights, inverse = y.contiguous(), weights.contiguous(), inverse.contiguous()
        hidden = y.shape[1]
        out = y.new_empty(n_tok, hidden)
        block = row_block(hidden)
        if n_tok:
            _combine_fwd_kernel[(n_tok, triton.cdiv(hidden, block))](
                y, weights, inverse, out, y.shape[0], hidden, y.stride(0), out.stride(0), K=k,
                BLOCK=block, ROUND=dot_precision(out.dtype), num_warps=4)
        ctx.save_for_backward(y, weights, inverse)
        ctx.n_tok, ctx.k = n_tok, k
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        y, weights, inverse = ctx.saved_tensors
        n_tok, k = ctx.n_tok, ctx.k
        dout = dout.contiguous()
        hidden = y.shape[1]
        block = row_block(hidden)
        n_blocks = triton.cdiv(hidden, block)
        need_dw = ctx.needs_input_grad[1]
        # every row is one (token, slot) pair's: each is written once, none is left
        dy = torch.empty_like(y)
        dw_parts = torch.empty(n_tok * k, n_blocks if need_dw else 0, device=y.device,
                               dtype=torch.float32)
        if n_tok:
            _combine_bwd_kernel[(n_tok, n_blocks)](
                dout, y, weights, inverse, dy, dw_parts, y.shape[0], hidden, dout.stride(0),
                y.stride(0), dy.stride(0), n_blocks, K=k, NEED_DW=need_dw, BLOCK=block,
                ROUND=dot_precision(dy.dtype), num_warps=4)
        dw = dw_parts.sum(1).view(n_tok, k).to(weights.dtype) if need_dw else None
        return dy, dw, None, None, None


def combine_slots_triton(y: torch.Tensor, weights: torch.Tensor, inverse: torch.Tensor
                         ) -> torch.Tensor:
    """y [rows, H] expert rows, weights [T, k], inverse int64 [T*k] (each pair's row; rows
    past y's: none) -> [T, H] in y's dtype; differentiable in y and weights."""
    n_tok, k = weights.shape
    if inverse.shape != (n_tok * k,) or y.dim() != 2:
        raise ValueError(f"combine_slots_triton: inverse {tuple(inverse.shape)} for weights "
                         f"{tuple(weights.shape)}, y {tuple(y.shape)}")
    return _CombineSlots.apply(y, weights, inverse.to(torch.int64), n_tok, k)
