"""Engine core pieces in one process: pages, prefix caches, plans, sampling, stop rules."""

import random

import pytest
import torch

from sglang_dsv41.engine.batch import Req, build_plan
from sglang_dsv41.engine.kv_cache import DUMMY_SLOT, OutOfPages, PageAllocator, slots_of
from sglang_dsv41.engine.messages import SamplingParams
from sglang_dsv41.engine.prefix_cache import NaivePrefixCache, RadixPrefixCache
from sglang_dsv41.engine.sampling import (StopChecker, apply_penalties, make_generator,
                                          model_logprobs, return_original_logprob,
                                          sample_token, validate_sampling)


def test_allocator_refcounts_and_reserved_page():
    a = PageAllocator(5, 4)
    pages = a.alloc(4)
    assert 0 not in pages and sorted(pages) == [1, 2, 3, 4]
    with pytest.raises(OutOfPages):
        a.alloc(1)
    a.incref(pages[:2])
    assert a.decref(pages) == 2 and a.num_free == 2
    assert a.decref(pages[:2]) == 2 and a.num_free == 4
    with pytest.raises(RuntimeError):
        a.decref([pages[0]])
    a.check()
    assert slots_of([3, 1], 2, 6, 4) == [14, 15, 4, 5]


def _page_lcp(a: list[int], b: list[int], page_size: int) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n // page_size * page_size


def _run_session(cache_cls, seed: int, page_size: int = 4, num_pages: int = 40):
    """Random multi-turn traffic; returns the (cached, copy-on-write) token counts of every
    admission and the oracle's: the longest whole-page prefix shared with any sequence cached so
    far, then the most tokens of the next page shared with one of those sequences."""
    rng = random.Random(seed)
    alloc = PageAllocator(num_pages, page_size)
    cache = cache_cls(alloc)
    histories = [[rng.randrange(5) for _ in range(rng.randrange(1, 9))] for _ in range(4)]
    hits, oracle, inserted, live = [], [], [], []
    for _ in range(60):
        h = histories[rng.randrange(4)]
        ids = h + [rng.randrange(5) for _ in range(rng.randrange(1, 9))]
        whole = max((_page_lcp(ids[:-1], seq, page_size) for seq in inserted), default=0)
        m = cache.match_prefix(ids[:-1])
        t = m.num_tokens
        nxt = ids[t:min(t + page_size, len(ids) - 1)]
        oracle.append((whole, max((_page_lcp(seq[t:t + page_size], nxt, 1)
                                   for seq in inserted if seq[:t] == ids[:t]), default=0)))
        assert m.num_tokens % page_size == 0 and m.num_tokens <= len(ids) - 1
        assert m.num_tokens == len(m.pages) * page_size
        cache.lock(m.handle)
        alloc.incref(m.pages)
        need = -(-len(ids) // page_size) - len(m.pages)
        if need > alloc.num_free:
            cache.evict(need - alloc.num_free)
        while need > alloc.num_free and live:   # locked pages hold it: drop the oldest request
            old_ids, old_pages, old_handle = live.pop(0)
            alloc.decref(old_pages)
            cache.unlock(old_handle)
            cache.evict(need - alloc.num_free)
        pages = m.pages + alloc.alloc(need)
        hits.append((m.num_tokens, m.copy_tokens))
        live.append((ids, pages, m.handle))
        if rng.random() < 0.7:   # finish: cache whole computed pages, drop own references
            ids, pages, handle = live.pop()
            full = (len(ids) - 1) // page_size
            cache.insert(ids[:full * page_size], pages[:full])
            inserted.append(ids[:full * page_size])
            alloc.decref(pages)
            cache.unlock(handle)
            h[:] = ids
        cache.check_integrity()
        alloc.check()
    for ids, pages, handle in live:
        alloc.decref(pages)
        cache.unlock(handle)
    cache.check_integrity()
    assert alloc.num_usable - alloc.num_free == cache.num_cached_pages
    cache.reset()
    assert alloc.num_free == alloc.num_usable
    return hits, oracle


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_radix_cache_finds_every_cached_prefix(seed):
    """With room for everything (no eviction) the radix cache matches exactly the brute-force
    oracle; under pressure it never claims more than the oracle; the naive twin never hits."""
    radix, oracle = _run_session(RadixPrefixCache, seed, num_pages=400)
    assert radix == oracle and sum(t for t, _ in oracle) > 0 and sum(c for _, c in oracle) > 0
    tight, tight_oracle = _run_session(RadixPrefixCache, seed)
    assert all(h[0] <= o[0] for h, o in zip(tight, tight_oracle))
    naive, _ = _run_session(NaivePrefixCache, seed)
    assert naive == [(0, 0)] * len(naive)


def test_radix_copy_match_reads_two_children_not_all(monkeypatch):
    """The part-page (copy-on-write) match under a node with many children compares the run
    with its two neighbours in sorted key order, which hold the longest shared prefix."""
    import sglang_dsv41.engine.prefix_cache as prefix_cache

    alloc = PageAllocator(600, 4)
    cache = RadixPrefixCache(alloc)
    for a in range(20):
        for b in range(20):
            pages = alloc.alloc(1)
            cache.insert([a, b, 7, 7], pages)
            alloc.decref(pages)
    compared = []
    real = prefix_cache._common_prefix
    monkeypatch.setattr(prefix_cache, "_common_prefix",
                        lambda x, y: compared.append(x) or real(x, y))
    m = cache.match_prefix([11, 5, 7, 9])
    assert (m.num_tokens, m.copy_tokens) == (0, 3) and len(compared) <= 2
    assert cache.match_prefix([11, 25]).copy_tokens == 1
    assert cache.match_prefix([30]).copy_tokens == 0
    cache.check_integrity()


def test_radix_match_split_insert_evict_lru():
    alloc = PageAllocator(20, 2)
    cache = RadixPrefixCache(alloc)
    a_pages = alloc.alloc(3)
    assert cache.insert([1, 2, 3, 4, 5, 6], a_pages) == 0
    alloc.decref(a_pages)                          # the cache alone holds them now
    m = cache.match_prefix([1, 2, 3, 4, 9, 9, 9])  # splits the 3-page node after 2 pages
    assert m.num_tokens == 4 and m.pages == a_pages[:2]
    cache.check_integrity()
    b_pages = alloc.alloc(2)
    assert cache.insert([1, 2, 3, 4, 9, 9], m.pages + b_pages[:1]) == 4
    alloc.decref(b_pages)
    cache.lock(m.handle)
    assert cache.evict(10) == 2           # leaves [5,6] and [9,9]; the locked prefix stays
    assert cache.match_prefix([1, 2, 3, 4]).num_tokens == 4
    cache.unlock(m.handle)
    assert cache.evict(10) == 2 and cache.num_cached_pages == 0
    assert alloc.num_free == alloc.num_usable


def test_plan_padding_rows_use_dummy_slot():
    req = Req("a", [5, 6, 7], SamplingParams(), pages=[3])
    plan = build_plan("extend", [req], [3], page_size=4, attn_tp_size=2, padding=True,
                      history_len=2, record_routing=False)
    assert plan.num_tokens == 3 and plan.padded_tokens == 4
    assert plan.slots.tolist() == [12, 13, 14, DUMMY_SLOT]
    assert plan.engram_history.tolist() == [[0, 0]]
    assert plan.logit_rows == [2] and plan.context_slots.tolist() == [12, 13, 14]
    off = build_plan("extend", [req], [3], 4, 2, False, 2, False)
    assert off.padded_tokens == 3
    req.num_computed, req.output_ids = 3, [8]
    dec = build_plan("decode", [req], [1], 4, 4, True, 2, False)
    assert dec.padded_tokens == 4 and dec.seq_lens == [4]
    assert dec.context_slots.tolist() == [12, 13, 14, 15]
    assert dec.engram_history.tolist() == [[6, 7]]   # the tokens before the new one


def _sampled_logprob(logits, p, generator, output_ids=(), original=False):
    token, returned = sample_token(logits, p, generator, output_ids, original=original)
    return token, float(model_logprobs(returned)[token])


def test_sampling_rules():
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    greedy = SamplingParams(temperature=0.0)
    tok, lp = _sampled_logprob(logits, greedy, None)
    assert tok == 1 and lp == pytest.approx(float(torch.log_softmax(logits, -1)[1]))
    for p, allowed in [(SamplingParams(temperature=1.0, top_k=2), {1, 2}),
                       (SamplingParams(temperature=1.0, top_p=0.5), {1}),
                       (SamplingParams(temperature=1.0, min_p=0.5), {1, 2})]:
        gen = torch.Generator().manual_seed(0)
        assert {sample_token(logits, p, gen)[0] for _ in range(50)} == allowed
    # sampling_seed reaches the sampler through the leader's make_generator(seed): the same seed
    # draws the same tokens, another seed other tokens.
    hot = SamplingParams(temperature=5.0, seed=7)

    def draws(seed: int, logprob_logits: bool = True) -> list[int]:
        gen = make_generator(seed)
        return [sample_token(logits, hot, gen, logprob_logits=logprob_logits)[0]
                for _ in range(40)]

    assert draws(hot.seed) == draws(hot.seed) and draws(hot.seed) != draws(8)
    # a request that returns no logprobs draws the same tokens and gets no logits
    assert draws(hot.seed, logprob_logits=False) == draws(hot.seed)
    assert sample_token(logits, hot, None, logprob_logits=False)[1] is None
    assert sample_token(logits, greedy, None, logprob_logits=False) == (1, None)
    with pytest.raises(ValueError, match="top_p"):
        validate_sampling(SamplingParams(top_p=0.0), 10)
    with pytest.raises(ValueError, match="max_new_tokens"):
        validate_sampling(SamplingParams(max_new_tokens=0), 10)


def test_min_new_tokens_holds_back_stop_ids_and_logit_bias_comes_last():
    """SGLang 0.5.23: BatchedMinNewTokensPenalizer puts the stop token ids and the EOS at -inf
    until min_new_tokens (they were sampled and kept in the output); logit_bias is added after
    the penalizers (it came first, which matters with the repetition penalty)."""
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0, 1.0])
    held = SamplingParams(temperature=0.0, stop_token_ids=[1], min_new_tokens=2)
    assert sample_token(logits, held, None, [], stop_ids=[2])[0] == 4   # 1 and EOS 2 held back
    assert sample_token(logits, held, None, [4], stop_ids=[2])[0] == 4
    assert sample_token(logits, held, None, [4, 4], stop_ids=[2])[0] == 1  # reached
    rep = SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={4: 10.0})
    assert apply_penalties(logits, rep, [4])[4].item() == 1.0 / 2.0 + 10.0


def test_output_logprobs_are_sglangs_sampling_distribution(monkeypatch):
    """SGLang 0.5.23 (layers/sampler.py): log_softmax of the logits after penalties and
    logit_bias, divided by the temperature; greedy requests and SGLANG_RETURN_ORIGINAL_LOGPROB
    leave the temperature out; top-k/top-p do not change the values."""
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    hot = SamplingParams(temperature=2.0, top_k=2, top_p=0.5, frequency_penalty=0.5,
                         logit_bias={3: 1.0})
    adjusted = logits - 0.5 * torch.tensor([0.0, 2.0, 0.0, 0.0]) + torch.tensor([0, 0, 0, 1.0])
    tok, got = sample_token(logits, hot, torch.Generator().manual_seed(0), [1, 1])
    torch.testing.assert_close(got, adjusted / 2.0)
    assert tok == int(torch.argmax(adjusted))   # top_p=0.5 keeps only the most likely token
    _, got = sample_token(logits, hot, torch.Generator().manual_seed(0), [1, 1], original=True)
    torch.testing.assert_close(got, adjusted)
    greedy = SamplingParams(temperature=0.0)
    torch.testing.assert_close(sample_token(logits, greedy, None)[1], logits)
    tok, lp = _sampled_logprob(logits, SamplingParams(temperature=2.0, top_k=1), None)
    assert tok == 1 and lp == pytest.approx(float(torch.log_softmax(logits, -1)[1]))
    # a temperature whose division overflows: its limit, the greedy token certain
    tok, tiny = sample_token(logits * 1e30, SamplingParams(temperature=1e-30), None)
    assert tok == 1 and tiny[1] == 0 and torch.isinf(tiny[[0, 2, 3]]).all()
    # a masked (-inf) logit is no overflow: the others keep their tempered values
    masked = torch.tensor([0.0, 3.0, 2.9, float("-inf")])
    _, got = sample_token(masked, SamplingParams(temperature=2.0), torch.Generator())
    torch.testing.assert_close(got, masked / 2.0)
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "true")
    assert return_original_logprob()
    _, lp = _sampled_logprob(logits, SamplingParams(temperature=2.0, seed=1),
                             torch.Generator().manual_seed(0), original=return_original_logprob())
    assert lp in set(torch.log_softmax(logits, -1).tolist())


def test_stop_rules():
    checker = StopChecker(eos_token_id=9, decode_fn=lambda ids: bytes(ids).decode())
    p = SamplingParams(max_new_tokens=5, stop=["bc"], stop_token_ids=[7])
    assert checker.check([ord("a")], p, 5) is None
    assert checker.check([ord("a"), ord("b"), ord("c")], p, 5) == {"type": "stop", "matched": "bc"}
    assert checker.check([1, 7], p, 5) == {"type": "stop", "matched": 7}
    assert checker.check([1, 9], p, 5) == {"type": "stop", "matched": 9}
    assert checker.check([1, 9], SamplingParams(ignore_eos=True), 5) is None
    assert checker.check([1, 2], p, 2) == {"type": "length", "length": 2}
