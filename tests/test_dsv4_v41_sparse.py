"""V4.1 ratio-1/2 compressors and indexers against SGLang 0.5.23's own code on CPU.

SGLang side, unmodified: ``DeepseekV41Compressor`` / ``DeepseekV41Indexer`` (bf16 weights), the
attention backend's ``_low_ratio_compress_torch`` / ``_low_ratio_pair_partners`` /
``_low_ratio_write_group`` (run on a stub backend whose KV pool records what is written),
``_low_ratio_compression_metadata``, ``prefill_k_slots``, the pool's ``source_layer_of``, and
the torch prefill indexers ``FullTopKIndexer._torch_prefill`` and ``DenseBlocksBackend``'s
candidate publish/consume. Only the pool and metadata objects are stand-ins.
"""

from __future__ import annotations

import os
import types
from dataclasses import replace

import pytest
import torch

from sglang_cpu import import_sglang
from sglang_dsv41.attention.dsv4 import BACKEND_ENV
from sglang_dsv41.model.dsv4.compressor import stable_topk
from sglang_dsv41.model.dsv4.config import DSV4Config
from sglang_dsv41.model.dsv4.context import DSV4Context
from sglang_dsv41.model.dsv4.rope import layer_inv_freq
from sglang_dsv41.model.dsv4.v41_sparse import (EntryLayout, build_low_ratio_modules, index_scores,
                                                low_ratio_entries, validate_low_ratio_config)

SEQS = [37, 20]          # packed; M below keeps each request's slots 2-aligned
M = 64
BF16 = torch.bfloat16

# 16 indexer heads: a score is an exact zero (every head's relu at 0) with probability 2^-16,
# so no tie straddles the top-k boundary. Ties are where our selection is deliberately defined
# (lowest entry first, the same for a prefix and the whole sequence) and SGLang's torch.topk is
# not; elsewhere the two must agree bit for bit.
CFG = DSV4Config(
    model_type="deepseek_v41", vocab_size=64, hidden_size=64, num_hidden_layers=5,
    num_attention_heads=4, head_dim=64, qk_rope_head_dim=16, q_lora_rank=32, o_groups=2,
    o_lora_rank=16, window_size=8, max_position_embeddings=256,
    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                  "beta_fast": 32, "beta_slow": 1},
    index_n_heads=16, index_head_dim=32, index_topk=6, n_routed_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=16, num_hash_layers=0,
    compress_ratios=[1, 2, 1, 2, 1], kv_source_layer_ids=[0, 1],
    index_source_layer_ids=[0, 1, 4], candidate_source_layer_id=0, candidate_topk_blocks=2,
    candidate_block_size=4)


def _sg():
    return types.SimpleNamespace(
        sparse=import_sglang("sglang.srt.layers.attention.dsv4.dsv41_sparse"),
        backend=import_sglang("sglang.srt.layers.attention.deepseek_v4_backend"),
        pool=import_sglang("sglang.srt.mem_cache.deepseek_v4_memory_pool"),
        scoring=import_sglang("sglang.srt.layers.attention.dsv4.v41_indexer.scoring"),
        full=import_sglang("sglang.srt.layers.attention.dsv4.v41_indexer.full_topk"),
        dense=import_sglang("sglang.srt.layers.attention.dsv4.v41_indexer.dense_blocks"),
        types=import_sglang("sglang.srt.layers.attention.dsv4.v41_indexer.types"))


def _batch():
    ends = torch.tensor(SEQS).cumsum(0).tolist()
    bounds = list(zip([0] + ends[:-1], ends))
    pos = torch.cat([torch.arange(n) for n in SEQS])
    req = torch.cat([torch.full((n,), r) for r, n in enumerate(SEQS)])
    return bounds, pos, req, (req + 1) * M + pos    # raw KV slots; slot 0 is SGLang's padding


def _models(cfg, seed):
    """Our modules (bf16 linears, fp32 norms) and SGLang's with the same weights, per layer."""
    torch.manual_seed(seed)
    sg, ours, theirs = _sg(), {}, {}
    sg_cfg = types.SimpleNamespace(**{k: getattr(cfg, k) for k in (
        "index_n_heads", "index_head_dim", "qk_rope_head_dim", "index_topk", "q_lora_rank",
        "hidden_size", "rms_norm_eps", "kv_source_layer_ids", "candidate_source_layer_id",
        "candidate_topk_blocks", "candidate_block_size")})
    for i, r in enumerate(cfg.compress_ratios):
        comp, idx = build_low_ratio_modules(cfg, i)
        s_comp = s_idx = None
        for m in (comp, idx):
            for name, p in (m.named_parameters() if m is not None else ()):
                p.data = (torch.randn_like(p) * (0.2 if "norm" in name else 0.15)).to(
                    torch.float32 if "norm" in name else BF16)
                if "norm" in name:
                    p.data = 1 + p.data.to(BF16).float()
        if comp is not None:
            s_comp = sg.sparse.DeepseekV41Compressor(cfg.hidden_size, cfg.head_dim, r,
                                                      cfg.rms_norm_eps, fused_compress=False)
            s_comp.load_state_dict(comp.state_dict())
        if idx is not None:
            s_idx = sg.sparse.DeepseekV41Indexer(sg_cfg, i, cfg.head_dim, None, "indexer")
            s_idx.load_state_dict(idx.state_dict())
        ours[i] = types.SimpleNamespace(compressor=comp, indexer=idx,
                                        freqs=layer_inv_freq(cfg, compressed=True))
        theirs[i] = (s_comp, s_idx)
    return ours, theirs


def _freqs_cis(cfg):
    # the same angles, cos and sin as our apply_rope, as SGLang's complex table
    ang = torch.arange(cfg.max_position_embeddings).float()[:, None] * layer_inv_freq(cfg, True)
    return torch.complex(ang.cos(), ang.sin())


class _Pool:
    """Stands in for DeepSeekV4TokenToKVPool: records compressed KV / index-K writes by slot."""

    def __init__(self, cfg):
        sg = _sg()
        self.compression_ratios = cfg.compress_ratios
        self.sources_by_ratio = sg.pool.collect_sources_by_ratio(
            cfg.compress_ratios, cfg.kv_source_layer_ids, range(cfg.num_hidden_layers))
        self.kv, self.index_k = {}, {}

    def source_layer_of(self, layer_id):
        return _sg().pool.DeepSeekV4TokenToKVPool.source_layer_of(self, layer_id)

    def get_attention_compress_states(self, layer_id):
        def read(loc):
            z = torch.zeros(loc.shape[0], CFG.head_dim)
            return types.SimpleNamespace(kv=z, score=z)
        return types.SimpleNamespace(ring_size=1 << 20, get_state_by_state_loc=read,
                                     translate_from_req_position_to_state_loc=lambda r, p: p,
                                     set_state_by_state_loc=lambda loc, v: None)

    def get_extra_key_layout(self, layer_id):
        return types.SimpleNamespace(is_fp4=False)

    def _write(self, table, layer_id, loc, cache_k):
        for s, row in zip(loc.tolist(), cache_k):
            if s:
                table[(self.source_layer_of(layer_id), s)] = row

    def set_extra_key_buffer_fused(self, layer_id, loc, cache_k):
        self._write(self.kv, layer_id, loc, cache_k)

    def set_index_k_fp4(self, layer_id, loc, cache_k):
        self._write(self.index_k, layer_id, loc, cache_k)

    def get_low_ratio_index_k_dequant(self, layer_id, slots):
        src = self.source_layer_of(layer_id)
        return torch.stack([self.index_k[(src, s)] for s in slots.tolist()])


def _sglang_compress(layer_id, ratio, s_comp, s_idx, x, pos, req, raw, pool, freqs):
    sg = _sg()
    out_loc, _ = sg.backend._low_ratio_compression_metadata(ratio, pos + 1, raw)
    core = types.SimpleNamespace(raw_out_loc=raw, c1_out_loc=out_loc, c2_out_loc=out_loc)
    fake = types.SimpleNamespace(token_to_kv_pool=pool,
                                 forward_metadata=types.SimpleNamespace(core_metadata=core))
    cls = sg.backend.DeepseekV4AttnBackend
    fake._low_ratio_pair_partners = types.MethodType(cls._low_ratio_pair_partners, fake)
    fake._low_ratio_write_group = types.MethodType(cls._low_ratio_write_group, fake)
    layer = types.SimpleNamespace(compressor=s_comp, indexer=s_idx, layer_id=layer_id,
                                  compress_ratio=ratio, freqs_cis=freqs,
                                  rope_head_dim=CFG.qk_rope_head_dim)
    cls._low_ratio_compress_torch(fake, layer, x, req, pos)


def _sglang_select(layer_id, ratio, s_idx, x, q_lora, pos, req, pool, freqs, published):
    sg = _sg()
    seq_lens = list(SEQS)
    req_to_token = torch.stack([(r + 1) * M + torch.arange(M) for r in range(len(SEQS))])
    k_slots = sg.scoring.prefill_k_slots(req_to_token=req_to_token,
                                         req_pool_indices=torch.arange(len(SEQS)),
                                         seq_lens_cpu=seq_lens, ratio=ratio)
    inputs = sg.types.PrefillInputs(
        indexer=s_idx, layer_id=layer_id, compress_ratio=ratio, freqs_cis=freqs, x=x,
        q_lora=q_lora, positions=pos, req_rows=req, req_pool_indices=torch.arange(len(SEQS)),
        k_slots=k_slots, index_plans=None, kv_page_table=torch.zeros(1), seq_lens_cpu=seq_lens,
        rows_per_request=seq_lens, rows_per_request_device=torch.tensor(seq_lens),
        out_raw_indices=torch.full((x.shape[0], CFG.index_topk), -1, dtype=torch.int32),
        out_page_indices=None)
    dense = types.SimpleNamespace(token_to_kv_pool=pool, topk_blocks=CFG.candidate_topk_blocks,
                                  block_size=CFG.candidate_block_size)
    if layer_id == CFG.candidate_source_layer_id:
        published = sg.dense.DenseBlocksBackend._torch_publish_prefill(dense, inputs)
    elif 0 <= CFG.candidate_source_layer_id < layer_id:
        sg.dense.DenseBlocksBackend._torch_consume_prefill(dense, inputs, published)
    else:
        sg.full.FullTopKIndexer._torch_prefill(
            types.SimpleNamespace(token_to_kv_pool=pool), inputs)
    return inputs.out_raw_indices.clone(), published, inputs


def _same_up_to_ties(ours, theirs, inputs, pool, block=None):
    """Rows may differ only where both picks are a top-k of equal scores: bf16 scores tie often,
    SGLang's torch.topk breaks ties by row length, our selection by the lower entry (so a prefix
    and the whole sequence agree). Scores from SGLang's own prefill scoring; with ``block``, the
    picks are candidate blocks ranked by their maximum score (the newest block always kept)."""
    sg = _sg()
    rows = (ours != theirs).any(dim=1).nonzero().flatten().tolist()
    if not rows:
        return True
    score_of = {}
    for request, chunks in sg.scoring.prefill_requests(inputs=inputs, token_to_kv_pool=pool):
        for chunk in chunks:
            for i, t in enumerate(chunk.tok.tolist()):
                row = chunk.scores[i].float()
                if block is not None:
                    newest = (int(chunk.lens[i]) - 1) // block
                    row = torch.nn.functional.pad(row, (0, -row.numel() % block),
                                                  value=-torch.inf)
                    row = row.view(-1, block).amax(-1)
                    row[newest] = torch.inf
                score_of[t] = row
    for r in rows:
        pick = [score_of[r][c].item() for c in ours[r].tolist() if c >= 0]
        want = [score_of[r][c].item() for c in theirs[r].tolist() if c >= 0]
        if sorted(pick) != sorted(want):
            return False
    return len(rows) <= max(1, ours.shape[0] // 4)   # ties, not a different rule


def _entry_slots(ratio):
    """SGLang's compressed slot of each of our entries (sequence-major, group order)."""
    return [(r + 1) * M // ratio + g for r, n in enumerate(SEQS) for g in range(n // ratio)]


def _entry_start(ratio):
    return torch.tensor([0] + [n // ratio for n in SEQS]).cumsum(0)[:-1]


def test_entries_and_selection_match_sglang(seed):
    bounds, pos, req, raw = _batch()
    ours, theirs = _models(CFG, seed)
    pool, freqs, shared, published = _Pool(CFG), _freqs_cis(CFG), {}, None
    for i, ratio in enumerate(CFG.compress_ratios):
        x = torch.randn(pos.shape[0], CFG.hidden_size).to(BF16)
        q_lora = torch.randn(pos.shape[0], CFG.q_lora_rank).to(BF16)
        comp_kv, comp_idx = low_ratio_entries(CFG, i, ours[i], x, q_lora, pos, bounds, shared,
                                              serving_numerics=True)
        s_comp, s_idx = theirs[i]
        if s_comp is not None:
            _sglang_compress(i, ratio, s_comp, s_idx, x, pos, req, raw, pool, freqs)
            want = torch.stack([pool.kv[(i, s)] for s in _entry_slots(ratio)])
            assert comp_kv.dtype == BF16 and torch.equal(comp_kv, want), f"layer {i} comp_kv"
            keys = torch.stack([pool.index_k[(i, s)] for s in _entry_slots(ratio)])
            assert torch.equal(shared[("v41_kv", i)][1], keys), f"layer {i} index keys"
        if s_idx is not None:
            raw_idx, published, inputs = _sglang_select(i, ratio, s_idx, x, q_lora, pos, req,
                                                        pool, freqs, published)
            start = _entry_start(ratio)[req][:, None].to(torch.int32)
            ours_local = torch.where(comp_idx >= 0, comp_idx - start, -1)
            assert _same_up_to_ties(ours_local, raw_idx, inputs, pool), f"layer {i} top-k"
            assert (raw_idx >= 0).any() and (raw_idx < 0).any()   # selects, and pads
        if i == CFG.candidate_source_layer_id:
            assert _same_up_to_ties(shared[("v41_candidates",)], published.blocks, inputs, pool,
                                    block=CFG.candidate_block_size)
            # Later layers pick inside these blocks: hand SGLang ours, so a block tie broken
            # the other way does not change what the consumers may pick from. (msgspec comes
            # with SGLang; imported here so a GPU machine without SGLang runs the kernel test.)
            import msgspec
            published = msgspec.structs.replace(published, blocks=shared[("v41_candidates",)])
        # every layer of a ratio reads its nearest kv / index source, as SGLang's pool does
        assert comp_kv is shared[("v41_kv", pool.source_layer_of(i))][0]


def test_query_starts_select_only_later_rows_as_the_full_selection_does(seed):
    """The engine's decode asks for the selections of its new tokens only (query_starts): the
    same entries, the same picks on those rows (the candidate blocks too), -1 before them; and
    the same given x and q_lora of the asked rows alone with the kv sources' entries handed in
    (what the engine passes: it reads no cached input row). An index source refuses row counts
    that fit neither, a kv source computing its entries needs every row, and entries handed to
    a layer that is no kv source are refused."""
    bounds, pos, _, _ = _batch()
    ours, _ = _models(CFG, seed)
    starts = [bounds[0][1] - 5, bounds[1][1] - 1]  # 5 new rows, then 1 (a decode step)
    asked = torch.cat([torch.arange(first, b) for first, (_, b) in zip(starts, bounds)])
    full, part, rows_only, picked = {}, {}, {}, False
    for i in range(CFG.num_hidden_layers):
        x = torch.randn(pos.shape[0], CFG.hidden_size).to(BF16)
        q = torch.randn(pos.shape[0], CFG.q_lora_rank).to(BF16)
        kv_full, idx_full = low_ratio_entries(CFG, i, ours[i], x, q, pos, bounds, full)
        kv_part, idx_part = low_ratio_entries(CFG, i, ours[i], x, q, pos, bounds, part,
                                              query_starts=starts)
        held = full.get(("v41_kv", i)) if i in CFG.kv_source_layer_ids else None
        kv_rows, idx_rows = low_ratio_entries(CFG, i, ours[i], x[asked], q[asked], pos, bounds,
                                              rows_only, query_starts=starts, kv_entries=held)
        assert torch.equal(kv_part, kv_full) and torch.equal(kv_rows, kv_full), f"layer {i}"
        assert torch.equal(idx_rows, idx_part), f"layer {i} picks from the asked rows alone"
        if i in CFG.index_source_layer_ids:  # the layers that read x and q_lora here
            with pytest.raises(ValueError, match="rows"):
                low_ratio_entries(CFG, i, ours[i], x[:-1], q[:-1], pos, bounds,
                                  dict(rows_only), query_starts=starts, kv_entries=held)
        if i in CFG.kv_source_layer_ids:  # its entries from x: every row, or handed in
            with pytest.raises(ValueError, match="needs every one"):
                low_ratio_entries(CFG, i, ours[i], x[asked], q[asked], pos, bounds,
                                  dict(rows_only), query_starts=starts)
        else:  # kv_entries belong to the kv source
            with pytest.raises(ValueError, match="is no kv source"):
                low_ratio_entries(CFG, i, ours[i], x, q, pos, bounds, dict(full),
                                  kv_entries=full[("v41_kv", CFG.kv_source_for(i))])
        for (a, b), first in zip(bounds, starts):
            assert torch.equal(idx_part[first:b], idx_full[first:b]), f"layer {i} picks"
            assert (idx_part[a:first] == -1).all(), f"layer {i} scored a cached row"
            picked |= bool((idx_full[first:b] >= 0).any())
    assert picked  # not only empty selections
    for (a, b), first in zip(bounds, starts):
        assert torch.equal(part[("v41_candidates",)][first:b],
                           full[("v41_candidates",)][first:b])


def test_consumer_selects_only_inside_published_blocks(seed):
    bounds, pos, _, _ = _batch()
    ours, _ = _models(CFG, seed)
    shared = {}
    for i in range(CFG.num_hidden_layers):
        x = torch.randn(pos.shape[0], CFG.hidden_size).to(BF16)
        q = torch.randn(pos.shape[0], CFG.q_lora_rank).to(BF16)
        _, comp_idx = low_ratio_entries(CFG, i, ours[i], x, q, pos, bounds, shared)
    blocks = shared[("v41_candidates",)].long()
    start = _entry_start(1)[torch.cat([torch.full((n,), r) for r, n in enumerate(SEQS)])]
    local = comp_idx.long() - start[:, None]
    block_of = torch.where(comp_idx >= 0, local // CFG.candidate_block_size, -2)
    inside = (block_of[:, :, None] == blocks[:, None, :]).any(-1) | (comp_idx < 0)
    assert inside.all()
    assert (blocks >= 0).sum(1).max() == CFG.candidate_topk_blocks


@pytest.mark.parametrize("ratio", [1, 2])
def test_queries_see_only_complete_groups_of_their_sequence(ratio, seed):
    cfg = replace(CFG, compress_ratios=[ratio], num_hidden_layers=1, kv_source_layer_ids=[0],
                  index_source_layer_ids=[0], candidate_source_layer_id=-1, index_topk=64)
    bounds, pos, req, _ = _batch()
    (ours, _) = _models(cfg, seed)
    x = torch.randn(pos.shape[0], cfg.hidden_size).to(BF16)
    q = torch.randn(pos.shape[0], cfg.q_lora_rank).to(BF16)
    comp_kv, comp_idx = low_ratio_entries(cfg, 0, ours[0], x, q, pos, bounds, {})
    assert comp_kv.shape[0] == sum(n // ratio for n in SEQS)
    start = _entry_start(ratio)[req]
    visible = (pos + 1) // ratio
    picked = comp_idx.long()
    ok = (picked < 0) | ((picked >= start[:, None]) & (picked < (start + visible)[:, None]))
    assert ok.all()
    # index_topk exceeds every context: each query selects every entry it may see
    assert torch.equal((comp_idx >= 0).sum(1), visible)
    # changing a later token leaves every earlier complete group's entry unchanged
    x2 = x.clone()
    x2[30] += 1
    comp_kv2, _ = low_ratio_entries(cfg, 0, ours[0], x2, q, pos, bounds, {})
    first_touched = 30 // ratio
    assert torch.equal(comp_kv2[:first_touched], comp_kv[:first_touched])
    assert not torch.equal(comp_kv2[first_touched], comp_kv[first_touched])


def test_serving_numerics_round_kv_and_pass_gradients(seed):
    cfg = replace(CFG, compress_ratios=[2], num_hidden_layers=1, kv_source_layer_ids=[0],
                  index_source_layer_ids=[0], candidate_source_layer_id=-1)
    bounds, pos, _, _ = _batch()
    (ours, _) = _models(cfg, seed)
    x = torch.randn(pos.shape[0], cfg.hidden_size).to(BF16)
    q = torch.randn(pos.shape[0], cfg.q_lora_rank).to(BF16)
    plain, _ = low_ratio_entries(cfg, 0, ours[0], x, q, pos, bounds, {})
    served, _ = low_ratio_entries(cfg, 0, ours[0], x, q, pos, bounds, {}, serving_numerics=True)
    assert not torch.equal(plain, served)
    rel = (plain.float() - served.float()).norm() / plain.float().norm()
    assert 0 < rel < 0.2
    served.float().square().sum().backward()
    grad = ours[0].compressor.wkv.weight.grad
    assert grad is not None and grad.abs().sum() > 0


def test_bad_layouts_and_configs_are_refused():
    bounds, pos, _, _ = _batch()
    ours, _ = _models(CFG, 0)
    x = torch.randn(pos.shape[0], CFG.hidden_size)
    q = torch.randn(pos.shape[0], CFG.q_lora_rank)
    with pytest.raises(ValueError, match="positions 0..n-1"):
        low_ratio_entries(CFG, 0, ours[0], x, q, pos + 1, bounds, {})
    # The trainer's contexts (DSV4Context.packed) built their positions as ranges: the check,
    # a device read-back, is skipped for them.
    assert DSV4Context.packed([3, 2]).positions_are_ranges
    EntryLayout.build(1, pos + 1, bounds, check_positions=False)
    with pytest.raises(RuntimeError, match="has not run"):
        low_ratio_entries(CFG, 2, ours[2], x, q, pos, bounds, {})
    for starts, match in (([0], "1 entries for 2 sequences"),
                          ([0, bounds[0][1] - 1], r"outside its sequence's rows")):
        with pytest.raises(ValueError, match=match):
            low_ratio_entries(CFG, 0, ours[0], x.to(BF16), q.to(BF16), pos, bounds, {},
                              query_starts=starts)
    with pytest.raises(ValueError, match="not an index source"):
        validate_low_ratio_config(replace(CFG, kv_source_layer_ids=[0, 1, 2]))
    with pytest.raises(ValueError, match="no index source"):
        validate_low_ratio_config(replace(CFG, index_source_layer_ids=[1, 4],
                                          candidate_source_layer_id=-1))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the indexer-score kernel: CUDA or TRITON_INTERPRET=1")
def test_index_scores_on_the_kernel_equal_the_torch_expression(monkeypatch):
    """V4.1's selection scores where the DSV4 kernels run (the indexer-score kernel, forced here
    through the backend variable) against SGLang's torch expression (the CPU path) in fp32:
    scores to fp32 rounding, the same -inf (causal counts, a row that sees nothing, a tile no
    row sees) and the same picks."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    rows, heads, dim, entries = 40, 16, 32, 37
    q = torch.randn(rows, heads, dim, generator=gen).to(dev)
    keys = torch.randn(entries, dim, generator=gen).to(dev)
    weights = torch.randn(rows, heads, generator=gen).to(dev)
    visible = torch.clamp(torch.arange(rows) - 3, min=0, max=entries).to(dev)
    monkeypatch.setenv(BACKEND_ENV, "reference")
    want = index_scores(q, keys, weights, visible)
    monkeypatch.setenv(BACKEND_ENV, "triton")
    got = index_scores(q, keys, weights, visible)
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.isinf(want[:4]).all()
    seen = ~torch.isinf(want)
    torch.testing.assert_close(got[seen], want[seen], rtol=1e-5, atol=1e-5)
    assert torch.equal(stable_topk(got, 6)[1], stable_topk(want, 6)[1])
