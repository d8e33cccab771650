"""Single turn: reward = fraction of the generated tokens that are bytes of a target set."""

from __future__ import annotations

from sglang_dsv41.tokenizer import ByteTokenizer

from .base import Environment, Episode, StepResult


class ByteTargetEpisode(Episode):
    def __init__(self, prompt: list[int], targets: frozenset[int]):
        self.prompt, self.targets = prompt, targets

    def step(self, turn: list[int]) -> StepResult:
        hits = sum(t in self.targets for t in turn)
        return StepResult(done=True, reward=hits / max(1, len(turn)))


class ByteTargetEnv(Environment):
    name, max_turns = "byte_target", 1

    def __init__(self, tokenizer: ByteTokenizer, target: str = "abcdefghijklmnopqrstuvwxyz"):
        if not target:
            raise ValueError("byte_target: target must name at least one byte")
        self.tokenizer = tokenizer
        self.targets = frozenset(target.encode())
        self.target = target

    def new_episode(self, prompt_index: int) -> Episode:
        text = f"#{prompt_index}: write bytes from [{self.target[:8]}]\n"
        return ByteTargetEpisode(self.tokenizer.encode(text, add_bos=True), self.targets)
