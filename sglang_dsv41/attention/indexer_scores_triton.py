"""Triton kernel of the CSA indexer scores (contract: indexer_scores.indexer_scores_reference).

One program per (block of tokens, block of entries): the entries' keys stay loaded, the loop
walks the heads, each head one [tokens x D] @ [D x entries] MMA (bf16 products are exact in the
fp32 accumulator), and relu(s) * c * w[t, h] is summed into the fp32 tile in head order. With
``visible`` (the entries each token may see: a causal selection's) an entry past a token's count
scores -inf, and a tile no token of the block may see stores -inf without a product (about half
the tiles of a sequence's causal scores).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import dot_precision, interpreting, mma


@triton.jit
def _indexer_scores_kernel(q_ptr, k_ptr, w_ptr, vis_ptr, out_ptr, T, N, H, D, scale,
                           stride_qt, stride_qh, stride_k, stride_wt, stride_ot,
                           HAS_VIS: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
                           BD: tl.constexpr, DOT_PREC: tl.constexpr):
    offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
    n0 = tl.program_id(1) * BN
    offs_n = n0 + tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    tmask, nmask, dmask = offs_t < T, offs_n < N, offs_d < D
    acc = tl.zeros([BT, BN], tl.float32)
    if HAS_VIS:
        vis = tl.load(vis_ptr + offs_t, mask=tmask, other=0)
        seen = n0 < tl.max(vis, 0)
    else:
        seen = True
    if seen:
        keys = tl.load(k_ptr + offs_n[:, None].to(tl.int64) * stride_k + offs_d[None, :],
                       mask=nmask[:, None] & dmask[None, :], other=0.0)
        q_rows = q_ptr + offs_t[:, None].to(tl.int64) * stride_qt + offs_d[None, :]
        qmask = tmask[:, None] & dmask[None, :]
        for h in range(H):
            q = tl.load(q_rows + h * stride_qh, mask=qmask, other=0.0)
            w = tl.load(w_ptr + offs_t * stride_wt + h, mask=tmask, other=0.0)
            s = mma(q, tl.trans(keys), DOT_PREC)
            acc += tl.maximum(s, 0.0) * scale * w[:, None]
    if HAS_VIS:
        acc = tl.where(offs_n[None, :] < vis[:, None], acc, float("-inf"))
    tl.store(out_ptr + offs_t[:, None].to(tl.int64) * stride_ot + offs_n[None, :], acc,
             mask=tmask[:, None] & nmask[None, :])


def indexer_scores_triton(q, keys, weights, scale, visible=None, block_t: int = 64,
                          block_n: int = 64):
    """q [T, Hi, Di], keys [N, Di], weights [T, Hi], visible None or [T] integers -> [T, N]
    fp32 (-inf at entries >= visible[t])."""
    if keys.dtype != q.dtype:
        q, keys = q.float(), keys.float()
    q, keys = q.contiguous(), keys.contiguous()
    weights = weights.float().contiguous()
    total, heads, dim = q.shape
    out = torch.empty(total, keys.shape[0], device=q.device, dtype=torch.float32)
    if out.numel() == 0:
        return out
    if interpreting():
        block_t = block_n = 16
    grid = (triton.cdiv(total, block_t), triton.cdiv(keys.shape[0], block_n))
    vis = None if visible is None else visible.to(device=q.device, dtype=torch.int32)
    _indexer_scores_kernel[grid](
        q, keys, weights, out if vis is None else vis, out, total, keys.shape[0], heads, dim,
        scale, q.stride(0), q.stride(1), keys.stride(0), weights.stride(0), out.stride(0),
        HAS_VIS=vis is not None, BT=block_t, BN=block_n,
        BD=max(16, triton.next_power_of_2(dim)), DOT_PREC=dot_precision(q.dtype),
        num_warps=4, num_stages=2)
    return out
