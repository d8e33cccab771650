"""How the engine runs the unmodified DSV4 model over its cache: module hooks.

The model computes every forward from its own tokens (packed sequences, no cache). The engine
keeps the model's math and changes only what the modules read, with forward hooks that act while
an EngineForwardContext is active (``ModelHooks.active``):

  Compressor (CSA, HCA, the CSA indexer's)  its ``wkv``/``wgate`` projections of this forward's
      tokens are written to the pool and replaced by the projections of every position of each
      sequence, and its ``bounds`` by the whole sequences': the model's own pooling, norm and
      RoPE then produce the compressed entries of the whole history, and its indexer/visibility
      code selects among them for the new queries (their positions are absolute).
  MoE  the input rows (and token ids, for hash routing) are gathered over the world before the
      module and the output sliced back to this DP group after it (forward_context.py).
  EngramHasher  receives each sequence's preceding tokens (plan.engram_history), so n-grams
      reach back across a cached prefix as in SGLang's extend and decode.
  V4.1 ratio-1/2 layers  the model's low_ratio_entries needs whole sequences (its entry layout
      and indexer run from position 0). A kv source's entries and index keys are cached per
      entry (at the slot of the group's last token): a forward computes those of the groups
      its tokens complete (kv_source_entries) and reads the rest (EngineForwardContext
      .cached_entries); a ratio-2 group may start on a cached token, whose input (x after
      attn_norm) is the only input row cached. The layer's ``compressed`` then runs the
      model's low_ratio_entries over the whole context of every sequence (EngineForwardContext
      .context_*, its own shared dict) with those entries and this forward's own x and q_lora
      rows, selecting for this forward's queries only (query_starts). This is an instance
      attribute set once at load (the model offers no context hook for it yet).

The attention core itself goes through EngineForwardContext.attend (the model's hook point).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ..model.dsv4.compressor import Compressor
from ..model.dsv4.moe import MoE
from .forward_context import EngineForwardContext


def cached_row_widths(model: nn.Module) -> dict[str, int]:
    """The pool's rows: one K=V latent per layer, the projections of every V4 compressor, the
    entries (and index keys) of the V4.1 kv sources and the inputs of the ratio-2 ones."""
    cfg = model.cfg
    widths = {f"layers.{i}.kv": cfg.head_dim for i in range(cfg.num_hidden_layers)}
    for name, mod in model.named_modules():
        if isinstance(mod, Compressor):
            widths[f"{name}.wkv"] = mod.wkv.out_features
            widths[f"{name}.wgate"] = mod.wgate.out_features
    for i in cfg.kv_source_layer_ids:
        widths[f"layers.{i}.v41_kv"] = cfg.head_dim
        if i in cfg.index_source_layer_ids:   # its indexer owns the index keys
            widths[f"layers.{i}.v41_keys"] = cfg.index_head_dim
        if cfg.compress_ratios[i] == 2:  # a pair may start on a cached token: its input
            widths[f"layers.{i}.attn_x"] = cfg.hidden_size
    return widths


def _context_compressed(attn: nn.Module, hooks: "ModelHooks"):
    """attn.compressed for a V4.1 ratio-1/2 layer served from the cache (see the module doc)."""
    from ..model.dsv4.v41_sparse import kv_source_entries, low_ratio_entries

    cfg, layer_id = attn.cfg, attn.layer_id
    plain = attn.compressed

    def compressed(x: torch.Tensor, q_lora: torch.Tensor, ctx):
        if ctx is not hooks.ctx:
            return plain(x, q_lora, ctx)
        # this forward's real rows: each sequence's new tokens, in the context's order
        n = ctx.plan.num_tokens
        x, q_lora = x[:n], q_lora[:n]
        kv_entries = None
        if layer_id in cfg.kv_source_layer_ids:  # the entries its tokens complete, then all
            kv_entries = ctx.cached_entries(
                layer_id, attn.ratio, x,
                lambda rows, layout: kv_source_entries(attn, rows, layout, ctx.serving_numerics),
                cfg.qk_rope_head_dim)
        # context_positions are 0..seq_len-1 per sequence by construction (_layout_window);
        # only this forward's tokens are projected and scored (the cached ones' picks are
        # unused), so x and q_lora are this forward's rows alone
        entries, selected = low_ratio_entries(cfg, layer_id, attn, x, q_lora,
                                              ctx.context_positions, ctx.context_bounds,
                                              ctx.context_shared, ctx.serving_numerics,
                                              check_positions=False,
                                              query_starts=ctx.context_query_starts,
                                              kv_entries=kv_entries)
        mine = selected.new_full((ctx.positions.shape[0], selected.shape[1]), -1)
        mine[:n] = selected[ctx.new_context_rows]
        return entries, mine

    return compressed


class ModelHooks:
    def __init__(self, model: nn.Module):
        self.ctx: EngineForwardContext | None = None
        self.handles = []
        for name, mod in model.named_modules():
            if isinstance(mod, Compressor):
                self.handles.append(mod.register_forward_pre_hook(self._compressor_bounds))
                for proj in ("wkv", "wgate"):
                    self.handles.append(getattr(mod, proj).register_forward_hook(
                        self._cached_projection(f"{name}.{proj}")))
            elif isinstance(mod, MoE):
                self.handles.append(mod.register_forward_pre_hook(self._moe_gather))
                self.handles.append(mod.register_forward_hook(self._moe_local))
        self.plain_compressed = []
        for layer in model.layers:
            if layer.attn.ratio in (1, 2):
                self.plain_compressed.append((layer.attn, layer.attn.compressed))
                layer.attn.compressed = _context_compressed(layer.attn, self)
        if getattr(model, "engram_hasher", None) is not None:
            self.handles.append(model.engram_hasher.register_forward_pre_hook(
                self._engram_history, with_kwargs=True))

    @contextmanager
    def active(self, ctx: EngineForwardContext):
        self.ctx = ctx
        try:
            yield ctx
        finally:
            self.ctx = None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for attn, _ in self.plain_compressed:
            del attn.compressed   # back to the class's method

    # ---- hooks ------------------------------------------------------------------------------
    def _compressor_bounds(self, module, args):
        if self.ctx is None:
            return None
        x, _bounds, freqs = args
        return x, self.ctx.context_bounds, freqs

    def _cached_projection(self, name: str):
        def hook(module, args, output):
            return None if self.ctx is None else self.ctx.cached_rows(name, output)
        return hook

    def _moe_gather(self, module, args):
        if self.ctx is None:
            return None
        x, input_ids, ctx = args
        return ctx.moe_gather(x), ctx.moe_gather(input_ids), ctx

    def _moe_local(self, module, args, output):
        return None if self.ctx is None else self.ctx.moe_local(output)

    def _engram_history(self, module, args, kwargs):
        if self.ctx is None:
            return None
        input_ids, cu = args
        history = self.ctx.plan.engram_history
        if history is None:   # an idle forward
            history = torch.zeros(0, module.max_ngram_size - 1, dtype=torch.long)
        history = history.to(input_ids.device)
        if input_ids.shape[0] > int(cu[-1]):   # padding rows: one more (blocked) sequence
            cu = torch.cat([cu, cu.new_tensor([input_ids.shape[0]])])
            history = torch.cat([history, history.new_zeros(1, history.shape[1])])
        return (input_ids, cu), {"history": history, "positions": self.ctx.positions}
