"""One DP rank's LeaderScheduler driven step by step in this process, over a real ModelRunner of
the engine tests' model (no world: one rank): what must hold between two steps."""

from __future__ import annotations

import queue
import types

import pytest
import torch
from engine_core_harness import engine_test_model, write_flat_checkpoint

from sglang_dsv41.engine.leader import LeaderScheduler
from sglang_dsv41.engine.messages import GenerateReq, SamplingParams
from sglang_dsv41.engine.model_runner import ModelRunner
from sglang_dsv41.server_args import ServerArgs

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg, model = engine_test_model()
    return write_flat_checkpoint(str(tmp_path_factory.mktemp("leader") / "ckpt"), cfg, model)


def leader(checkpoint, **kw) -> tuple[LeaderScheduler, queue.Queue]:
    args = ServerArgs(**{"model_path": checkpoint, "device": "cpu", "page_size": 4,
                         "max_total_tokens": 512, "chunked_prefill_size": 16,
                         "log_level": "warning", **kw})
    runner = ModelRunner(args, None, checkpoint, torch.device("cpu"))
    runner.info = types.SimpleNamespace(dp_rank=0, attn_tp_size=1, is_leader=True)
    out: queue.Queue = queue.Queue()
    return LeaderScheduler(runner, out), out


def step(lead: LeaderScheduler) -> bool:
    plan, reqs, chunks = lead.schedule()
    if plan is None:
        return False
    hidden, ctx = lead.runner.forward(plan, [plan.padded_tokens])
    lead.process_results(plan, reqs, chunks, hidden, ctx)
    return True


def outputs(out: queue.Queue) -> list:
    got = []
    while not out.empty():
        got.append(out.get_nowait())
    return got


def test_an_r3_request_aborted_in_its_chunked_prefill_answers_with_the_rows_it_ran(checkpoint):
    """An abort between two prefill chunks (a client gone, a weight update's abort_all) of a
    request with return_routed_experts: its answer has the routing of the 16 tokens computed;
    it read the rows of the whole prompt and the rank died (IndexError)."""
    lead, out = leader(checkpoint, enable_return_routed_experts=True)
    prompt = [(7 * i + 3) % 200 for i in range(60)]
    lead.add_request(GenerateReq("a", prompt, SamplingParams(max_new_tokens=4, temperature=0.0),
                                 return_routed_experts=True))
    assert step(lead) and lead.running[0].num_computed == 16  # one chunk of four
    lead.abort("a")
    [answer] = outputs(out)
    assert answer.finish_reason == {"type": "abort"}
    assert answer.routed_experts.shape[0] == 16
    lead.check_integrity()  # its pages went back


def run(lead: LeaderScheduler, out: queue.Queue, reqs: list[GenerateReq]) -> dict:
    for req in reqs:
        lead.add_request(req)
    while step(lead):
        pass
    return {o.rid: o for o in outputs(out) if o.finished}


def test_routed_experts_start_len_returns_the_rows_from_there_on(checkpoint):
    """SGLang 0.5.23: the routing of positions [routed_experts_start_len, seqlen - 1) (a
    multi-turn client asks for the new turn's rows only); it was accepted and ignored. Outside
    [0, prompt length] the request is refused."""
    lead, out = leader(checkpoint, enable_return_routed_experts=True)
    prompt = [(5 * i + 1) % 200 for i in range(30)]
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    got = run(lead, out, [GenerateReq("all", prompt, greedy, return_routed_experts=True),
                          GenerateReq("tail", prompt, greedy, return_routed_experts=True,
                                      routed_experts_start_len=12)])
    full, tail = got["all"].routed_experts, got["tail"].routed_experts
    assert full.shape[0] == 30 + 4 - 1 and tail.shape[0] == full.shape[0] - 12
    assert (tail == full[12:]).all()
    bad = run(lead, out, [GenerateReq("bad", prompt, greedy, return_routed_experts=True,
                                      routed_experts_start_len=31)])["bad"]
    assert bad.finish_reason == {"type": "abort"} and "routed_experts_start_len" in bad.error
