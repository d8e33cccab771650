"""Scores of the V4 CSA lightning indexer: score[t, n] = sum_h w[t, h] * relu(q[t, h] . k[n]) * c.

The torch reference materialises the fp32 [T, heads, entries] products (1 GiB at 4k tokens and
64 heads) and makes four more passes over them; the Triton kernel (indexer_scores_triton.py)
keeps one [tokens x entries] tile in registers and loops over the heads, so only the [T, entries]
result reaches memory. Dispatch as for the attention (dsv4.py): the kernel on CUDA, the reference
on CPU. The two agree up to fp32 rounding (the kernel sums the heads in order; exact ties such
as all-zero rows stay exact, and bf16 q.k products are exact in both).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dsv4 import resolve_backend


def indexer_scores_reference(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor,
                             scale: float, visible: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hi, Di], keys [N, Di], weights [T, Hi] fp32 -> [T, N] fp32; with ``visible`` ([T]
    integers: the entries each token may see) -inf at entries >= visible[t]."""
    scores = torch.einsum("thd,nd->thn", q.float(), keys.float())
    scores = (F.relu(scores) * scale * weights[:, :, None]).sum(dim=1)
    return scores if visible is None else mask_unseen(scores, visible)


def mask_unseen(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """scores [T, N] with -inf at entries >= visible[t]."""
    cols = torch.arange(scores.shape[1], device=scores.device)
    return scores.masked_fill(cols[None, :] >= visible.to(scores.device)[:, None], -torch.inf)


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, scale: float,
                   backend: str | None = None, visible: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """indexer_scores_reference's contract on the chosen backend (dsv4.py's rule)."""
    if q.dim() != 3 or keys.dim() != 2 or keys.shape[1] != q.shape[2] or \
            weights.shape != q.shape[:2]:
        raise ValueError(f"q must be [T, H, D], keys [N, D] and weights [T, H]; got "
                         f"{tuple(q.shape)}, {tuple(keys.shape)}, {tuple(weights.shape)}")
    if visible is not None and visible.shape != q.shape[:1]:
        raise ValueError(f"visible must be [T] = [{q.shape[0]}]; got {tuple(visible.shape)}")
    if resolve_backend(q.device, backend) == "reference" or q.dtype == torch.float64:
        return indexer_scores_reference(q, keys, weights, scale, visible)
    from .indexer_scores_triton import indexer_scores_triton

    return indexer_scores_triton(q, keys, weights, scale, visible)
