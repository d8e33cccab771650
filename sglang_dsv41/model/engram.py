"""Engram: hashed n-gram embedding tables gated into the residual stream.

For every token, each n-gram order n and each hash head k select one row of the layer's table
from the token and its n-1 predecessors. The rows are concatenated, projected to the hidden
size and added to the residual through a per-token sigmoid gate. The table is frozen and is
read only through the EngramTable interface, so a runtime can keep it in host memory (see
``sglang_dsv41.loader``) without the model knowing.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from .config import DSV41Config

HASH_MODULUS = 2_147_483_647  # 2^31 - 1: products stay below 2^62, so int64 never overflows
_HASH_MULTIPLIERS = (1_000_003, 998_244_353, 1_234_567_891, 1_610_612_741, 805_306_457,
                     402_653_189, 201_326_611, 100_663_319)


@runtime_checkable
class EngramTable(Protocol):
    num_rows: int
    dim: int

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """int64 rows of any shape -> float32 [*rows.shape, dim]."""
        ...


class ParameterEngramTable(nn.Module):
    """A table held as a frozen parameter (checkpoint key ``...engram.table.weight``)."""

    def __init__(self, num_rows: int, dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        super().__init__()
        self.num_rows, self.dim = num_rows, dim
        self.weight = nn.Parameter(torch.empty(num_rows, dim, dtype=dtype, device=device),
                                   requires_grad=False)

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        return self.weight.detach().index_select(0, rows.reshape(-1)).float().reshape(
            *rows.shape, self.dim)


def ngram_window_from_packed(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, n: int
                             ) -> torch.Tensor:
    """[T, n]: column j is the token j steps back within its sequence, -1 before its start."""
    t = input_ids.shape[0]
    pos = torch.arange(t, device=input_ids.device)
    seq = torch.searchsorted(cu_seqlens[1:].to(torch.long), pos, right=True)
    start = cu_seqlens.to(torch.long)[seq]
    cols = []
    for j in range(n):
        src = pos - j
        valid = src >= start
        cols.append(torch.where(valid, input_ids[src.clamp(min=0)], torch.full_like(input_ids, -1)))
    return torch.stack(cols, dim=1) if t else input_ids.new_zeros(0, n)


def ngram_window_from_history(tokens: list[int], n: int) -> list[int]:
    """The window of the last token of ``tokens`` (decode path)."""
    return [tokens[-1 - j] if j < len(tokens) else -1 for j in range(n)]


def engram_rows(window: torch.Tensor, orders: list[int], num_heads: int, num_rows: int
                ) -> torch.Tensor:
    """[T, n_max] token windows -> int64 rows [T, len(orders) * num_heads]."""
    w = window.to(torch.int64) + 2  # -1 padding hashes as 1, token t as t+2
    out = []
    for n in orders:
        for k in range(num_heads):
            mult = _HASH_MULTIPLIERS[k % len(_HASH_MULTIPLIERS)]
            h = torch.full_like(w[:, 0], n * 7919 + k)
            for j in range(n):
                h = (h * mult + w[:, j]) % HASH_MODULUS
            out.append(h % num_rows)
    return torch.stack(out, dim=1)


class EngramLayer(nn.Module):
    def __init__(self, cfg: DSV41Config, dtype: torch.dtype, device=None):
        super().__init__()
        from .layers import RMSNorm

        self.orders = list(cfg.engram_ngram_orders)
        self.num_heads = cfg.engram_num_hash_heads
        self.max_order = cfg.max_ngram_order
        self.table: nn.Module | EngramTable = ParameterEngramTable(
            cfg.engram_num_rows, cfg.engram_dim, dtype=dtype, device=device)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.proj = nn.Linear(cfg.engram_lookups_per_token * cfg.engram_dim, cfg.hidden_size,
                              bias=False, dtype=dtype, device=device)
        self.gate = nn.Linear(cfg.hidden_size, 1, bias=False, dtype=dtype, device=device)

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor, ctx) -> torch.Tensor:
        window = ctx.ngram_window(input_ids, self.max_order)
        rows = engram_rows(window, self.orders, self.num_heads, self.table.num_rows)
        emb = self.table.lookup(rows).flatten(1).to(h.dtype)  # flatten: 0-token idle batches
        gate = torch.sigmoid(self.gate(self.norm(h)).float()).to(h.dtype)
        return h + gate * self.proj(emb)
