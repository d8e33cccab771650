"""A transformers DeepseekV4 checkpoint, written by transformers' own save_pretrained (its names
and its config.json, no tokenizer), served by the engine's scheduler ranks (attention TP 2):
greedy tokens and logprobs match transformers' own forward over the whole sequence, on the
first turn and on a second turn served from the prefix cache."""

from __future__ import annotations

import pytest
import torch

from engine_core_harness import V4_TEST_OVERRIDES, V4_TEST_PRESET, RankCluster, tiny_args
from sglang_dsv41.engine.messages import SamplingParams
from sglang_dsv41.model.dsv4 import get_preset, names

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402

STEPS = 6
GREEDY = SamplingParams(max_new_tokens=STEPS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    from dataclasses import replace

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = replace(get_preset(V4_TEST_PRESET), **V4_TEST_OVERRIDES)
    torch.manual_seed(7)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**names.to_transformers_config(cfg)))
    with torch.no_grad():   # weights large enough that logprobs are far from uniform
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            elif "norm" not in name:
                p.add_(torch.randn_like(p) * 0.3)
    path = tmp_path_factory.mktemp("hf_v4")
    model.save_pretrained(path)
    model.path = str(path)
    yield model.eval()
    torch.set_num_threads(threads)


def hf_logprobs(model, seq: list[int]) -> torch.Tensor:
    """[len(seq)-1] logprob of token t+1 from transformers' forward over the whole sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0]


def hf_greedy(model, prompt: list[int]) -> list[int]:
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(STEPS):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.timeout(180)
def test_transformers_checkpoint_served_like_transformers(hf):
    import os

    from sglang_dsv41.loader.serving import has_tokenizer, model_layout, serving_numerics_for

    assert not os.path.exists(os.path.join(hf.path, "tokenizer.json"))
    assert model_layout(hf.path) == "transformers" and not has_tokenizer(hf.path)
    assert not serving_numerics_for(hf.path)   # served with transformers' plain math
    prompt = [(13 * i + 5) % 256 for i in range(140)]   # 35 CSA blocks, one HCA block
    args = tiny_args(model_path=hf.path, tp_size=2, chunked_prefill_size=48)
    with RankCluster(args) as c:
        assert all(m.ok for m in c.wait_ready(90))
        first = c.generate([prompt], sampling=GREEDY, return_logprob=True, timeout=120)[0]
        assert first.token_ids == hf_greedy(hf, prompt)
        turn1 = prompt + first.token_ids
        torch.testing.assert_close(torch.tensor(first.logprobs),
                                   hf_logprobs(hf, turn1)[len(prompt) - 1:], rtol=0, atol=1e-4)
        p2 = turn1 + [7, 8, 9]
        second = c.generate([p2], sampling=GREEDY, return_logprob=True, timeout=120)[0]
        assert second.cached_tokens >= len(turn1) - args.page_size
        assert second.token_ids == hf_greedy(hf, p2)
        torch.testing.assert_close(torch.tensor(second.logprobs),
                                   hf_logprobs(hf, p2 + second.token_ids)[len(p2) - 1:],
                                   rtol=0, atol=1e-4)
        assert c.shutdown() == [0, 0]
