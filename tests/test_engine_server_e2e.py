"""End to end: ``python -m sglang_dsv41.launch_server`` with real scheduler processes, the real
model's tiny preset (DeepSeek V4.1 layer kinds, Engram), tp=4 dp=2 with DP attention
(attn_tp=2), over HTTP. One server is shared by the checks; a second one, with prefill padding off, shows the crash the padding plugin prevents."""

from __future__ import annotations

import base64
import json
import random

import httpx
import numpy as np
import pytest
from engine_server_cases import BAD_BODIES, CONTEXT

from sglang_dsv41.server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
KEY = "test-key"
LAYOUT = ["--model-path", "tiny", "--tp-size", "4", "--dp-size", "2", "--enable-dp-attention",
          "--context-length", str(CONTEXT), "--max-new-tokens-limit", "200"]
PAGE = 16  # the default --page-size: the prefix cache keeps whole pages


@pytest.fixture(scope="module")
def server():
    with ServerProcess([*LAYOUT, "--stall-timeout", "30", "--enable-return-routed-experts"],
                       api_key=KEY,
                       startup_timeout=150) as s:
        s.http = httpx.Client(base_url=s.url, headers=s.headers, timeout=60)
        yield s
        s.http.close()
        assert s.stop() == 0 and not s.orphans, s.log_text()[-2000:]


def generate(server, **body) -> dict:
    r = server.http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_health_generate_right_after_start(server):
    r = server.http.get("/health_generate")
    assert r.status_code == 200, (r.text, server.log_text()[-3000:])
    info = server.http.get("/get_server_info").json()
    assert (info["tp_size"], info["dp_size"], info["attn_tp_size"]) == (4, 2, 2)
    assert info["enable_prefill_padding"] is True and info["healthy"] is True


def test_every_prompt_length_and_stream(server):
    served_by = []
    for n in range(1, 18):
        out = generate(server, input_ids=list(range(1, n + 1)),
                       sampling_params={"max_new_tokens": 2, "ignore_eos": True})
        assert out["meta_info"]["prompt_tokens"] == n
        assert len(out["output_ids"]) == 2, out
        served_by.append(out["meta_info"]["dp_rank"])
    assert sorted(set(served_by)) == [0, 1]  # unpinned: round robin over both DP ranks
    r = server.http.post("/generate", json={"text": "hi", "stream": True,
                                            "sampling_params": {"max_new_tokens": 3,
                                                                "ignore_eos": True}})
    events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3]


def test_routed_experts_and_logprobs(server):
    info = server.http.get("/get_model_info").json()
    layers, top_k = info["num_hidden_layers"], info["num_experts_per_tok"]
    out = generate(server, input_ids=[3, 1, 4, 1, 5], return_routed_experts=True,
                   return_logprob=True, sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    meta = out["meta_info"]
    shape = meta["routed_experts_shape"]
    assert shape == [5 + 3 - 1, layers, top_k]
    ids = np.frombuffer(base64.b64decode(meta["routed_experts"]), "<i4").reshape(shape)
    # every layer routes (tiny: layers 0-1 hash-routed through tid2eid, the rest top-k of 8)
    assert ((ids >= 0) & (ids < 8)).all()
    weights = np.frombuffer(base64.b64decode(meta["routed_expert_weights"]), "<f4")
    assert weights.size == ids.size
    logprobs = meta["output_token_logprobs"]
    assert [t for _, t, _ in logprobs] == out["output_ids"]
    assert all(lp <= 0 for lp, _, _ in logprobs)


def test_pinned_turns_stay_on_their_rank_and_hit_the_prefix_cache(server):
    rng = random.Random(7)
    for rank in (0, 1):
        other = 1 - rank
        prompt = [rng.randrange(256) for _ in range(2 * PAGE - 2)]
        sp = {"max_new_tokens": 3, "ignore_eos": True, "temperature": 0}
        first = generate(server, input_ids=prompt, routed_dp_rank=rank, sampling_params=sp)
        assert first["meta_info"]["dp_rank"] == rank and first["meta_info"]["cached_tokens"] == 0
        history = prompt + first["output_ids"]
        turn2 = history + [rng.randrange(256) for _ in range(5)]
        again = generate(server, input_ids=turn2, routed_dp_rank=rank, sampling_params=sp)
        assert again["meta_info"]["dp_rank"] == rank
        # The last sampled token was never run through the model, so it has no K/V yet: the
        # cache covers history minus one token (here exactly two whole pages).
        assert again["meta_info"]["cached_tokens"] >= len(history) - 1 == 2 * PAGE
        elsewhere = generate(server, input_ids=turn2, routed_dp_rank=other, sampling_params=sp)
        assert elsewhere["meta_info"]["dp_rank"] == other
        assert elsewhere["meta_info"]["cached_tokens"] == 0
        header = server.http.post("/generate", json={"input_ids": [5, 6], "sampling_params": {
            "max_new_tokens": 1}}, headers={"X-Data-Parallel-Rank": str(rank)})
        assert header.json()["meta_info"]["dp_rank"] == rank


def test_bad_input_is_4xx_and_the_server_stays_healthy(server):
    for body, needle in BAD_BODIES:
        r = server.http.post("/generate", json=body)
        assert 400 <= r.status_code < 500 and needle in r.json()["error"]["message"], (body,
                                                                                      r.text)
        assert server.http.get("/health_generate").status_code == 200, body
    r = server.http.post("/generate", content=b"{oops",
                         headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"], r.text
    assert server.http.get("/health_generate").status_code == 200


def test_api_key_metrics_and_flush(server):
    bare = httpx.post(server.url + "/generate", json={"input_ids": [1]}, timeout=10)
    assert bare.status_code == 401
    assert httpx.get(server.url + "/health", timeout=10).status_code == 401
    assert server.http.post("/flush_cache").json()["message"] == "flush_cache done on 4 ranks"
    text = server.http.get("/metrics").text
    for d in (0, 1):
        assert f'sglang_dsv41_num_running_reqs{{dp_rank="{d}"}}' in text
        assert f'sglang_dsv41_prefix_cache_hit_tokens_total{{dp_rank="{d}"}}' in text


def payload(**tensors) -> str:
    from safetensors.torch import save

    return base64.b64encode(save(tensors)).decode()


def test_weight_update_over_http_keeps_engram_and_refuses_bad_tensors(server):
    import torch

    sinks = "layers.0.attn.attn_sink"   # SGLang's flat name; tiny has 4 heads
    before = server.http.get("/engram_checksum")
    assert before.status_code == 200 and before.json()["result"], before.text
    r = server.http.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": payload(**{sinks: torch.full((4,), 0.5)}),
        "weight_version": "step-1"})
    assert r.status_code == 200 and r.json()["weight_version"] == "step-1", r.text
    got = server.http.get("/get_weights_by_name", params={"name": sinks}).json()["result"]
    assert got["values"] == [0.5] * 4
    out = generate(server, input_ids=[1, 2], sampling_params={"max_new_tokens": 1})
    assert out["meta_info"]["weight_version"] == "step-1"
    for bad, needle in [({sinks: torch.zeros(3)}, f"{sinks}: shape [3]"),
                        ({"layers.1.engram.embed.weight": torch.zeros(4, 32)},
                         "frozen Engram table")]:
        r = server.http.post("/update_weights_from_tensor",
                             json={"serialized_named_tensors": payload(**bad)})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
        assert server.http.get("/health_generate").status_code == 200
    assert server.http.get("/get_model_info").json()["weight_version"] == "step-1"
    assert server.http.get("/engram_checksum").json()["result"] == before.json()["result"]


def test_without_prefill_padding_the_health_check_kills_a_rank():
    with ServerProcess([*LAYOUT, "--no-enable-prefill-padding", "--stall-timeout", "5",
                        "--health-check-timeout", "15"], startup_timeout=150) as s:
        r = httpx.get(s.url + "/health_generate", timeout=60)
        assert r.status_code == 503, r.text
        reason = r.json()["error"]["message"]
        print("503 reason:", reason)
        # The rank's own words: gloo's reduce-scatter refused the 1-token (unpadded) shard.
        assert "scheduler rank" in reason and "died" in reason, reason
        assert "Check failed: outputShape[0] * worldSize == inputShape[0]" in reason, reason
        # A dead rank is fatal: the server stops serving and exits 1 (a supervisor restarts
        # it), and no scheduler process outlives it.
        s.proc.wait(60)
        assert s.stop() == 1 and not s.orphans, s.log_text()[-2000:]
