"""Environment interface for multi-turn episodes.

An episode starts from a prompt (token ids). After each model turn the episode answers with a
StepResult: either an observation to append (a tool result, a user message) and another turn, or
done with the episode's reward. Episodes are plain objects so a rollout worker can run many of
them concurrently, one session each.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass
class StepResult:
    done: bool
    reward: float = 0.0
    observation: list[int] = field(default_factory=list)   # appended before the next turn

    def __post_init__(self) -> None:
        if self.done and self.observation:
            raise ValueError("a finished episode has no observation")
        if not self.done and not self.observation:
            raise ValueError("an unfinished episode must give the model something to read")


class Episode(ABC):
    prompt: list[int]

    @abstractmethod
    def step(self, turn: list[int]) -> StepResult:
        """The model's turn (generated token ids, eos included when it stopped on it)."""


class Environment(ABC):
    name: str
    max_turns: int

    @abstractmethod
    def new_episode(self, prompt_index: int) -> Episode:
        """Episodes of one prompt_index share the prompt (one GRPO group)."""
