"""Long sequences: the indexers' selection scored a chunk of queries at a time picks, bit for bit,
what one whole-sequence block picks (ties included), and its memory grows linearly with T."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import replace

import pytest
import torch

from sglang_dsv41.model.dsv4 import compressor, get_preset
from sglang_dsv41.model.dsv4.context import DSV4Context
from sglang_dsv41.model.dsv4.model import DSV4ForCausalLM, init_weights
from sglang_dsv41.model.dsv4.rope import layer_inv_freq
from sglang_dsv41.model.dsv4.v41_sparse import build_low_ratio_modules, low_ratio_entries

SEQS = [57, 30]


def _selections(model, ids, serving_numerics):
    """Every selection of one forward: V4.1's per-index-source top-k and candidate blocks (left
    in ctx.shared), V4's CSA indexer picks (its module's output), and the logits."""
    picks = {}
    hooks = [layer.attn.indexer.register_forward_hook(
        lambda mod, args, out, i=i: picks.__setitem__(("csa", i), out))
        for i, layer in enumerate(model.layers) if layer.attn.ratio == 4]
    ctx = DSV4Context.packed(SEQS, serving_numerics=serving_numerics)
    with torch.no_grad():
        logits = model(ids, ctx)
    for h in hooks:
        h.remove()
    picks.update({k: v for k, v in ctx.shared.items()
                  if k[0] in ("v41_topk", "v41_candidates")})
    return picks, logits


@pytest.mark.parametrize("preset, serving_numerics", [("tiny", False), ("tiny", True),
                                                       ("tiny-v4", False)])
def test_chunked_selection_equals_one_block(monkeypatch, preset, serving_numerics):
    model = DSV4ForCausalLM(get_preset(preset))
    init_weights(model, seed=7, std=0.08)
    ids = torch.randint(0, 256, (sum(SEQS),), generator=torch.Generator().manual_seed(0))
    whole, logits = _selections(model, ids, serving_numerics)
    kinds = {k[0] for k in whole}
    assert kinds == ({"v41_topk", "v41_candidates", "csa"} if preset == "tiny" else {"csa"})
    # Ties are where a chunked top-k could differ: tiny's 2 indexer heads give exact-zero
    # scores (both relus at 0) often, and serving numerics round q and k to FP4.
    for products in (1, 37, 300, 2000):  # 1 query per chunk up to most of a sequence
        monkeypatch.setattr(compressor, "SELECTION_CHUNK_PRODUCTS", products)
        chunked, chunked_logits = _selections(model, ids, serving_numerics)
        assert chunked.keys() == whole.keys()
        for k in whole:
            assert torch.equal(chunked[k], whole[k]), (products, k)
        assert torch.equal(chunked_logits, logits)


def test_query_chunks_cover_each_row_once(monkeypatch):
    monkeypatch.setattr(compressor, "SELECTION_CHUNK_PRODUCTS", 100)
    chunks = compressor.query_chunks(10, 47, entries=9, heads=2)
    assert chunks[0] == (10, 15) and chunks[-1] == (45, 47)
    assert [r for a, b in chunks for r in range(a, b)] == list(range(10, 47))
    assert compressor.query_chunks(0, 3, entries=10 ** 9, heads=64) == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize("ratio", [1, 2, 4, 128])
def test_entries_seen_bound_holds_for_every_length(ratio):
    """The bound is never below what the query sees, (length - after) // ratio, and at most
    one above it, whatever the sequence's length (the engine's queries follow a cached prefix)."""
    for length in range(0, 3 * ratio + 5):
        for after in range(length):
            seen = (length - after) // ratio
            bound = compressor.entries_seen_bound(length // ratio, after, ratio)
            assert seen <= bound <= seen + 1, (length, after)


def _peak_bytes(fn) -> int:
    """bench/long_context_memory.py's measure: the peak of the bytes torch allocated on the CPU
    while fn ran (the profiler's memory events)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(
        "bench_long_context_memory", os.path.join(root, "bench", "long_context_memory.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench.peak_bytes(fn)


def test_ratio_one_selection_memory_grows_linearly(monkeypatch):
    """V4.1's ratio-1 index source scores every earlier token: one [T, heads, T] block would
    grow 4x per doubling of T; the chunks keep the selection's peak O(T)."""
    cfg = replace(get_preset("tiny"), compress_ratios=[1], num_hidden_layers=1,
                  kv_source_layer_ids=[0], index_source_layer_ids=[0],
                  candidate_source_layer_id=-1, engram_layer_ids=[], engram_num_embeddings=[],
                  index_n_heads=8,
                  index_topk=8, num_hash_layers=0)
    monkeypatch.setattr(compressor, "SELECTION_CHUNK_PRODUCTS", 1 << 16)
    attn = torch.nn.Module()
    attn.compressor, attn.indexer = build_low_ratio_modules(cfg, 0)
    attn.freqs = layer_inv_freq(cfg, compressed=True)
    gen = torch.Generator().manual_seed(0)
    peaks = []
    for t in (1024, 2048):
        x = torch.randn(t, cfg.hidden_size, generator=gen)
        q = torch.randn(t, cfg.q_lora_rank, generator=gen)
        pos = torch.arange(t)
        with torch.no_grad():
            peaks.append(_peak_bytes(lambda: low_ratio_entries(cfg, 0, attn, x, q, pos, [(0, t)],
                                                               {})))
    whole_block = 2048 * cfg.index_n_heads * 2048 * 4  # what one unchunked score block takes
    assert peaks[1] < 2.5 * peaks[0], peaks
    assert peaks[1] < whole_block / 4, (peaks, whole_block)
