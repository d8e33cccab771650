"""Seeded fuzzing of every route of a real embedded server (tiny preset, tp=2 dp=2): 1200
hostile requests (wrong types, extreme and non-finite numbers, deep JSON, broken Unicode and
UTF-8, junk headers and content types, unknown fields, valid requests at the limits). No answer
may be a 5xx, no rank may die, and greedy output must be the same afterwards."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from sglang_dsv41.engine.api_models import SamplingParamsIn
from sglang_dsv41.server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
SEED, COUNT = 20261130, 1200
LAYOUT = ["--model-path", "tiny", "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention",
          "--context-length", "256", "--max-new-tokens-limit", "8"]
POSTS = ["/generate", "/abort_request", "/open_session", "/close_session", "/pause_generation",
         "/continue_generation", "/flush_cache", "/update_weights_from_tensor",
         "/update_weights_from_disk", "/init_weights_update_group",
         "/update_weights_from_distributed"]
GETS = ["/health", "/health_generate", "/model_info", "/get_model_info", "/server_info",
        "/get_server_info", "/get_weight_version", "/metrics", "/engram_checksum",
        "/get_weights_by_name?name=x", "/nope", "/generate"]
# Bodies of these would make every rank wait for a trainer (a setup timeout, not a bug): the
# fuzzer sends them only schema-invalid bodies.
JUNK_ONLY = {"/init_weights_update_group"}
NUMBERS = [0, -1, 1, 2, 7, 0.5, -0.5, 1e-45, 5e-324, 1e308, -1e308, 2**31, 2**63, 2**70, -2**70,
           True, 1e-7, 3.0]


def junk(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 4 else 5)
    if kind == 0:
        return rng.choice(NUMBERS)
    if kind == 1:
        return rng.choice(["", "a", "\u0000", "é" * 50, "<｜end▁of▁sentence｜>", "x" * 3000])
    if kind == 2:
        return None
    if kind == 3:
        return rng.choice([True, False])
    if kind == 4:
        return [rng.randrange(-5, 400) for _ in range(rng.randrange(0, 20))]
    if kind in (5, 6):
        return [junk(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return {rng.choice(["text", "input_ids", "rid", "x", "stream", "sampling_params", "n"]):
            junk(rng, depth + 1) for _ in range(rng.randrange(0, 4))}


def sampling(rng: random.Random) -> dict:
    fields = list(SamplingParamsIn.model_fields)
    sp = {f: junk(rng) if rng.random() < 0.3 else rng.choice(NUMBERS)
          for f in rng.sample(fields, rng.randrange(0, 6))}
    sp["max_new_tokens"] = rng.choice([0, 1, 2, 4, 8, 9, -1])
    return sp


def generate_body(rng: random.Random) -> dict:
    body = {rng.choice(["text", "input_ids"]): rng.choice([
        "hello", ["a", "b"], [1, 2, 3], [[1, 2], [3]], list(range(1, 40)), [0], [319], [320],
        junk(rng)]), "sampling_params": sampling(rng)}
    for key in rng.sample(["stream", "return_logprob", "logprob_start_len", "routed_dp_rank",
                           "data_parallel_rank", "rid", "session_params", "top_logprobs_num",
                           "return_text_in_logprobs", "routing_key", "future_field",
                           "return_routed_experts", "image_data"], rng.randrange(0, 4)):
        body[key] = junk(rng)
    return body


def request(rng: random.Random) -> tuple[str, str, bytes | None, dict]:
    headers = {"content-type": rng.choice(["application/json"] * 6 + [
        "text/plain", "application/x-www-form-urlencoded", ""])}
    if rng.random() < 0.1:
        headers["x-data-parallel-rank"] = rng.choice(["1", "-3", "abc", "", "99"])
    if rng.random() < 0.05:
        headers["origin"] = "http://evil.example"
    if rng.random() < 0.2:
        return "GET", rng.choice(GETS), None, headers
    path = rng.choice(POSTS)
    raw_kind = rng.random()
    if raw_kind < 0.08:
        raw = rng.choice([b"[" * 5000, b'{"text": "\\ud800"}', b'{"text": "\xff\xfe"}',
                          b'{"text": "a", "sampling_params": {"temperature": NaN}}',
                          b'{"input_ids": [1e999]}', b"{", b"", b"null", b'"x"'])
        return "POST", path, raw, headers
    if path == "/generate" and raw_kind < 0.7:
        body = generate_body(rng)
    elif path in JUNK_ONLY:
        body = {"master_port": junk(rng), "world_size": junk(rng)}
    else:
        body = junk(rng)
    return "POST", path, json.dumps(body).encode(), headers


@pytest.fixture(scope="module")
def server():
    with ServerProcess(LAYOUT, startup_timeout=150) as s:
        yield s


def greedy(http: httpx.Client) -> list:
    r = http.post("/generate", json={"input_ids": [3, 1, 4, 1, 5], "return_logprob": True,
                                     "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert r.status_code == 200, r.text
    out = r.json()
    return [out["output_ids"], [round(e[0], 4) for e in out["meta_info"]["output_token_logprobs"]]]


def test_fuzz_every_route_no_5xx_no_dead_rank_same_greedy_output(server):
    rng = random.Random(SEED)
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        before = greedy(http)
        for i in range(COUNT):
            method, path, body, headers = request(rng)
            r = http.request(method, path, content=body, headers=headers)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, \
                (i, method, path, body[:300] if body else None, r.status_code, r.text[:500])
            if path == "/pause_generation" and r.status_code == 200:
                assert http.post("/continue_generation").status_code == 200
        info = http.get("/server_info").json()
        assert info["healthy"] and http.get("/health").status_code == 200
        assert http.get("/health_generate").status_code == 200
        assert greedy(http) == before
    assert statuses.get(200, 0) >= 100 and sum(statuses.values()) == COUNT, statuses
