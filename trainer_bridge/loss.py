"""PPO/GRPO: advantages, the clipped token-level loss with dual clip, k3 KL and truncated IS.

Every per-token tensor is aligned with MicroBatch.targets. The loss of a micro-batch is
``sum(token_loss * mask) / global_tokens * world_size``: FSDP averages gradients over ranks,
so the result is the token-level mean over every rank's tokens of the mini-batch.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from .batch import Sample
from .config import LossConfig


def compute_advantages(samples: list[Sample], cfg: LossConfig, eps: float = 1e-6) -> None:
    """grpo: reward minus its group's mean (over group std); ppo: batch-whitened rewards.
    Sets ``sample.advantage`` (one value per episode, broadcast to its tokens)."""
    if cfg.advantage == "grpo":
        groups: dict[int, list[Sample]] = defaultdict(list)
        for s in samples:
            groups[s.group_id].append(s)
        for members in groups.values():
            _normalize(members, cfg.normalize_std, eps)
    else:
        _normalize(samples, cfg.normalize_std, eps)


def _normalize(members: list[Sample], by_std: bool, eps: float) -> None:
    r = torch.tensor([s.reward for s in members], dtype=torch.float64)
    centered = r - r.mean()
    if by_std and len(members) > 1:
        centered = centered / (r.std(unbiased=False) + eps)
    for s, a in zip(members, centered.tolist()):
        s.advantage = a


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi || ref) per token: exp(ref - logp) - (ref - logp) - 1 >= 0."""
    d = ref_logp - logp
    # expm1: exp(d) - 1 in fp32 rounds near 1, which made |d| < 3e-4 come out below 0; the
    # clamp takes the last ulp of expm1 (|d| < 1e-7, where the gradient is ~d anyway).
    return (torch.expm1(d) - d).clamp_min(0)


@dataclass
class LossTerms:
    loss: torch.Tensor                # the scalar to backward
    # Token sums (divide by the token count for means), detached 0-dim tensors: reading them
    # is a host sync, which the trainer does once per step.
    pg_sum: torch.Tensor
    kl_sum: torch.Tensor
    clip_frac_sum: torch.Tensor
    tis_sum: torch.Tensor
    # train-inference mismatch: |old - rollout| and k3(rollout || old) of the logprobs
    mismatch_abs_sum: torch.Tensor
    mismatch_k3_sum: torch.Tensor

    def sums(self) -> torch.Tensor:
        """float64 [7] on the device: the loss and the token sums of pg, kl, clipped, tis and
        the two mismatches (trainer.STEP_SUMS), read once a step."""
        return torch.stack([self.loss.detach(), self.pg_sum, self.kl_sum, self.clip_frac_sum,
                            self.tis_sum, self.mismatch_abs_sum, self.mismatch_k3_sum]).double()


def loss_scale(global_tokens: float, world_size: int) -> float:
    """The factor ppo_loss multiplies a micro-batch's token sum by: world_size / global_tokens
    (the module docstring's normalisation)."""
    if not global_tokens > 0:
        raise ValueError(f"global_tokens must be positive, got {global_tokens}")
    return world_size / global_tokens


def ppo_loss(logp: torch.Tensor, old_logp: torch.Tensor | None, rollout_logp: torch.Tensor,
             advantages: torch.Tensor, mask: torch.Tensor, cfg: LossConfig, *,
             scale: float | torch.Tensor, ref_logp: torch.Tensor | None = None) -> LossTerms:
    """``old_logp`` None: on-policy (one optimizer step a batch), the old policy is the one
    computing ``logp``, whose values stand in for it (ratio 1). ``scale``:
    loss_scale(global_tokens, world_size); a 0-d fp32 device tensor holding that value gives
    the same bits (a captured CUDA graph reads it anew at each replay)."""
    old = logp.detach() if old_logp is None else old_logp.detach()
    ratio = torch.exp(logp - old)
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * ratio.clamp(1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    # Dual clip: a negative advantage with a huge ratio is bounded by -c * A.
    pg = torch.where(advantages < 0, torch.minimum(pg, -advantages * cfg.dual_clip_c), pg)
    # Truncated IS: the samples came from the rollout engine's policy, not from the old one.
    tis = torch.exp(old - rollout_logp).clamp(max=cfg.tis_cap)
    token_loss = tis * pg
    kl = torch.zeros_like(logp)
    if ref_logp is not None and cfg.kl_coef > 0:
        kl = k3_kl(logp, ref_logp)
        token_loss = token_loss + cfg.kl_coef * kl
    loss = (token_loss * mask).sum() * scale
    clipped = (pg_clipped > pg_unclipped).float()
    # float64: at fp32 agreement (|d| ~ 1e-7) k3 ~ d^2/2 vanishes in float32
    mismatch_k3 = k3_kl(rollout_logp.double(), old.double())
    return LossTerms(loss=loss, pg_sum=(pg * mask).sum().detach(),
                     kl_sum=(kl * mask).sum().detach(),
                     clip_frac_sum=(clipped * mask).sum().detach(),
                     tis_sum=(tis * mask).sum().detach(),
                     mismatch_abs_sum=((old - rollout_logp).abs() * mask).sum(),
                     mismatch_k3_sum=(mismatch_k3 * mask).sum())
