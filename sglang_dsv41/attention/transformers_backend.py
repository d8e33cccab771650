"""The DSV4 sparse sink attention as a transformers attention implementation for DeepseekV4.

transformers' DeepseekV4Attention calls the attention interface with q [B, H, S, D],
key = value = [B, 1, S + C, D] (the S window latents followed by C compressed entries) and an
additive mask [B, 1, S, S + C]: the sliding causal band over the first S columns, then the
compressor's per-query validity (HCA: blocks complete before the query; CSA: the indexer's
picks). The wrapper maps that onto dsv4_attention's packed form: one sequence per batch row,
the band checked column for column against `sliding_window`, each query's allowed compressed
columns turned into an index list (-1 padded). A mask that is not of that form (a KV cache
during generation, padding, non-zero biases) goes to transformers' eager function unchanged,
so results never depend on the path taken.
"""

from __future__ import annotations

import logging

import torch

from .dsv4 import dsv4_attention

IMPLEMENTATION_NAME = "sglang_dsv41_dsv4"
log = logging.getLogger(__name__)


def _is_band(allowed: torch.Tensor, window: int, rows: int = 2048) -> bool:
    """allowed [B, S, S] is exactly the sliding causal band; checked in row chunks so a 64k mask
    needs no [S, S] int64 temporary."""
    seq = allowed.shape[-1]
    cols = torch.arange(seq, device=allowed.device)
    for r0 in range(0, seq, rows):
        i = cols[r0:r0 + rows, None]
        band = (cols[None, :] <= i) & (cols[None, :] > i - window)
        if not bool((allowed[:, r0:r0 + rows] == band).all()):
            return False
    return True


def selection_from_mask(allowed: torch.Tensor) -> torch.Tensor:
    """allowed [B, S, C] bool -> [B, S, K] int32 column lists, ascending, -1 padded (K = most
    columns any query sees)."""
    cols = allowed.shape[-1]
    if allowed.numel() == 0:
        return torch.full(allowed.shape[:-1] + (0,), -1, dtype=torch.int32, device=allowed.device)
    k = int(allowed.sum(-1).max())
    order = torch.arange(cols, device=allowed.device, dtype=torch.int32)
    keyed = torch.where(allowed, order, torch.full_like(order, cols))
    picked = keyed.topk(k, dim=-1, largest=False, sorted=True).values if k else keyed[..., :0]
    return torch.where(picked < cols, picked, torch.full_like(picked, -1))


def _split_mask(attention_mask, seq, keys, window):
    """-> [B, S, C] allowed compressed columns, or None when the mask is not band + selection."""
    if attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[1] != 1 \
            or attention_mask.shape[-2:] != (seq, keys) or keys < seq or window is None:
        return None
    mask = attention_mask[:, 0]
    allowed = mask > torch.finfo(mask.dtype).min / 2
    if bool((mask[allowed] != 0).any()):
        return None
    if not _is_band(allowed[:, :, :seq], window):
        return None
    return allowed[:, :, seq:]


def dsv4_transformers_attention(module, query, key, value, attention_mask, scaling=None,
                                dropout=0.0, sliding_window=None, s_aux=None, **kwargs):
    """transformers attention function: -> (out [B, S, H, D], None)."""
    batch, heads, seq, dim = query.shape
    keys = key.shape[2]
    comp_allowed = None
    if key.shape[1] == 1 and value is key and dropout == 0.0:
        comp_allowed = _split_mask(attention_mask, seq, keys, sliding_window)
    if comp_allowed is None:
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import eager_attention_forward

        log.debug("DSV4 attention: mask is not window band + selection; using eager")
        return eager_attention_forward(module, query, key, value, attention_mask,
                                       scaling=scaling, dropout=dropout, **kwargs)
    sinks = s_aux if s_aux is not None else getattr(module, "sinks", None)
    scale = scaling if scaling is not None else dim ** -0.5
    comp = keys - seq
    q = query.transpose(1, 2).reshape(batch * seq, heads, dim)
    kv = key[:, 0, :seq].reshape(batch * seq, dim)
    cu = torch.arange(batch + 1, device=query.device, dtype=torch.int32) * seq
    comp_kv = comp_idx = None
    if comp:
        comp_kv = key[:, 0, seq:].reshape(batch * comp, dim)
        sel = selection_from_mask(comp_allowed)
        offset = (torch.arange(batch, device=sel.device, dtype=torch.int32) * comp)[:, None, None]
        comp_idx = torch.where(sel >= 0, sel + offset, sel).reshape(batch * seq, -1)
    out = dsv4_attention(q, kv, sinks, cu, sliding_window, scale, comp_kv, comp_idx)
    return out.view(batch, seq, heads, dim), None


def register_transformers_attention(name: str = IMPLEMENTATION_NAME) -> str:
    """Register the kernel (and transformers' eager mask builder, which keeps the compressor's
    validity bias) under `name`; -> name, for `attn_implementation=name`."""
    from ..torchvision_shim import install_torchvision_shim

    install_torchvision_shim()  # transformers' imports reach torchvision (a CUDA build on CPU)
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(name, dsv4_transformers_attention)
    AttentionMaskInterface.register(name, eager_mask)
    return name
