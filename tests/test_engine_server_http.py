"""The FastAPI app against a real in-process DPController whose queues the test drains."""

from __future__ import annotations

import base64
import json
import queue

import httpx
import numpy as np
import pytest
from engine_server_cases import BAD_BODIES, CONTEXT
from engine_server_fakes import QueueDrainer, poll_until

from sglang_dsv41.engine.request_limits import RequestLimits
from sglang_dsv41.engine.dp_controller import DPController
from sglang_dsv41.engine.http_server import ServerState, create_app
from sglang_dsv41.engine.messages import AbortReq, GenerateReq, RankStats
from sglang_dsv41.model.dsv4 import get_preset
from sglang_dsv41.server_args import ServerArgs
from sglang_dsv41.tokenizer import ByteTokenizer

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


def make_server(api_key=None, refuse=None, client=("127.0.0.1", 5000), **kw):
    args = ServerArgs(tp_size=4, dp_size=2, enable_dp_attention=True, api_key=api_key,
                      enable_return_routed_experts=True, max_new_tokens_limit=200,
                      health_check_timeout=2.0, **kw)
    req_queues, out_queue = [queue.Queue(), queue.Queue()], queue.Queue()
    controller = DPController(req_queues, out_queue, list(range(4)), args.load_balance_method)
    drainer = QueueDrainer(req_queues, out_queue, args.attn_tp_size, refuse)
    cfg = get_preset("tiny")
    state = ServerState(args, controller, ByteTokenizer.from_config(cfg),
                        RequestLimits(cfg.vocab_size, CONTEXT, args.max_new_tokens_limit, 2),
                        "tiny", cfg)
    transport = httpx.ASGITransport(app=create_app(state), client=client)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    http = httpx.AsyncClient(transport=transport, base_url="http://test", headers=headers)
    return http, controller, drainer, state


async def gen(http, **body):
    return await http.post("/generate", json=body)


async def test_generate_text_and_ids_pinned_and_round_robin():
    http, controller, drainer, _ = make_server()
    async with http:
        r = await gen(http, text="ab", sampling_params={"max_new_tokens": 3})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["output_ids"] == [99, 100, 101] and out["text"] == "cde"
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == 2 and meta["completion_tokens"] == 3
        assert meta["finish_reason"] == {"type": "length", "length": 3}
        assert meta["weight_version"] == "default"
        ranks = [meta["dp_rank"]]
        for _ in range(3):
            ranks.append((await gen(http, input_ids=[5], sampling_params={"max_new_tokens": 1})
                          ).json()["meta_info"]["dp_rank"])
        assert sorted(ranks) == [0, 0, 1, 1]  # round robin alternates
        for rank in (0, 1):
            for field in ("routed_dp_rank", "data_parallel_rank"):
                r = await gen(http, input_ids=[1, 2], **{field: rank})
                assert r.json()["meta_info"]["dp_rank"] == rank
            r = await http.post("/generate", json={"input_ids": [1]},
                                headers={"X-Data-Parallel-Rank": str(rank)})
            assert r.json()["meta_info"]["dp_rank"] == rank
        assert controller.num_in_flight() == [0, 0]
        controller.shutdown()


async def test_bad_input_is_400_and_server_keeps_serving():
    http, controller, drainer, _ = make_server()
    async with http:
        for body, needle in BAD_BODIES:
            r = await http.post("/generate", json=body)
            assert r.status_code == 400, (body, r.text)
            assert needle in r.json()["error"]["message"], (body, r.text)
        r = await http.post("/generate", content=b"{not json",
                            headers={"content-type": "application/json"})
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"], r.text
        r = await http.post("/generate", content=b"{not json", headers={"content-type": "x"})
        assert r.status_code == 400 and "valid dictionary" in r.json()["error"]["message"]
        r = await http.post("/generate", json={"input_ids": [1]},
                            headers={"X-Data-Parallel-Rank": "7"})
        assert r.status_code == 400 and "X-Data-Parallel-Rank=7" in r.text
        assert (await http.get("/health_generate")).status_code == 200
        # Nothing invalid reached a scheduler queue: only the health check's request did.
        assert [type(m) for _, m in drainer.seen] == [GenerateReq]
        controller.shutdown()


async def test_null_max_new_tokens_means_up_to_the_context_length_as_sglang():
    """SGLang 0.5.23 keeps a null max_new_tokens as None: no limit of its own (the context and
    --max-new-tokens-limit bound it); absent, it is 128. A null became 128 here, and a prompt
    within 128 tokens of the context was refused."""
    http, controller, drainer, _ = make_server()
    async with http:
        near = [1] * (CONTEXT - 10)
        r = await gen(http, input_ids=near, sampling_params={"max_new_tokens": None})
        assert r.status_code == 200, r.text
        r = await gen(http, input_ids=near, sampling_params={})
        assert r.status_code == 400 and "exceeds the context length" in r.text
        r = await gen(http, input_ids=[1], sampling_params={"max_new_tokens": None,
                                                            "min_new_tokens": 300})
        assert r.status_code == 200, r.text
        sent = [m.sampling.max_new_tokens for _, m in drainer.seen if isinstance(m, GenerateReq)]
        assert sent == [200, 200]  # --max-new-tokens-limit; the leader caps at the context
        controller.shutdown()


# (body, a phrase the 400's message must contain): hostile logprob fields (tiny vocab 320)
BAD_LOGPROB_BODIES = [
    ({"top_logprobs_num": -1}, "top_logprobs_num"),
    ({"top_logprobs_num": 10**9}, "top_logprobs_num"),
    ({"top_logprobs_num": "many"}, "top_logprobs_num"),
    ({"top_logprobs_num": [2, 3]}, "2 entries for 1 prompts"),
    ({"token_ids_logprob": [320]}, "outside the vocabulary"),
    ({"token_ids_logprob": [-1]}, "outside the vocabulary"),
    ({"token_ids_logprob": list(range(300))}, "the limit is"),
    ({"token_ids_logprob": [[1], [2]]}, "flat list"),
    ({"token_ids_logprob": [[[1]]]}, "token_ids_logprob"),
    ({"token_ids_logprob": [1, [2]]}, "token_ids_logprob"),
    ({"token_ids_logprob": [1.5]}, "token_ids_logprob"),
    ({"logprob_start_len": 3}, "logprob_start_len"),
    ({"logprob_start_len": -2}, "logprob_start_len"),
    ({"input_ids": [[1], [2]], "token_ids_logprob": [[1]]}, "1 lists for 2 prompts"),
    ({"input_ids": [[1], [2]], "token_ids_logprob": [[1], [999]]}, "outside the vocabulary"),
]


async def test_logprob_fields_reach_the_scheduler_per_prompt_and_bad_ones_are_400():
    http, controller, drainer, _ = make_server()
    async with http:
        for bad, needle in BAD_LOGPROB_BODIES:
            body = {"input_ids": [1, 2], "return_logprob": True, **bad}
            r = await http.post("/generate", json=body)
            assert r.status_code == 400, (body, r.text)
            assert needle in r.json()["error"]["message"], (body, r.text)
        assert drainer.seen == []
        r = await gen(http, input_ids=[[1, 2], [3], [4, 5, 6]], return_logprob=True,
                      logprob_start_len=[0, 1, -1], top_logprobs_num=[3, 0, 100],
                      token_ids_logprob=[[7, 7], [], [319]], sampling_params={"max_new_tokens": 1})
        assert r.status_code == 200, r.text
        reqs = sorted((m for _, m in drainer.seen), key=lambda m: len(m.input_ids))
        assert [(m.input_ids, m.logprob_start_len, m.top_logprobs_num, m.token_ids_logprob)
                for m in reqs] == [([3], 1, 0, []), ([1, 2], 0, 3, [7, 7]),
                                   ([4, 5, 6], -1, 100, [319])]
        # As SGLang: a flat list applies to every prompt, [] asks none, and without
        # return_logprob the fields mean nothing (not even checked against the vocabulary).
        drainer.seen.clear()
        await gen(http, input_ids=[[1], [2]], return_logprob=True, token_ids_logprob=[5],
                  sampling_params={"max_new_tokens": 1})
        await gen(http, input_ids=[1], return_logprob=True, token_ids_logprob=[],
                  sampling_params={"max_new_tokens": 1})
        r = await gen(http, input_ids=[1], token_ids_logprob=[999], top_logprobs_num=10**9,
                      sampling_params={"max_new_tokens": 1})
        assert r.status_code == 200 and "output_token_logprobs" not in r.json()["meta_info"]
        assert [(m.token_ids_logprob, m.top_logprobs_num, m.return_logprob)
                for _, m in drainer.seen] == [([5], 0, True), ([5], 0, True), (None, 0, True),
                                              (None, 0, False)]
        controller.shutdown()


async def test_api_key_and_loopback_guard():
    http, controller, _, _ = make_server(api_key="sekret")
    async with http:
        assert (await http.get("/health")).status_code == 200
        bare = httpx.AsyncClient(transport=http._transport, base_url="http://test")
        async with bare:
            for method, path in [("GET", "/health"), ("POST", "/generate"), ("GET", "/metrics"),
                                 ("POST", "/flush_cache"), ("GET", "/get_model_info")]:
                r = await bare.request(method, path, json={"input_ids": [1]})
                assert r.status_code == 401, path
            r = await bare.get("/health", headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401
        controller.shutdown()
    remote, controller, _, _ = make_server(client=("10.0.0.7", 4000))
    async with remote:
        for path in ("/flush_cache", "/abort_request", "/update_weights_from_disk",
                     "/update_weights_from_tensor", "/init_weights_update_group",
                     "/update_weights_from_distributed"):
            r = await remote.post(path, json={})
            assert r.status_code == 403 and "loopback" in r.text, path
        assert (await remote.get("/health")).status_code == 200  # read-only stays open
        controller.shutdown()


async def test_stream_stop_logprobs_and_routed_experts():
    http, controller, _, _ = make_server()
    async with http:
        r = await gen(http, text="a", stream=True, sampling_params={"max_new_tokens": 4})
        events = [ln[6:] for ln in r.text.split("\n\n") if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert [c["text"] for c in chunks] == ["b", "bc", "bcd", "bcde"]
        assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
        # Stop strings are matched by the leader only (StopChecker: test_engine_core_units,
        # tests/test_api_clients.py through real ranks); this fake leader does not match them.
        r = await gen(http, input_ids=[3, 4], return_logprob=True, return_routed_experts=True,
                      sampling_params={"max_new_tokens": 2})
        meta = r.json()["meta_info"]
        assert meta["output_token_logprobs"] == [[-0.5, 5, None], [-0.5, 6, None]]
        assert meta["routed_experts_shape"] == [3, 3, 2]
        experts = np.frombuffer(base64.b64decode(meta["routed_experts"]), "<i4")
        assert experts.tolist() == list(range(18))
        weights = np.frombuffer(base64.b64decode(meta["routed_expert_weights"]), "<f4")
        np.testing.assert_allclose(weights, np.arange(18) / 10, rtol=1e-6)
        controller.shutdown()


async def test_control_calls_fan_in_over_every_rank():
    http, controller, drainer, state = make_server(refuse={"engram_checksum": 3})
    async with http:
        r = await http.post("/flush_cache")
        assert r.status_code == 200 and r.json()["message"] == "flush_cache done on 4 ranks"
        r = await http.get("/engram_checksum")
        assert r.status_code == 400 and "rank 3: engram_checksum refused" in r.text
        from safetensors.torch import save
        import torch

        payload = base64.b64encode(save({"w": torch.ones(2)})).decode()
        r = await http.post("/update_weights_from_tensor",
                            json={"serialized_named_tensors": payload, "weight_version": "v7"})
        assert r.status_code == 200, r.text
        assert r.json()["result"]["args"] == ["flush_cache", "named_tensors", "weight_version"]
        info = (await http.get("/get_model_info")).json()
        assert info["weight_version"] == "v7" and info["is_generation"] is True
        r = await http.post("/update_weights_from_tensor",
                            json={"serialized_named_tensors": "!!notbase64"})
        assert r.status_code == 400 and "base64" in r.text
        r = await http.post("/update_weights_from_disk", json={"model_path": "x", "bad": 1})
        assert r.status_code == 400
        assert (await http.get("/health_generate")).status_code == 200
        controller.shutdown()


async def test_abort_metrics_and_dead_rank():
    http, controller, drainer, _ = make_server()
    async with http:
        drainer.hold = True
        import asyncio

        task = asyncio.create_task(gen(http, input_ids=[1], rid="r1", routed_dp_rank=1))
        while not drainer.parked:
            await asyncio.sleep(0.01)
        r = await http.post("/abort_request", json={"rid": "r1"})
        assert r.json()["success"] is True
        out = (await task).json()
        assert out["meta_info"]["finish_reason"] == {"type": "abort"}
        assert any(isinstance(m, AbortReq) and d == 1 for d, m in drainer.seen)
        drainer.hold = False
        await gen(http, input_ids=[1, 2, 3], routed_dp_rank=0)
        text = (await poll_until(lambda: http.get("/metrics"), lambda r: (
            'sglang_dsv41_prompt_tokens_total{dp_rank="0"} 3.0' in r.text))).text
        assert 'sglang_dsv41_kv_cache_usage{dp_rank="0"} 0.05' in text
        assert 'sglang_dsv41_requests_total{endpoint="/generate",status="200"}' in text
        drainer.hold = True
        task = asyncio.create_task(gen(http, input_ids=[1]))
        while len(drainer.parked) < 2:
            await asyncio.sleep(0.01)
        controller.fail_engine("scheduler rank 2 died with exit code -6 (SIGABRT)", 1)
        r = await task
        assert r.status_code == 503 and "dp_rank 1: scheduler rank 2" in r.text
        for path in ("/health", "/health_generate"):
            r = await http.get(path)
            assert r.status_code == 503 and "SIGABRT" in r.json()["error"]["message"]
        assert (await gen(http, input_ids=[1])).status_code == 503
        controller.shutdown()


async def test_shutdown_cut_ends_running_requests_with_503_and_aborts_them():
    # What the server does when SIGTERM's grace runs out (launch_server._serve): a plain
    # request gets a 503 naming the reason, a stream an error event then [DONE], and each
    # scheduler is told to abort its request; /health says the server is shutting down.
    import asyncio

    http, controller, drainer, state = make_server()
    async with http:
        drainer.hold = True
        plain = asyncio.create_task(gen(http, input_ids=[1], rid="p", routed_dp_rank=0))
        stream = asyncio.create_task(gen(http, input_ids=[1], rid="s", routed_dp_rank=1,
                                         stream=True))
        while len(drainer.parked) < 2:
            await asyncio.sleep(0.01)
        state.draining = True
        assert controller.cut_all("--shutdown-grace 1 s ran out") == 2
        r = await plain
        assert r.status_code == 503, r.text
        assert r.json()["error"]["message"] == \
            "server shutting down: --shutdown-grace 1 s ran out"
        events = [line for line in (await stream).text.splitlines() if line]
        assert json.loads(events[0].removeprefix("data: ")) == {"error": {
            "message": "server shutting down: --shutdown-grace 1 s ran out", "code": 503}}
        assert events[-1] == "data: [DONE]"
        async def aborted():
            return sorted(m.rid for _, m in drainer.seen if isinstance(m, AbortReq))

        await poll_until(aborted, lambda rids: rids == ["p", "s"])
        assert controller.num_in_flight() == [0, 0] and controller.healthy
        r = await http.get("/health")
        assert r.status_code == 503 and "shutting down" in r.text
        assert (await gen(http, input_ids=[1])).status_code == 503
        controller.shutdown()


async def test_stall_report_marks_unhealthy():
    http, controller, _, _ = make_server()
    async with http:
        controller.out_queue.put(RankStats(1, 0, 0, 0, 1, 0, 0, 9, healthy=False,
                                           stall="rank 3 stuck in collective 'all_gather' at "
                                                 "step 9"))
        r = await poll_until(lambda: http.get("/health_generate"), lambda r: r.status_code != 200)
        assert r.status_code == 503 and "dp_rank 1: rank 3 stuck" in r.text and "step 9" in r.text
        # DP rank 0 sent no stall report (within the grace its own report would take): it is
        # not waiting in the collective, so it is the one holding it (a leader busy in host
        # code, a skipped idle batch)
        r = await poll_until(lambda: http.get("/health"),
                             lambda r: "reported no stall" in r.text)
        assert "DP rank 0 reported no stall" in r.text, r.text
        controller.out_queue.put(RankStats(0, 0, 0, 0, 1, 0, 0, 9, healthy=False,
                                           stall="rank 1 stuck in collective 'all_gather' at "
                                                 "step 9"))
        r = await poll_until(lambda: http.get("/health"), lambda r: "rank 1 stuck" in r.text)
        assert "reported no stall" not in r.text, r.text  # every rank waits: no one to blame
        controller.shutdown()


async def test_shortest_queue_and_pinned_requests_count_as_load():
    import asyncio

    from sglang_dsv41.engine.messages import SamplingParams

    qs = [queue.Queue(), queue.Queue()]
    c = DPController(qs, queue.Queue(), [0, 1], "shortest_queue")
    loop = asyncio.get_running_loop()
    pin = [c.submit(GenerateReq(f"p{i}", [1], SamplingParams(), routed_dp_rank=0), loop)[0]
           for i in range(2)]
    free = [c.submit(GenerateReq(f"f{i}", [1], SamplingParams()), loop)[0] for i in range(3)]
    assert pin == [0, 0] and free == [1, 1, 0]  # rank 1 until it is as loaded as rank 0
    assert c.num_in_flight() == [3, 2]
    with pytest.raises(ValueError, match="already running"):
        c.submit(GenerateReq("p0", [1], SamplingParams()), loop)
    c.shutdown()


async def test_a_failed_rank_names_itself_to_its_waiting_requests():
    import asyncio

    from sglang_dsv41.engine.dp_controller import EngineFailure
    from sglang_dsv41.engine.messages import SamplingParams

    c = DPController([queue.Queue(), queue.Queue()], queue.Queue(), [0, 1])
    loop = asyncio.get_running_loop()
    _, on_rank1 = c.submit(GenerateReq("a", [1], SamplingParams(), routed_dp_rank=1), loop)
    _, on_rank0 = c.submit(GenerateReq("b", [1], SamplingParams(), routed_dp_rank=0), loop)
    c.fail_rank(1, "lost its GPU")
    failure = await asyncio.wait_for(on_rank1.get(), 5)
    assert isinstance(failure, EngineFailure) and failure.reason == "dp_rank 1: lost its GPU"
    assert on_rank0.empty() and c.rank_health() == {0: "", 1: "lost its GPU"}
    c.shutdown()
