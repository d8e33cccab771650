"""The R3 (returned routed experts) host buffer as SGLang 0.5.23 sizes it, one rule for the
planner's budget and the embedded engine's buffer. File:line references are to SGLang 0.5.23's
srt/ tree."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..model.dsv4.config import DSV4Config

R3_EXPERT_ID_BYTES = 4  # SGLang stores routed expert ids as int32


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def r3_bytes_per_token(cfg: DSV4Config) -> int:
    """Routed-expert ids kept per token: int32 [num_hidden_layers, num_experts_per_tok]
    (state_capturer/routed_experts.py:72-73; 40 x 6 x 4 = 960 B on V4.1-Flash). Every layer
    counts, hash-routed ones included."""
    return cfg.num_hidden_layers * cfg.num_experts_per_tok * R3_EXPERT_ID_BYTES


def r3_buffer_bytes(cfg: DSV4Config, max_total_tokens: int, page_size: int) -> int:
    """The exact request of one scheduler process's R3 host cache: int32[max_total_tokens +
    page_size, layers, top_k] (kv_index_translator.py:268 capture_token_capacity, state_capturer
    base.py:64-72 BaseHostCache)."""
    _need(max_total_tokens >= 0, f"max_total_tokens must be >= 0, got {max_total_tokens}")
    _need(page_size >= 1, f"page_size must be >= 1, got {page_size}")
    return (max_total_tokens + page_size) * r3_bytes_per_token(cfg)
