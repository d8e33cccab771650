"""Two turns with a tool-call-like step: the model "calls the tool", the environment answers
with a tool result holding a digit, and the second turn is rewarded for repeating that digit
(reward = fraction of the second turn's tokens equal to it)."""

from __future__ import annotations

import random

from sglang_dsv41.tokenizer import ByteTokenizer

from .base import Environment, Episode, StepResult


class ToolCallEpisode(Episode):
    def __init__(self, tokenizer: ByteTokenizer, prompt: list[int], digit: str):
        self.tokenizer, self.prompt, self.digit = tokenizer, prompt, digit
        self.turns = 0

    def step(self, turn: list[int]) -> StepResult:
        self.turns += 1
        if self.turns == 1:
            reply = f"\n<tool_result>{self.digit * 4}</tool_result>\n"
            return StepResult(done=False, observation=self.tokenizer.encode(reply))
        target = ord(self.digit)
        return StepResult(done=True, reward=sum(t == target for t in turn) / max(1, len(turn)))


class ToolCallEnv(Environment):
    name, max_turns = "tool_call", 2

    def __init__(self, tokenizer: ByteTokenizer, seed: int = 0):
        self.tokenizer, self.seed = tokenizer, seed

    def new_episode(self, prompt_index: int) -> Episode:
        digit = str(random.Random(self.seed * 1_000_003 + prompt_index).randrange(10))
        prompt = self.tokenizer.encode(f"#{prompt_index}: <tool_call>lookup()", add_bos=True)
        return ToolCallEpisode(self.tokenizer, prompt, digit)
