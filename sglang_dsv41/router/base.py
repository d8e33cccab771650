"""SessionRouter: the interface the trainer talks to when it sends a multi-turn episode's turns.

A session (one trajectory) must come back to the same engine AND the same DP rank on every
turn, or the KV cache of its prefix is recomputed elsewhere. Implementations decide where a new
session goes, keep it there, move it when its engine dies, and hold new turns back while the
weights are being replaced. A router service can implement the same interface later.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterator

import orjson


class RouterError(RuntimeError):
    """A request failed for a reason retrying elsewhere cannot fix (e.g. HTTP 4xx). ``status``:
    the HTTP status that best describes it (the engine's own for a refusal, 504 for a turn
    that got no answer in time), None when unknown; ``reason``: the engine's own message."""

    def __init__(self, message: str, status: int | None = None, reason: str | None = None):
        super().__init__(message)
        self.status = status
        self.reason = message if reason is None else reason


def engine_error_message(body: bytes) -> str:
    """The message of an engine's error body ({"error": {"message": ...}}, SGLang's and ours),
    else the body itself (its first 500 characters)."""
    try:
        err = orjson.loads(body).get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
    except (orjson.JSONDecodeError, AttributeError):
        pass
    return body.decode("utf-8", "replace")[:500]


class NoEngineAvailable(RouterError):
    """Every engine is dead (or none was given)."""


SSE_DONE = object()  # parse_sse_line: the stream's "data: [DONE]"


def parse_sse_line(line: bytes, where: str) -> dict[str, Any] | object | None:
    """One line of an engine's SSE answer to /generate with ``"stream": true`` (SGLang's and
    ours): its chunk (cumulative text, output_ids, meta_info), SSE_DONE, or None for a line
    that is not data. An error chunk raises RouterError with its status (NoEngineAvailable for
    a 5xx); ``where`` names the engine in the message."""
    if not line.startswith(b"data: "):
        return None
    data = line[6:].rstrip()
    if data == b"[DONE]":
        return SSE_DONE
    chunk = orjson.loads(data)
    if "error" in chunk:
        err = chunk["error"]
        status = int(err.get("code", 500)) if isinstance(err, dict) else 500
        reason = str(err.get("message", err) if isinstance(err, dict) else err)
        raise (RouterError if status < 500 else NoEngineAvailable)(f"{where}: {err}", status,
                                                                   reason)
    return chunk


@dataclass(frozen=True, order=True)
class Route:
    url: str
    dp_rank: int


class SessionRouter(ABC):
    @abstractmethod
    def generate(self, session_id: str, payload: dict[str, Any],
                 expected_tokens: int = 0) -> dict[str, Any]:
        """POST /generate for one turn of ``session_id`` on its pinned (engine, dp_rank).

        ``expected_tokens`` (prompt + new tokens) helps place a new session by KV budget.
        The response's meta_info gains ``"route": [url, dp_rank]``.
        """

    @abstractmethod
    def route_of(self, session_id: str) -> Route | None:
        """The pin of a session, None when it has none yet."""

    @abstractmethod
    def end_session(self, session_id: str) -> None:
        """Forget the pin (the KV prefix may be evicted)."""

    # Implementations hold ``_cond`` (a threading.Condition) and ``_paused``, and wait on
    # ``_cond`` while ``_paused`` before sending a turn.
    def pause(self) -> None:
        """New turns block until resume(); turns already sent keep running."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @abstractmethod
    def drain(self, timeout: float) -> bool:
        """Wait until no turn is in flight; False on timeout."""

    @abstractmethod
    def engine_urls(self) -> list[str]:
        """The engines that are alive (weight updates go to each of them)."""

    def all_engine_urls(self) -> list[str]:
        """Every engine the router knows, alive or dead (a weight push also reaches the dead
        ones that answer again). Default: the live ones, for routers that forget the dead."""
        return self.engine_urls()

    def weights_updated(self, version: str, urls: list[str]) -> None:
        """A weight update labelled ``version`` reached ``urls``. Default: nothing to do."""

    @contextlib.contextmanager
    def paused(self, drain_timeout: float = 300.0) -> Iterator[None]:
        """Pause, drain, run the body (e.g. a weight update), resume, even on error."""
        self.pause()
        try:
            if not self.drain(drain_timeout):
                raise RouterError(f"requests still in flight after {drain_timeout}s of draining")
            yield
        finally:
            self.resume()
