"""Scheduler ranks spawned directly (no launcher): DP attention on CPU/gloo end to end.

One tp=4 dp=2 spin-up covers the serving checks; tp=1 and tp=2 runs pin greedy determinism; two
more show the failures the plugins prevent (padding off: gloo's reduce-scatter check kills the
rank; idle batch off: the decoding rank blocks in the MLP gather and the watchdog reports it).
"""

import random

import pytest
import torch

from engine_core_harness import RankCluster, tiny_args
from sglang_dsv41.engine.messages import AbortReq, GenerateReq, SamplingParams
from sglang_dsv41.model import build_model, get_preset, reference_logprobs

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
_rng = random.Random(1234)
DET_PROMPTS = [[_rng.randrange(256) for _ in range(n)] for n in (1, 3, 9, 17, 30)]
GREEDY_RESULTS: dict[str, list[list[int]]] = {}


@pytest.fixture(scope="module")
def ref_model():
    # One thread: OpenMP threads spinning against the rank processes on 2 cores are 30x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = build_model(get_preset("tiny"), torch.float32, seed=0)
    model.greedy_ref = [reference_greedy(model, p, GREEDY.max_new_tokens) for p in DET_PROMPTS]
    yield model
    torch.set_num_threads(threads)


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    from sglang_dsv41.model import ForwardContext

    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            hidden = model(torch.tensor(seq), ForwardContext.packed([len(seq)]))
            seq.append(int(model.compute_logits(hidden[-1:]).argmax()))
    return seq[len(prompt):]


def check_logprobs(model, prompts, outs, atol=1e-5):
    refs, _ = reference_logprobs(model, [p + o.token_ids for p, o in zip(prompts, outs)])
    for p, o, ref in zip(prompts, outs, refs):
        assert len(o.logprobs) == len(o.token_ids)
        torch.testing.assert_close(torch.tensor(o.logprobs), ref[len(p) - 1:], rtol=0, atol=atol)


def check_greedy(name, model, cluster, dp_ranks=None):
    outs = cluster.generate(DET_PROMPTS, dp_ranks, sampling=GREEDY, return_logprob=True)
    got = [o.token_ids for o in outs]
    assert got == model.greedy_ref
    check_logprobs(model, DET_PROMPTS, outs)
    GREEDY_RESULTS[name] = got
    assert all(v == got for v in GREEDY_RESULTS.values()), GREEDY_RESULTS


@pytest.mark.timeout(150)
def test_tp4_dp2_serving(ref_model):
    args = tiny_args(tp_size=4, dp_size=2, enable_dp_attention=True, chunked_prefill_size=32,
                     enable_return_routed_experts=True)
    with RankCluster(args) as c:
        ready = c.wait_ready(90)
        assert all(m.ok for m in ready) and {m.dp_rank for m in ready} == {0, 1}
        # SGLang's health check: one token, no DP rank (the controller picks one).
        health = c.generate([[0]], sampling=SamplingParams(max_new_tokens=1))[0]
        assert health.finished and health.error is None and len(health.token_ids) == 1

        # Every prompt length 1..17, pinned alternately: each DP rank runs its own batches,
        # padded to a multiple of attn_tp_size=2, with the other rank's tokens in the MoE.
        prompts = [[(7 * n + i) % 256 for i in range(n)] for n in range(1, 18)]
        pins = [n % 2 for n in range(17)]
        outs = c.generate(prompts, pins, sampling=GREEDY, return_logprob=True)
        assert [o.dp_rank for o in outs] == pins
        assert all(o.finish_reason == {"type": "length", "length": 6} for o in outs)
        check_logprobs(ref_model, prompts, outs)

        # One DP rank decoding, the other idle (eager): completes thanks to idle batches.
        long = c.generate([DET_PROMPTS[2]], [1], sampling=SamplingParams(
            max_new_tokens=16, temperature=0.0, ignore_eos=True), return_logprob=True)[0]
        assert long.dp_rank == 1 and len(long.token_ids) == 16

        check_greedy("tp4_dp2", ref_model, c, dp_ranks=[0, 1, 0, 1, 0])

        # Multi-turn: turn 2 extends turn 1's prompt + output on the same DP rank.
        p1 = [200 + i % 50 for i in range(13)]
        t1 = c.generate([p1], [0], sampling=SamplingParams(max_new_tokens=8, temperature=0.0,
                                                           ignore_eos=True),
                        return_routed_experts=True)[0]
        turn1 = p1 + t1.token_ids
        p2 = turn1 + [1, 2, 3]
        same, other = (c.generate([p2], [r], sampling=GREEDY, return_routed_experts=True)[0]
                       for r in (0, 1))
        # Turn 1's last token never went through the model, so it has no K/V (as in SGLang).
        assert same.cached_tokens >= len(turn1) - 1 and same.dp_rank == 0
        assert other.cached_tokens < args.page_size and other.dp_rank == 1

        # R3: routing of every token that went through the model, dense layers -1; the cached
        # prefix keeps turn 1's routing; ids and weights match the reference model's router.
        cfg = ref_model.config
        assert t1.routed_experts.shape == (len(turn1) - 1, cfg.num_hidden_layers,
                                           cfg.num_experts_per_tok)
        assert (t1.routed_experts[:, 0] == -1).all()
        n1 = len(turn1) - 1
        assert (same.routed_experts[:n1] == t1.routed_experts).all()
        _, ctx = reference_logprobs(ref_model, [turn1], record_routing=True)
        for layer, (ids, weights) in ctx.routed.items():
            assert (torch.from_numpy(t1.routed_experts[:, layer]) == ids[:n1]).all()
            torch.testing.assert_close(torch.from_numpy(t1.routed_weights[:, layer]),
                                       weights[:n1].float(), rtol=0, atol=1e-5)

        # Control ops run on every rank; a flush empties both DP groups' caches.
        info = c.control("get_model_info")
        assert [o.rank for o in info] == [0, 1, 2, 3] and all(o.ok for o in info)
        assert info[0].result["max_total_tokens"] == 2048
        assert all(o.ok for o in c.control("flush_cache"))
        sums = c.control("engram_checksum")   # registered from the loader
        assert all(o.ok for o in sums) and all(o.result == sums[0].result for o in sums)
        bad = c.control("no_such_op")
        assert not any(o.ok for o in bad) and "unknown control op" in bad[0].error
        again = c.generate([p2], [0], sampling=GREEDY)[0]
        assert again.cached_tokens == 0 and again.token_ids == same.token_ids
        assert any(s.dp_rank == 1 and s.prompt_tokens > 0 for s in c.stats)
        assert c.shutdown() == [0, 0, 0, 0]


@pytest.mark.timeout(120)
def test_tp1_chunked_sampling_stops_abort(ref_model):
    # 48 KV tokens: two 17-token prompts decoding 12 tokens each must retract one of them.
    args = tiny_args(tp_size=1, chunked_prefill_size=8, page_size=1, max_total_tokens=48)
    with RankCluster(args) as c:
        assert c.wait_ready(60)[0].ok
        check_greedy("tp1_chunked", ref_model, c)
        prompt = DET_PROMPTS[3]
        hot = SamplingParams(max_new_tokens=12, temperature=1.5, top_p=0.9, top_k=50, seed=3)
        a, b = c.generate([prompt, prompt], sampling=hot, return_logprob=True)
        assert a.token_ids == b.token_ids
        check_logprobs(ref_model, [prompt, prompt], [a, b])   # temperature-1 logprobs
        d = c.generate([prompt], sampling=SamplingParams(**{**hot.__dict__, "seed": 4}))[0]
        assert d.token_ids != a.token_ids
        stop_id = a.token_ids[3]
        s = c.generate([prompt], sampling=SamplingParams(**{**hot.__dict__,
                                                            "stop_token_ids": [stop_id]}))[0]
        first = a.token_ids.index(stop_id)
        assert s.token_ids == a.token_ids[:first + 1]
        assert s.finish_reason == {"type": "stop", "matched": stop_id}
        # Streaming: one chunk per decode step, together the same tokens.
        c.submit(GenerateReq("st", prompt, hot, stream=True))
        streamed = c.wait_finished(["st"])["st"]
        assert len(c.outs["st"]) == 12 and streamed.token_ids == a.token_ids
        # Bad input: an error for that request, the rank keeps serving.
        bad = c.generate([[999]])[0]
        assert bad.error and "input_ids" in bad.error
        # Abort a request while it decodes (after its first streamed chunk).
        c.submit(GenerateReq("long", prompt, SamplingParams(max_new_tokens=200, ignore_eos=True,
                                                            temperature=0.0), stream=True))
        while "long" not in c.outs:
            c._drain_one(30)
        c.submit(AbortReq("long"))
        aborted = c.wait_finished(["long"])["long"]
        assert aborted.finish_reason == {"type": "abort"} and aborted.completion_tokens < 30
        # Its pages went back (the idle integrity check would kill the rank otherwise).
        assert c.generate([prompt], sampling=GREEDY)[0].cached_tokens > 0
        assert c.shutdown() == [0]


@pytest.mark.timeout(120)
def test_tp2_greedy_matches(ref_model):
    with RankCluster(tiny_args(tp_size=2)) as c:
        assert all(m.ok for m in c.wait_ready(60))
        check_greedy("tp2", ref_model, c)
        assert c.shutdown() == [0, 0]


@pytest.mark.timeout(120)
def test_prefill_padding_off_kills_rank_like_sglang(tmp_path):
    args = tiny_args(tp_size=4, dp_size=2, enable_dp_attention=True, enable_prefill_padding=False)
    with RankCluster(args, stderr_dir=str(tmp_path)) as c:
        assert all(m.ok for m in c.wait_ready(90))
        c.submit(GenerateReq("HEALTH_CHECK_0", [0], SamplingParams(max_new_tokens=1)))
        for p in c.procs[:2]:   # DP group 0's ranks run the 1-token reduce-scatter
            p.join(60)
            assert p.exitcode not in (0, None)
        err = open(c.stderr_paths[0]).read()
        assert "Check failed: outputShape[0] * worldSize == inputShape[0]" in err, err[-2000:]


@pytest.mark.timeout(120)
def test_idle_batch_off_stalls_and_watchdog_names_rank():
    args = tiny_args(tp_size=2, dp_size=2, enable_dp_attention=True, enable_idle_batch=False,
                     stall_timeout=2.0)
    with RankCluster(args) as c:
        assert all(m.ok for m in c.wait_ready(60))
        # DP rank 0 has a request, DP rank 1 is idle and, without an idle batch, never joins
        # the MLP gather of rank 0's forward.
        c.submit(GenerateReq("a", DET_PROMPTS[2], SamplingParams(max_new_tokens=20)), 0)
        report = c.wait_stall(timeout=30, contains="rank 0 stuck in collective 'mlp_gather'")
        assert not report.healthy and report.dp_rank == 0
        assert f"at step {report.step}" in report.stall
        assert "a" not in c.outs
