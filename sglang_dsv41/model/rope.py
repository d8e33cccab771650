"""Rotary embeddings computed from position ids on every call (no cached table to outgrow).

YaRN (arXiv:2309.00071) scaling when ``rope_scaling = {"type": "yarn", ...}``.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _yarn_correction_dim(num_rot: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rot * 2 * math.pi))) / (2 * math.log(base))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                  device: torch.device | None = None) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [head_dim/2] fp32, attention magnitude scale)."""
    idx = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    inv_freq = 1.0 / (theta ** idx)
    if not scaling or scaling.get("type", scaling.get("rope_type")) in (None, "default"):
        return inv_freq.float(), 1.0
    kind = scaling.get("type", scaling.get("rope_type"))
    if kind != "yarn":
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
    factor = float(scaling["factor"])
    orig = int(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast", 32)), float(scaling.get("beta_slow", 1))
    low = max(math.floor(_yarn_correction_dim(beta_fast, head_dim, theta, orig)), 0)
    high = min(math.ceil(_yarn_correction_dim(beta_slow, head_dim, theta, orig)), head_dim - 1)
    ramp = (torch.arange(head_dim // 2, dtype=torch.float64, device=device) - low) / max(high - low, 1e-3)
    extrapolate = 1.0 - ramp.clamp(0, 1)
    inv_freq = inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate
    mscale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv_freq.float(), mscale


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, mscale: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, head_dim/2] in fp32 for int positions [T]."""
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    return torch.cos(angles) * mscale, torch.sin(angles) * mscale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; rotate-half (NeoX) convention, computed in fp32."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
