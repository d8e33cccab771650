"""Sampling and stop conditions (leader only).

Returned logprobs follow SGLang 0.5.23's default (``layers/sampler.py``, ``logits_processor``):
a prompt position's values are of the model's own distribution (``model_logprobs``: fp32
log_softmax of the logits); an output position's are of the distribution the token was sampled
from before top-k/top-p/min-p: logits after penalties and logit_bias, divided by the temperature
(greedy requests: 1); ``sample_token`` computes them once and draws the token from them.
SGLang's switch ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` leaves out the temperature, as there. A
trainer that samples at temperature T compares them with its own log_softmax(logits / T).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from typing import Any

import regex
import torch

from .messages import SamplingParams

# Characters a stop_regex match may span: the decoded tail it is matched against holds at least
# twice this (more with multi-character tokens).
STOP_REGEX_WINDOW = 256
# The time limit of one step's stop_regex check, all of a request's patterns together. The
# leader matches between steps, so a pattern that backtracks exponentially ("(a|aa)+$"), or many
# slow ones, would hold every request of its DP rank, and the ranks waiting on it in the step's
# collectives; the `regex` engine stops such a search, and the request ends (finish_reason
# abort, with the reason) instead.
STOP_REGEX_TIMEOUT_S = 0.05


class StopRegexTimeout(Exception):
    pass


def validate_sampling(p: SamplingParams, vocab_size: int) -> None:
    """The scheduler's last line of defence for messages that did not come through HTTP (the
    HTTP layer refuses these with a 400 first): nothing here may reach a rank as a crash."""
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
    need(-2 <= p.frequency_penalty <= 2 and -2 <= p.presence_penalty <= 2,
         "frequency/presence penalties must be in [-2, 2]")
    need(0 < p.repetition_penalty <= 2, "repetition_penalty must be in (0, 2]")
    need(all(isinstance(s, str) and s for s in p.stop), "stop strings must be non-empty strings")
    need(all(isinstance(t, int) and 0 <= t < vocab_size for t in p.stop_token_ids),
         f"stop_token_ids must be token ids in [0, {vocab_size})")
    need(all(0 <= t < vocab_size and math.isfinite(b) for t, b in p.logit_bias.items()),
         f"logit_bias must map token ids in [0, {vocab_size}) to finite values")


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed) % (2**63))


def apply_penalties(logits: torch.Tensor, p: SamplingParams, output_ids: Sequence[int],
                    stop_ids: Sequence[int] = ()) -> torch.Tensor:
    """SGLang's penalizers over the output so far (frequency, presence, repetition;
    min_new_tokens: until then the stop token ids and ``stop_ids``, the EOS, at -inf), then the
    request's logit_bias, which SGLang adds after them (sampling_batch_info.py
    apply_logits_bias); returns new logits, never modifies the input."""
    if output_ids and (p.frequency_penalty != 0 or p.presence_penalty != 0
                       or p.repetition_penalty != 1):
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long),
                                minlength=logits.numel())[:logits.numel()].to(logits.dtype)
        seen = counts > 0
        logits = (logits - p.frequency_penalty * counts
                  - p.presence_penalty * seen.to(logits.dtype))
        if p.repetition_penalty != 1:
            scaled = torch.where(logits > 0, logits / p.repetition_penalty,
                                 logits * p.repetition_penalty)
            logits = torch.where(seen, scaled, logits)
    if len(output_ids) < p.min_new_tokens:
        banned = sorted({*p.stop_token_ids, *stop_ids})
        if banned:
            logits = logits.index_fill(0, torch.tensor(banned, dtype=torch.long),
                                       float("-inf"))
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
        logits = logits.index_add(0, ids, torch.tensor(list(p.logit_bias.values()),
                                                       dtype=logits.dtype))
    return logits


def model_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] logits -> the fp32 logprobs every returned logprob is read from, clamped to the
    lowest finite float as SGLang clamps them (JSON has no -inf)."""
    return torch.log_softmax(logits.float(), dim=-1).clamp_(min=torch.finfo(torch.float32).min)


RETURN_ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"


def return_original_logprob() -> bool:
    """SGLang's ``get_bool_env_var`` reading of its switch."""
    return os.environ.get(RETURN_ORIGINAL_LOGPROB_ENV, "false").strip().lower() in ("true", "1")


def sample_token(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None,
                 output_ids: Sequence[int] = (), *, stop_ids: Sequence[int] = (),
                 logprob_logits: bool = True, original: bool = False
                 ) -> tuple[int, torch.Tensor | None]:
    """fp32 CPU logits [V] -> (the sampled token id, the logits whose log_softmax its output
    position returns, or None without ``logprob_logits``).

    The returned logits are those after penalties and logit_bias, divided by the temperature
    unless the request is greedy or ``original`` (SGLang's RETURN_ORIGINAL_LOGPROB); top-k,
    top-p and min-p filter only the draw. Never raises on extreme but valid settings: a
    temperature that overflows the scaled logits gives its limit (the greedy token, certain),
    and a filter that leaves no finite mass falls back to the greedy token, instead of
    killing the rank."""
    adjusted = apply_penalties(logits, p, output_ids, stop_ids)
    greedy = int(torch.argmax(adjusted))
    if p.temperature == 0 or p.top_k == 1:
        return greedy, adjusted if logprob_logits else None
    scaled = adjusted / p.temperature
    if not torch.isfinite(scaled.max()):
        if not logprob_logits:
            return greedy, None
        if original:
            return greedy, adjusted
        limit = torch.full_like(adjusted, float("-inf"))
        limit[greedy] = 0.0
        return greedy, limit
    returned = (adjusted if original else scaled) if logprob_logits else None
    filtered = scaled
    if p.top_k > 0 and p.top_k < filtered.numel():
        kth = torch.topk(filtered, p.top_k).values[-1]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    probs = torch.softmax(filtered, dim=-1)
    if p.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        # Keep the smallest set of most likely tokens whose mass reaches top_p.
        drop = (torch.cumsum(sorted_p, 0) - sorted_p) >= p.top_p
        probs = probs.scatter(0, order[drop], 0.0)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    total = probs.sum()
    if not (torch.isfinite(total) and total > 0):
        return greedy, returned
    return int(torch.multinomial(probs / total, 1, generator=generator)), returned


class StopChecker:
    """The one place stop conditions are decided (after each new token, on the leader):
    stop token ids, EOS, stop strings and stop regexes on the decoded output, the length limit;
    nothing but the length limit before min_new_tokens. A matched string is reported in
    finish_reason["matched"]; the HTTP layer only trims the text at it."""

    def __init__(self, eos_token_id: int | None, decode_fn):
        self.eos_token_id, self.decode_fn = eos_token_id, decode_fn

    def check(self, output_ids: list[int], p: SamplingParams, max_new_tokens: int
              ) -> dict[str, Any] | None:
        if len(output_ids) >= max(p.min_new_tokens, 1):
            last = output_ids[-1]
            if last in p.stop_token_ids:
                return {"type": "stop", "matched": last}
            if not p.ignore_eos and last == self.eos_token_id:
                return {"type": "stop", "matched": last}
            if p.stop or p.stop_regex:
                try:
                    matched = self._match_text(output_ids, p)
                except StopRegexTimeout as e:
                    return {"type": "abort", "message": (
                        f"stop_regex {e.args[0]!r} ran past the "
                        f"{STOP_REGEX_TIMEOUT_S * 1e3:.0f} ms a step's stop_regex check may take "
                        f"(all patterns together) on the output's tail (a pattern that "
                        f"backtracks exponentially, or many slow ones); the request was stopped")}
                if matched is not None:
                    return {"type": "stop", "matched": matched}
        if len(output_ids) >= max_new_tokens:
            return {"type": "length", "length": len(output_ids)}
        return None

    def _match_text(self, output_ids: list[int], p: SamplingParams) -> str | None:
        # Decode a tail long enough to hold any stop (doubling past ids that decode to nothing,
        # such as specials); only a match the newest token completed counts.
        longest = max([len(s) for s in p.stop] + [STOP_REGEX_WINDOW if p.stop_regex else 0])
        width = 4 * longest + 8
        while True:
            tail = output_ids[-width:]
            text = self.decode_fn(tail)
            if len(text) >= 2 * longest or width >= len(output_ids):
                break
            width *= 2
        before = self.decode_fn(tail[:-1])
        for s in p.stop:
            if s in text and s not in before:
                return s
        deadline = time.monotonic() + STOP_REGEX_TIMEOUT_S  # for all of them, not each

        def search(pattern, string):
            return regex.search(pattern, string, timeout=max(0.0, deadline - time.monotonic()))

        for pattern in p.stop_regex:
            try:
                m = search(pattern, text)
                if m is not None and search(pattern, before) is None:
                    return m.group(0)
            except TimeoutError as e:
                raise StopRegexTimeout(pattern) from e
        return None
