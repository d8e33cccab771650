"""In-process sampling from a frozen DSV4ForCausalLM, no server (test helper): writes offline
rollouts for the trainer tests, with the model's own routing of every layer as the server would
return it for R3. SGLang's serving numerics (the trainer's default, model.serving_numerics).
Full recompute per token (no KV cache): only for tiny models."""

from __future__ import annotations

import numpy as np
import torch

from sglang_dsv41.model.dsv4.context import DSV4Context
from sglang_dsv41.model.dsv4.model import DSV4ForCausalLM
from trainer_bridge.batch import Sample
from trainer_bridge.config import RolloutConfig
from trainer_bridge.envs import Environment
from trainer_bridge.rollout import RolloutSource


def recorded_routing(model: DSV4ForCausalLM, tokens: list[int]
                     ) -> tuple[np.ndarray, np.ndarray]:
    """The model's routing of positions 0..n-2 as the server returns it: ids int32 and weights
    fp32, [n-1, num_layers, top_k]."""
    ctx = DSV4Context.packed([len(tokens)], record_routing=True, serving_numerics=True)
    with torch.no_grad():
        model(torch.tensor(tokens), ctx)
    cfg = model.cfg
    ids = np.full((len(tokens) - 1, cfg.num_hidden_layers, cfg.num_experts_per_tok), -1, np.int32)
    weights = np.zeros(ids.shape, np.float32)
    for layer, (i, w) in ctx.routed.items():
        ids[:, layer] = i[:-1].numpy()
        weights[:, layer] = w[:-1].float().numpy()
    return ids, weights


class LocalRolloutSource(RolloutSource):
    def __init__(self, model: DSV4ForCausalLM, env: Environment, cfg: RolloutConfig,
                 seed: int = 0):
        self.model, self.env, self.cfg, self.seed = model, env, cfg, seed
        self.eos = model.cfg.eos_token_id

    @torch.no_grad()
    def collect(self, step: int) -> list[Sample]:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + step)
        cfg = self.cfg
        samples = []
        for p in range(cfg.prompts_per_step):
            prompt_index = step * cfg.prompts_per_step + p
            for _ in range(cfg.group_size):
                samples.append(self._episode(prompt_index, gen))
        return samples

    def _episode(self, prompt_index: int, gen: torch.Generator) -> Sample:
        episode = self.env.new_episode(prompt_index)
        tokens = list(episode.prompt)
        mask, lps = [0] * len(tokens), [0.0] * len(tokens)
        for _ in range(self.env.max_turns):
            turn = []
            for _ in range(self.cfg.max_new_tokens):
                ctx = DSV4Context.packed([len(tokens)], serving_numerics=True)
                logits = self.model(torch.tensor(tokens), ctx)
                logp = (logits[-1].float() / self.cfg.temperature).log_softmax(-1)
                tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
                tokens.append(tok)
                turn.append(tok)
                mask.append(1)
                lps.append(float(logp[tok]))
                if tok == self.eos:
                    break
            result = episode.step(turn)
            if result.done:
                break
            tokens += result.observation
            mask += [0] * len(result.observation)
            lps += [0.0] * len(result.observation)
        ids, weights = recorded_routing(self.model, tokens)
        return Sample(tokens, mask, lps, result.reward, prompt_index, routed_experts=ids,
                      routed_weights=weights, prompt_tokens=len(episode.prompt))
