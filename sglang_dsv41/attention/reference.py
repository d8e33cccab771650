"""Torch reference for sink attention (device-agnostic, float64-capable, differentiable).

P_ij = exp(s_ij) / (sum_k exp(s_ik) + exp(b_h)); o_i = sum_j P_ij v_j. Sliding window of size W:
query at absolute position p sees keys at positions (p - W, p]. Queries are aligned to the end of
their keys (q length <= k length: the first k - q keys are a cached prefix).
"""

from __future__ import annotations

import torch


def _one_sequence(q, k, v, sinks, causal, window, scale):
    lq, lk = q.shape[0], k.shape[0]
    hq, hkv = q.shape[1], k.shape[1]
    rep = hq // hkv
    kf = k.repeat_interleave(rep, dim=1)
    vf = v.repeat_interleave(rep, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kf) * scale
    qpos = torch.arange(lk - lq, lk, device=q.device)[:, None]
    kpos = torch.arange(lk, device=q.device)[None, :]
    mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
    if causal:
        mask &= kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink_col = sinks.to(s.dtype)[:, None, None].expand(hq, lq, 1)
    else:
        sink_col = torch.full((hq, lq, 1), float("-inf"), dtype=s.dtype, device=s.device)
    s = torch.cat([s, sink_col], dim=-1)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    p = torch.where(denom > 0, p / denom.clamp_min(torch.finfo(p.dtype).tiny), torch.zeros_like(p))
    return torch.einsum("hqk,khd->qhd", p[..., :-1], vf)


def sink_attention_reference(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, causal=True, window=None,
                             softmax_scale=None):
    """q [total_q, Hq, D], k/v [total_k, Hkv, D], sinks [Hq] or None -> out [total_q, Hq, D]."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    outs = []
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        outs.append(_one_sequence(q[qs], k[ks], v[ks], sinks, causal, window, scale))
    if not outs:
        return q.new_zeros(q.shape)
    return torch.cat(outs, 0).to(q.dtype)


def sink_decode_reference(q, k_cache, v_cache, page_table, seq_lens, sinks, window=None,
                          softmax_scale=None):
    """One query per sequence over a paged cache.

    q [B, Hq, D]; k_cache/v_cache [num_pages, page_size, Hkv, D]; page_table int [B, max_pages];
    seq_lens int [B] (keys in the cache, the query's own key included) -> [B, Hq, D].
    """
    page_size = k_cache.shape[1]
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    outs = []
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        pages = page_table[b, : (n + page_size - 1) // page_size].long()
        k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:n]
        v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:n]
        outs.append(_one_sequence(q[b:b + 1], k, v, sinks, True, window, scale))
    return torch.cat(outs, 0).to(q.dtype) if outs else q.new_zeros(q.shape)
