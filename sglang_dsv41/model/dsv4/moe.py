"""DeepSeek V4 MoE: sqrtsoftplus top-k routing with an fp32 correction bias, hash-routed layers
(``tid2eid``), SwiGLU experts with a clamp, one shared expert; R3 record/replay.

Names are SGLang's flat ones: ``ffn.gate.{weight,bias,tid2eid}``, ``ffn.experts.E.w{1,2,3}``,
``ffn.shared_experts.w{1,2,3}`` (w1 gate, w3 up, w2 down). The bias picks the experts only; the
weights come from the unbiased scores, renormalised and scaled by routed_scaling_factor
(transformers' DeepseekV4TopKRouter / DeepseekV4HashRouter).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import DSV4Config
from .context import DSV4Context
from .v41 import renormalize_topk_weights, sqrtsoftplus_log1p


def route_scores(logits: torch.Tensor, scoring_func: str, log1p: bool = False) -> torch.Tensor:
    """Router scores from logits; ``log1p`` is V4.1's sqrtsoftplus written through log1p."""
    if scoring_func == "sqrtsoftplus":
        if log1p:
            return sqrtsoftplus_log1p(logits)
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)


class Gate(nn.Module):
    def __init__(self, cfg: DSV4Config, layer_id: int):
        super().__init__()
        self.top_k, self.scoring = cfg.num_experts_per_tok, cfg.scoring_func
        self.is_hash = cfg.is_hash_layer(layer_id)
        # V4.1's fused gate scores through log1p and renormalises without an epsilon; its hash
        # layers score with plain softplus().sqrt() (SGLang HashTopK).
        self.v41_gate = cfg.is_v41 and not self.is_hash
        self.norm_topk, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if self.is_hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.top_k,
                                                        dtype=torch.int32))
        else:
            self.register_buffer("bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> expert ids [T, k] int64, weights [T, k] fp32."""
        scores = route_scores(F.linear(x, self.weight).float(), self.scoring, self.v41_gate)
        if self.is_hash:
            ids = self.tid2eid[input_ids].long()
        else:
            ids = torch.topk(scores + self.bias.float(), self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.norm_topk and self.v41_gate:
            weights = renormalize_topk_weights(weights)
        elif self.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling


class Expert(nn.Module):
    """SwiGLU with DeepSeek V4's clamp: gate <= limit, |up| <= limit."""

    def __init__(self, hidden: int, inter: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """rows x [M, K] sorted by group, w [G, K, N], offs int32 [G] group ends -> [M, N].
    CUDA: torch's grouped GEMM (one launch for every expert). CPU: one matmul per group (torch's
    CPU grouped_mm has no backward for every layout); rows past offs[-1] are never read."""
    if x.is_cuda:
        return F.grouped_mm(x, w, offs=offs)
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    parts = [x[s:e] @ w[g] for g, (s, e) in enumerate(zip(starts, ends))]
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[-1])


class MoE(nn.Module):
    """``grouped``: every expert in two grouped GEMMs (tokens sorted by expert); off, the plain
    per-expert loop (the reference the grouped path is tested against)."""

    def __init__(self, cfg: DSV4Config, layer_id: int, grouped: bool = True):
        super().__init__()
        self.layer_id, self.grouped = layer_id, grouped
        self.limit = cfg.swiglu_limit
        self.gate = Gate(cfg, layer_id)
        self.experts = nn.ModuleList(
            Expert(cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit)
            for _ in range(cfg.n_routed_experts))
        self.shared_experts = Expert(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                     cfg.swiglu_limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, ctx: DSV4Context) -> torch.Tensor:
        replay = ctx.replayed_routing(self.layer_id)
        if replay is None:
            ids, weights = self.gate(x, input_ids)
        else:
            ids, weights = replay[0].long(), replay[1].float()
        ctx.record(self.layer_id, ids, weights)
        experts = ctx.expert_range(len(self.experts))
        run = self.routed_grouped if self.grouped else self.routed_loop
        return ctx.mlp_reduce(run(x, ids, weights, experts)) + self.shared_experts(x)

    def routed_loop(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    experts: range) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in experts:
            token, slot = torch.where(ids == e)
            if token.numel():
                y = self.experts[e](x[token]) * weights[token, slot, None].to(x.dtype)
                out.index_add_(0, token, y.to(out.dtype))
        return out

    def routed_grouped(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       experts: range) -> torch.Tensor:
        """The (token, slot) pairs sorted by expert (stable: then by token, slot), w1|w3 in one
        grouped GEMM, w2 in another; back in slot order by a permutation and summed over the k
        slots in a fixed order. Every gather is a permutation or a broadcast, so the backward has
        no atomically accumulated index_add: bit-reproducible run to run."""
        n_tok, k = ids.shape
        local = ids.reshape(-1) - experts.start
        slots = None
        if len(experts) != len(self.experts):  # expert parallel: this rank's experts only
            slots = torch.nonzero((local >= 0) & (local < len(experts))).squeeze(1)
            local = local[slots]
        order = torch.argsort(local, stable=True)
        offs = torch.cumsum(torch.bincount(local, minlength=len(experts)), 0).to(torch.int32)
        # [T*k, H] broadcast of each token to its k slots, then gathered in expert order.
        rows = x[:, None, :].expand(n_tok, k, x.shape[-1]).reshape(n_tok * k, x.shape[-1])
        slot_order = order if slots is None else slots[order]
        rows = rows[slot_order]
        mods = [self.experts[e] for e in experts]
        w13 = torch.cat([torch.stack([m.w1.weight for m in mods]),
                         torch.stack([m.w3.weight for m in mods])], dim=1)  # [E, 2I, H]
        w2 = torch.stack([m.w2.weight for m in mods])                     # [E, H, I]
        gate, up = grouped_mm(rows, w13.transpose(1, 2), offs).chunk(2, dim=-1)
        act = F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)
        y = grouped_mm(act, w2.transpose(1, 2), offs)
        if slots is None:
            y_slot = torch.empty_like(y)
        else:  # slots of other ranks' experts contribute zero
            y_slot = y.new_zeros(n_tok * k, y.shape[-1])
        y_slot = y_slot.index_put((slot_order,), y)
        y_slot = y_slot.view(n_tok, k, y.shape[-1]) * weights.to(x.dtype)[..., None]
        return y_slot.sum(dim=1).to(x.dtype)
