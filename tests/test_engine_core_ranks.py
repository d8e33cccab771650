"""Scheduler ranks spawned directly (no launcher): the real DSV4.1 model (tiny: sliding, CSA, HCA
and ratio-1/2 layers with shared kv/index sources and candidate blocks, Engram, hash and top-k
MoE, mHC) served over CPU/gloo end to end, against a whole-sequence recompute of the reference
model (our bf16 layout on disk, kept fp32).

One tp=4 dp=2 spin-up covers the serving checks; tp=1 and tp=2 runs pin greedy determinism; two
more show the failures the plugins prevent (padding off: gloo's reduce-scatter check kills the
rank; idle batch off: the decoding rank blocks in the MoE gather and the watchdog reports it).
The prompts cross many CSA blocks (ratio 4), ratio-1/2 groups and the HCA block (ratio 128),
and exceed the 16-token window, so decode reads compressed entries rebuilt from the cache.
"""

import random

import pytest
import torch

from engine_core_harness import (RankCluster, engine_test_model, reference_greedy,
                                 reference_logprobs, tiny_args, write_flat_checkpoint)
from sglang_dsv41.engine.messages import AbortReq, GenerateReq, SamplingParams
from sglang_dsv41.loader.engram_codec import ALIGN_ROWS, tensor_checksum
from sglang_dsv41.loader.engram_layouts import row_shard
from sglang_dsv41.tokenizer import AddedToken, ByteTokenizer

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
_rng = random.Random(1234)
DET_PROMPTS = [[_rng.randrange(256) for _ in range(n)] for n in (1, 9, 30, 70, 140)]
GREEDY_RESULTS: dict[str, list[list[int]]] = {}
RENAMED_TAG = "<reasoning>"


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    # One thread: OpenMP threads spinning against the rank processes on 2 cores are 30x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg, model = engine_test_model()
    model.ckpt = write_flat_checkpoint(str(tmp_path_factory.mktemp("tiny")), cfg, model)
    # The checkpoint's own tokenizer file, one tag renamed: stop strings must read it.
    tok = ByteTokenizer.from_config(cfg)
    table = dict(tok.added_tokens)
    model.renamed_tag = next(t for t, a in table.items() if a.content == "<think>")
    table[model.renamed_tag] = AddedToken(RENAMED_TAG, False)
    ByteTokenizer(tok.vocab_size, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id,
                  table).save_pretrained(model.ckpt)
    with torch.no_grad():
        model.greedy_ref = [reference_greedy(model, p, GREEDY.max_new_tokens)
                            for p in DET_PROMPTS]
    yield model
    torch.set_num_threads(threads)


def check_logprobs(model, prompts, outs, atol=1e-5, temperature=1.0):
    with torch.no_grad():
        refs, _ = reference_logprobs(model, [p + o.token_ids for p, o in zip(prompts, outs)],
                                     temperature=temperature)
    for p, o, r in zip(prompts, outs, refs):
        assert len(o.logprobs) == len(o.token_ids)
        torch.testing.assert_close(torch.tensor(o.logprobs), r[len(p) - 1:], rtol=0, atol=atol)


def check_greedy(name, model, cluster, dp_ranks=None):
    outs = cluster.generate(DET_PROMPTS, dp_ranks, sampling=GREEDY, return_logprob=True,
                            timeout=120)
    got = [o.token_ids for o in outs]
    assert got == model.greedy_ref
    check_logprobs(model, DET_PROMPTS, outs)
    GREEDY_RESULTS[name] = got
    assert all(v == got for v in GREEDY_RESULTS.values()), GREEDY_RESULTS


def args_for(model, **kw):
    return tiny_args(model_path=model.ckpt, **kw)


@pytest.mark.timeout(240)
def test_tp4_dp2_serving(ref):
    args = args_for(ref, tp_size=4, dp_size=2, enable_dp_attention=True, chunked_prefill_size=32,
                    enable_return_routed_experts=True)
    with RankCluster(args) as c:
        ready = c.wait_ready(90)
        assert all(m.ok for m in ready) and {m.dp_rank for m in ready} == {0, 1}
        # SGLang's health check: one token, no DP rank (the controller picks one).
        health = c.generate([[0]], sampling=SamplingParams(max_new_tokens=1))[0]
        assert health.finished and health.error is None and len(health.token_ids) == 1

        check_greedy("tp4_dp2", ref, c, dp_ranks=[0, 1, 0, 1, 0])

        # Multi-turn: turn 2 extends turn 1's prompt + output on the same DP rank; the other
        # DP rank has nothing cached. Turn 1 crosses 35 CSA blocks and the HCA block.
        p1 = [200 + i % 50 for i in range(133)]
        t1 = c.generate([p1], [0], sampling=SamplingParams(max_new_tokens=8, temperature=0.0,
                                                           ignore_eos=True),
                        return_routed_experts=True, timeout=120)[0]
        turn1 = p1 + t1.token_ids
        p2 = turn1 + [1, 2, 3]
        same, other = (c.generate([p2], [r], sampling=GREEDY, return_routed_experts=True,
                                  return_logprob=True, timeout=120)[0] for r in (0, 1))
        # Turn 1's last token never went through the model, so it has no cache rows (as in
        # SGLang); the radix cache matches whole pages.
        assert same.cached_tokens >= len(turn1) - args.page_size and same.dp_rank == 0
        assert other.cached_tokens == 0 and other.dp_rank == 1
        assert same.token_ids == other.token_ids == reference_greedy(ref, p2, 6)
        check_logprobs(ref, [p2, p2], [same, other])

        # R3: routing of every token that went through the model (hash layers from tid2eid);
        # the cached prefix keeps turn 1's routing; ids and weights match the reference router.
        cfg = ref.cfg
        n1 = len(turn1) - 1
        assert t1.routed_experts.shape == (n1, cfg.num_hidden_layers, cfg.num_experts_per_tok)
        assert (same.routed_experts[:n1] == t1.routed_experts).all()
        with torch.no_grad():
            _, ctx = reference_logprobs(ref, [turn1], record_routing=True)
        assert sorted(ctx.routed) == list(range(cfg.num_hidden_layers))
        for layer, (ids, weights) in ctx.routed.items():
            assert (torch.from_numpy(t1.routed_experts[:, layer]).long() == ids[:n1]).all()
            torch.testing.assert_close(torch.from_numpy(t1.routed_weights[:, layer]),
                                       weights[:n1].float(), rtol=0, atol=1e-5)

        # Engram: one shared-memory copy per node (the default on one node), full tables.
        layout = [o.result for o in c.control("engram_info")]
        assert all(i["layout"] == "shared" and i["shared_memory"] for i in layout)
        # Control ops run on every rank; a flush empties both DP groups' caches.
        info = c.control("get_model_info")
        assert [o.rank for o in info] == [0, 1, 2, 3] and all(o.ok for o in info)
        assert info[0].result["max_total_tokens"] == 2048
        assert all(o.ok for o in c.control("flush_cache"))
        bad = c.control("no_such_op")
        assert not any(o.ok for o in bad) and "unknown control op" in bad[0].error
        again = c.generate([p2], [0], sampling=GREEDY)[0]
        assert again.cached_tokens == 0 and again.token_ids == same.token_ids
        assert any(s.dp_rank == 1 and s.prompt_tokens > 0 for s in c.stats)
        assert c.shutdown() == [0, 0, 0, 0]


@pytest.mark.timeout(180)
def test_tp1_chunked_sampling_stops_abort(ref):
    # 320 cache tokens: two 140-token prompts decoding 12 tokens each must retract one of them.
    args = args_for(ref, tp_size=1, chunked_prefill_size=24, page_size=1, max_total_tokens=300)
    with RankCluster(args) as c:
        assert c.wait_ready(60)[0].ok
        check_greedy("tp1_chunked", ref, c)
        prompt = DET_PROMPTS[4]
        hot = SamplingParams(max_new_tokens=12, temperature=1.5, top_p=0.9, top_k=50, seed=3)
        a, b = c.generate([prompt, prompt], sampling=hot, return_logprob=True, timeout=120)
        assert a.token_ids == b.token_ids
        # SGLang's default: output logprobs of the sampling distribution, logits / temperature
        check_logprobs(ref, [prompt, prompt], [a, b], temperature=1.5)
        d = c.generate([prompt], sampling=SamplingParams(**{**hot.__dict__, "seed": 4}))[0]
        assert d.token_ids != a.token_ids
        stop_id = a.token_ids[3]
        s = c.generate([prompt], sampling=SamplingParams(**{**hot.__dict__,
                                                            "stop_token_ids": [stop_id]}))[0]
        first = a.token_ids.index(stop_id)
        assert s.token_ids == a.token_ids[:first + 1]
        assert s.finish_reason == {"type": "stop", "matched": stop_id}
        forced = SamplingParams(max_new_tokens=4, temperature=0.0, stop=[RENAMED_TAG],
                                logit_bias={ref.renamed_tag: 100.0})
        t = c.generate([prompt], sampling=forced)[0]
        assert t.token_ids == [ref.renamed_tag]
        assert t.finish_reason == {"type": "stop", "matched": RENAMED_TAG}
        # Streaming: one chunk per decode step, together the same tokens.
        c.submit(GenerateReq("st", prompt, hot, stream=True))
        streamed = c.wait_finished(["st"])["st"]
        assert len(c.outs["st"]) == 12 and streamed.token_ids == a.token_ids
        # Bad input: an error for that request, the rank keeps serving.
        bad = c.generate([[999]])[0]
        assert bad.error and "input_ids" in bad.error
        # Abort a request while it decodes (after its first streamed chunk).
        c.submit(GenerateReq("long", prompt, SamplingParams(max_new_tokens=100, ignore_eos=True,
                                                            temperature=0.0), stream=True))
        while "long" not in c.outs:
            c._drain_one(30)
        c.submit(AbortReq("long"))
        aborted = c.wait_finished(["long"])["long"]
        assert aborted.finish_reason == {"type": "abort"} and aborted.completion_tokens < 30
        # Its pages went back (the idle integrity check would kill the rank otherwise).
        assert c.generate([prompt], sampling=GREEDY)[0].cached_tokens > 0
        assert c.shutdown() == [0]


@pytest.mark.timeout(180)
def test_tp2_greedy_matches_with_row_sharded_engram(ref):
    # SGLang's per_rank layout: each rank holds half of every table's rows; lookups gather.
    with RankCluster(args_for(ref, tp_size=2, engram_layout="private")) as c:
        assert all(m.ok for m in c.wait_ready(60))
        check_greedy("tp2", ref, c)
        info = [o.result for o in c.control("engram_info")]
        tables = {n: b.shape[0] for n, b in ref.named_buffers() if n.endswith("embed.weight")}
        assert all(i["layout"] == "private" and not i["shared_memory"] for i in info)
        for name, rows in tables.items():
            held = [i["rows"][name.rsplit(".", 1)[0]] for i in info]
            assert held == [hi - lo for lo, hi in (row_shard(rows, r, 2) for r in range(2))]
            assert 0 < held[0] < rows and held[0] % ALIGN_ROWS == 0
        # /engram_checksum: the ranks' partial sums combine into the whole table's checksum
        # (it was rank 0's shard's)
        want = {n: tensor_checksum(b) for n, b in ref.named_buffers()
                if n.endswith(("embed.weight", "embed.scale"))}
        assert [o.result for o in c.control("engram_checksum")] == [want, want]
        assert c.shutdown() == [0, 0]


@pytest.mark.timeout(120)
def test_prefill_padding_off_kills_rank_like_sglang(ref, tmp_path):
    args = args_for(ref, tp_size=4, dp_size=2, enable_dp_attention=True,
                    enable_prefill_padding=False)
    with RankCluster(args, stderr_dir=str(tmp_path)) as c:
        assert all(m.ok for m in c.wait_ready(90))
        c.submit(GenerateReq("HEALTH_CHECK_0", [0], SamplingParams(max_new_tokens=1)))
        for p in c.procs[:2]:   # DP group 0's ranks run the 1-token reduce-scatter
            p.join(60)
            assert p.exitcode not in (0, None)
        err = open(c.stderr_paths[0]).read()
        assert "Check failed: outputShape[0] * worldSize == inputShape[0]" in err, err[-2000:]


@pytest.mark.timeout(120)
def test_idle_batch_off_stalls_and_watchdog_names_rank(ref):
    args = args_for(ref, tp_size=2, dp_size=2, enable_dp_attention=True,
                    enable_idle_batch=False, stall_timeout=2.0)
    with RankCluster(args) as c:
        assert all(m.ok for m in c.wait_ready(60))
        # DP rank 0 has a request, DP rank 1 is idle and, without an idle batch, never joins
        # the MoE gather of rank 0's forward.
        c.submit(GenerateReq("a", DET_PROMPTS[2], SamplingParams(max_new_tokens=20)), 0)
        report = c.wait_stall(timeout=30, contains="rank 0 stuck in collective 'mlp_gather'")
        assert not report.healthy and report.dp_rank == 0
        assert f"at step {report.step}" in report.stall
        assert "a" not in c.outs
