"""The agent gateway driven by the ``openai`` client over two real engines (tiny preset, tp=1
each): a multi-turn session keeps exact token ids (a turn's prompt extends the previous prompt +
output, never re-tokenized), stays on one (engine, DP rank) and reuses its prefix; killing its
engine's rank moves the next turn, with the whole history, to the live engine, and the agent
sees no error. Streaming forwards the engine's tokens as they come (same text and record as the
non-streamed turn) and a client that leaves mid-stream aborts the engine's request.

Health is per (engine, DP rank): over the real embedded HTTP app and DP controller of a dp=2
engine (engine_server_fakes.QueueDrainer stands in for its scheduler ranks), one DP rank marked
down moves only its sessions, the other rank keeps its own and takes the new ones."""

from __future__ import annotations

import time

import httpx
import psutil
import pytest

from engine_server_fakes import serve
from sglang_dsv41.gateway.__main__ import build_gateway
from sglang_dsv41.gateway.app import create_gateway_app
from sglang_dsv41.gateway.trajectory import END_OF_ASSISTANT
from sglang_dsv41.server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
LAYOUT = ["--model-path", "tiny", "--context-length", "1024", "--max-new-tokens-limit", "256"]


@pytest.fixture(scope="module")
def engines():
    with ServerProcess(LAYOUT, startup_timeout=150) as a, \
            ServerProcess(LAYOUT, startup_timeout=150) as b:
        yield {a.url: a, b.url: b}


def serving(app):
    """``app`` on loopback (engine_server_fakes.serve); yields its URL, stops it after."""
    server, url = serve(app, "warning")
    yield url
    server.stop()


@pytest.fixture(scope="module")
def gateway(engines):
    gw = build_gateway(list(engines), "tiny")
    yield from ((gw, url) for url in serving(create_gateway_app(gw)))


def chat(base_url: str, sid: str, messages: list[dict], max_tokens: int = 8, **kw):
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/sessions/{sid}/v1", api_key="unused",
                           max_retries=0)
    return client.chat.completions.create(model="tiny", messages=messages,
                                          max_tokens=max_tokens, temperature=0, **kw)


def test_two_turns_exact_tokens_one_rank_then_move_on_rank_death(engines, gateway):
    gw, url = gateway
    messages = [{"role": "system", "content": "You are a shell agent."},
                {"role": "user", "content": "List the files, then say done."}]
    first = chat(url, "traj-1", messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Now print README."}]
    second = chat(url, "traj-1", messages)
    assert second.choices[0].message.role == "assistant"
    record = httpx.get(f"{url}/sessions/traj-1/trajectory").json()
    t1, t2 = record["turns"]
    ids = record["token_ids"]
    p1, o1 = ids[:t1["prompt_len"]], ids[t1["prompt_len"]:t1["prompt_len"] + t1["output_len"]]
    tok = gw.tokenizer
    assert p1 == tok.encode(gw.encoding.render_conversation(
        gw.dr.ChatCompletionRequest({"model": "DeepSeek-V4.1-Flash", "messages": messages[:2]})
        .convert(gw.options).conversation).prompt)
    closing = [] if t1["finish_reason"]["type"] == "stop" else tok.encode(END_OF_ASSISTANT)
    added = tok.encode("<｜User｜>Now print README.<｜Assistant｜></think>")
    assert ids[:t2["prompt_len"]] == p1 + o1 + closing + added  # token-in/token-out
    assert not t1["retokenized"] and not t2["retokenized"]
    assert (t1["engine"], t1["dp_rank"]) == (t2["engine"], t2["dp_rank"])
    assert t2["cached_tokens"] >= 16 and t1["cached_tokens"] == 0
    assert record["loss_mask"].count(1) == t1["output_len"] + t2["output_len"]

    # Kill the session's scheduler rank: its engine exits; the next turn moves, whole history.
    dead = engines[t2["engine"]]
    ranks = [p for p in psutil.Process(dead.proc.pid).children(recursive=True)
             if "spawn_main" in " ".join(p.cmdline())]
    assert len(ranks) == 1
    ranks[0].kill()
    assert dead.proc.wait(60) != 0
    messages += [{"role": "assistant", "content": second.choices[0].message.content},
                 {"role": "user", "content": "Thanks."}]
    third = chat(url, "traj-1", messages)
    assert third.choices[0].message.role == "assistant"
    record = httpx.get(f"{url}/sessions/traj-1/trajectory").json()
    t3 = record["turns"][2]
    assert t3["engine"] != t2["engine"] and not t3["retokenized"]
    prev = t2["prompt_len"] + t2["output_len"]
    assert t3["prompt_len"] > prev and record["token_ids"][:prev] == ids[:prev]


def test_header_session_streaming_and_bad_requests(gateway):
    import openai

    gw, url = gateway
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                           default_headers={"X-Session-ID": "traj-2"})
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, stream=True)
    chunks = list(stream)
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert httpx.get(f"{url}/sessions/traj-2/trajectory").json()["turns"]
    for body in [{"messages": "nope"}, {"model": "tiny", "messages": []}, [1, 2]]:
        r = httpx.post(f"{url}/sessions/x/v1/chat/completions", json=body)
        assert 400 <= r.status_code < 500, r.text
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": [
        {"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "X-Session-ID" in r.text


def test_streaming_forwards_tokens_as_they_come_and_matches_the_whole_answer(engines, gateway):
    import openai

    gw, url = gateway
    messages = [{"role": "user", "content": "Write a long answer."}]
    client = openai.OpenAI(base_url=f"{url}/sessions/stream-a/v1", api_key="unused",
                           max_retries=0)
    t0 = time.monotonic()
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=48,
                                            temperature=0, stream=True)
    arrivals, deltas = [], []
    for chunk in stream:
        arrivals.append(time.monotonic() - t0)
        if chunk.choices and chunk.choices[0].delta.content:
            deltas.append(chunk.choices[0].delta.content)
    whole = chat(url, "stream-b", messages, max_tokens=48)
    a, b = (httpx.get(f"{url}/sessions/{s}/trajectory").json() for s in ("stream-a", "stream-b"))
    assert a["turns"][0]["output_len"] == 48 and len(deltas) > 8, deltas  # token by token
    assert arrivals[0] < arrivals[-1] / 2, arrivals   # the first token long before the last
    assert "".join(deltas) == whole.choices[0].message.content
    assert a["token_ids"] == b["token_ids"] and a["loss_mask"] == b["loss_mask"]
    assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)
    # The same prompt again on that engine and rank: all of it but the last token comes from
    # the prefix cache, the tail part-way into a page by copy-on-write, and greedy decoding
    # still gives the tokens and logprobs of the turn computed from scratch.
    t = a["turns"][0]
    n = t["prompt_len"]
    again = httpx.post(t["engine"] + "/generate", timeout=60, json={
        "input_ids": a["token_ids"][:n], "routed_dp_rank": t["dp_rank"], "return_logprob": True,
        "sampling_params": {"max_new_tokens": 48, "temperature": 0}}).json()
    assert (n - 1) % 16 and again["meta_info"]["cached_tokens"] == n - 1
    assert again["output_ids"] == a["token_ids"][n:]
    assert [lp for lp, _, _ in again["meta_info"]["output_token_logprobs"]] == \
        pytest.approx(a["logprobs"][n:], abs=1e-5)


def test_a_client_leaving_mid_stream_aborts_the_engine_request(engines, gateway):
    import openai

    gw, url = gateway
    # The tiny model's greedy answer to this prompt runs past 256 tokens without an eos.
    messages = [{"role": "user", "content": "Write a long answer."}]
    t0 = time.monotonic()
    whole = chat(url, "leave-ref", messages, max_tokens=64)
    full_time = time.monotonic() - t0  # a whole 64-token turn on this machine, now
    assert whole.usage.completion_tokens == 64
    client = openai.OpenAI(base_url=f"{url}/sessions/leave/v1", api_key="unused",
                           max_retries=0)
    # 256 tokens asked: an engine left generating would take about four reference turns more;
    # the abort gets one (a stall of the loaded CI machine once took 0.8 s of a 1.5 s turn).
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=256,
                                            temperature=0, stream=True)
    chunks = iter(stream)
    next(chunks), next(chunks)
    engine = next(e for e in engines.values() if e.proc.poll() is None and httpx.get(
        e.url + "/server_info").json()["in_flight"] != [0])
    stream.close()
    t0 = time.monotonic()
    while httpx.get(engine.url + "/server_info").json()["in_flight"] != [0]:
        assert time.monotonic() - t0 < full_time, "the engine kept generating"
        time.sleep(0.02)
    assert httpx.get(f"{url}/sessions/leave/trajectory").json()["turns"] == []
    # The session is free again: its next turn runs.
    assert chat(url, "leave", messages).choices[0].message.role == "assistant"


@pytest.fixture
def dp2_engine():
    """The real embedded app of a dp=2 engine (HTTP layer + DPController) on loopback."""
    from test_hardening_http import make_app

    app, state, drainer = make_app()
    for url in serving(app):
        yield url, state
    state.controller.shutdown()


def test_a_dead_dp_rank_moves_only_its_sessions(dp2_engine):
    import openai

    engine_url, state = dp2_engine
    gw = build_gateway([engine_url], "tiny")
    for url in serving(create_gateway_app(gw)):
        messages = [{"role": "user", "content": "hi"}]

        def turn(sid, msgs):
            client = openai.OpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="unused",
                                   max_retries=0)
            return client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4)

        first = {sid: turn(sid, messages) for sid in ("s0", "s1")}
        rank_of = {sid: httpx.get(f"{url}/sessions/{sid}/trajectory").json()["turns"][-1][
            "dp_rank"] for sid in first}
        assert sorted(rank_of.values()) == [0, 1], rank_of
        dead_sid = next(s for s, r in rank_of.items() if r == 1)
        state.controller.fail_rank(1, "lost its GPU")
        health = {q: httpx.get(f"{engine_url}/health{q}").status_code
                  for q in ("", "?dp_rank=0", "?dp_rank=1", "?dp_rank=2")}
        assert health == {"": 200, "?dp_rank=0": 200, "?dp_rank=1": 503, "?dp_rank=2": 400}
        info = httpx.get(f"{engine_url}/server_info").json()["rank_health"]
        assert info["0"]["healthy"] and info["1"] == {"healthy": False,
                                                      "reason": "lost its GPU"}
        for sid, out in first.items():
            history = messages + [{"role": "assistant", "content": out.choices[0].message.content},
                                  {"role": "user", "content": "next"}]
            assert turn(sid, history).choices[0].message.role == "assistant"
        turn("s2", messages)
        records = {sid: httpx.get(f"{url}/sessions/{sid}/trajectory").json()
                   for sid in ("s0", "s1", "s2")}
        ranks = {sid: [t["dp_rank"] for t in r["turns"]] for sid, r in records.items()}
        live_sid = "s0" if dead_sid == "s1" else "s1"
        assert ranks[dead_sid] == [1, 0] and ranks[live_sid] == [0, 0] and ranks["s2"] == [0]
        moved = records[dead_sid]
        t1, t2 = moved["turns"]
        assert not t2["retokenized"] and t2["prompt_len"] > t1["prompt_len"] + t1["output_len"]
        assert moved["loss_mask"].count(1) == t1["output_len"] + t2["output_len"]
    gw.router.close()
