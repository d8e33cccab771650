"""What a call that may be refused gave, as a plain string a spawned test body can put on its
queue: "accepted", or the refusal's message (the parent asserts on the words)."""

from __future__ import annotations

from typing import Callable


def outcome(call: Callable[[], object]) -> str:
    try:
        call()
    except ValueError as e:
        return str(e)
    return "accepted"
