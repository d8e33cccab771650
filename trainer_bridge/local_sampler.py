"""In-process sampling from a (frozen) model, no server: writes offline rollouts for tests and
for runs without an engine. Full recompute per token (no KV cache): only for tiny models."""

from __future__ import annotations

import numpy as np
import torch

from sglang_dsv41.model import DSV41ForCausalLM, ForwardContext, reference_logprobs

from .batch import Sample
from .config import RolloutConfig
from .envs import Environment
from .rollout import RolloutSource


class LocalRolloutSource(RolloutSource):
    def __init__(self, model: DSV41ForCausalLM, env: Environment, cfg: RolloutConfig,
                 seed: int = 0):
        self.model, self.env, self.cfg, self.seed = model, env, cfg, seed
        self.eos = model.config.eos_token_id

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
                hidden = self.model(torch.tensor(tokens), ForwardContext.packed([len(tokens)]))
                logits = self.model.compute_logits(hidden[-1:]).float() / self.cfg.temperature
                logp = logits.log_softmax(-1)[0]
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
        _, ctx = reference_logprobs(self.model, [tokens], record_routing=True)
        layers, k = self.model.config.num_hidden_layers, self.model.config.num_experts_per_tok
        ids = np.full((len(tokens) - 1, layers, k), -1, dtype=np.int32)
        weights = np.zeros((len(tokens) - 1, layers, k), dtype=np.float32)
        for layer, (i, w) in ctx.routed.items():
            ids[:, layer] = i[:-1].numpy()
            weights[:, layer] = w[:-1].float().numpy()
        return Sample(tokens, mask, lps, result.reward, prompt_index, routed_experts=ids,
                      routed_weights=weights, prompt_tokens=len(episode.prompt))
