"""Torch reference for the DeepSeek V4 / V4.1 sparse sink attention core.

One layer's attention, as the real model computes it after projections and RoPE:

  queries    q [T, H, D]     packed variable-length sequences (cu_seqlens [B+1], int32)
  latent     kv [T, D]       one K=V head (MQA): the same tensor is key and value
  sinks      [H] fp32        gpt-oss style: an extra logit per head with no value
  window     int             query t sees the latents of positions (t - window, t] of its sequence
  compressed comp_kv [C, D]  compressed entries of every sequence, packed
  selection  comp_idx [T, K] int32 rows of comp_kv that query t also sees; -1 = none.
             CSA: the indexer's top-k; HCA: every block complete before the query; V4.1
             ratio 1/2: the shared indexer's picks. Repeats are the caller's job (the model
             never produces them).

  P = softmax over [window scores | selected compressed scores | sink]; the sink column is
  dropped; o = P @ values. Scores, softmax and the weighted sum run in fp32.

Memory is O(T x (window + K) x H): never a [H, T, T] score tensor.
"""

from __future__ import annotations

import torch


def sequence_first_rows(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[T] int32: the packed row where each token's sequence starts."""
    cu = cu_seqlens.to(torch.long)
    t = torch.arange(total, device=cu.device)
    return cu[torch.searchsorted(cu[1:], t, right=True)].to(torch.int32)


def window_indices(cu_seqlens: torch.Tensor, window: int, total: int) -> torch.Tensor:
    """[T, window] packed row of each query's window keys, oldest first; -1 before the start."""
    device = cu_seqlens.device
    t = torch.arange(total, device=device)
    start = sequence_first_rows(cu_seqlens, total)
    idx = t[:, None] - torch.arange(window - 1, -1, -1, device=device)[None, :]
    return torch.where(idx >= start[:, None], idx, torch.full_like(idx, -1))


def dsv4_attention_reference(q: torch.Tensor, kv: torch.Tensor, sinks: torch.Tensor | None,
                             cu_seqlens: torch.Tensor, window: int, scale: float,
                             comp_kv: torch.Tensor | None = None,
                             comp_idx: torch.Tensor | None = None) -> torch.Tensor:
    """-> [T, H, D] in q's dtype. Differentiable in q, kv, sinks and comp_kv."""
    if q.dim() != 3 or kv.dim() != 2 or kv.shape != (q.shape[0], q.shape[2]):
        raise ValueError(f"q must be [T, H, D] and kv [T, D]; got {tuple(q.shape)}, "
                         f"{tuple(kv.shape)}")
    total, heads, dim = q.shape
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    widx = window_indices(cu_seqlens, window, total)
    keys = kv.to(compute)[widx.clamp_min(0)]                                   # [T, W, D]
    valid = widx >= 0
    if comp_idx is not None and comp_idx.shape[1] > 0:
        if comp_kv is None:
            raise ValueError("comp_idx given without comp_kv")
        cidx = comp_idx.long()
        if comp_kv.shape[0] == 0:
            cidx = torch.full_like(cidx, -1)
            comp_kv = kv.new_zeros(1, dim)
        keys = torch.cat([keys, comp_kv.to(compute)[cidx.clamp_min(0)]], dim=1)
        valid = torch.cat([valid, cidx >= 0], dim=1)
    s = torch.einsum("thd,tnd->thn", q.to(compute), keys) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    sink = (sinks.to(compute)[None, :, None].expand(total, heads, 1) if sinks is not None
            else s.new_full((total, heads, 1), float("-inf")))
    s = torch.cat([s, sink], dim=-1)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    p = p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(compute).tiny)
    return torch.einsum("thn,tnd->thd", p[..., :-1], keys).to(q.dtype)
