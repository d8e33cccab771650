"""Engram hashing of the real model against SGLang 0.5.23's own code (sglang.srt.layers.engram,
imported on CPU): compressed vocabulary, primes and table sizes, multipliers, and hash ids of
packed sequences for fresh extends, extends after a cached prefix and decode steps."""

from __future__ import annotations

import types

import pytest
import torch
from sglang_cpu import import_sglang

from sglang_dsv41.model.dsv4 import get_preset
from sglang_dsv41.model.dsv4.engram_hash import (ByteTokenizerHFView, EngramHasher, EngramLayout,
                                                 compressed_token_map, hash_multipliers)
from sglang_dsv41.tokenizer import ByteTokenizer

PRESETS_WITH_ENGRAM = ("tiny", "small", "v41-flash")


@pytest.fixture(scope="module")
def sg():
    return import_sglang("sglang.srt.layers.engram")


@pytest.fixture(scope="module")
def cfg():
    return get_preset("tiny")


@pytest.fixture
def hashers(sg, cfg):
    """(ours, SGLang's) for the tiny preset, SGLang's built from the byte tokenizer."""
    view = ByteTokenizerHFView(ByteTokenizer(vocab_size=cfg.vocab_size))
    theirs = sg.EngramHasher(sg.EngramLayout.from_config(cfg), view, cfg.engram_pad_token_id,
                             cfg.engram_compressed_vocab_size)
    theirs.init_history(8, "cpu")
    return EngramHasher(cfg), theirs


def _tokens(n: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Random ids with what the map merges or keeps apart: upper/lower case, whitespace runs,
    partial UTF-8 bytes, the pad token, specials and reserved ids."""
    ids = torch.randint(0, vocab, (n,), generator=gen)
    pool = torch.tensor([ord(c) for c in "AaBb \t\n\rZz"] + [0xC3, 0x80, 258, 256, 300])
    pick = torch.rand(n, generator=gen) < 0.6
    return torch.where(pick, pool[torch.randint(0, len(pool), (n,), generator=gen)], ids)


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lens).cumsum(0).to(torch.int32)


def _extend_batch(fb, lens, positions, slots):
    starts = [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + n)
    return types.SimpleNamespace(
        forward_mode=fb.ForwardMode.EXTEND, positions=positions,
        req_pool_indices=torch.tensor(slots), extend_seq_lens=torch.tensor(lens, dtype=torch.int32),
        extend_start_loc=torch.tensor(starts, dtype=torch.int32), extend_seq_lens_cpu=list(lens),
        engram_history=None, out_cache_loc=None, spec_info=None)


def test_token_map_is_sglangs_on_byte_and_hf_tokenizers(sg, cfg):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    for vocab in (cfg.vocab_size, get_preset("small").vocab_size):
        view = ByteTokenizerHFView(ByteTokenizer(vocab_size=vocab))
        assert compressed_token_map(view) == sg.build_compressed_token_map(view)
    ours, size = compressed_token_map(ByteTokenizer(vocab_size=cfg.vocab_size))
    assert size == cfg.engram_compressed_vocab_size and ours[ord("A")] == ours[ord("a")]
    assert ours[0x80] != ours[0x81]  # partial bytes stay apart (keyed by name)
    words = ["Hello", "hello", " hello", "HÉLLO", "\n\n", " ", "\t", "[PAD]", "ﬁ", "fi", "Ａ",
             "a", "  x ", "x", "[UNK]"]
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        {w: i for i, w in enumerate(words)}, unk_token="[UNK]")))
    theirs = sg.build_compressed_token_map(hf)
    assert compressed_token_map(hf) == theirs and theirs[1] < len(words) - 4  # merges happened


@pytest.mark.parametrize("preset", PRESETS_WITH_ENGRAM)
def test_layout_and_multipliers_are_sglangs(sg, preset):
    cfg = get_preset(preset)
    ours, theirs = EngramLayout.from_config(cfg), sg.EngramLayout.from_config(cfg)
    assert ours.primes == theirs.primes
    for i in range(len(cfg.engram_layer_ids)):
        assert ours.column_bounds(i) == theirs.column_bounds(i)
        # SGLang's row sharding asserts the config's table size equals the primes' sum.
        assert sg.shard_range(cfg.engram_num_embeddings[i], theirs.column_bounds(i), 0, 1) == (
            0, cfg.engram_num_embeddings[i])
    args = (ours.layer_ids, ours.max_ngram_size, cfg.engram_compressed_vocab_size)
    assert torch.equal(hash_multipliers(*args), sg.compute_hash_multipliers(*args))


def test_packed_fresh_sequences_hash_as_sglangs_extend(hashers, cfg):
    ours, theirs = hashers
    fb = import_sglang("sglang.srt.model_executor.forward_batch_info")
    gen = torch.Generator().manual_seed(0)
    lens = [5, 1, 2, 9, 3]
    ids = _tokens(sum(lens), cfg.vocab_size, gen)
    positions = torch.cat([torch.arange(n) for n in lens])
    want = theirs(ids, _extend_batch(fb, lens, positions, [0, 1, 2, 3, 4]))
    got = ours(ids, _cu(lens))
    assert got.dtype == torch.int64 and got.shape == want.shape == (sum(lens), 2, 4)
    assert torch.equal(got, want)
    # No n-gram crosses a sequence start: each sequence hashed alone gives the same rows.
    alone = torch.cat([ours(ids[a:b], _cu([b - a])) for a, b in zip(_cu(lens)[:-1], _cu(lens)[1:])])
    assert torch.equal(got, alone)
    as_one = ours(ids, _cu([sum(lens)]))
    assert not torch.equal(got[5], as_one[5])  # the second sequence's start differs when joined
    # SGLang's history commit is what history_rows builds from each whole sequence.
    seqs = [ids[a:b].tolist() for a, b in zip(_cu(lens)[:-1], _cu(lens)[1:])]
    assert torch.equal(theirs.history[:5].long(), ours.history_rows(seqs))


def test_extend_after_prefix_and_decode_hash_as_sglangs(hashers, cfg):
    ours, theirs = hashers
    fb = import_sglang("sglang.srt.model_executor.forward_batch_info")
    gen = torch.Generator().manual_seed(1)
    prefixes = [_tokens(n, cfg.vocab_size, gen).tolist() for n in (0, 1, 4, 2)]
    lens = [3, 2, 1, 4]
    ids = _tokens(sum(lens), cfg.vocab_size, gen)
    history = ours.history_rows(prefixes)
    for slot, p in enumerate(prefixes):
        theirs.history[slot] = torch.tensor(theirs.history_row(p[-2:]), dtype=torch.int32)
    positions = torch.cat([torch.arange(n) + len(p) for n, p in zip(lens, prefixes)])
    want = theirs(ids, _extend_batch(fb, lens, positions, [0, 1, 2, 3]))
    got = ours(ids, _cu(lens), history=history, positions=positions)
    assert torch.equal(got, want)
    # Oracle without history: the whole sequences hashed fresh end in the same rows.
    whole = [p + ids[a:b].tolist() for p, a, b in zip(prefixes, _cu(lens)[:-1], _cu(lens)[1:])]
    fresh = ours(torch.tensor(sum(whole, [])), _cu([len(w) for w in whole]))
    ends = torch.cat([torch.arange(len(w) - n, len(w)) + s
                      for w, n, s in zip(whole, lens, _cu([len(w) for w in whole])[:-1])])
    assert torch.equal(got, fresh[ends])

    # One decode step per sequence, continuing from SGLang's committed history.
    step = _tokens(4, cfg.vocab_size, gen)
    pos = torch.tensor([len(w) for w in whole])
    decode = types.SimpleNamespace(forward_mode=fb.ForwardMode.DECODE, positions=pos,
                                   req_pool_indices=torch.tensor([0, 1, 2, 3]),
                                   out_cache_loc=None, engram_history=None, spec_info=None)
    want = theirs(step, decode)
    got = ours(step, _cu([1, 1, 1, 1]), history=ours.history_rows(whole), positions=pos)
    assert torch.equal(got, want)


def test_hostile_inputs_and_configs_are_refused(cfg):
    from dataclasses import replace

    hasher = EngramHasher(cfg)
    ids = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="together"):
        hasher(ids, _cu([4]), history=hasher.history_rows([[]]))
    with pytest.raises(ValueError, match="history must be"):
        hasher(ids, _cu([4]), history=torch.zeros(2, 2, dtype=torch.long),
               positions=torch.arange(4))
    with pytest.raises(ValueError, match="input_ids"):
        hasher(ids.view(2, 2), _cu([4]))
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        EngramLayout.from_config(replace(cfg, engram_num_embeddings=[4062, 4153]))
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        EngramHasher(replace(cfg, engram_compressed_vocab_size=290))
    with pytest.raises(ValueError, match="multiple of 32"):
        EngramLayout.from_config(replace(cfg, engram_head_dim=48))
