"""The DeepSeek V4 / V4.1 text model: embed -> hc_mult streams -> layers -> hc head -> norm -> head.

Each layer: Engram (on its layers) adds to the streams; then two mHC sublayers, attention and MoE,
each reading a collapsed input and writing back into the streams. Packed variable-length input
(ctx.cu_seqlens); no torch.distributed (runtimes override DSV4Context's hooks).
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from .attention import Attention
from .config import DSV4Config
from .context import DSV4Context
from .engram import Engram, EngramHasher
from .mhc import (StreamGradSum, hc_collapse, hc_expand, hc_head, hc_mix, hc_params,
                  hc_weights)
from .moe import MoE
from .names import per_expert_state
from .norm import RMSNorm
from .token_logprobs import token_logprobs
from .v41 import hc_input_from_prev, mhc_combine


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DSV4Config, layer_id: int):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_id)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn = MoE(cfg, layer_id)
        n_mix = (2 + cfg.hc_mult) * cfg.hc_mult
        hc_params(self, "hc_attn", cfg.hc_mult, cfg.hidden_size, n_mix)
        hc_params(self, "hc_ffn", cfg.hc_mult, cfg.hidden_size, n_mix)
        self.engram: nn.Module | None = None
        if layer_id in cfg.engram_layer_ids:
            self.engram = Engram(cfg, layer_id)

    def sublayer(self, streams: torch.Tensor, prev_pre: torch.Tensor | None, which: str, run):
        """One mHC sublayer -> (new streams, its pre). V4 collapses the streams with the
        sublayer's own pre; V4.1 (hc_pre_from_prev_sublayer) with the previous sublayer's, and
        hands its own pre on (stream 0 feeds the model's first sublayer). The streams'
        gradient from their uses is summed by the uses' kernels (StreamGradSum)."""
        cfg = self.cfg
        fn, base, scale = (getattr(self, f"hc_{which}_{p}") for p in ("fn", "base", "scale"))
        grad_sum = StreamGradSum()
        pre, post, comb = hc_weights(hc_mix(streams, fn, cfg.rms_norm_eps, grad_sum), base,
                                     scale, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps)
        x = (hc_input_from_prev(streams, prev_pre, grad_sum) if cfg.hc_pre_from_prev_sublayer
             else hc_collapse(streams, pre))
        return hc_expand(streams, run(x), post, comb, grad_sum), pre

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, ctx: DSV4Context,
                hash_ids: torch.Tensor | None = None, prev_pre: torch.Tensor | None = None):
        """-> (streams, pre of the last sublayer)."""
        if self.engram is not None:
            streams = self.engram(streams, hash_ids[:, self.engram.layer_hash_index])
        streams, pre = self.sublayer(streams, prev_pre, "attn",
                                     lambda x: self.attn(self.attn_norm(x), ctx))
        return self.sublayer(streams, pre, "ffn",
                             lambda x: self.ffn(self.ffn_norm(x), input_ids, ctx))


class LMHead(nn.Linear):
    """``head``: logits, or given ``targets`` only their fp32 log-probabilities, computed a chunk
    of rows at a time (token_logprobs.py) without the [rows, vocab] block. A module call either
    way, so a sharded head (FSDP) unshards and reduces its gradient as for the logits.
    ``fp32_gemm``: how an fp32 head's log-probability GEMMs run (token_logprobs.FP32_GEMMS; the
    trainer's model.lm_head_gemm)."""

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__(hidden_size, vocab_size, bias=False)
        self.fp32_gemm = "ieee"

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        return token_logprobs(x, self.weight, targets, self.fp32_gemm)


class DSV4ForCausalLM(nn.Module):
    def __init__(self, cfg: DSV4Config):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.hc_pre_from_prev_sublayer:  # V4.1 ends with mhc_combine, no hc_head
            hc_params(self, "hc_head", cfg.hc_mult, cfg.hidden_size, cfg.hc_mult)
        self.head = LMHead(cfg.hidden_size, cfg.vocab_size)
        self.engram_hasher = None
        if cfg.engram_layer_ids:
            self.engram_hasher = EngramHasher(cfg)

    def hidden(self, input_ids: torch.Tensor, ctx: DSV4Context) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, hidden] (before the head)."""
        cfg = self.cfg
        ctx.shared.clear()
        hash_ids = (self.engram_hasher(input_ids, ctx.cu_seqlens)
                    if self.engram_hasher is not None else None)
        streams = self.embed(input_ids).unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        pre = None
        for layer in self.layers:
            streams, pre = layer(streams, input_ids, ctx, hash_ids, pre)
        if cfg.hc_pre_from_prev_sublayer:
            return self.norm(mhc_combine(streams, pre))
        x = hc_head(streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, cfg.hc_eps,
                    cfg.rms_norm_eps)
        return self.norm(x)

    def forward(self, input_ids: torch.Tensor, ctx: DSV4Context,
                hidden_index: torch.Tensor | None = None,
                targets: torch.Tensor | None = None, temperature: float = 1.0) -> torch.Tensor:
        """-> logits [T, vocab] in the head's dtype (keep the head fp32 for RL); given
        ``hidden_index`` [N] and ``targets`` [N], the fp32 log-probability [N] of targets[i]
        after the hidden state of row hidden_index[i] (the trainer's, without [T, vocab]) under
        log_softmax(logits / temperature), the distribution a server samples from at that
        temperature (the head has no bias: the rows are divided before it)."""
        if (hidden_index is None) != (targets is None):
            raise ValueError("pass hidden_index and targets together")
        if not (temperature > 0 and math.isfinite(temperature)):
            raise ValueError(f"temperature must be a positive finite number, got {temperature}")
        x = self.hidden(input_ids, ctx)
        if targets is None:
            return self.head(x.to(self.head.weight.dtype))
        rows = x.index_select(0, hidden_index)
        if temperature != 1.0:
            rows = rows.float() / temperature
        return self.head(rows.to(self.head.weight.dtype), targets)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Build the model with ``dtype`` as torch's default (its fp32 parameters are explicit)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


@torch.no_grad()
def init_weights(model: DSV4ForCausalLM, seed: int = 0, std: float | None = None) -> None:
    """Random weights for tests and dummy checkpoints (normal(0, std) for matrices, the
    config's initializer_range by default; norms 1; sinks, ape, biases and mHC bases 0;
    mHC scales 1; Engram q/k weights 1 as SGLang starts them; Engram tables random fp8 rows
    with their e8m0 scales; tid2eid a fixed pseudo-random expert set per token)."""
    cfg = model.cfg
    std = cfg.initializer_range if std is None else std
    gen = torch.Generator().manual_seed(seed)
    # Per expert, in checkpoint order: the same draws as when each expert had its own tensors.
    for name, p in per_expert_state(dict(model.named_parameters())).items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf.endswith("_scale") or leaf in ("q_weight", "k_weight") or (
                leaf == "weight" and p.dim() == 1):
            p.fill_(1.0)
        elif p.dim() == 1 or leaf == "ape" or leaf.endswith("_base"):
            p.zero_()
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    for layer in model.layers:
        if layer.engram is not None:
            layer.engram.embed.reset_table_(gen)
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            scores = torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=gen)
            b.copy_(scores.topk(cfg.num_experts_per_tok, dim=-1).indices.to(b.dtype))
