"""Environments the tiny model can learn on a CPU in minutes, and their registry."""

from __future__ import annotations

from typing import Any

from sglang_dsv41.tokenizer import ByteTokenizer

from .base import Environment, Episode, StepResult
from .byte_target import ByteTargetEnv
from .tool_call import ToolCallEnv

ENVIRONMENTS = {"byte_target": ByteTargetEnv, "tool_call": ToolCallEnv}


def make_env(name: str, tokenizer: ByteTokenizer, args: dict[str, Any] | None = None
             ) -> Environment:
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; choose from {sorted(ENVIRONMENTS)}")
    try:
        return ENVIRONMENTS[name](tokenizer, **(args or {}))
    except TypeError as e:
        raise ValueError(f"environment {name!r}: bad env_args {args}: {e}") from None


__all__ = ["ENVIRONMENTS", "Environment", "Episode", "StepResult", "make_env"]
