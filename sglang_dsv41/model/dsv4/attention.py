"""DeepSeek V4 / V4.1 attention: low-rank Q, one K=V latent head, sinks, window + compressed
entries, grouped output projection.

  q_lora = q_norm(wq_a x);  q = wq_b q_lora  [T, H, D]  (V4: unweighted per-head RMS norm)
  kv = kv_norm(wkv x)  [T, D]: the key and the value of every head (MQA)
  RoPE on the last qk_rope_head_dim channels of q and kv (interleaved pairs)
  o = attend(q, kv, sinks, window, compressed entries selected per query)
  the rope slice of o is de-rotated (RoPE at -position): K=V carried rope into the values
  o grouped in o_groups -> wo_a per group [G, R, H*D/G] -> wo_b [hidden, G*R]

Names are SGLang's flat ones (``attn.wq_a`` ... ``attn.attn_sink``). Attention TP splits the
o-groups (ctx.attn_group_range): heads, wq_b rows and wo_a rows of the local groups, then
ctx.attn_reduce sums wo_b's partial outputs, so attention TP can never exceed o_groups.
"""

from __future__ import annotations

import torch
from torch import nn

from .compressor import Compressor, Indexer, all_visible_index
from .config import DSV4Config
from .context import DSV4Context, rank_part
from .kv_numerics import served_window_kv
from .mhc import unweighted_rms_norm
from .norm import RMSNorm
from .projections import linears_of
from .rope import apply_rope, layer_inv_freq
from .v41_sparse import build_low_ratio_modules, low_ratio_entries


class GroupedProjection(torch.autograd.Function):
    """out[t, g] = o[t, g] @ w[g]^T for o [T, G, I], w [G, R, I] -> [T, G, R]: batched matmuls
    over group views of o that read and write the token-major tensors in place. The einsum it
    replaces made o group-major and handed RoPE's backward a group-major gradient that reshape
    copied (two 256 MiB copies per layer at 4k tokens, 64 heads, D 512); same products, same
    fp32 accumulation. The forward's bmm is a plain one (no out=): selective checkpointing saves
    aten.bmm outputs (trainer_bridge/parallelize.py) and would hand an out= call's cache back
    without filling the out tensor; the [T, G, R] view it returns costs wo_b one 64 MiB copy."""

    @staticmethod
    def forward(ctx, o, w):
        ctx.save_for_backward(o, w)
        return torch.bmm(o.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)

    @staticmethod
    def backward(ctx, grad):
        o, w = ctx.saved_tensors
        by_group = grad.transpose(0, 1)                                   # [G, T, R]
        grad_o = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_o = torch.empty(o.shape, dtype=o.dtype, device=o.device)
            torch.bmm(by_group, w, out=grad_o.transpose(0, 1))
        if ctx.needs_input_grad[1]:
            grad_w = torch.bmm(by_group.transpose(1, 2), o.transpose(0, 1))
        return grad_o, grad_w


class Attention(nn.Module):
    def __init__(self, cfg: DSV4Config, layer_id: int):
        super().__init__()
        self.layer_id, self.cfg = layer_id, cfg
        self.ratio = cfg.compress_ratio(layer_id)
        h, d, g = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
        self.n_heads, self.head_dim, self.o_groups = h, d, g
        self.window, self.scale, self.eps = cfg.window_size, d ** -0.5, cfg.rms_norm_eps
        self.wq_a = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, h * d, bias=False)
        self.wkv = nn.Linear(cfg.hidden_size, d, bias=False)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.wo_a = nn.Linear(h * d // g, g * cfg.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(g * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(h, dtype=torch.float32))
        self.compressor: nn.Module | None = None
        self.indexer: nn.Module | None = None
        if self.ratio in (4, 128):
            self.compressor = Compressor(cfg.hidden_size, d, self.ratio, cfg.rms_norm_eps)
            if self.ratio == 4:
                self.indexer = Indexer(cfg, self.ratio)
        elif self.ratio in (1, 2):
            self.compressor, self.indexer = build_low_ratio_modules(cfg, layer_id)
        self.register_buffer("freqs", layer_inv_freq(cfg, self.ratio > 0), persistent=False)

    def compressed(self, x: torch.Tensor, q_lora: torch.Tensor, ctx: DSV4Context):
        """-> (entries [C, D] or None, selected rows [T, K] or None) for this layer's kind."""
        if self.ratio == 0:
            return None, None
        if self.ratio in (1, 2):
            return low_ratio_entries(self.cfg, self.layer_id, self, x, q_lora, ctx.positions,
                                     ctx.seq_bounds, ctx.shared, ctx.serving_numerics,
                                     check_positions=not ctx.positions_are_ranges)
        bounds = ctx.seq_bounds
        entries, starts = self.compressor(x, bounds, self.freqs)
        if self.indexer is None:
            return entries, all_visible_index(ctx.positions, bounds, starts, self.ratio)
        return entries, self.indexer(x, q_lora, ctx.positions, bounds, starts, self.freqs)

    def forward(self, x: torch.Tensor, ctx: DSV4Context) -> torch.Tensor:
        """x [T, hidden] (after attn_norm) -> [T, hidden] (this rank's partial under attn TP)."""
        t, d = x.shape[0], self.head_dim
        groups = ctx.attn_group_range(self.o_groups)
        per_group = self.n_heads // self.o_groups
        heads = range(groups.start * per_group, groups.stop * per_group)
        q_lora, kv = linears_of(x, self.wq_a, self.wkv)
        q_lora = self.q_norm(q_lora)
        wq_b = rank_part(self.wq_b.weight, 0, range(heads.start * d, heads.stop * d))
        q = torch.nn.functional.linear(q_lora, wq_b).view(t, -1, d)
        if self.cfg.q_head_norm:
            q = unweighted_rms_norm(q, self.eps)
        table = ctx.rope_table(self.freqs, self.ratio > 0)  # q's, kv's and the output's
        # The gradients of the rotated q and of the de-rotated output are read by nothing but
        # these rotations (the attention's fresh dq; the grouped projection's fresh dx):
        # rotated in place by the backward.
        q = apply_rope(q, ctx.positions, self.freqs, table=table, overwrite_grad=True)
        kv = (served_window_kv(kv, self.kv_norm, ctx.positions, self.freqs, table)
              if ctx.serving_numerics
              else apply_rope(self.kv_norm(kv), ctx.positions, self.freqs, table=table))
        entries, selected = self.compressed(x, q_lora, ctx)
        if ctx.serving_numerics and entries is not None:  # read back from SGLang's fp8 cache
            source = (self.cfg.kv_source_for(self.layer_id) if self.ratio in (1, 2)
                      else self.layer_id)
            entries = ctx.compressed_as_read(source, entries, self.cfg.qk_rope_head_dim)
        o = ctx.attend(self.layer_id, q, kv, rank_part(self.attn_sink, 0, heads), self.window,
                       self.scale, entries, selected)
        o = apply_rope(o, ctx.positions, self.freqs, inverse=True, table=table,
                       overwrite_grad=True)
        rank = self.wo_a.weight.shape[0] // self.o_groups
        wo_a = rank_part(self.wo_a.weight.view(self.o_groups, rank, -1), 0, groups)
        o = GroupedProjection.apply(o.reshape(t, len(groups), -1), wo_a.to(o.dtype))
        wo_b = rank_part(self.wo_b.weight, 1, range(groups.start * rank, groups.stop * rank))
        return ctx.attn_reduce(torch.nn.functional.linear(o.flatten(1), wo_b))
