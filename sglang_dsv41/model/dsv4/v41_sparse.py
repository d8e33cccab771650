"""DeepSeek V4.1 ratio-1/2 attention layers: compressors, indexers and the entries a query sees.

What SGLang 0.5.23 computes (``layers/attention/dsv4/dsv41_sparse.py``, the torch paths of
``deepseek_v4_backend.py`` ``_low_ratio_compress_torch`` / ``_low_ratio_write_group`` /
``_low_ratio_index_topk`` and ``v41_indexer/``), over packed sequences that start at position 0:

* Only ``kv_source_layer_ids`` own a compressor (``attn.compressor.{wkv,wgate,norm}``). Ratio 1:
  one entry per token, ``norm(wkv(x))``. Ratio 2: one entry per complete pair of positions
  (2g, 2g+1), ``norm(sum_i kv_i * softmax_i(score))`` with fp32 projections and pooling; a
  trailing odd token has no entry yet. Entries are RoPE'd at their first position (2g, or p).
  Every later layer of the same ratio reads the nearest kv source at or before it.
* Only ``index_source_layer_ids`` own an indexer (``attn.indexer.{wq_b,weights_proj}``; on a
  layer that is also a kv source ``wk`` and ``k_norm`` too: it writes the index keys
  ``rope(k_norm(wk(latent)))`` of its kv storage). An index source scores its kv source's keys:
  ``sum_h relu(q_h . k) * w_h`` in the activation dtype, ``w = weights_proj(x) / sqrt(d * H)``,
  and keeps the top ``index_topk`` of the entries a query at position p may see,
  ``j < (p + 1) // ratio`` (the group is complete). Layers of that ratio up to the next index
  source attend the same selection (SGLang keeps one selection buffer per ratio).
* Candidate blocks (``candidate_source_layer_id``): the candidate source also publishes, per
  query, its ``candidate_topk_blocks`` best blocks of ``candidate_block_size`` entries (block
  maximum, the newest block always kept); every later index source picks its top-k only inside
  those blocks (SGLang's dense-block scheme, the torch path of ``DenseBlocksBackend``).
* Serving numerics: indexer q and k rounded to FP4 after RoPE, compressed KV to FP4 with e4m3
  scales (see ``v41.py``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...attention.dsv4 import resolve_backend
from ...attention.indexer_scores import indexer_scores, mask_unseen
from .compressor import query_chunks, stable_topk
from .config import DSV4Config
from .norm import RMSNorm
from .rope import apply_rope
from .v41 import fake_quant_compressed_kv, fake_quant_fp4

LOW_RATIOS = (1, 2)


class V41Compressor(nn.Module):
    """``layers.N.attn.compressor`` of a ratio-1/2 kv-source layer."""

    def __init__(self, hidden_size: int, head_dim: int, ratio: int, eps: float):
        super().__init__()
        if ratio not in LOW_RATIOS:
            raise ValueError(f"V41Compressor handles ratios {LOW_RATIOS}, not {ratio}")
        self.ratio = ratio
        self.wkv = nn.Linear(hidden_size, head_dim, bias=False)
        if ratio == 2:
            self.wgate = nn.Linear(hidden_size, head_dim, bias=False)
        self.norm = RMSNorm(head_dim, eps)

    def latents(self, x: torch.Tensor, layout: "EntryLayout") -> torch.Tensor:
        """x [T, hidden] -> pre-RoPE latents [C, head_dim] in x's dtype, one per entry."""
        if self.ratio == 1:
            return self.norm(self.wkv(x).to(x.dtype))
        # fp32 projections and pooling (SGLang's linear_bf16_fp32 and pool_pairs)
        xf = x.float()
        kv = torch.mm(xf, self.wkv.weight.float().t())
        score = torch.mm(xf, self.wgate.weight.float().t())
        pair = layout.pair_rows                          # [C, 2] token rows of each group
        weights = score[pair].softmax(dim=1)
        pooled = (kv[pair] * weights).sum(dim=1)
        return self.norm(pooled.to(x.dtype))


class V41Indexer(nn.Module):
    """``layers.N.attn.indexer`` of a ratio-1/2 index-source layer."""

    def __init__(self, cfg: DSV4Config, owns_keys: bool):
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.topk = cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        self.owns_keys = owns_keys
        if owns_keys:
            self.wk = nn.Linear(cfg.head_dim, self.head_dim, bias=False)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    @property
    def head_weight_scale(self) -> float:
        return self.head_dim ** -0.5 * self.n_heads ** -0.5


def build_low_ratio_modules(cfg: DSV4Config, layer_id: int
                            ) -> tuple[V41Compressor | None, V41Indexer | None]:
    """The (compressor, indexer) a ratio-1/2 layer owns; assign them to ``attn.compressor`` /
    ``attn.indexer`` so the names come out as SGLang's."""
    validate_low_ratio_config(cfg)
    ratio = cfg.compress_ratios[layer_id]
    if ratio not in LOW_RATIOS:
        raise ValueError(f"layer {layer_id} has compress ratio {ratio}, not 1 or 2")
    compressor = (V41Compressor(cfg.hidden_size, cfg.head_dim, ratio, cfg.rms_norm_eps)
                  if layer_id in cfg.kv_source_layer_ids else None)
    indexer = (V41Indexer(cfg, owns_keys=layer_id in cfg.kv_source_layer_ids)
               if layer_id in cfg.index_source_layer_ids else None)
    return compressor, indexer


def validate_low_ratio_config(cfg: DSV4Config) -> None:
    """What SGLang assumes but does not check: an index source's keys exist (its kv source is an
    index source too), every ratio-1/2 layer has an index source at or before it, and the
    candidate source is an index source."""
    for i, r in enumerate(cfg.compress_ratios):
        if r not in LOW_RATIOS:
            continue
        if cfg.index_source_for(i) is None:
            raise ValueError(f"layer {i} (ratio {r}) has no index source layer at or before it")
        if i in cfg.index_source_layer_ids and \
                cfg.kv_source_for(i) not in cfg.index_source_layer_ids:
            raise ValueError(f"index source {i} reads the keys of kv source {cfg.kv_source_for(i)}"
                             ", which is not an index source (only those write index keys)")
    c = cfg.candidate_source_layer_id
    if c >= 0:
        if c not in cfg.index_source_layer_ids:
            raise ValueError(f"candidate source {c} is not an index source layer")
        if cfg.candidate_topk_blocks <= 0 or cfg.candidate_block_size <= 0:
            raise ValueError("candidate_topk_blocks and candidate_block_size must be positive")


@dataclass
class EntryLayout:
    """Where one ratio's compressed entries sit in this forward: sequence by sequence, entry j of
    a sequence at row ``entry_start[s] + j``."""
    ratio: int
    pair_rows: torch.Tensor        # ratio 2: [C, 2] token rows of each group; ratio 1: [C, 1]
    entry_pos: torch.Tensor        # [C] RoPE position of each entry (first of its group)
    entry_start: list[int]         # first entry of each sequence
    token_bounds: list[tuple[int, int]]

    @classmethod
    def build(cls, ratio: int, positions: torch.Tensor, bounds: list[tuple[int, int]],
              check_positions: bool = True) -> "EntryLayout":
        """bounds: each sequence's packed rows [start, end), on the host. check_positions
        compares positions with 0..n-1 per sequence on the device (a read-back); a caller that
        built them so (DSV4Context.packed) passes False."""
        if bounds and bounds[-1][1] != positions.shape[0]:
            raise ValueError(f"the sequences end at {bounds[-1][1]}, positions has "
                             f"{positions.shape[0]} tokens")
        # One comparison for the whole batch: a per-sequence check reads back once per sequence.
        if check_positions and bounds and not torch.equal(
                positions.to(torch.int64),
                torch.cat([torch.arange(b - a, device=positions.device) for a, b in bounds])):
            raise ValueError("V4.1 ratio-1/2 layers without a KV cache need every packed "
                             "sequence at positions 0..n-1")
        rows, starts, total = [], [], 0
        for a, b in bounds:
            n = b - a
            groups = n // ratio
            rows.append(a + torch.arange(groups * ratio, device=positions.device).view(-1, ratio))
            starts.append(total)
            total += groups
        pair = (torch.cat(rows) if rows else
                torch.zeros(0, ratio, dtype=torch.int64, device=positions.device))
        return cls(ratio, pair, positions[pair[:, 0]].to(torch.int64), starts, bounds)


def kv_source_entries(attn: nn.Module, x: torch.Tensor, layout: EntryLayout,
                      serving_numerics: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A kv-source layer's entries ``comp_kv [C, head_dim]`` (RoPE'd, FP4-rounded under serving
    numerics) of ``layout``'s groups of ``x``, and the index keys ``[C, index_head_dim]`` when
    its indexer owns them (else None). Each row is a function of its own group's tokens and
    position alone, so a cache may hold them per entry (the engine's, model_hooks.py)."""
    compressor, indexer = getattr(attn, "compressor", None), getattr(attn, "indexer", None)
    if not isinstance(compressor, V41Compressor):
        raise ValueError(f"kv source layer {attn.layer_id} has no V41Compressor")
    inv_freq = attn.freqs  # the layer's compressed-RoPE frequencies, already on the device
    latent = compressor.latents(x, layout)
    comp_kv = apply_rope(latent, layout.entry_pos, inv_freq)
    if serving_numerics:
        comp_kv = fake_quant_compressed_kv(comp_kv)
    keys = None
    if indexer is not None and indexer.owns_keys:
        with torch.no_grad():
            keys = apply_rope(indexer.k_norm(indexer.wk(latent)), layout.entry_pos, inv_freq)
            keys = fake_quant_fp4(keys) if serving_numerics else keys
    return comp_kv, keys


def low_ratio_entries(cfg: DSV4Config, layer_id: int, attn: nn.Module, x: torch.Tensor,
                      q_lora: torch.Tensor, positions: torch.Tensor,
                      seq_bounds: list[tuple[int, int]],
                      shared: dict, serving_numerics: bool = False,
                      check_positions: bool = True, query_starts: list[int] | None = None,
                      kv_entries: tuple[torch.Tensor, torch.Tensor | None] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The compressed entries of ratio-1/2 layer ``layer_id``: ``comp_kv [C, head_dim]`` RoPE'd
    (and FP4-rounded under serving numerics) and ``comp_idx [T, index_topk]`` int32 rows of
    comp_kv each query attends, -1 = none. ``x`` is the attention input after attn_norm,
    ``q_lora`` after q_norm; ``shared`` is one forward's dict (``DSV4Context.shared``): source
    layers leave their entries and selections there for the layers after them, so call the
    layers in order. check_positions: as EntryLayout.build's. query_starts: per sequence, the
    first row whose selection is wanted (an engine's new tokens after its cached context; the
    same for every layer of one forward); the rows before it stay -1 and are neither projected
    nor scored, which would make each decode step quadratic in the context. kv_entries: a kv
    source's (comp_kv, keys) of every group, when the caller holds them (an engine's cache of
    kv_source_entries); else they are computed here from x. With query_starts and kv_entries
    (or on a layer that is no kv source), x and q_lora may hold only the asked rows: an engine
    then reads no cached row of them."""
    ratio = cfg.compress_ratios[layer_id]
    if ratio not in LOW_RATIOS:
        raise ValueError(f"layer {layer_id} has compress ratio {ratio}, not 1 or 2")
    layout = shared.get(("v41_layout", ratio))
    if layout is None:
        layout = shared[("v41_layout", ratio)] = EntryLayout.build(ratio, positions, seq_bounds,
                                                                     check_positions)
    inv_freq = attn.freqs  # the layer's compressed-RoPE frequencies, already on the device
    indexer = getattr(attn, "indexer", None)
    if layer_id in cfg.kv_source_layer_ids:
        if kv_entries is None and x.shape[0] != positions.shape[0]:
            raise ValueError(f"kv source {layer_id} computes its entries from x: x needs every "
                             f"one of the {positions.shape[0]} rows, not {x.shape[0]}")
        shared[("v41_kv", layer_id)] = (kv_entries if kv_entries is not None else
                                        kv_source_entries(attn, x, layout, serving_numerics))
    elif kv_entries is not None:
        raise ValueError(f"layer {layer_id} is no kv source: it reads layer "
                         f"{cfg.kv_source_for(layer_id)}'s entries, kv_entries is for that one")
    source = cfg.kv_source_for(layer_id)
    if ("v41_kv", source) not in shared:
        raise RuntimeError(f"layer {layer_id} reads kv source {source}, which has not run in "
                           "this forward (call the layers in order with one shared dict)")
    comp_kv, keys = shared[("v41_kv", source)]
    if layer_id in cfg.index_source_layer_ids:
        if not isinstance(indexer, V41Indexer) or keys is None:
            raise ValueError(f"index source {layer_id} needs a V41Indexer and index keys from "
                             f"kv source {source}")
        with torch.no_grad():
            shared[("v41_topk", layer_id)] = _select(cfg, layer_id, indexer, x, q_lora, positions,
                                                     keys, layout, inv_freq, shared,
                                                     serving_numerics, query_starts)
    index_source = cfg.index_source_for(layer_id)
    if ("v41_topk", index_source) not in shared:
        raise RuntimeError(f"layer {layer_id} reads index source {index_source}, which has not "
                           "run in this forward")
    return comp_kv, shared[("v41_topk", index_source)]


def _select(cfg: DSV4Config, layer_id: int, indexer: V41Indexer, x: torch.Tensor,
            q_lora: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
            layout: EntryLayout, inv_freq: torch.Tensor, shared: dict,
            serving_numerics: bool, query_starts: list[int] | None = None) -> torch.Tensor:
    """Per sequence, as SGLang's torch prefill indexer (``prefill_requests`` + the full or the
    candidate top-k + ``write_prefill``), for its rows from query_starts[s] on (all without).
    x and q_lora hold every row of the forward, or only those query rows (in order)."""
    ratio, T = layout.ratio, positions.shape[0]
    if query_starts is None:
        query_starts = [a for a, _ in layout.token_bounds]
    if len(query_starts) != len(layout.token_bounds):
        raise ValueError(f"query_starts has {len(query_starts)} entries for "
                         f"{len(layout.token_bounds)} sequences")
    for s, ((a, b), first) in enumerate(zip(layout.token_bounds, query_starts)):
        if not a <= first <= b:
            raise ValueError(f"query_starts[{s}] = {first} is outside its sequence's rows "
                             f"[{a}, {b}]")
    # The queries are projected for the asked rows only (an engine's decode: one row of a long
    # context); row r of sequence s is row r + base[s] of q and weights.
    spans = [(first, b) for first, (_, b) in zip(query_starts, layout.token_bounds)]
    asked = sum(b - first for first, b in spans)
    if x.shape[0] not in (T, asked) or q_lora.shape[0] != x.shape[0]:
        raise ValueError(f"x / q_lora have {x.shape[0]} / {q_lora.shape[0]} rows: every one of "
                         f"the {T} rows, or the {asked} asked ones")
    base, x_q, pos_q = [0] * len(spans), x, positions
    if asked < T:
        base = [at - first for at, (first, _) in
                zip(itertools.accumulate((b - f for f, b in spans), initial=0), spans)]
        rows = torch.cat([torch.arange(first, b, device=x.device) for first, b in spans])
        pos_q = positions[rows]
        if x.shape[0] == T:
            q_lora, x_q = q_lora[rows], x[rows]
    q = indexer.wq_b(q_lora).view(-1, indexer.n_heads, indexer.head_dim)
    q = apply_rope(q, pos_q, inv_freq)
    q = fake_quant_fp4(q) if serving_numerics else q
    weights = indexer.weights_proj(x_q) * indexer.head_weight_scale
    lens = (positions.to(torch.int64) + 1) // ratio
    out = torch.full((T, indexer.topk), -1, dtype=torch.int32, device=x.device)
    cand = cfg.candidate_source_layer_id
    publishes, consumes = layer_id == cand, 0 <= cand < layer_id
    blocks = shared.get(("v41_candidates",)) if consumes else None
    if consumes and blocks is None:
        raise RuntimeError(f"index layer {layer_id} needs the candidate blocks of layer {cand}")
    table = None
    if publishes:
        longest = max(((b - a) // ratio for a, b in layout.token_bounds), default=0)
        width = min(cfg.candidate_topk_blocks, -(-longest // cfg.candidate_block_size))
        table = torch.full((T, width), -1, dtype=torch.int32, device=x.device)
    for s, (a, b) in enumerate(layout.token_bounds):
        start, first, r0 = layout.entry_start[s], query_starts[s], base[s]
        for c0, c1 in query_chunks(first, b, (b - a) // ratio, indexer.n_heads):
            # Positions are 0..n-1 (EntryLayout.build): the chunk's last query sees the most
            # entries. A row's picks do not depend on the masked tail (stable_topk), so scoring
            # only the entries the chunk sees picks what the whole sequence's scores pick.
            lc = (c1 - a) // ratio
            if lc == 0:
                continue
            lens_c = lens[c0:c1]
            scores = index_scores(q[c0 + r0:c1 + r0], keys[start:start + lc],
                                  weights[c0 + r0:c1 + r0], lens_c)
            k = min(indexer.topk, lc)
            if consumes:
                idx = topk_among_blocks(scores, lens_c, blocks[c0:c1], k, cfg.candidate_block_size)
                idx = idx.masked_fill(idx < 0, lc)
            else:
                idx = stable_topk(scores, k)[1]
            if publishes:
                ids = select_candidate_block_ids(scores, lens_c[:, None], cfg.candidate_topk_blocks,
                                                 cfg.candidate_block_size)
                table[c0:c1, :ids.shape[1]] = ids
            idx = idx.sort(dim=-1).values
            out[c0:c1, :k] = torch.where(idx < lens_c[:, None], idx + start, -1).to(torch.int32)
    if publishes:
        shared[("v41_candidates",)] = table
    return out


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor,
                 visible: torch.Tensor) -> torch.Tensor:
    """score[t, n] = sum_h weights[t, h] relu(q[t, h] . keys[n]) (fp32 [T, N]), -inf at
    n >= visible[t]. Where the DSV4 kernels run (resolve_backend: CUDA) the indexer-score
    kernel: fp32 sums of the products, one [T, N] pass, the tiles no row may see skipped. Else
    SGLang's torch prefill expression with its roundings in the compute dtype (the products,
    the relu'd weighted terms, their sum over the heads), which tests/test_dsv4_v41_sparse.py
    holds the picks to on the CPU; on a GPU it made three [T, heads, N] passes (512 MiB each
    at 4k tokens of a ratio-1 layer), which selective checkpointing also kept (the bmm)."""
    if resolve_backend(q.device, None) == "triton" and q.dtype != torch.float64:
        return indexer_scores(q, keys, weights, 1.0, backend="triton", visible=visible)
    scores = torch.einsum("bhd,nd->bhn", q, keys)
    scores = (scores.relu() * weights.unsqueeze(-1)).sum(dim=1).float()
    return mask_unseen(scores, visible)


def select_candidate_block_ids(scores: torch.Tensor, lens: torch.Tensor, topk_blocks: int,
                               block_size: int) -> torch.Tensor:
    """[rows, min(topk_blocks, blocks)] int32 ids of the best blocks by block maximum, the block
    of entry ``lens - 1`` always kept, -1 past the finite blocks (``scores`` -inf past lens)."""
    pad = -scores.shape[-1] % block_size
    blocks = F.pad(scores, (0, pad), value=-torch.inf) if pad else scores
    blocks = blocks.unflatten(-1, (-1, block_size)).amax(dim=-1)
    n = blocks.shape[-1]
    newest = (lens - 1) // block_size
    blocks = blocks.masked_fill(torch.arange(n, device=scores.device) == newest, torch.inf)
    values, indices = stable_topk(blocks, min(topk_blocks, n))
    return indices.to(torch.int32).masked_fill_(~(values > -torch.inf), -1)


def topk_among_blocks(scores: torch.Tensor, lens: torch.Tensor, blocks: torch.Tensor, k: int,
                      block_size: int) -> torch.Tensor:
    """Top-k entries of each row inside its candidate ``blocks`` and below its ``lens``: int64
    [rows, k] entry positions, -1 where fewer than k candidates are finite."""
    rows, width = scores.shape
    n = blocks.shape[1]
    if width == 0 or n == 0:
        return torch.full((rows, k), -1, dtype=torch.int64, device=scores.device)
    if width % block_size:
        scores = F.pad(scores, (0, -width % block_size), value=-torch.inf)
    num_blocks = scores.shape[1] // block_size
    ids = blocks.to(torch.int64)
    cand = scores.unflatten(1, (num_blocks, block_size)).gather(
        1, ids.clamp(0, num_blocks - 1)[:, :, None].expand(rows, n, block_size))
    offs = torch.arange(block_size, device=scores.device, dtype=lens.dtype)
    drop = (offs[None, None, :] >= (lens[:, None] - ids * block_size)[:, :, None]) | \
        (ids < 0)[:, :, None]
    flat = cand.masked_fill(drop, -torch.inf).flatten(1)
    # Candidates in entry order, so ties break toward the lower entry as in the full top-k.
    entry = (ids.clamp_min(0)[:, :, None] * block_size + offs[None, None, :]).flatten(1)
    order = entry.masked_fill(drop.flatten(1), torch.iinfo(entry.dtype).max).argsort(dim=-1)
    values, top = stable_topk(flat.gather(1, order), min(k, flat.shape[1]))
    picked = entry.gather(1, order.gather(1, top)).masked_fill(values == -torch.inf, -1)
    return F.pad(picked, (0, k - picked.shape[1]), value=-1) if picked.shape[1] < k else picked
