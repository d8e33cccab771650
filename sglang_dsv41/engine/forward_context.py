"""EngineForwardContext: DSV4Context for one scheduler rank of the embedded engine.

Sharding under DP attention (T ranks, D DP groups of A = T/D attention-TP ranks), SGLang's layout:
- attention: a rank computes o_groups/A output groups (its heads) on every token of its DP group;
  attn_reduce sums the groups' partial outputs with a reduce-scatter by token plus an all-gather
  inside the attention-TP group, which is why a DP group's token count must be a multiple of A
  (prefill padding: without it the collective fails exactly as SGLang's does);
- MoE: the MoE module's input is all-gathered over the world (each rank contributes its 1/A token
  shard of its DP group, so every DP group's tokens appear once, in order), each rank computes
  its experts (expert_range) on all of them, mlp_reduce all-reduces the partial sums, and each
  rank keeps its DP group's rows (model_hooks.py hooks the MoE module for the gather/slice).
  A rank without tokens still joins those collectives (idle batch).
- the attention core reads the cache (TokenRowPool): this forward's K=V latents are written at
  plan.slots, then a decode forward (one new token per sequence) runs the paged decode
  (dsv4_decode) over the pool's pages through plan.decode_page_table, and any other forward
  runs dsv4_attention over each query's window gathered from the pool; both dispatch by device
  (Triton on CUDA, the torch reference on CPU); the compressors see their cached per-token rows
  (model_hooks.py).
Every rank holds the full weights and computes only its shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..attention.dsv4 import dsv4_attention, dsv4_decode
from ..model.dsv4.context import DSV4Context

if TYPE_CHECKING:
    from .batch import ForwardPlan
    from .dist import DistGroups
    from .kv_cache import TokenRowPool


def split_range(n: int, parts: int, index: int) -> range:
    return range(index * n // parts, (index + 1) * n // parts)


def cu_of(lens: list[int], device) -> torch.Tensor:
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32, device=device)
    if lens:
        cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32, device=device), 0)
    return cu


@dataclass
class EngineForwardContext(DSV4Context):
    plan: "ForwardPlan | None" = None
    pool: "TokenRowPool | None" = None
    groups: "DistGroups | None" = None      # None: one process (tests, tp=1 without a world)
    dp_tokens: list[int] = field(default_factory=list)  # padded tokens of each DP group

    def __post_init__(self) -> None:
        info = self.groups.info if self.groups is not None else None
        self._a = info.attn_tp_size if info else 1
        self._w = info.world_size if info else 1
        self._rank = info.rank if info else 0
        self._attn_rank = info.attn_tp_rank if info else 0
        dp_rank = info.dp_rank if info else 0
        dp_of = info.dp_of if info else (lambda r: 0)
        if not self.dp_tokens:
            self.dp_tokens = [self.plan.padded_tokens]
        self._local = self.dp_tokens[dp_rank]
        self._shards = [self.dp_tokens[dp_of(r)] // self._a for r in range(self._w)]
        self._max_shard = max(self._shards)
        m, dev = self._max_shard, self.positions.device
        # Rows of the padded [world * max_shard] layout that hold real shards, in world order.
        self._gather_rows = torch.cat([torch.arange(r * m, r * m + s) for r, s in
                                       enumerate(self._shards)]).to(dev)
        self.dp_offset = sum(self.dp_tokens[:dp_rank])
        # this forward's pool slots and its context's, on the device once for every layer
        self._slots, self._context_slots = self.plan.slots.to(dev), self.plan.context_slots.to(dev)
        self._layout_window()
        # a decode forward's page table and seq_lens, on the device once for every layer
        self._decode_tables = None
        if self.plan.decode_page_table is not None and self.plan.num_tokens:
            self._decode_tables = (self.plan.decode_page_table.to(dev),
                                   torch.tensor(self.plan.seq_lens, dtype=torch.int32,
                                                device=dev))

    def _layout_window(self) -> None:
        """The context: every sequence's positions [0, seq_len), packed (context_bounds); this
        forward's tokens are the last extend_len of each."""
        plan, dev = self.plan, self.positions.device
        self.window_size = None
        self._seq_start = [s - n for s, n in zip(plan.seq_lens, plan.extend_lens)]
        self.context_bounds, new_rows, at = [], [], 0
        self.context_query_starts = []  # each sequence's first new row in the context
        for s, n in zip(plan.seq_lens, plan.extend_lens):
            self.context_bounds.append((at, at + s))
            self.context_query_starts.append(at + s - n)
            new_rows.append(torch.arange(at + s - n, at + s))
            at += s
        self.context_positions = (torch.cat([torch.arange(s) for s in plan.seq_lens]).to(dev)
                                  if plan.seq_lens else torch.zeros(0, dtype=torch.long,
                                                                    device=dev))
        self.new_context_rows = (torch.cat(new_rows).to(dev) if new_rows else
                                 torch.zeros(0, dtype=torch.long, device=dev))
        # model_hooks' V4.1 layers run over the context: their sources' entries and selections
        self.context_shared: dict = {}

    def _window_rows(self, window: int) -> None:
        if self.window_size == window:
            return
        plan, dev = self.plan, self.positions.device
        cache_rows, query_rows, lens, at = [], [], [], 0
        for (_, c1), start, n in zip(self.context_bounds, self._seq_start, plan.extend_lens):
            tail = min(window - 1, start)
            cache_rows.append(torch.arange(c1 - n - tail, c1))
            query_rows.append(torch.arange(at + tail, at + tail + n))
            lens.append(tail + n)
            at += tail + n
        empty = torch.zeros(0, dtype=torch.long)
        # pool slots of each sequence's window rows (context positions -> slots)
        self._window_slots = self._context_slots[torch.cat(cache_rows or [empty]).to(dev)]
        self._query_rows = torch.cat(query_rows or [empty]).to(dev)
        self._window_cu = cu_of(lens, dev)
        self.window_size = window

    # ---- sharding ---------------------------------------------------------------------------
    def attn_group_range(self, o_groups: int) -> range:
        return split_range(o_groups, self._a, self._attn_rank)

    def expert_range(self, n_experts: int) -> range:
        return split_range(n_experts, self._w, self._rank)

    # ---- collectives ------------------------------------------------------------------------
    def attn_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        # A DP group with no tokens skips it as a whole group: nobody else is in this group.
        if self._a == 1 or self._local == 0:
            return partial
        return self.groups.all_gather_attn(self.groups.reduce_scatter_attn(partial))

    def moe_gather(self, x: torch.Tensor) -> torch.Tensor:
        """This DP group's rows -> every DP group's rows (world order)."""
        self._moe_rows = x.shape[0]
        if self._w == 1:
            return x
        s = self._local // self._a
        shard = x[self._attn_rank * s:(self._attn_rank + 1) * s]
        padded = shard.new_zeros(self._max_shard, *shard.shape[1:])
        padded[:shard.shape[0]] = shard
        return self.groups.all_gather_world(padded).index_select(0, self._gather_rows)

    def mlp_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        if self._w == 1:
            return partial
        return self.groups.all_reduce_world(partial)

    def moe_local(self, y: torch.Tensor) -> torch.Tensor:
        """Every DP group's rows -> this DP group's."""
        if self._w == 1:
            return y
        mine = y[self.dp_offset:self.dp_offset + self._local]
        if self._moe_rows > mine.shape[0]:   # an idle forward's placeholder row
            mine = torch.cat([mine, mine.new_zeros(self._moe_rows - mine.shape[0],
                                                   *mine.shape[1:])])
        return mine

    # ---- the cache --------------------------------------------------------------------------
    def _low_ratio_layout(self, ratio: int) -> tuple:
        """For ratio ``ratio``'s V4.1 entries (entry j of a sequence pools its positions
        [j * ratio, (j + 1) * ratio) and is kept at the slot of the last of them), once a
        forward for every kv source of that ratio: the context rows from each sequence's first
        group this forward completes on (a ratio-2 group may start on a cached token), the
        EntryLayout of those groups, the slots of the entries this forward completes and of
        every entry, in sequence order."""
        from ..model.dsv4.v41_sparse import EntryLayout

        key = ("engine_entry_layout", ratio)
        if key not in self.context_shared:
            tail, bounds, new_rows, all_rows, at = [], [], [], [], 0
            for (a, b), first in zip(self.context_bounds, self.context_query_starts):
                length, cached = b - a, first - a
                aligned = cached // ratio * ratio
                tail.append(torch.arange(a + aligned, b))
                bounds.append((at, at + length - aligned))
                at += length - aligned
                last = a + ratio - 1 + ratio * torch.arange(length // ratio)
                new_rows.append(last[cached // ratio:])
                all_rows.append(last)
            empty, dev = torch.zeros(0, dtype=torch.long), self.positions.device
            rows, new, every = (torch.cat(t or [empty]).to(dev) for t in (tail, new_rows, all_rows))
            layout = EntryLayout.build(ratio, self.context_positions[rows], bounds,
                                       check_positions=False)
            self.context_shared[key] = (rows, layout, self._context_slots[new],
                                        self._context_slots[every])
        return self.context_shared[key]

    def cached_entries(self, layer_id: int, ratio: int, x_new: torch.Tensor, compute,
                       rope_dim: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """V4.1 kv source ``layer_id``'s (entries, index keys) of every sequence's context,
        computed only for the groups this forward completes: ``compute(x rows, EntryLayout)``
        -> (entries, keys or None) of those groups, written to the pool and read back with the
        cached ones. Without it a decode step would project and pool the whole history again.
        ``x_new``: the layer input of this forward's tokens; a ratio-2 pair that starts on a
        cached token takes that token's input from the pool (``layers.N.attn_x``).
        Under serving numerics the entries are stored as the attention reads them back from
        SGLang's fp8 cache (rounded once, here; compressed_as_read hands them over as they are)
        rather than rounded again for every layer that reads them, every step."""
        from ..model.dsv4.kv_numerics import kv_cache_round_trip

        rows, layout, new_slots, all_slots = self._low_ratio_layout(ratio)
        if ratio == 1:  # the rows are this forward's own
            x_rows = x_new
        else:
            name = f"layers.{layer_id}.attn_x"
            self.pool.write(name, self._slots[:x_new.shape[0]], x_new)
            x_rows = self.pool.gather(name, self._context_slots[rows])
        entries, keys = compute(x_rows, layout)
        if self.serving_numerics:
            entries = kv_cache_round_trip(entries, rope_dim)
            self.context_shared[("engine_entries_as_read", layer_id)] = True
        out = []
        for name, new in ((f"layers.{layer_id}.v41_kv", entries),
                          (f"layers.{layer_id}.v41_keys", keys)):
            if new is not None:
                self.pool.write(name, new_slots, new)
            out.append(None if new is None else self.pool.gather(name, all_slots))
        return out[0], out[1]

    def compressed_as_read(self, source_layer: int, entries: torch.Tensor,
                           rope_dim: int) -> torch.Tensor:
        if self.context_shared.get(("engine_entries_as_read", source_layer)):
            return entries  # cached_entries stored them so
        return super().compressed_as_read(source_layer, entries, rope_dim)

    def cached_rows(self, name: str, new_rows: torch.Tensor) -> torch.Tensor:
        """Writes this forward's rows of a cached quantity; returns every sequence's rows for
        positions [0, seq_len), packed by context_bounds."""
        self.pool.write(name, self._slots, new_rows)
        return self.pool.gather(name, self._context_slots)

    def attend(self, layer_id: int, q: torch.Tensor, kv: torch.Tensor, sinks: torch.Tensor,
               window: int, scale: float, comp_kv: torch.Tensor | None,
               comp_idx: torch.Tensor | None) -> torch.Tensor:
        """Rows >= num_tokens (padding, an idle plan's placeholder) get zeros. The bounds are
        built on the host from the plan and the picks come from the model's own indexer, so the
        dispatch's value checks (a device sync each on CUDA) are left out."""
        name = f"layers.{layer_id}.kv"
        self.pool.write(name, self._slots, kv)
        n = self.plan.num_tokens
        if n == 0:
            return q.new_zeros(q.shape)
        comp_idx = None if comp_idx is None else comp_idx[:n]
        if self._decode_tables is not None:
            o = self._attend_paged(name, q[:n], sinks, window, scale, comp_kv, comp_idx)
        else:
            o = self._attend_windows(name, q[:n], sinks, window, scale, comp_kv, comp_idx)
        if n == q.shape[0]:
            return o
        out = q.new_zeros(q.shape)
        out[:n] = o
        return out

    def _attend_paged(self, name, q, sinks, window, scale, comp_kv, comp_idx) -> torch.Tensor:
        """One query per sequence, its window read in place through the page table."""
        cache = self.pool.rows[name]
        pages = cache.view(-1, self.pool.page_size, cache.shape[1])
        page_table, seq_lens = self._decode_tables
        o = dsv4_decode(q.to(cache.dtype), pages, page_table, seq_lens, sinks, window, scale,
                        None if comp_kv is None else comp_kv.to(cache.dtype), comp_idx,
                        backend=self.attention_backend, check_values=False)
        return o.to(q.dtype)

    def _attend_windows(self, name, q, sinks, window, scale, comp_kv, comp_idx) -> torch.Tensor:
        """Each sequence's window of latents gathered from the pool, its queries placed at the
        end of it: packed sequences for the prefill attention."""
        self._window_rows(window)
        keys = self.pool.gather(name, self._window_slots).to(q.dtype)
        queries = q.new_zeros(keys.shape[0], *q.shape[1:])
        queries[self._query_rows] = q
        selected = None
        if comp_idx is not None:
            selected = comp_idx.new_full((keys.shape[0], comp_idx.shape[1]), -1)
            selected[self._query_rows] = comp_idx
        o = dsv4_attention(queries, keys, sinks, self._window_cu, window, scale,
                           None if comp_kv is None else comp_kv.to(q.dtype), selected,
                           backend=self.attention_backend, check_values=False)
        return o[self._query_rows]

    # ---- R3 ---------------------------------------------------------------------------------
    def replayed_routing(self, layer_id: int):
        return None  # the server routes; the trainer replays
