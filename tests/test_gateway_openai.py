"""The agent gateway driven by the ``openai`` client over two real engines (tiny preset, tp=1
each): a multi-turn session keeps exact token ids (a turn's prompt extends the previous prompt +
output, never re-tokenized), stays on one (engine, DP rank) and reuses its prefix; killing its
engine's rank moves the next turn, with the whole history, to the live engine, and the agent
sees no error."""

from __future__ import annotations

import threading
import time

import httpx
import psutil
import pytest
import uvicorn

from sglang_dsv41.gateway.__main__ import build_gateway
from sglang_dsv41.gateway.app import create_gateway_app
from sglang_dsv41.gateway.trajectory import END_OF_ASSISTANT
from sglang_dsv41.server_process import ServerProcess, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
LAYOUT = ["--model-path", "tiny", "--context-length", "1024", "--max-new-tokens-limit", "64"]


@pytest.fixture(scope="module")
def engines():
    with ServerProcess(LAYOUT, startup_timeout=150) as a, \
            ServerProcess(LAYOUT, startup_timeout=150) as b:
        yield {a.url: a, b.url: b}


@pytest.fixture(scope="module")
def gateway(engines):
    gw = build_gateway(list(engines), "tiny")
    server = uvicorn.Server(uvicorn.Config(create_gateway_app(gw), host="127.0.0.1",
                                           port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield gw, f"http://127.0.0.1:{server.config.port}"
    server.should_exit = True
    thread.join(10)


def chat(base_url: str, sid: str, messages: list[dict], **kw):
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/sessions/{sid}/v1", api_key="unused",
                           max_retries=0)
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                          temperature=0, **kw)


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
