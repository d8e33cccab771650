"""Prompt and output top-N / token-id logprobs from the scheduler ranks (tp=1, spawned directly)
across chunked prefill and a retraction, against the reference model's whole-sequence
log_softmax. The HTTP shape is checked in test_api_clients.py (real server) and
test_engine_server_http.py (hostile bodies)."""

import pytest
import torch

from engine_core_harness import RankCluster, engine_test_model, tiny_args
from sglang_dsv41.engine.messages import GenerateReq, SamplingParams
from sglang_dsv41.model.dsv4.context import DSV4Context

pytestmark = pytest.mark.timeout(180)
PROMPTS = [[(7 * i + 3 * k) % 256 for i in range(40)] for k in range(2)]
TOP, IDS, START = 4, [5, 250, 5], 3


def reference_rows(model, seq: list[int]) -> torch.Tensor:
    """[len(seq), V]: row t is the distribution of token t+1 (the server's numerics)."""
    with torch.no_grad():
        logits = model(torch.tensor(seq), DSV4Context.packed([len(seq)], serving_numerics=True))
    return torch.log_softmax(logits.float(), dim=-1)


def check_position(rows: torch.Tensor, at: int, token: int, lp: float, top_values, top_ids,
                   ids_values) -> None:
    row = rows[at]
    assert lp == pytest.approx(float(row[token]), abs=1e-5)
    assert top_values == sorted(top_values, reverse=True) and len(top_ids) == TOP
    assert top_values == pytest.approx([float(row[t]) for t in top_ids], abs=1e-5)
    assert top_values[-1] == pytest.approx(float(row.topk(TOP).values[-1]), abs=1e-5)
    assert ids_values == pytest.approx([float(row[t]) for t in IDS], abs=1e-5)


def test_chunked_and_retracted_requests_match_the_reference():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # the ranks share the 2 cores
    try:
        _, model = engine_test_model()
        # 8-token chunks; 96 cache tokens for two 40 + 12 token requests: one is retracted.
        args = tiny_args(tp_size=1, chunked_prefill_size=8, page_size=4, max_total_tokens=96)
        with RankCluster(args) as c:
            assert c.wait_ready(60)[0].ok
            sampling = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7,
                                      ignore_eos=True)
            # A request without logprobs in the same batches: the leader scores only the
            # others' rows, each still its own.
            c.submit(GenerateReq("plain", [9, 8, 7], SamplingParams(
                max_new_tokens=16, temperature=0.7, frequency_penalty=1.0, ignore_eos=True)))
            outs = c.generate(PROMPTS, sampling=sampling, return_logprob=True,
                              logprob_start_len=START, top_logprobs_num=TOP,
                              token_ids_logprob=IDS, timeout=150)
            plain = c.wait_finished(["plain"], timeout=30)["plain"]
            assert c.shutdown() == [0]
        assert len(plain.token_ids) == 16 and not plain.logprobs
        for prompt, out in zip(PROMPTS, outs):
            rows = reference_rows(model, prompt + out.token_ids)
            scored = prompt[START + 1:]   # SGLang: the start position has no value
            assert len(out.input_logprobs) == len(out.input_extras) == len(scored)
            ex = out.input_extras
            for j, token in enumerate(scored):
                check_position(rows, START + j, token, out.input_logprobs[j], ex.top_values[j],
                               ex.top_ids[j], ex.ids_values[j])
            ex = out.output_extras
            assert len(out.logprobs) == len(ex) == len(out.token_ids) == 12
            for j, token in enumerate(out.token_ids):
                check_position(rows, len(prompt) - 1 + j, token, out.logprobs[j],
                               ex.top_values[j], ex.top_ids[j], ex.ids_values[j])
                if token in ex.top_ids[j]:   # the sampled token's value is its entry's
                    assert ex.top_values[j][ex.top_ids[j].index(token)] == out.logprobs[j]
    finally:
        torch.set_num_threads(threads)


def test_scheduler_refuses_bad_logprob_fields_of_direct_messages():
    args = tiny_args(tp_size=1)
    with RankCluster(args) as c:
        assert c.wait_ready(60)[0].ok
        bad = [dict(top_logprobs_num=-1), dict(top_logprobs_num=10**6),
               dict(token_ids_logprob=[320]), dict(logprob_start_len=9)]
        for i, kw in enumerate(bad):
            c.submit(GenerateReq(f"bad{i}", [1, 2, 3], SamplingParams(max_new_tokens=1),
                                 return_logprob=True, **kw))
        outs = c.wait_finished([f"bad{i}" for i in range(len(bad))], timeout=60)
        for i, needle in enumerate(["top_logprobs_num", "top_logprobs_num", "vocabulary",
                                    "logprob_start_len"]):
            assert needle in (outs[f"bad{i}"].error or ""), outs[f"bad{i}"]
        assert c.shutdown() == [0]
