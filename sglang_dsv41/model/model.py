"""DeepseekV41ForCausalLM reference model (text only), plain torch, no torch.distributed."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import DSV41Config
from .context import ForwardContext
from .engram import EngramLayer
from .layers import MoE, Attention, DenseMLP, RMSNorm

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DSV41Config, layer_id: int, dtype=None, device=None):
        super().__init__()
        self.layer_id = layer_id
        self.engram = EngramLayer(cfg, dtype, device) if cfg.has_engram(layer_id) else None
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(cfg, layer_id, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = (MoE(cfg, layer_id, dtype, device) if cfg.is_moe_layer(layer_id)
                    else DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype, device))

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # h holds every token of this DP group; between attn_reduce and attn_gather a rank holds
        # only its token shard, and the MLP runs on the tokens that mlp_gather collects.
        if self.engram is not None:
            h = self.engram(h, input_ids, ctx)
        a = ctx.attn_reduce(self.self_attn(self.input_layernorm(h), ctx))
        h = ctx.token_shard(h) + a
        m = self.mlp(ctx.mlp_gather(self.post_attention_layernorm(h)), ctx)
        return ctx.attn_gather(h + ctx.mlp_reduce(m))


class DSV41Model(nn.Module):
    def __init__(self, cfg: DSV41Config, dtype=None, device=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, device)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, input_ids, ctx)
        return self.norm(h)


class DSV41ForCausalLM(nn.Module):
    def __init__(self, cfg: DSV41Config, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.config = cfg
        dtype = dtype or DTYPES[cfg.torch_dtype]
        self.model = DSV41Model(cfg, dtype, device)
        head_dtype = torch.float32 if cfg.lm_head_fp32 else dtype
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=head_dtype,
                                 device=device)
        if cfg.tie_word_embeddings:
            if cfg.lm_head_fp32 and dtype != torch.float32:
                raise ValueError("tie_word_embeddings with lm_head_fp32 needs an fp32 model")
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Packed token ids [T] -> final hidden states [T, hidden]."""
        return self.model(input_ids, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.lm_head.weight
        return F.linear(hidden.to(w.dtype), w).float()

    def token_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """log p(targets[i] | prefix up to i) for each row of hidden: fp32 [T]."""
        logits = self.compute_logits(hidden)
        return logits.log_softmax(-1).gather(1, targets.long()[:, None]).squeeze(1)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Random weights with a fixed seed (independent of the device's RNG)."""
        gen = torch.Generator().manual_seed(seed)
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                val = torch.ones(p.shape)
            elif name.endswith("sinks"):
                val = torch.randn(p.shape, generator=gen) * 0.5
            elif name.endswith("e_score_correction_bias"):
                val = torch.randn(p.shape, generator=gen) * 0.01
            elif name.endswith("table.weight"):
                val = torch.randn(p.shape, generator=gen)
            else:
                val = torch.randn(p.shape, generator=gen) * std
            p.copy_(val.to(p.dtype))


def is_engram_table(name: str) -> bool:
    return ".engram.table." in name


def build_model(cfg: DSV41Config, dtype: torch.dtype | None = None, device=None,
                seed: int | None = 0) -> DSV41ForCausalLM:
    model = DSV41ForCausalLM(cfg, dtype, device)
    if seed is not None:
        model.init_weights(seed)
    return model


def reference_logprobs(model: DSV41ForCausalLM, seqs: list[list[int]], **ctx_kw
                       ) -> tuple[list[torch.Tensor], ForwardContext]:
    """Per-sequence logprobs of tokens 1..n-1 given their prefixes, in one packed forward."""
    device = next(model.parameters()).device
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=device)
    ctx = ForwardContext.packed([len(s) for s in seqs], device=device, **ctx_kw)
    hidden = model(ids, ctx)
    out, start = [], 0
    for s in seqs:
        n = len(s)
        out.append(model.token_logprobs(hidden[start:start + n - 1], ids[start + 1:start + n]))
        start += n
    return out, ctx
