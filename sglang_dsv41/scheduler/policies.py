"""DP-attention scheduling policies as pure functions over plain data.

One implementation, two adapters: the embedded engine's scheduler ranks and the SGLang patches
(``sglang_dsv41.sglang_backend``) both call these.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PaddingPlan:
    num_tokens: int      # real tokens of this DP rank's forward
    padded_tokens: int   # tokens the forward runs with (multiple of attn_tp_size)

    @property
    def num_pad(self) -> int:
        return self.padded_tokens - self.num_tokens


def pad_to_multiple(n: int, multiple: int) -> int:
    if multiple <= 0:
        raise ValueError(f"multiple must be positive, got {multiple}")
    return -(-n // multiple) * multiple


def plan_prefill_padding(num_tokens: int, attn_tp_size: int, enabled: bool = True) -> PaddingPlan:
    """Under DP attention the tokens of a forward are reduce-scattered evenly across the
    attention-TP ranks; a count that is not a multiple of attn_tp_size aborts the collective.
    Padding rows write to a reserved dummy KV slot and are trimmed from the outputs."""
    if num_tokens < 0:
        raise ValueError("num_tokens must be >= 0")
    if not enabled or attn_tp_size <= 1:
        return PaddingPlan(num_tokens, num_tokens)
    return PaddingPlan(num_tokens, pad_to_multiple(num_tokens, attn_tp_size))


def needs_idle_batch(local_tokens: int, global_tokens: list[int]) -> bool:
    """Every rank must join every MoE/MLP collective: a rank with nothing to do runs an idle
    (zero-token) batch whenever any rank has tokens."""
    return local_tokens == 0 and any(n > 0 for n in global_tokens)


def should_run_forward(local_tokens: int, global_tokens: list[int], idle_batch_enabled: bool = True
                       ) -> bool:
    """Whether this rank enters the forward this step (with its tokens or an idle batch)."""
    if local_tokens > 0:
        return True
    return idle_batch_enabled and needs_idle_batch(local_tokens, global_tokens)


def mlp_sync_token_counts(per_rank_tokens: list[int], attn_tp_size: int, padding: bool = True
                          ) -> list[int]:
    """Per-DP-rank token counts after padding, as the MLP sync sees them (0 stays 0: an idle rank
    runs its idle batch with zero tokens, which every collective must accept)."""
    return [plan_prefill_padding(n, attn_tp_size, padding).padded_tokens for n in per_rank_tokens]


def pad_idle_ranks(per_rank_tokens: list[int], attn_tp_size: int) -> list[int]:
    """Give every idle DP rank (0 tokens while another rank has some) attn_tp_size padding rows.

    SGLang's SUM_LEN gather hands an idle rank a zero-length slice and runs its idle forward
    with 0 tokens; a collective skipped on 0 tokens deadlocks the others. One row per
    attention-TP rank keeps the idle forward inside every collective."""
    if attn_tp_size < 1:
        raise ValueError(f"attn_tp_size must be >= 1, got {attn_tp_size}")
    return [attn_tp_size if needs_idle_batch(n, per_rank_tokens) else n for n in per_rank_tokens]
