"""ForwardContext: everything a forward needs besides the weights.

The model never imports torch.distributed. Parallel runtimes (the embedded engine's scheduler
ranks, the FSDP trainer) subclass ForwardContext and override the hooks below: which shard of
heads/experts/MLP columns this rank computes, the collectives between the attention and the MoE
part, and how attention reads and writes a KV cache. The base class is the single-process
reference: packed variable-length sequences, no cache, identity collectives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .engram import ngram_window_from_packed


@dataclass
class ForwardContext:
    cu_seqlens: torch.Tensor            # int32 [B+1] boundaries of the packed sequences
    positions: torch.Tensor             # int64 [T]
    # R3: replay these routings (layer -> (ids [T, k] int, weights [T, k] float)) instead of
    # running the router; record the routing of every MoE layer when record_routing is set.
    routing_replay: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    record_routing: bool = False
    routed: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    attention_backend: str | None = None  # attend's sink_attention backend (None: auto/env)

    @classmethod
    def packed(cls, seq_lens: list[int], device: torch.device | str = "cpu",
               **kw) -> "ForwardContext":
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32, device=device)
        cu[1:] = torch.cumsum(lens, 0)
        positions = torch.cat([torch.arange(n, device=device) for n in seq_lens]) if seq_lens \
            else torch.zeros(0, dtype=torch.long, device=device)
        return cls(cu_seqlens=cu, positions=positions, **kw)

    # ---- sharding: which part of each layer this rank computes ------------------------------
    def attn_group_range(self, o_groups: int) -> range:
        return range(o_groups)

    def expert_range(self, n_experts: int) -> range:
        return range(n_experts)

    def mlp_slice(self, intermediate_size: int) -> slice:
        return slice(0, intermediate_size)

    # ---- collectives (identity in one process) ---------------------------------------------
    def attn_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Partial attention output over local heads -> this rank's token shard of the sum."""
        return partial

    def token_shard(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of a full (DP-local) token tensor that this rank owns after attn_reduce."""
        return x

    def mlp_gather(self, x_shard: torch.Tensor) -> torch.Tensor:
        """Token shard -> the tokens every rank's MLP/MoE runs on."""
        return x_shard

    def mlp_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Partial MLP output over gathered tokens -> this rank's token shard of the sum."""
        return partial

    def attn_gather(self, h_shard: torch.Tensor) -> torch.Tensor:
        """Token shard -> all DP-local tokens, for the next attention layer."""
        return h_shard

    # ---- attention --------------------------------------------------------------------------
    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sinks: torch.Tensor | None, window: int | None, scale: float) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (this forward's tokens) -> [T, Hq, D]."""
        from ..attention import sink_attention

        return sink_attention(q, k, v, sinks, self.cu_seqlens, self.cu_seqlens, causal=True,
                              window=window, softmax_scale=scale, backend=self.attention_backend)

    # ---- Engram -----------------------------------------------------------------------------
    def ngram_window(self, input_ids: torch.Tensor, n: int) -> torch.Tensor:
        """[T, n]: column j holds the token j steps back (-1 before the sequence start)."""
        return ngram_window_from_packed(input_ids, self.cu_seqlens, n)

    # ---- R3 ---------------------------------------------------------------------------------
    def replayed_routing(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.routing_replay is None:
            return None
        return self.routing_replay.get(layer_id)

    def record(self, layer_id: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        if self.record_routing:
            self.routed[layer_id] = (ids.detach(), weights.detach())
