"""The trainer's tool-using agent environment through the real gateway (openai client, DeepSeek
V4.1 encoding and DSML tool-call parsing) to a scripted engine: it answers the first turn with a
bash tool call and, once it sees the tool result, with the answer. Shows the whole loop (tool
call parsed, tool run, result sent back, token-exact two-turn trajectory) without a model that
has learnt to call tools."""

from __future__ import annotations


import pytest
from engine_server_fakes import serve
from fastapi import FastAPI, Request

from sglang_dsv41.gateway.__main__ import build_gateway
from sglang_dsv41.gateway.app import create_gateway_app
from sglang_dsv41.model.dsv4 import get_preset
from sglang_dsv41.tokenizer import ByteTokenizer
from trainer_bridge.envs.agent_shell import TASKS, ShellAgentEpisode

pytestmark = [pytest.mark.timeout(60)]
TOOL_CALL = ('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="bash">\n<｜DSML｜ parameter '
             'name="command" string="true">cat setup.cfg</｜DSML｜ parameter>\n</｜DSML｜ '
             'invoke>\n</｜DSML｜ calls>')


def scripted_engine() -> FastAPI:
    tok = ByteTokenizer.from_config(get_preset("tiny"))
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        prompt = tok.decode(body["input_ids"])
        text = "4.1.7" if "version = 4.1.7" in prompt else TOOL_CALL
        ids = tok.encode(text) + [tok.eos_token_id]
        return {"text": text, "output_ids": ids, "meta_info": {
            "prompt_tokens": len(body["input_ids"]), "completion_tokens": len(ids),
            "cached_tokens": 0, "dp_rank": body.get("routed_dp_rank", 0),
            "finish_reason": {"type": "stop", "matched": tok.eos_token_id},
            "output_token_logprobs": [[-0.5, t, None] for t in ids]}}

    @app.get("/get_server_info")
    async def server_info():
        return {"dp_size": 1, "rank_stats": {}}

    @app.get("/model_info")
    async def model_info():
        return {"context_length": 8192}

    return app


def test_agent_episode_calls_a_tool_and_answers_through_the_gateway():
    engine, engine_url = serve(scripted_engine())
    gateway, url = serve(create_gateway_app(build_gateway([engine_url], "tiny")))
    try:
        episode = ShellAgentEpisode(url, "traj-agent-1", TASKS[0])
        assert episode.run() == 1.0
        assert episode.tool_calls == 1
        assert episode.messages[3] == {"role": "tool", "tool_call_id": episode.messages[2][
            "tool_calls"][0]["id"], "content": "[metadata]\nversion = 4.1.7\n"}
        record = episode.trajectory()
        t1, t2 = record["turns"]
        ids = record["token_ids"]
        assert not t2["retokenized"] and t2["prompt_len"] > t1["prompt_len"] + t1["output_len"]
        turn1 = ids[t1["prompt_len"]:t1["prompt_len"] + t1["output_len"]]
        assert ByteTokenizer.from_config(get_preset("tiny")).decode(turn1) == TOOL_CALL
        assert record["loss_mask"].count(1) == t1["output_len"] + t2["output_len"]
        assert record["logprobs"][t1["prompt_len"]] == -0.5
    finally:
        gateway.should_exit = engine.should_exit = True
