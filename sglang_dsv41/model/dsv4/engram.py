"""Engram (DeepSeek V4.1): a gated n-gram hash memory added to the mHC streams before a layer.

The model hashes once per forward (``EngramHasher``, in engram_hash.py) and each Engram layer
reads its slice: ``streams = engram(streams, hash_ids[:, engram.layer_hash_index])``, on the
residual streams before the layer's attention sublayer. Mirrors the torch paths of SGLang
0.5.23's ``sglang/srt/layers/engram.py``:

  EngramTable   EngramEmbedding for one rank holding the whole table (_owned_rows' CPU path):
                fp8 e4m3 rows with one e8m0 scale per 32 columns, dequantized to bf16 per row
  engram_gate   engram_gate: the per-hc-copy RMS-normalised q.k dot, signed square root,
                sigmoid, times the shared value (fp32 math, cast back to the streams' dtype;
                on CUDA engram_triton.py's kernels: the same math, fp32 sums in their order)
  Engram        Engram: embed -> wkv -> engram_gate; parameter names as SGLang loads them
                (``embed.weight``, ``embed.scale``, ``wkv.weight``, ``q_weight``, ``k_weight``)

SGLang's row sharding, host tables and peer shards place the same rows elsewhere and are
bitwise equal to this lookup; the image-token rule applies to vision models only.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import DSV4Config
from .engram_hash import (SCALE_BLOCK, EngramHasher, EngramLayout, compressed_token_map,
                          default_token_map)
from .kv_numerics import quantize_ue8m0_tiles

__all__ = ["Engram", "EngramHasher", "EngramLayout", "EngramTable", "compressed_token_map",
           "default_token_map", "engram_gate"]

GATE_CLAMP = 1e-6  # SGLang's Engram.clamp_value
_E8M0_ONE = 127  # e8m0 exponent byte of 2^0


class EngramTable(nn.Module):
    """One layer's hash table: buffers ``weight`` float8_e4m3fn [rows, dim] and ``scale``
    float8_e8m0fnu [rows, dim/32]. Frozen, never converted as a whole: ``.to(dtype)``, ``.half()``
    and FSDP's casts leave them alone (only devices change), a state dict in another dtype is
    refused, and a lookup dequantizes only the rows it reads."""

    def __init__(self, num_rows: int, dim: int):
        super().__init__()
        if num_rows < 1 or dim < 1 or dim % SCALE_BLOCK:
            raise ValueError(f"an Engram table needs rows >= 1 and dim a multiple of "
                             f"{SCALE_BLOCK}, got [{num_rows}, {dim}]")
        self.dim = dim
        # Valid zeros (scale 2^0) until loaded or reset_table_: torch.empty could hold NaN bytes.
        self.register_buffer("weight", torch.zeros(num_rows, dim, dtype=torch.float8_e4m3fn))
        self.register_buffer("scale", torch.full((num_rows, dim // SCALE_BLOCK), _E8M0_ONE,
                                                 dtype=torch.uint8).view(torch.float8_e8m0fnu))

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        """indices (any shape, int) -> bf16 [*indices.shape, dim]."""
        rows = self.weight[indices].float().unflatten(-1, (-1, SCALE_BLOCK))
        values = (rows * self.scale[indices].float().unsqueeze(-1)).flatten(-2)
        return values.to(torch.bfloat16)

    @torch.no_grad()
    def reset_table_(self, generator: torch.Generator | None = None, std: float = 1.0,
                     chunk_rows: int = 1 << 16) -> None:
        """Fill with normal(0, std) rows quantized as DeepSeek stores them (per 32 columns, a
        power-of-two scale rounded up so no value passes 448), chunk by chunk."""
        for lo in range(0, self.weight.shape[0], chunk_rows):
            n = min(chunk_rows, self.weight.shape[0] - lo)
            values = torch.randn(n, self.dim, generator=generator) * std
            codes, exponents = quantize_ue8m0_tiles(values, SCALE_BLOCK)
            self.weight[lo:lo + n].view(torch.uint8).copy_(codes.view(torch.uint8))
            self.scale[lo:lo + n].view(torch.uint8).copy_(exponents)

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) casts every floating-point tensor, fp8 included: hand it the bytes.
        for name, buf in self._buffers.items():
            if buf is None:
                continue
            moved = fn(buf.view(torch.uint8))
            if moved.dtype != torch.uint8:
                raise ValueError(f"Engram table {name!r} stays {buf.dtype}; refusing a cast")
            self._buffers[name] = moved.view(buf.dtype)
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        for name, buf in self._buffers.items():
            got = state_dict.get(prefix + name)
            if got is not None and (got.dtype != buf.dtype or got.shape != buf.shape):
                raise ValueError(f"{prefix}{name}: expected {buf.dtype} {tuple(buf.shape)}, got "
                                 f"{got.dtype} {tuple(got.shape)}; Engram tables load byte-exact")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)


def engram_gate(streams: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor,
                k_weight: torch.Tensor, eps: float, clamp_value: float = GATE_CLAMP
                ) -> torch.Tensor:
    """streams [T, hc, D]; kv [T, (hc+1)*D] = one key per hc copy, then the shared value.
    Adds the gated value to every copy. On CUDA one Triton kernel each way (engram_triton.py)
    when streams and kv share a dtype."""
    if streams.is_cuda and kv.dtype == streams.dtype and streams.dim() == 3:
        from .engram_triton import engram_gate_fused

        return engram_gate_fused(streams, kv, q_weight, k_weight, eps, clamp_value)
    return engram_gate_torch(streams, kv, q_weight, k_weight, eps, clamp_value)


def engram_gate_torch(streams: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor,
                      k_weight: torch.Tensor, eps: float, clamp_value: float = GATE_CLAMP
                      ) -> torch.Tensor:
    """engram_gate in torch ops (the CPU path, and the kernels' reference)."""
    hc_mult, dim = streams.shape[-2:]
    key, value = kv.split([hc_mult * dim, dim], dim=-1)
    key = key.float().unflatten(-1, (hc_mult, dim))
    weight = q_weight.float() * k_weight.float()
    h = streams.float()
    # Normalised per (token, hc copy) over D, not jointly over the copies.
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (h * weight * key).sum(-1) * rstd * dim**-0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(clamp_value).sqrt(), dot))
    return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(streams.dtype)


class Engram(nn.Module):
    """One Engram layer. ``wkv``, ``q_weight`` and ``k_weight`` are trainable parameters in the
    model's dtype (SGLang: ReplicatedLinear and ones(hc, D)); the table is a frozen buffer."""

    def __init__(self, cfg: DSV4Config, layer_id: int, layout: EngramLayout | None = None):
        super().__init__()
        layout = EngramLayout.from_config(cfg) if layout is None else layout
        if layer_id not in layout.layer_ids:
            raise ValueError(f"layer {layer_id} is not an Engram layer {layout.layer_ids}")
        self.layer_hash_index = layout.layer_ids.index(layer_id)
        self.n_hash_cols = layout.n_hash_cols
        self.eps = cfg.rms_norm_eps
        hidden, hc_mult = cfg.hidden_size, cfg.hc_mult
        self.embed = EngramTable(layout.column_bounds(self.layer_hash_index)[-1], layout.head_dim)
        self.wkv = nn.Linear(layout.n_hash_cols * layout.head_dim, hidden * (hc_mult + 1),
                             bias=False)
        self.q_weight = nn.Parameter(torch.ones(hc_mult, hidden))
        self.k_weight = nn.Parameter(torch.ones(hc_mult, hidden))

    def forward(self, streams: torch.Tensor, hash_ids: torch.Tensor) -> torch.Tensor:
        """streams [T, hc, D], hash_ids [T, n_hash_cols] (this layer's slice) -> streams."""
        if hash_ids.shape != (streams.shape[0], self.n_hash_cols):
            raise ValueError(f"hash_ids must be [{streams.shape[0]}, {self.n_hash_cols}], got "
                             f"{tuple(hash_ids.shape)}")
        # Rows come out in bf16 as in SGLang; wkv then runs in its own dtype (fp32 tiny models).
        emb = self.embed(hash_ids)
        kv = self.wkv(emb.flatten(-2).to(self.wkv.weight.dtype))
        return engram_gate(streams, kv, self.q_weight, self.k_weight, self.eps)
