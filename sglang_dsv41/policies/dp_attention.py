"""DP-attention batch policies of the embedded engine, as pure functions over plain data.

SGLang 0.5.23 already pads prefill counts to attn_tp_size and adds idle batches
(``managers/scheduler_components/dp_attn.py``), so only the embedded engine calls these.
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
