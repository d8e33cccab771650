"""Optimizer and LR schedule: sinks get their own param group and their own LR lambda
(frozen for the first sink_frozen_frac of the steps, ramped linearly over sink_ramp_frac)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.optim.lr_scheduler import LambdaLR

from sglang_dsv41.attention.triton_common import interpreting

from .config import OptimConfig
from .local_shards import LocalShardAdamW
from .parallelize import is_sink_param

if TYPE_CHECKING:
    from .policy import Policy


class MainLR:
    def __init__(self, warmup_steps: int):
        self.warmup_steps = warmup_steps

    def __call__(self, step: int) -> float:
        return min(1.0, (step + 1) / self.warmup_steps) if self.warmup_steps else 1.0


class SinkWarmupLR:
    """LR factor of the sink group at (0-based) optimizer step ``step``."""

    def __init__(self, total_steps: int, frozen_frac: float, ramp_frac: float):
        self.frozen = int(round(total_steps * frozen_frac))
        self.ramp = int(round(total_steps * ramp_frac))

    def __call__(self, step: int) -> float:
        if step < self.frozen:
            return 0.0
        if step < self.frozen + self.ramp:
            return (step - self.frozen + 1) / self.ramp
        return 1.0


def build_optimizer(policy: "Policy", cfg: OptimConfig, total_steps: int
                    ) -> tuple[torch.optim.Optimizer, LambdaLR]:
    main, sinks = [], []
    for name, p in policy.trainable_parameters():
        (sinks if is_sink_param(name) else main).append(p)
    groups = [{"params": main, "lr": cfg.lr, "name": "main"},
              {"params": sinks, "lr": cfg.sink_lr if cfg.sink_lr is not None else cfg.lr,
               "name": "sinks", "weight_decay": 0.0}]
    # fused: one multi-tensor kernel per step on CUDA; stepped on the local shards
    # (local_shards.py: DTensor's per-op dispatch made the step host-bound)
    fused = all(p.is_cuda for p in main + sinks) and bool(main + sinks)
    copies = getattr(policy.model, "compute_copies", None)
    kernel = cfg.adamw_kernel
    if kernel == "auto":
        kernel = "triton" if fused and copies is not None else "torch"
    if kernel == "triton" and not (fused or interpreting()):
        raise ValueError("optim.adamw_kernel=triton: the parameters must be on CUDA (or Triton "
                         "interpreted: TRITON_INTERPRET=1)")
    opt = LocalShardAdamW(groups, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                          fused=fused or None, kernel=kernel,
                          compute_copies=copies if kernel == "triton" else None)
    sched = LambdaLR(opt, [MainLR(cfg.warmup_steps),
                           SinkWarmupLR(total_steps, cfg.sink_frozen_frac, cfg.sink_ramp_frac)])
    return opt, sched
