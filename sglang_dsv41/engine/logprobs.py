"""The logprobs a request asks for besides its sampled tokens': SGLang's ``top_logprobs_num``
(the N most likely tokens at each position) and ``token_ids_logprob`` (fixed token ids at each
position), for prompt and output positions, computed on the DP group's leader from the logits
the step already has (one batched pass over the step's rows, see ``score_rows``).

A prompt position's values are of the model's distribution, an output position's of the one
its token was sampled from (``sampling``'s docstring: SGLang's default), and at every position
the sampled or given token's logprob equals its entry in the top list.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Ours (SGLang has none): each entry costs the leader a host copy and the HTTP layer a JSON row
# per position, so a request's output stays bounded by its length times these.
MAX_TOP_LOGPROBS = 100
MAX_TOKEN_IDS_LOGPROB = 256


def check_logprob_request(top_logprobs_num: int, token_ids: list[int] | None,
                          vocab_size: int) -> None:
    """The one rule for both fields (HTTP layer and scheduler): ValueError names the problem."""
    top_max = min(MAX_TOP_LOGPROBS, vocab_size)
    if isinstance(top_logprobs_num, bool) or not isinstance(top_logprobs_num, int) or \
            not 0 <= top_logprobs_num <= top_max:
        raise ValueError(f"top_logprobs_num must be an integer in [0, {top_max}], "
                         f"got {top_logprobs_num!r}")
    if token_ids is None:
        return
    if len(token_ids) > MAX_TOKEN_IDS_LOGPROB:
        raise ValueError(f"token_ids_logprob has {len(token_ids)} ids; the limit is "
                         f"{MAX_TOKEN_IDS_LOGPROB}")
    bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int)
           or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token_ids_logprob {bad[:8]} outside the vocabulary [0, {vocab_size})")


@dataclass
class LogprobExtras:
    """Per position, SGLang's ``*_top_logprobs_val/idx`` and ``*_token_ids_logprobs_val``: the
    top ``top_logprobs_num`` (descending) and the requested ids' logprobs, in their order. A
    position's lists are empty when the request did not ask for them."""
    top_values: list[list[float]] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    ids_values: list[list[float]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.top_values)

    def extend(self, other: "LogprobExtras") -> None:
        self.top_values += other.top_values
        self.top_ids += other.top_ids
        self.ids_values += other.ids_values

    def window(self, start: int, stop: int | None = None) -> "LogprobExtras":
        """Positions [start, stop)."""
        part = slice(start, stop)
        return LogprobExtras(self.top_values[part], self.top_ids[part], self.ids_values[part])

    def clear(self) -> None:
        self.top_values, self.top_ids, self.ids_values = [], [], []


def score_rows(logprobs: torch.Tensor, targets: list[int], top_nums: list[int],
               token_ids: list[list[int] | None]) -> tuple[list[float], LogprobExtras]:
    """logprobs fp32 [R, V] -> (logprob of targets[r] at row r, the rows' LogprobExtras).

    One gather per kind over all rows, then one host copy each: no per-row sync."""
    rows = torch.arange(len(targets), device=logprobs.device)
    token = logprobs[rows, torch.tensor(targets, device=logprobs.device)].tolist()
    extras = LogprobExtras([[] for _ in targets], [[] for _ in targets], [[] for _ in targets])
    asking = [r for r, n in enumerate(top_nums) if n]
    if asking:
        k = max(top_nums)
        values, ids = (t.tolist() for t in logprobs[asking].topk(k, dim=-1))
        for r, v, i in zip(asking, values, ids):
            extras.top_values[r], extras.top_ids[r] = v[:top_nums[r]], i[:top_nums[r]]
    asked = [(r, t) for r, ids in enumerate(token_ids) for t in ids or ()]
    if asked:
        at, tok = (torch.tensor(c, device=logprobs.device) for c in zip(*asked))
        for (r, _), value in zip(asked, logprobs[at, tok].tolist()):
            extras.ids_values[r].append(value)
    return token, extras
