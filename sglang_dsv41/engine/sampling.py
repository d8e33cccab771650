"""Sampling and stop conditions (leader only).

Returned logprobs are those of the sampled tokens under the model's own distribution: fp32
log_softmax of the unscaled logits (temperature 1, no top-k/top-p/min-p filtering), as SGLang
returns them by default, so a trainer can compare them to its own forward directly.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .messages import SamplingParams


def validate_sampling(p: SamplingParams, vocab_size: int) -> None:
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ValueError(msg)

    need(isinstance(p.max_new_tokens, int) and p.max_new_tokens >= 1,
         f"max_new_tokens must be an integer >= 1, got {p.max_new_tokens!r}")
    need(math.isfinite(p.temperature) and p.temperature >= 0,
         f"temperature must be >= 0, got {p.temperature}")
    need(0 < p.top_p <= 1, f"top_p must be in (0, 1], got {p.top_p}")
    need(p.top_k == -1 or p.top_k >= 1, f"top_k must be -1 (off) or >= 1, got {p.top_k}")
    need(0 <= p.min_p <= 1, f"min_p must be in [0, 1], got {p.min_p}")
    need(all(isinstance(s, str) and s for s in p.stop), "stop strings must be non-empty strings")
    need(all(isinstance(t, int) and 0 <= t < vocab_size for t in p.stop_token_ids),
         f"stop_token_ids must be token ids in [0, {vocab_size})")


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed) % (2**63))


def sample_token(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None
                 ) -> tuple[int, float]:
    """logits fp32 [V] -> (token id, its logprob at temperature 1)."""
    logits = logits.float().cpu()
    logprobs = torch.log_softmax(logits, dim=-1)
    if p.temperature == 0 or p.top_k == 1:
        token = int(torch.argmax(logits))
        return token, float(logprobs[token])
    scaled = logits / p.temperature
    if p.top_k > 0 and p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        # Keep the smallest set of most likely tokens whose mass reaches top_p.
        drop = (torch.cumsum(sorted_p, 0) - sorted_p) >= p.top_p
        probs = probs.scatter(0, order[drop], 0.0)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    token = int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
    return token, float(logprobs[token])


class StopChecker:
    """Decides whether a request is finished after its newest token."""

    def __init__(self, eos_token_id: int | None, decode_fn):
        self.eos_token_id, self.decode_fn = eos_token_id, decode_fn

    def check(self, output_ids: list[int], p: SamplingParams, max_new_tokens: int
              ) -> dict[str, Any] | None:
        last = output_ids[-1]
        if last in p.stop_token_ids:
            return {"type": "stop", "matched": last}
        if not p.ignore_eos and last == self.eos_token_id:
            return {"type": "stop", "matched": last}
        if p.stop:
            longest = max(len(s) for s in p.stop)
            # A stop string can span several byte tokens; look at a tail long enough for it.
            tail = self.decode_fn(output_ids[-(4 * longest + 4):])
            for s in p.stop:
                if s in tail:
                    return {"type": "stop", "matched": s}
        if len(output_ids) >= max_new_tokens:
            return {"type": "length", "length": len(output_ids)}
        return None


def make_decode_fn(cfg):
    """Token ids -> text with the project's ByteTokenizer (raw bytes if it is not available)."""
    try:
        from ..tokenizer import ByteTokenizer

        tok = ByteTokenizer.from_config(cfg)
        return lambda ids: tok.decode(ids)
    except (ImportError, ValueError):
        return lambda ids: bytes(t for t in ids if 0 <= t < 256).decode("utf-8", errors="replace")
