"""Per-session token state of the agent gateway: token-in/token-out turns and the trajectory
record the trainer reads.

A turn's prompt ids are the previous turn's prompt ids + its output ids + the ids of what the
client added since (tool results, a user message, the generation prompt), never a
re-tokenization of the whole conversation: the rendered conversation must extend the previous
turn's rendered prompt, with the assistant's own message closed by the encoding's end token.
When a client rewrites history instead, the turn is re-tokenized and marked so.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

END_OF_ASSISTANT = "<｜end▁of▁sentence｜>"   # DeepSeek V4/V4.1: closes an assistant message


@dataclass
class Turn:
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    engine: str
    dp_rank: int
    cached_tokens: int
    finish_reason: Any = None
    retokenized: bool = False
    routed_experts: dict[str, Any] | None = None   # {"data": base64 int32, "shape": [...]}


@dataclass
class Trajectory:
    session_id: str
    turns: list[Turn] = field(default_factory=list)
    prompt_text: str = ""          # the last turn's rendered prompt
    closed: bool = False

    def next_prompt_ids(self, prompt_text: str, encode_from, encode) -> tuple[list[int], bool]:
        """The ids of the next turn's prompt and whether they had to be re-tokenized;
        ``encode_from(start)``: the prompt's ids from character ``start`` on."""
        if not self.turns:
            return encode_from(0), False
        last, prev = self.turns[-1], self.prompt_text
        rest = prompt_text[len(prev):] if prompt_text.startswith(prev) else None
        cut = rest.find(END_OF_ASSISTANT) if rest is not None else -1
        if cut < 0:  # history was edited (or the template changed it): start over
            return encode_from(0), True
        start = len(prev) + cut + len(END_OF_ASSISTANT)
        ids = last.prompt_ids + last.output_ids
        close = encode(END_OF_ASSISTANT)
        if ids[-len(close):] != close:  # the model did not close its message itself
            ids = ids + close
        return ids + encode_from(start), False

    def record(self) -> dict[str, Any]:
        """Everything a trainer needs: the final token ids, which of them the policy generated
        (loss mask), their rollout logprobs, and per turn the route and prefix-cache reuse."""
        if not self.turns:
            return {"session_id": self.session_id, "token_ids": [], "loss_mask": [],
                    "logprobs": [], "turns": []}
        last = self.turns[-1]
        ids = last.prompt_ids + last.output_ids
        mask, logprobs = [0] * len(ids), [0.0] * len(ids)
        for t in self.turns:
            start = len(t.prompt_ids)
            if ids[:start + len(t.output_ids)] != t.prompt_ids + t.output_ids:
                continue  # a re-tokenized later turn rewrote this one's tokens
            for i, lp in enumerate(t.output_logprobs):
                mask[start + i], logprobs[start + i] = 1, lp
        return {"session_id": self.session_id, "token_ids": ids, "loss_mask": mask,
                "logprobs": logprobs, "turns": [
                    {"prompt_len": len(t.prompt_ids), "output_len": len(t.output_ids),
                     "engine": t.engine, "dp_rank": t.dp_rank, "cached_tokens": t.cached_tokens,
                     "finish_reason": t.finish_reason, "retokenized": t.retokenized,
                     "routed_experts": t.routed_experts} for t in self.turns]}


def routed_experts_of(meta: dict[str, Any]) -> dict[str, Any] | None:
    data = meta.get("routed_experts")
    if data is None:
        return None
    base64.b64decode(data, validate=True)  # refuse a corrupt payload here, not in the trainer
    return {"data": data, "shape": meta.get("routed_experts_shape")}
