"""DSV4Context: everything a forward needs besides the weights.

The model never imports torch.distributed. Parallel runtimes (the embedded engine's scheduler
ranks, the FSDP trainer) subclass DSV4Context and override the hooks: which o-groups of heads
and which experts this rank computes, the collectives between attention and MoE, and how the
attention core runs (kernel, cache). The base class is the single-process reference over packed
variable-length sequences without a cache.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch


# While a CUDA graph is captured: where host_to_device keeps the pinned tensors it copies from
# (keeping_host_inputs).
_graph_host_inputs: list[torch.Tensor] | None = None


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without making the host wait: a copy from pageable memory
    blocks until the GPU has run everything queued before it (a sync per input a step), one
    from pinned memory is queued like a kernel (the caching host allocator keeps the pinned
    buffer until the copy has run). An already pinned ``t`` is copied from as it is: its owner
    must not write to it until the copy has run."""
    if device.type != "cuda" or t.is_cuda:
        return t.to(device)
    pinned = t.pin_memory()
    if _graph_host_inputs is not None and torch.cuda.is_current_stream_capturing():
        _graph_host_inputs.append(pinned)
    return pinned.to(device, non_blocking=True)


@contextlib.contextmanager
def keeping_host_inputs(keep: list[torch.Tensor]):
    """Around a CUDA graph's capture: the pinned tensors host_to_device copies from while the
    stream captures go into ``keep``. A replay copies from that host memory again (a packed
    batch's per-sequence tables, compressor.py), so it must outlive the capture: the caching
    host allocator would hand it to the next pinned tensor once its copy had run."""
    global _graph_host_inputs
    previous, _graph_host_inputs = _graph_host_inputs, keep
    try:
        yield keep
    finally:
        _graph_host_inputs = previous


def rank_part(t: torch.Tensor, dim: int, part: range) -> torch.Tensor:
    """t's indices ``part`` along ``dim`` (this rank's heads or experts, from the context's
    sharding hooks); t itself when that is all of it. Even a full slice has a backward that
    zero-fills a gradient the size of the whole weight and copies into it: two kernels and two
    passes over the weight per slice, for nothing when the rank holds everything."""
    if part.start == 0 and part.stop == t.shape[dim]:
        return t
    return t.narrow(dim, part.start, len(part))


@dataclass
class DSV4Context:
    cu_seqlens: torch.Tensor            # int32 [B+1] boundaries of the packed sequences
    positions: torch.Tensor             # int64 [T] position of each token in its sequence
    # R3: replay these routings (layer -> (ids [T, k], weights [T, k])) instead of the router's
    # top-k; record every routed layer's (ids, weights) when record_routing is set.
    routing_replay: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    record_routing: bool = False
    routed: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    attention_backend: str | None = None
    # Reproduce SGLang's inference numerics where they differ from plain math (fake FP4 on the
    # V4.1 indexer), so the trainer computes what the server computed.
    serving_numerics: bool = False
    # Per-forward state that V4.1's ratio-1/2 source layers hand to the layers reusing them.
    shared: dict[Any, Any] = field(default_factory=dict)
    # packed() built positions as 0..n-1 per sequence: the ratio-1/2 layers need not check
    # them on the device (a read-back each).
    positions_are_ranges: bool = False

    @classmethod
    def packed(cls, seq_lens: list[int], device: torch.device | str = "cpu",
               **kw) -> "DSV4Context":
        ends = [0, *itertools.accumulate(seq_lens)]
        cu = host_to_device(torch.tensor(ends, dtype=torch.int32), torch.device(device))
        positions = (torch.cat([torch.arange(n, device=device) for n in seq_lens]) if seq_lens
                     else torch.zeros(0, dtype=torch.long, device=device))
        ctx = cls(cu_seqlens=cu, positions=positions, positions_are_ranges=True, **kw)
        ctx.__dict__["seq_bounds"] = list(zip(ends[:-1], ends[1:]))  # no read-back from the device
        return ctx

    @functools.cached_property  # read back once per forward, not once per compressed layer
    def seq_bounds(self) -> list[tuple[int, int]]:
        cu = self.cu_seqlens.tolist()
        return list(zip(cu[:-1], cu[1:]))

    @functools.cached_property  # one for every layer's attention kernel, not one per layer
    def first_rows(self) -> torch.Tensor:
        from ...attention.dsv4_reference import sequence_first_rows

        return sequence_first_rows(self.cu_seqlens, self.positions.shape[0])

    def rope_table(self, freqs: torch.Tensor,
                   compressed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """rope.rope_table(positions, freqs), once a forward for each of the two frequency sets:
        every layer with a compressor has the same (rope.layer_inv_freq), every other layer the
        other. A context serves one forward (its positions are that forward's)."""
        from .rope import rope_table

        tables = self.__dict__.setdefault("_rope_tables", {})
        if compressed not in tables:
            tables[compressed] = rope_table(self.positions, freqs)
        return tables[compressed]

    # ---- sharding ---------------------------------------------------------------------------
    def attn_group_range(self, o_groups: int) -> range:
        return range(o_groups)

    def expert_range(self, n_experts: int) -> range:
        return range(n_experts)

    # ---- collectives (identity in one process) ---------------------------------------------
    def attn_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial

    def mlp_gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def mlp_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial

    # ---- attention core ---------------------------------------------------------------------
    def attend(self, layer_id: int, q: torch.Tensor, kv: torch.Tensor, sinks: torch.Tensor,
               window: int, scale: float, comp_kv: torch.Tensor | None,
               comp_idx: torch.Tensor | None) -> torch.Tensor:
        """q [T, H, D], kv [T, D] (this forward's tokens), compressed entries -> [T, H, D].
        The Triton kernel on CUDA, the torch reference on CPU (attention_backend overrides)."""
        from ...attention.dsv4 import dsv4_attention

        # The bounds are on the host once per forward and the picks come from this model's own
        # indexer, so the per-layer value checks (a device sync each on CUDA) are left out.
        if self.seq_bounds and self.seq_bounds[-1][1] != q.shape[0]:
            raise ValueError(f"cu_seqlens ends at {self.seq_bounds[-1][1]}, but q has "
                             f"{q.shape[0]} tokens")
        return dsv4_attention(q, kv, sinks, self.cu_seqlens, window, scale,
                              None if comp_kv is None else comp_kv.to(q.dtype), comp_idx,
                              backend=self.attention_backend, check_values=False,
                              first_rows=self.first_rows)

    def compressed_as_read(self, source_layer: int, entries: torch.Tensor,
                           rope_dim: int) -> torch.Tensor:
        """Serving numerics: the compressed entries of layer ``source_layer`` (the layer itself,
        or a V4.1 reader's kv source) as SGLang's attention reads them back from its fp8 cache.
        A runtime with a cache may hand back rows it rounded once, when it stored them."""
        from .kv_numerics import kv_cache_round_trip

        return kv_cache_round_trip(entries, rope_dim)

    # ---- R3 ---------------------------------------------------------------------------------
    def replayed_routing(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.routing_replay is None else self.routing_replay.get(layer_id)

    def record(self, layer_id: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        if self.record_routing:
            self.routed[layer_id] = (ids.detach(), weights.detach())
