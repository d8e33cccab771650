"""Deployment layouts refused before anything starts, with the reason.

SGLang 0.5.23 computes ``n_local_groups = o_groups // attn_tp_size`` for the grouped output
projection of DeepSeek V4: an attention TP wider than o_groups gives 0 groups and fails deep in
the first forward. Pipeline parallelism with R3 (returned routed experts) records the experts
of one stage only, so the trainer would replay wrong routes.
"""

from __future__ import annotations


class DeploymentRefused(ValueError):
    """A layout that cannot serve; the message names the rule and the fix."""


def check_attention_tp(attn_tp_size: int, o_groups: int) -> None:
    if o_groups < 1 or attn_tp_size < 1:
        raise ValueError(f"o_groups and attn_tp_size must be >= 1, got {o_groups}, "
                         f"{attn_tp_size}")
    if attn_tp_size > o_groups:
        raise DeploymentRefused(
            f"attention TP size {attn_tp_size} exceeds o_groups={o_groups}: the grouped output "
            f"projection cannot be split more than o_groups ways (SGLang would compute "
            f"{o_groups} // {attn_tp_size} = 0 local groups). Keep attention TP <= {o_groups} "
            f"and split attention into more DP-attention groups (SGLang 0.5.23: --attn-dp-size "
            f"{-(-attn_tp_size // o_groups)} or more; the embedded engine: --dp-size with "
            f"--enable-dp-attention)")
    if o_groups % attn_tp_size:
        raise DeploymentRefused(f"attention TP size {attn_tp_size} must divide "
                                f"o_groups={o_groups}")


def check_pp_with_r3(pp_size: int, r3_enabled: bool) -> None:
    if pp_size > 1 and r3_enabled:
        raise DeploymentRefused(
            f"pipeline parallelism (pp_size={pp_size}) with R3 (--enable-return-routed-experts) "
            "is refused: each pipeline stage records only its own layers' routed experts, so "
            "the replay the trainer receives is incomplete; use pp_size 1 or turn R3 off")
