"""Environments the tiny model can learn on a CPU in minutes, and their registry."""

from __future__ import annotations

import inspect
from typing import Any

from sglang_dsv41.tokenizer import ByteTokenizer

from .base import Environment, Episode, StepResult
from .byte_target import ByteTargetEnv
from .tool_call import ToolCallEnv

ENVIRONMENTS = {"byte_target": ByteTargetEnv, "tool_call": ToolCallEnv}


def check_env(name: str, args: dict[str, Any] | None = None) -> None:
    """Refuses (ValueError) an unknown environment or arguments its constructor does not take
    (bound as the constructor would bind them: the tokenizer comes first)."""
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; choose from {sorted(ENVIRONMENTS)}")
    try:
        inspect.signature(ENVIRONMENTS[name]).bind(None, **(args or {}))
    except TypeError as e:
        raise ValueError(f"environment {name!r}: bad env_args {dict(args or {})}: {e}") from None


def make_env(name: str, tokenizer: ByteTokenizer, args: dict[str, Any] | None = None
             ) -> Environment:
    check_env(name, args)
    return ENVIRONMENTS[name](tokenizer, **(args or {}))


__all__ = ["ENVIRONMENTS", "Environment", "Episode", "StepResult", "check_env", "make_env"]
