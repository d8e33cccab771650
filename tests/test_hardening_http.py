"""Hardening of the HTTP layer, in process (the FastAPI app over a real DPController whose
queues engine_server_fakes.QueueDrainer answers): refused sampling, admin calls from another
site, body size, deep JSON and broken Unicode, client disconnects, health during a weight-sync
setup, bounded metric labels. Plus the sampler on extreme values and the setup timeout of a
weight-sync group."""

from __future__ import annotations

import asyncio
import json
import queue
import time

import httpx
import pytest
import torch
from engine_server_fakes import QueueDrainer, poll_until

from sglang_dsv41.engine.request_limits import RequestLimits
from sglang_dsv41.engine.dp_controller import DPController
from sglang_dsv41.engine.http_server import ServerState, create_app
from sglang_dsv41.engine.messages import AbortReq, SamplingParams
from sglang_dsv41.engine.sampling import StopChecker, model_logprobs, sample_token
from sglang_dsv41.loader import weight_sync_group
from sglang_dsv41.model.dsv4 import get_preset
from sglang_dsv41.server_args import ServerArgs
from sglang_dsv41.ports import free_port
from sglang_dsv41.tokenizer import ByteTokenizer

pytestmark = [pytest.mark.timeout(60)]


def make_app(api_key=None, max_request_bytes=1 << 20):
    args = ServerArgs(tp_size=2, dp_size=2, enable_dp_attention=True, api_key=api_key,
                      max_new_tokens_limit=200, max_request_bytes=max_request_bytes)
    req_queues, out_queue = [queue.Queue(), queue.Queue()], queue.Queue()
    controller = DPController(req_queues, out_queue, [0, 1])
    drainer = QueueDrainer(req_queues, out_queue, args.attn_tp_size)
    cfg = get_preset("tiny")
    state = ServerState(args, controller, ByteTokenizer.from_config(cfg),
                        RequestLimits(cfg.vocab_size, 256, 200, 2), "tiny", cfg)
    return create_app(state), state, drainer


@pytest.fixture
def app():
    app, state, drainer = make_app()
    yield app, state, drainer
    state.controller.shutdown()


def client(app, **kw):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=("127.0.0.1", 1)),
                             base_url="http://127.0.0.1:30000", **kw)


@pytest.mark.parametrize("temperature", [1e-40, 1e-45, 5e-324])
def test_sampler_survives_overflowing_temperatures(temperature):
    logits = torch.randn(320) * 30
    p = SamplingParams(temperature=temperature, top_p=0.5, min_p=0.9)
    token, returned = sample_token(logits, p, torch.Generator().manual_seed(0))
    assert token == int(torch.argmax(logits)) and float(model_logprobs(returned)[token]) <= 0


@pytest.mark.asyncio
async def test_sampling_that_cannot_be_a_distribution_is_refused(app):
    app, _, _ = app
    async with client(app) as http:
        for raw in ['{"text": "a", "sampling_params": {"temperature": NaN}}',
                    '{"text": "a", "sampling_params": {"top_p": Infinity}}',
                    '{"text": "a", "sampling_params": {"logit_bias": {"5": 1e308}}}',
                    '{"text": "a", "sampling_params": {"repetition_penalty": 0}}',
                    '{"text": "a", "sampling_params": {"logit_bias": {"99999": 1}}}']:
            r = await http.post("/generate", content=raw,
                                headers={"content-type": "application/json"})
            assert r.status_code == 400, (raw, r.text)


@pytest.mark.asyncio
async def test_admin_calls_need_json_post_from_the_same_site(app):
    app, _, drainer = app
    async with client(app) as http:
        refused = [
            http.post("/flush_cache", content="x", headers={"content-type": "text/plain"}),
            http.get("/flush_cache"),
            http.post("/flush_cache", headers={"origin": "http://evil.example"}),
            http.post("/flush_cache", headers={"sec-fetch-site": "cross-site"}),
            http.post("/abort_request", data={"rid": "x"}),  # a form post
            http.post("/update_weights_from_disk", content='{"model_path": "/x"}',
                      headers={"content-type": "text/plain"})]
        for call in refused:
            r = await call
            assert r.status_code == 403, r.text
        ok = await http.post("/flush_cache", headers={"origin": "http://127.0.0.1:30000"})
        assert ok.status_code == 200, ok.text
        assert [m.op for _, m in drainer.seen if hasattr(m, "op")] == ["flush_cache"] * 2


@pytest.mark.asyncio
async def test_body_size_deep_json_and_broken_unicode_are_4xx():
    app, state, _ = make_app(max_request_bytes=4096)
    async with client(app) as http:
        big = json.dumps({"input_ids": [1] * 5000})
        r = await http.post("/generate", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        for raw in [b'{"text": ' + b"[" * 1500 + b"]" * 1500 + b"}",
                    b'{"text": "\\ud800"}', b'{"text": "\xff\xfe"}',
                    b'{"input_ids": [1], "rid": "\\udfff"}',
                    b'{"input_ids": [1], "sampling_params": {"stop": "\\ud800"}}']:
            r = await http.post("/generate", content=raw,
                                headers={"content-type": "application/json"})
            assert r.status_code == 400, (raw[:40], r.text)
    state.controller.shutdown()


@pytest.mark.asyncio
async def test_a_disconnected_client_request_is_aborted(app):
    app, state, drainer = app
    drainer.hold = True
    body = json.dumps({"input_ids": [1, 2], "rid": "gone"}).encode()
    sent = {"body": False}
    disconnect = asyncio.Event()

    async def receive():
        if not sent["body"]:
            sent["body"] = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        pass

    scope = {"type": "http", "method": "POST", "path": "/generate", "raw_path": b"/generate",
             "root_path": "", "scheme": "http", "query_string": b"", "http_version": "1.1",
             "headers": [(b"content-type", b"application/json"), (b"host", b"127.0.0.1")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 30000)}
    task = asyncio.create_task(app(scope, receive, send))
    while not drainer.parked:
        await asyncio.sleep(0.01)
    disconnect.set()
    await asyncio.wait_for(task, 5)
    deadline = time.monotonic() + 5
    while not any(isinstance(m, AbortReq) and m.rid == "gone" for _, m in drainer.seen):
        assert time.monotonic() < deadline, drainer.seen
        await asyncio.sleep(0.01)
    assert state.controller.num_in_flight() == [0, 0]


@pytest.mark.asyncio
async def test_health_fails_while_a_weight_sync_group_is_being_set_up(app):
    app, state, _ = app
    release = asyncio.Event()

    async def blocked(op, args, timeout=None):
        await release.wait()
        return []

    state.controller.control_async = blocked
    async with client(app) as http:
        call = asyncio.create_task(http.post("/init_weights_update_group", json={
            "master_address": "10.255.255.1", "master_port": 1234, "rank_offset": 1,
            "world_size": 3}))
        r = await poll_until(lambda: http.get("/health"), lambda r: r.status_code != 200)
        assert r.status_code == 503 and "init_weights_update_group" in r.text
        release.set()
        assert (await call).status_code == 200
        assert (await http.get("/health")).status_code == 200


@pytest.mark.asyncio
async def test_unauthenticated_junk_cannot_grow_metrics():
    app, state, _ = make_app(api_key="k")
    async with client(app) as http:
        for i in range(200):
            await http.get(f"/junk/{i}")
            await http.post(f"/generate{i}", json={})
        text = (await http.get("/metrics", headers={"authorization": "Bearer k"})).text
    series = [ln for ln in text.splitlines() if ln.startswith("sglang_dsv41_requests_total")]
    assert len(series) <= 3, series
    assert all("junk" not in s and "generate1" not in s for s in series)
    state.controller.shutdown()


def test_weight_sync_group_setup_times_out(monkeypatch):
    monkeypatch.setattr(weight_sync_group, "SETUP_TIMEOUT_S", 2.0)
    port = free_port()  # nothing listens there: the trainer never comes
    t0 = time.monotonic()
    with pytest.raises(Exception):
        weight_sync_group.init_weight_sync_group("127.0.0.1", port, rank=1, world_size=2)
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("entry", ["../outside.safetensors", "/etc/passwd", "link.safetensors",
                                   "sub/../../outside.safetensors", 7])
def test_checkpoint_index_entries_stay_inside_the_directory(tmp_path, entry):
    from sglang_dsv41.loader.shards import checkpoint_files

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (tmp_path / "outside.safetensors").write_bytes(b"x")
    (ckpt / "link.safetensors").symlink_to(tmp_path / "outside.safetensors")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001.safetensors", "b": entry}}))
    (ckpt / "model-00001.safetensors").write_bytes(b"x")
    with pytest.raises(ValueError, match="outside the checkpoint directory"):
        checkpoint_files(str(ckpt))


def test_pushed_weights_are_range_checked_against_the_current_scale():
    from sglang_dsv41.loader.weight_update import WeightUpdateError, validate_named_tensors

    model = torch.nn.Linear(4, 4)
    w = model.weight.detach().clone()
    validate_named_tensors(model, [("weight", w * 3 + 0.5)])  # a large but sane step
    with pytest.raises(WeightUpdateError, match="current tensor's scale"):
        validate_named_tensors(model, [("weight", torch.full_like(w, 1e30))])
    with pytest.raises(WeightUpdateError, match="NaN or inf"):
        validate_named_tensors(model, [("bias", torch.full((4,), float("inf")))])


def test_a_stop_regex_that_backtracks_ends_its_request_not_the_rank():
    # "(a|aa)+$" on a run of a's followed by another letter backtracks exponentially: Python's
    # re took minutes on the leader, wedging its DP rank and the ranks waiting in its collectives
    tok = ByteTokenizer.from_config(get_preset("tiny"))
    checker = StopChecker(None, tok.decode)
    ids = tok.encode("a" * 60 + "b")
    p = SamplingParams(max_new_tokens=200, stop_regex=["(a|aa)+$"])
    start = time.monotonic()
    reason = checker.check(ids, p, 200)
    assert time.monotonic() - start < 2
    assert reason["type"] == "abort" and "(a|aa)+$" in reason["message"], reason
    # an ordinary pattern still stops at the token that completes it, and only there
    p = SamplingParams(max_new_tokens=200, stop_regex=[r"b\d+;"])
    assert checker.check(tok.encode("xx b12;"), p, 200) == {"type": "stop", "matched": "b12;"}
    assert checker.check(tok.encode("xx b12;y"), p, 200) is None
    # many patterns, each under the limit alone (about 10-20 ms here): the limit is the
    # whole check's, so a request cannot hold its rank for 64 x 2 searches a step
    p = SamplingParams(max_new_tokens=4096, stop_regex=[r"a.*a.*a.*a.*c"] * 64)
    start = time.monotonic()
    reason = checker.check(tok.encode("a" * 150), p, 4096)
    assert time.monotonic() - start < 1.0
    assert reason["type"] == "abort" and "all patterns together" in reason["message"], reason


@pytest.mark.asyncio
async def test_a_refused_batch_leaves_nothing_generating(app):
    app, state, drainer = app
    drainer.hold = True
    async with client(app, timeout=10) as http:
        busy = asyncio.create_task(http.post("/generate", json={
            "input_ids": [1, 2], "rid": "busy", "routed_dp_rank": 0}))
        while not drainer.parked:
            await asyncio.sleep(0.01)
        # the batch's second id is running: 400, and its first prompt is not left running
        r = await http.post("/generate", json={"input_ids": [[1], [2]], "rid": ["fresh", "busy"],
                                               "routed_dp_rank": 1})
        assert r.status_code == 400 and "already running" in r.text, r.text
        assert state.controller.num_in_flight() == [1, 0]
        await poll_until(lambda: asyncio.sleep(0, [m for _, m in drainer.seen
                                                   if isinstance(m, AbortReq)]),
                         lambda aborts: [m.rid for m in aborts] == ["fresh"])
        # ids repeated within one request are refused before anything is submitted
        r = await http.post("/generate", json={"input_ids": [[1], [2]], "rid": ["d", "d"]})
        assert r.status_code == 400 and "unique" in r.text, r.text
        assert state.controller.num_in_flight() == [1, 0]
        drainer.hold = False
        for d, req in drainer.parked:
            drainer.answer(d, req)
        assert (await busy).status_code == 200
        # one rid for a batch names its prompts rid_0, rid_1 (SGLang's _normalize_rid)
        r = await http.post("/generate", json={"input_ids": [[1], [2]], "rid": "x",
                                               "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200 and [o["meta_info"]["id"] for o in r.json()] == ["x_0", "x_1"]


@pytest.mark.asyncio
async def test_ranks_and_token_ids_are_not_coerced(app):
    app, _, _ = app
    async with client(app) as http:
        for body in ({"input_ids": [1], "routed_dp_rank": True},
                     {"input_ids": [1], "routed_dp_rank": "1"},
                     {"input_ids": [1], "data_parallel_rank": 1.0},
                     {"input_ids": [True, False]},
                     {"input_ids": [1.0, 2.0]}):
            r = await http.post("/generate", json=body)
            assert r.status_code == 400, (body, r.text)


@pytest.mark.asyncio
async def test_sessions_record_streamed_requests_and_refuse_what_they_cannot_continue(app):
    app, _, _ = app
    async with client(app, timeout=10) as http:
        assert (await http.post("/open_session", json={"session_id": "s"})).status_code == 200
        r = await http.post("/generate", json={
            "input_ids": [10, 11], "rid": "t1", "stream": True, "session_params": {"id": "s"},
            "sampling_params": {"max_new_tokens": 3}})
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        r = await http.post("/generate", json={
            "input_ids": [20], "rid": "t2", "session_params": {"id": "s", "rid": "t1"},
            "sampling_params": {"max_new_tokens": 1}, "return_logprob": True,
            "logprob_start_len": 0})
        assert r.status_code == 200, r.text
        # the drainer answers prompt[-1] + 1, ...: t1 was 10 11 -> 12 13 14, t2 continues it
        assert r.json()["meta_info"]["prompt_tokens"] == 6
        # an appended turn's leading BOS is dropped (SGLang's _strip_bos_token): 6 + 1
        r = await http.post("/generate", json={
            "input_ids": [get_preset("tiny").bos_token_id, 30],
            "session_params": {"id": "s", "rid": "t2"},
            "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 200 and r.json()["meta_info"]["prompt_tokens"] == 8, r.text
        for session_params, why in (({"id": "s", "rid": "t1", "offset": 99}, "outside"),
                                    ({"id": "s", "rid": "t1", "offset": -6}, "outside")):
            r = await http.post("/generate", json={"input_ids": [1],
                                                   "session_params": session_params})
            assert r.status_code == 400 and why in r.text, r.text
        r = await http.post("/generate", json={"input_ids": [1], "session_params": {"id": "s"},
                                               "sampling_params": {"n": 2}})
        assert r.status_code == 400 and "n = 1" in r.text, r.text
