"""Building blocks of the reference model: RMSNorm, sink attention, MLP, MoE with R3 replay."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import DSV41Config
from .rope import apply_rope, rope_cos_sin, rope_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class Attention(nn.Module):
    """GQA attention with per-head learnable sinks and a grouped output projection.

    Heads are split into ``o_groups`` groups; each group's heads project to ``o_lora_rank``
    (``o_a_proj``), the groups are concatenated and projected back to the hidden size
    (``o_b_proj``). A rank computes whole groups (ForwardContext.attn_group_range), which is why
    attention TP cannot exceed o_groups.
    """

    def __init__(self, cfg: DSV41Config, layer_id: int, dtype=None, device=None):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.o_groups, self.o_rank = cfg.head_dim, cfg.o_groups, cfg.o_lora_rank
        self.window = cfg.window_for_layer(layer_id)
        h, d = cfg.hidden_size, cfg.head_dim
        kw = dict(bias=False, dtype=dtype, device=device)
        self.q_proj = nn.Linear(h, self.num_heads * d, **kw)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, **kw)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, **kw)
        heads_per_group = self.num_heads // self.o_groups
        self.o_a_proj = nn.Parameter(torch.empty(self.o_groups, self.o_rank, heads_per_group * d,
                                                 dtype=dtype, device=device))
        self.o_b_proj = nn.Linear(self.o_groups * self.o_rank, h, **kw)
        self.sinks = (nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32, device=device))
                      if cfg.use_attention_sinks else None)
        inv_freq, self.mscale = rope_inv_freq(d, cfg.rope_theta, cfg.rope_scaling, device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scale = 1.0 / math.sqrt(d)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        groups = ctx.attn_group_range(self.o_groups)
        hpg = self.num_heads // self.o_groups
        h0, h1 = groups.start * hpg, groups.stop * hpg
        rep = self.num_heads // self.num_kv_heads
        kv0, kv1 = h0 // rep, -(-h1 // rep)
        q = F.linear(x, self.q_proj.weight[h0 * d:h1 * d]).view(t, h1 - h0, d)
        k = F.linear(x, self.k_proj.weight[kv0 * d:kv1 * d]).view(t, kv1 - kv0, d)
        v = F.linear(x, self.v_proj.weight[kv0 * d:kv1 * d]).view(t, kv1 - kv0, d)
        cos, sin = rope_cos_sin(ctx.positions, self.inv_freq, self.mscale)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        sinks = self.sinks[h0:h1] if self.sinks is not None else None
        o = ctx.attend(self.layer_id, q, k, v, sinks, self.window, self.scale)
        ng = len(groups)
        z = torch.einsum("tgd,grd->tgr", o.reshape(t, ng, hpg * d),
                         self.o_a_proj[groups.start:groups.stop])
        w_b = self.o_b_proj.weight[:, groups.start * self.o_rank:groups.stop * self.o_rank]
        return F.linear(z.reshape(t, ng * self.o_rank), w_b)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, dtype=None, device=None):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.gate_proj = nn.Linear(hidden, inter, **kw)
        self.up_proj = nn.Linear(hidden, inter, **kw)
        self.down_proj = nn.Linear(inter, hidden, **kw)

    def forward(self, x: torch.Tensor, cols: slice = slice(None)) -> torch.Tensor:
        """``cols`` selects a slice of the intermediate dimension (TP); the result is partial."""
        g = F.linear(x, self.gate_proj.weight[cols])
        u = F.linear(x, self.up_proj.weight[cols])
        return F.linear(F.silu(g) * u, self.down_proj.weight[:, cols])


class Router(nn.Module):
    def __init__(self, cfg: DSV41Config, dtype=None, device=None):
        super().__init__()
        self.top_k, self.scoring = cfg.num_experts_per_tok, cfg.scoring_func
        self.norm_topk, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size,
                                               dtype=dtype, device=device))
        # Load-balancing bias: selects experts, never weights them (DeepSeek-V3 style).
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(cfg.n_routed_experts, dtype=torch.float32, device=device),
            requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if self.scoring == "sigmoid" else logits.softmax(-1)
        ids = torch.topk(scores + self.e_score_correction_bias.float(), self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
        return ids.to(torch.int32), weights * self.scaling


class MoE(nn.Module):
    def __init__(self, cfg: DSV41Config, layer_id: int, dtype=None, device=None):
        super().__init__()
        self.layer_id = layer_id
        self.gate = Router(cfg, dtype, device)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size, dtype, device)
                                     for _ in range(cfg.n_routed_experts))
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                   dtype, device) if cfg.n_shared_experts else None)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        replay = ctx.replayed_routing(self.layer_id)
        if replay is not None:
            ids, weights = replay[0].to(x.device), replay[1].to(x.device, torch.float32)
            if ids.shape != (x.shape[0], self.gate.top_k):
                raise ValueError(f"layer {self.layer_id}: replayed routing has shape "
                                 f"{tuple(ids.shape)}, expected {(x.shape[0], self.gate.top_k)}")
        else:
            ids, weights = self.gate(x)
        ctx.record(self.layer_id, ids, weights)
        out = torch.zeros_like(x)
        for e in ctx.expert_range(len(self.experts)):
            tok, slot = (ids == e).nonzero(as_tuple=True)
            if tok.numel():
                y = self.experts[e](x[tok]) * weights[tok, slot, None].to(x.dtype)
                out.index_add_(0, tok, y)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, ctx.mlp_slice(self.shared_experts.up_proj.out_features))
        return out


class DenseMLP(MLP):
    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x, ctx.mlp_slice(self.up_proj.out_features))
