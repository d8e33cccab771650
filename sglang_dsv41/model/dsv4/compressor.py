"""V4 compressed attention: the CSA (ratio 4) and HCA (ratio 128) compressors and the CSA indexer.

A compressor pools every ``ratio`` tokens of a sequence into one entry: softmax over the window
of (gate + ape) weights the projected latents, then RMSNorm, then RoPE at the window's first
position. CSA overlaps windows: its projections are 2x wide; entry w pools the first half of
window w-1 with the second half of window w (2 x ratio slots; window 0's missing half gets weight
0). A query at position p may see entry w only when the entry's span ended: w < (p + 1) // ratio.
HCA attends to every such entry; CSA to the indexer's top-k of them. The queries of a sequence
are its last tokens (the whole sequence here; the engine's extend after a cached prefix, its
compressor fed the whole history through model hooks), so how many entries a block of queries
may see is bounded by host integers and no count is read back from the device.

Mirrors transformers' DeepseekV4HCACompressor / DeepseekV4CSACompressor / DeepseekV4Indexer
(stateless path). Names are SGLang's flat ones: ``compressor.{wkv,wgate,ape,norm}``,
``indexer.{wq_b,weights_proj}``, ``indexer.compressor.*``.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from ...attention.indexer_scores import indexer_scores
from .config import DSV4Config
from .context import host_to_device
from .norm import RMSNorm
from .rope import apply_rope


class Compressor(nn.Module):
    def __init__(self, hidden: int, head_dim: int, ratio: int, eps: float):
        super().__init__()
        self.ratio, self.head_dim, self.overlap = ratio, head_dim, ratio == 4
        width = 2 * head_dim if self.overlap else head_dim
        self.wkv = nn.Linear(hidden, width, bias=False)
        self.wgate = nn.Linear(hidden, width, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.norm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor, bounds: list[tuple[int, int]], freqs: torch.Tensor
                ) -> tuple[torch.Tensor, list[int]]:
        """x [T, hidden] -> entries [C, head_dim] (normed, RoPE'd) and entry_starts [B+1], a
        host list: sequence s owns entries entry_starts[s]..entry_starts[s+1]-1. Every
        sequence's entries are pooled together: the same kernels for one sequence or many (a
        loop over the packed sequences added launches with each one,
        bench/results/packed_launches_cpu.txt)."""
        # module calls, not one GEMM (projections.py): the engine's cache hooks these layers
        kv_all, gate_all = self.wkv(x), self.wgate(x)
        r, d = self.ratio, self.head_dim
        counts = [(end - start) // r for start, end in bounds]
        starts = [0, *itertools.accumulate(counts)]
        if starts[-1] == 0:
            return x.new_zeros(0, d), starts
        windows, rel = entry_windows(bounds, counts, r, x.device)
        kv = windows(kv_all)
        gate = windows(gate_all).float() + self.ape.float()
        if self.overlap:
            # entry w also pools window w-1's first half; a sequence's entry 0 has none (its
            # weights 0: kv 0, gate -inf)
            prev_kv = torch.cat([kv.new_zeros(1, r, d), kv[:-1, :, :d]])
            prev_gate = torch.cat([gate.new_full((1, r, d), float("-inf")), gate[:-1, :, :d]])
            if sum(n > 0 for n in counts) > 1:  # entry 0 of a later sequence follows another's
                first = (rel == 0)[:, None, None]
                prev_kv = prev_kv.masked_fill(first, 0)
                prev_gate = prev_gate.masked_fill(first, float("-inf"))
            kv = torch.cat([prev_kv, kv[..., d:]], dim=1)
            gate = torch.cat([prev_gate, gate[..., d:]], dim=1)
        pooled = (kv * gate.softmax(dim=1).to(kv.dtype)).sum(dim=1)
        return apply_rope(self.norm(pooled), rel * r, freqs), starts


def entry_windows(bounds: list[tuple[int, int]], counts: list[int], ratio: int,
                  device: torch.device):
    """The whole windows of ``ratio`` rows that the packed sequences' entries pool: -> (a
    function t [T, ...] -> [C, ratio, ...] of every entry's rows, and each entry's index in its
    sequence [C]). One sequence: views of t. Several: one gather by row index (index_select:
    its backward writes each row's gradient once, rows outside every window get zeros)."""
    total = sum(counts)
    entry = torch.arange(total, device=device)
    if len(bounds) == 1:
        start = bounds[0][0]
        return lambda t: t[start:start + total * ratio].view(total, ratio, *t.shape[1:]), entry
    # per sequence: its entries' first index and (first row - ratio x first index)
    firsts = [0, *itertools.accumulate(counts)][:-1]
    host = torch.tensor([firsts, [a - ratio * f for (a, _), f in zip(bounds, firsts)], counts])
    firsts_d, offsets_d, counts_d = host_to_device(host, device).unbind(0)
    rel = entry - firsts_d.repeat_interleave(counts_d, output_size=total)
    rows = ((offsets_d.repeat_interleave(counts_d, output_size=total) + ratio * entry)[:, None]
            + torch.arange(ratio, device=device)).flatten()
    return lambda t: t.index_select(0, rows).view(total, ratio, *t.shape[1:]), rel


def stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest per row, equal scores broken toward the lower index.

    torch.topk breaks ties differently for rows of different lengths, and relu'd indexer scores
    tie often (exact zeros): a decode step (entries so far) and a recompute of the whole
    sequence (future entries masked) must pick the same entries, so the rule must not depend
    on the masked tail.
    """
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


# Selection scores are built for at most this many (query, head, entry) products at a time, so
# their memory is O(chunk x entries) and not O(T x entries): V4.1's ratio-1 index scores of one
# 65,536-token sequence would be a [T, 16, T] bf16 block of 128 GiB. The picks have no gradient,
# so the chunks cost no recompute. Read at call time (tests shrink it to force many chunks).
SELECTION_CHUNK_PRODUCTS = 1 << 28


def query_chunks(start: int, end: int, entries: int, heads: int) -> list[tuple[int, int]]:
    """Row ranges [a, b) covering queries start..end-1 whose [rows, heads, entries] score block
    holds at most SELECTION_CHUNK_PRODUCTS products (one row at least)."""
    rows = max(1, SELECTION_CHUNK_PRODUCTS // max(1, heads * entries))
    return [(a, min(a + rows, end)) for a in range(start, end, rows)]


def entries_seen_bound(entries: int, after: int, ratio: int) -> int:
    """At most how many entries a query may see that comes ``after`` tokens before the last
    token of its sequence, whose ``entries`` (= length // ratio) the last token sees: the
    length is entries * ratio + m (m < ratio), so (length - after) // ratio <= entries -
    after // ratio (exact when m >= after % ratio, one too many otherwise: a row's picks do not
    depend on an entry it may not see, stable_topk)."""
    return max(0, entries - after // ratio)


def visible_entries(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """[T] number of compressed entries a query may see (their span ended at or before it)."""
    return torch.div(positions + 1, ratio, rounding_mode="floor")


def all_visible_index(positions: torch.Tensor, bounds: list[tuple[int, int]],
                      entry_starts: list[int], ratio: int) -> torch.Tensor:
    """HCA selection: every visible entry of the query's sequence, as rows of the packed
    entries; [T, max entries], -1 past the visible ones and on rows outside every sequence's
    bounds (the engine pads a batch's rows). One pass for all sequences."""
    t = positions.shape[0]
    width = max((b - a for a, b in zip(entry_starts[:-1], entry_starts[1:])), default=0)
    cols = torch.arange(width, dtype=torch.int32, device=positions.device)
    seen = visible_entries(positions, ratio)
    if len(bounds) == 1 and bounds[0] == (0, t):
        return torch.where(cols[None, :] < seen[:, None], cols + entry_starts[0], -1)
    # the rows as segments: (first entry, rows, 1) for a sequence, (0, rows, 0) for a gap
    segments, row = [], 0
    for (a, b), first in zip(bounds, entry_starts):
        if not row <= a <= b <= t:
            raise ValueError(f"all_visible_index: bounds {bounds[:4]}... are not ordered, "
                             f"disjoint rows of the {t} queries")
        segments += [(0, a - row, 0), (first, b - a, 1)]
        row = b
    segments.append((0, t - row, 0))
    host = torch.tensor(segments, dtype=torch.int32).t()
    first, lens, inside = host_to_device(host, positions.device).unbind(0)
    per_row = torch.stack([first, inside]).repeat_interleave(lens, dim=1, output_size=t)
    seen = seen * per_row[1]
    return torch.where(cols[None, :] < seen[:, None], cols + per_row[0, :, None], -1)


class Indexer(nn.Module):
    """CSA's lightning indexer: score = sum_h w_h * relu(q_h . k_s) over its own compressed
    keys; each query keeps the top-k visible entries."""

    def __init__(self, cfg: DSV4Config, ratio: int):
        super().__init__()
        self.ratio, self.n_heads, self.head_dim = ratio, cfg.index_n_heads, cfg.index_head_dim
        self.topk = cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        self.compressor = Compressor(cfg.hidden_size, self.head_dim, ratio, cfg.rms_norm_eps)

    # The picks are integers: no gradient reaches the indexer through them, so no graph is built.
    @torch.no_grad()
    def forward(self, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor,
                bounds: list[tuple[int, int]], entry_starts: list[int], freqs: torch.Tensor
                ) -> torch.Tensor:
        """-> selected entries [T, min(topk, max entries)] as packed rows, -1 for none."""
        keys, key_starts = self.compressor(x, bounds, freqs)
        q = apply_rope(self.wq_b(q_lora).view(-1, self.n_heads, self.head_dim), positions, freqs)
        w = self.weights_proj(x).float() * self.n_heads ** -0.5
        counts = [b - a for a, b in zip(entry_starts[:-1], entry_starts[1:])]
        width = min(self.topk, max(counts, default=0))
        out = torch.full((x.shape[0], width), -1, dtype=torch.int32, device=x.device)
        for s, (start, end) in enumerate(bounds):
            for a, b in query_chunks(start, end, counts[s], self.n_heads):
                # Only the entries some query of the chunk may see (its last query the most): a
                # row's picks do not depend on the masked tail (stable_topk), and -1 pads rows
                # that see fewer than top-k.
                n = entries_seen_bound(counts[s], end - b, self.ratio)
                if n == 0:
                    continue
                seen = visible_entries(positions[a:b], self.ratio)
                scores = indexer_scores(q[a:b], keys[key_starts[s]:key_starts[s] + n], w[a:b],
                                        self.head_dim ** -0.5, visible=seen)
                picks = stable_topk(scores, min(self.topk, n))[1]
                out[a:b, :picks.shape[1]] = torch.where(picks < seen[:, None],
                                                        picks + entry_starts[s], -1)
        return out
