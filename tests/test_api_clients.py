"""Real clients against the embedded server: SGLang 0.5.23's own frontend (``sglang.lang`` gen
and select), the real sglang-router 0.3.2 (``--dp-aware --policy manual``), and SGLang's
/generate schema (every SamplingParams field of ``sglang/api/v1/api_types.py``). One server
(tiny preset, tp=2 dp=2 with DP attention) is shared by the module."""

from __future__ import annotations

import importlib.util
import json
import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from sglang_cpu import import_sglang

from sglang_dsv41.ports import free_port
from sglang_dsv41.router.smg import SMGProcess, SMGSessionRouter
from sglang_dsv41.server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
LAYOUT = ["--model-path", "tiny", "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention",
          "--context-length", "512", "--max-new-tokens-limit", "64"]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(LAYOUT, startup_timeout=150) as s:
        s.http = httpx.Client(base_url=s.url, timeout=60)
        yield s
        s.http.close()


def sglang_api_types():
    """SGLang 0.5.23's generated schema module, loaded without importing the sglang package."""
    root = os.path.dirname(importlib.util.find_spec("sglang").origin)
    path = os.path.join(root, "api", "v1", "api_types.py")
    spec = importlib.util.spec_from_file_location("sglang_api_types", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gen(server, **body) -> dict:
    r = server.http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_every_sglang_sampling_param_with_its_default_is_accepted(server):
    types = sglang_api_types()
    defaults = types.encode_SamplingParams(types.SamplingParams(max_new_tokens=4))
    nulls = {f: None for f in types.SamplingParams.__struct_fields__}
    assert set(defaults) <= set(nulls)
    for sp in (defaults, nulls | {"max_new_tokens": 4}):
        out = gen(server, text="hi", sampling_params=sp, routing_key="k", rid=None,
                  bootstrap_host=None, priority=3, some_future_field={"x": 1})
        assert out["meta_info"]["completion_tokens"] <= 4
    for field, value in [("regex", "a+"), ("json_schema", "{}"), ("ebnf", "root ::= 'a'")]:
        r = server.http.post("/generate", json={"text": "hi", "sampling_params": {field: value}})
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    r = server.http.post("/generate", json={"text": "hi", "sampling_params": {"typo_field": 1}})
    assert r.status_code == 400 and "typo_field" in r.text


def test_sampling_params_are_honoured(server):
    base = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    greedy = gen(server, **base)["output_ids"]
    biased = gen(server, input_ids=[5, 6, 7], sampling_params={
        "max_new_tokens": 4, "temperature": 0, "logit_bias": {"65": 100.0}})["output_ids"]
    assert biased == [65] * 4
    first = greedy[0]
    stopped = gen(server, input_ids=[5, 6, 7], sampling_params={
        "max_new_tokens": 6, "temperature": 0, "stop_token_ids": [first], "ignore_eos": True})
    assert stopped["output_ids"] == [first]
    held = gen(server, input_ids=[5, 6, 7], sampling_params={
        "max_new_tokens": 6, "temperature": 0, "stop_token_ids": [first], "min_new_tokens": 3,
        "ignore_eos": True})
    # SGLang holds the stop ids back until min_new_tokens: never among the first three
    assert len(held["output_ids"]) >= 3 and first not in held["output_ids"][:3], held
    # Near-flat tiny-model logits: a +3 bias makes token 65 the greedy choice every step, and
    # presence + frequency penalties (-4 after its first use) make it appear once.
    sp = {"max_new_tokens": 6, "temperature": 0, "logit_bias": {"65": 3.0}, "ignore_eos": True}
    assert gen(server, input_ids=[5, 6, 7], sampling_params=sp)["output_ids"] == [65] * 6
    pen = gen(server, input_ids=[5, 6, 7], sampling_params={
        **sp, "presence_penalty": 2.0, "frequency_penalty": 2.0})["output_ids"]
    assert pen[0] == 65 and pen.count(65) == 1, pen
    biased_text = gen(server, input_ids=[5, 6, 7], sampling_params={
        "max_new_tokens": 6, "temperature": 0, "logit_bias": {"65": 100.0},
        "stop_regex": "A{3}", "no_stop_trim": True})
    assert biased_text["text"] == "AAA" and biased_text["meta_info"]["finish_reason"] == {
        "type": "stop", "matched": "AAA"}
    trimmed = gen(server, input_ids=[5, 6, 7], sampling_params={
        "max_new_tokens": 6, "temperature": 0, "logit_bias": {"65": 100.0}, "stop": "AA"})
    assert trimmed["text"] == "" and trimmed["output_ids"] == [65, 65]
    outs = server.http.post("/generate", json={"text": ["ab", "cd"], "sampling_params": {
        "max_new_tokens": 2, "n": 2, "sampling_seed": 1}}).json()
    assert isinstance(outs, list) and len(outs) == 4
    prefill = gen(server, text="abc", sampling_params={"max_new_tokens": 0})
    assert prefill["output_ids"] == [] and prefill["meta_info"]["prompt_tokens"] == 3


def test_prompt_logprobs_match_generation_logprobs(server):
    prompt = [10, 20, 30, 40]
    out = gen(server, input_ids=prompt, return_logprob=True,
              sampling_params={"max_new_tokens": 5, "temperature": 0})
    gen_lps = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
    # As SGLang, the logprob_start_len position itself has no value: start one before.
    scored = gen(server, input_ids=prompt + out["output_ids"], return_logprob=True,
                 logprob_start_len=len(prompt) - 1, return_text_in_logprobs=True,
                 sampling_params={"max_new_tokens": 0})
    first, *entries = scored["meta_info"]["input_token_logprobs"]
    assert first[:2] == [None, prompt[-1]]
    assert [e[1] for e in entries] == out["output_ids"]
    assert [e[0] for e in entries] == pytest.approx(gen_lps, abs=1e-4)
    full = gen(server, input_ids=prompt, return_logprob=True, logprob_start_len=0,
               sampling_params={"max_new_tokens": 0})["meta_info"]["input_token_logprobs"]
    assert full[0][0] is None and [e[1] for e in full] == prompt


def reference_rows(seq: list[int]):
    """fp32 logprobs [len(seq), V] of the served tiny model (same init, same numerics) over the
    whole sequence: row t is the distribution of token t+1."""
    import torch

    from sglang_dsv41.loader.serving import load_serving_model, serving_numerics_for
    from sglang_dsv41.model.dsv4.context import DSV4Context

    model = load_serving_model("tiny", torch.float32, "cpu").eval()
    with torch.no_grad():
        logits = model(torch.tensor(seq), DSV4Context.packed(
            [len(seq)], serving_numerics=serving_numerics_for("tiny")))
    return torch.log_softmax(logits.float(), dim=-1)


def check_top(entries, row, k: int, text_of) -> None:
    """entries are the top k of row: descending, each value the oracle's, none missing."""
    assert len(entries) == k
    values = [e[0] for e in entries]
    assert values == sorted(values, reverse=True)
    assert values == pytest.approx([float(row[e[1]]) for e in entries], abs=1e-4)
    assert values[-1] == pytest.approx(float(row.topk(k).values[-1]), abs=1e-4)
    assert [e[2] for e in entries] == [text_of(e[1]) for e in entries]


def test_top_logprobs_and_token_ids_match_the_reference_model(server):
    from sglang_dsv41.model.dsv4 import get_preset
    from sglang_dsv41.tokenizer import ByteTokenizer

    tok = ByteTokenizer.from_config(get_preset("tiny"))
    prompts, starts, tops, ids = [[10, 20, 30, 40, 50], [7, 8, 9]], [1, 0], [5, 3], [[3, 65, 3],
                                                                                     []]
    outs = gen(server, input_ids=prompts, return_logprob=True, logprob_start_len=starts,
               top_logprobs_num=tops, token_ids_logprob=ids, return_text_in_logprobs=True,
               sampling_params={"max_new_tokens": 3, "temperature": 0})
    for prompt, out, start, k, asked in zip(prompts, outs, starts, tops, ids):
        meta, rows = out["meta_info"], reference_rows(prompt + out["output_ids"])
        text_of = lambda t: tok.decode([t], skip_special_tokens=False)  # noqa: E731
        n_in = len(prompt) - start
        for key in ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs"):
            assert len(meta[key]) == n_in and meta[key][0] in (None, [None, prompt[start], text_of(
                prompt[start])]), key  # SGLang: the start position has no value
        assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None
        for j in range(1, n_in):   # position start+j, scored by row start+j-1
            row = rows[start + j - 1]
            lp, tid, text = meta["input_token_logprobs"][j]
            assert tid == prompt[start + j] and lp == pytest.approx(float(row[tid]), abs=1e-4)
            check_top(meta["input_top_logprobs"][j], row, k, text_of)
            assert (meta["input_token_ids_logprobs"][j] is None) == (not asked)
        for j, token in enumerate(out["output_ids"]):
            row = rows[len(prompt) - 1 + j]
            lp, tid, _ = meta["output_token_logprobs"][j]
            top = meta["output_top_logprobs"][j]
            check_top(top, row, k, text_of)
            assert tid == token and [lp, tid] in [e[:2] for e in top]   # the very same value
            assert lp == top[0][0]                                      # greedy: the top one
            if asked:
                got = meta["output_token_ids_logprobs"][j]
                assert [e[1] for e in got] == asked
                assert [e[0] for e in got] == pytest.approx([float(row[t]) for t in asked],
                                                            abs=1e-4)
            else:
                assert meta["output_token_ids_logprobs"][j] is None
        assert meta["output_token_logprobs_length"] == len(out["output_ids"])
    # Not asked: no keys; no text unless asked; a start at the prompt's end scores nothing.
    plain = gen(server, input_ids=prompts[0], return_logprob=True, top_logprobs_num=2,
                logprob_start_len=len(prompts[0]), sampling_params={"max_new_tokens": 2})
    meta = plain["meta_info"]
    assert "input_token_ids_logprobs" not in meta and meta["input_token_logprobs"] == []
    assert meta["input_top_logprobs"] == [] and len(meta["output_top_logprobs"]) == 2
    assert all(e[2] is None for e in meta["output_top_logprobs"][0])
    assert "output_top_logprobs" not in gen(server, input_ids=[1], top_logprobs_num=2,
                                            sampling_params={"max_new_tokens": 1})["meta_info"]


def test_sglang_schema_encodes_the_logprob_request_and_decodes_the_response(server):
    types = sglang_api_types()
    body = types.encode_GenerateRequest(types.GenerateRequest(
        input_ids=[[5, 6, 7], [8, 9]], return_logprob=True, logprob_start_len=[0, 1],
        top_logprobs_num=[2, 3], token_ids_logprob=[[1, 2], [3]], return_text_in_logprobs=True,
        sampling_params=types.SamplingParams(max_new_tokens=2, temperature=0)))
    outs = server.http.post("/generate", json=body).json()
    for out, k, ids, n_in in zip(outs, [2, 3], [[1, 2], [3]], [3, 1]):
        meta = types.decode_GenerateResponse(out).meta_info   # SGLang's contract, or it raises
        assert len(meta.input_top_logprobs) == len(meta.input_token_ids_logprobs) == n_in
        assert [len(row) for row in meta.output_top_logprobs] == [k, k]
        assert [[e.token_id for e in row] for row in meta.output_token_ids_logprobs] == [ids] * 2
        assert meta.output_token_logprobs_length == 2


def test_streamed_top_logprobs_equal_the_whole_response(server):
    body = {"input_ids": [5, 6, 7], "return_logprob": True, "top_logprobs_num": 4,
            "token_ids_logprob": [1, 2], "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    whole = gen(server, **body)["meta_info"]
    with server.http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert len(events) == 4 and len(events[0]["meta_info"]["output_top_logprobs"]) == 1
    assert len(events[0]["meta_info"]["input_top_logprobs"]) == 3
    last = events[-1]["meta_info"]
    for key in ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs",
                "output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs"):
        assert last[key] == whole[key], key


def test_sessions_continue_a_request(server):
    sid = server.http.post("/open_session", json={"capacity_of_str_len": 1000}).json()
    first = gen(server, input_ids=[1, 2, 3], rid="turn1", session_params={"id": sid},
                sampling_params={"max_new_tokens": 3, "temperature": 0})
    second = gen(server, input_ids=[9], session_params={"id": sid, "rid": "turn1"},
                 sampling_params={"max_new_tokens": 1, "temperature": 0})
    assert second["meta_info"]["prompt_tokens"] == 3 + len(first["output_ids"]) + 1
    assert server.http.post("/close_session", json={"session_id": sid}).status_code == 200
    r = server.http.post("/generate", json={"input_ids": [9], "session_params": {"id": sid}})
    assert r.status_code == 400 and "not open" in r.text


def test_sglang_lang_frontend_gen_and_select(server):
    import_sglang("sglang.lang.api")
    import sglang as sgl
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

    backend = RuntimeEndpoint(server.url)

    # select before gen: select's token healing subtracts the logprob at logprob_start_len,
    # which SGLang 0.5.23 (and this server) reports as None, so a prompt whose second-to-last
    # token's text ends it (e.g. two undecodable bytes of a random gen) fails in the client.
    @sgl.function
    def qa(s):
        s += "Q: pick one\nA:"
        s += sgl.select("choice", choices=["yes", "no", "maybe"])
        s += sgl.gen("answer", max_tokens=6, temperature=0)

    state = qa.run(backend=backend)
    assert state.error() is None, state.error()
    direct = gen(server, text="Q: pick one\nA:" + state["choice"],
                 sampling_params={"max_new_tokens": 6, "temperature": 0})
    assert state["answer"] == direct["text"]
    meta = state.get_meta_info("choice")
    scores = meta["normalized_prompt_logprobs"]
    assert state["choice"] == ["yes", "no", "maybe"][scores.index(max(scores))]


def test_sglang_router_dp_aware_manual_policy(server):
    # min_group gives a new routing key to the DP rank with the fewest keys *in flight*, ties
    # broken at random: the trajectories of a turn run concurrently (as in an RL rollout), else
    # every pick is a tie and all eight land on one rank once in 128 runs.
    with SMGProcess([server.url], free_port(), ["--dp-aware", "--policy", "manual",
                                                "--assignment-mode", "min_group"]) as smg:
        router = SMGSessionRouter(smg.url, [server.url])
        ranks: dict[str, set[int]] = {}

        def turn_of(k: int, turn: int) -> dict:
            prompt = [(k * 7 + i) % 200 + 1 for i in range(40 + 20 * turn)]
            return router.generate(f"traj-{k}", {"input_ids": prompt, "sampling_params": {
                "max_new_tokens": 16, "temperature": 0, "ignore_eos": True}})

        with ThreadPoolExecutor(8) as pool:
            for turn in range(3):
                for k, out in enumerate(pool.map(turn_of, range(8), [turn] * 8)):
                    ranks.setdefault(f"traj-{k}", set()).add(out["meta_info"]["dp_rank"])
                    if turn:  # the previous turn's whole pages are reused on the same rank
                        assert out["meta_info"]["cached_tokens"] >= 32, out["meta_info"]
        assert all(len(r) == 1 for r in ranks.values()), ranks
        assert {r for rs in ranks.values() for r in rs} == {0, 1}
        assert httpx.get(smg.url + "/health", timeout=10).status_code == 200


def test_routing_key_keeps_unpinned_turns_on_one_rank(server):
    ranks = {k: {gen(server, input_ids=[1, 2, 3], routing_key=k,
                     sampling_params={"max_new_tokens": 1})["meta_info"]["dp_rank"]
                 for _ in range(3)} for k in ("a", "b", "c", "d")}
    assert all(len(r) == 1 for r in ranks.values()), ranks
    assert {r for rs in ranks.values() for r in rs} == {0, 1}
