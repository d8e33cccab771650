"""SGLang's /open_session, /close_session and ``session_params`` on /generate, in the HTTP
process: a session remembers each finished request's token ids, and a request naming one of
them (``session_params.rid``) continues it: that request's prompt + output (only its prompt with
``drop_previous_output``), cut at ``offset`` when it is non-zero, then the new ids. As SGLang's
non-streaming sessions, a request without ``rid`` starts from nothing.

Bounded: at most MAX_SESSIONS open sessions and MAX_REQUESTS_PER_SESSION remembered requests
each (the oldest is forgotten first), so no client can grow the server's memory without limit.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api_models import GenerateRequest
    from .messages import GenerateReq

MAX_SESSIONS = 4096
MAX_REQUESTS_PER_SESSION = 256


class SessionStore:
    def __init__(self) -> None:
        self._sessions: dict[str, OrderedDict[str, list[int]]] = {}
        self._prompts: dict[str, dict[str, list[int]]] = {}

    def open(self, session_id: str | None = None) -> str:
        sid = session_id or uuid.uuid4().hex
        if sid in self._sessions:
            raise ValueError(f"session {sid!r} is already open")
        if len(self._sessions) >= MAX_SESSIONS:
            raise ValueError(f"too many open sessions ({MAX_SESSIONS}); close some first")
        self._sessions[sid], self._prompts[sid] = OrderedDict(), {}
        return sid

    def close(self, session_id: str) -> bool:
        self._prompts.pop(session_id, None)
        return self._sessions.pop(session_id, None) is not None

    def extend_request(self, body: "GenerateRequest", encode,
                       bos_token_id: int | None = None) -> "GenerateRequest":
        """``body`` with its prompt replaced by the session's history + its own ids (a leading
        ``bos_token_id`` of an appended turn dropped, as SGLang's Session._strip_bos_token: a
        tokenizer that adds BOS to every text would put one mid-sequence)."""
        sp = body.session_params
        if sp.id not in self._sessions:
            raise ValueError(f"session {sp.id!r} is not open (POST /open_session first)")
        if body.is_batch:
            raise ValueError("session_params needs a single prompt, not a batch")
        params = body.sampling_params
        if any(p.n > 1 for p in (params if isinstance(params, list) else [params])):
            raise ValueError("session_params needs one sample (n = 1): a session continues "
                             "from one finished request")
        new_ids = encode(body.text) if body.text is not None else list(body.input_ids)
        history: list[int] = []
        if sp.rid is not None:
            if bos_token_id is not None and new_ids[:1] == [bos_token_id]:
                new_ids = new_ids[1:]
            done = self._sessions[sp.id]
            if sp.rid not in done:
                raise ValueError(f"session {sp.id!r} has no finished request {sp.rid!r}")
            history = list(self._prompts[sp.id][sp.rid] if sp.drop_previous_output
                           else done[sp.rid])
            if sp.offset:
                # SGLang slices history[:offset] (a negative offset counts from the end); one
                # past either end would silently keep or drop everything there: refused here.
                if not -len(history) <= sp.offset <= len(history):
                    raise ValueError(f"session_params.offset {sp.offset} is outside the "
                                     f"request's {len(history)} tokens (-{len(history)} to "
                                     f"{len(history)})")
                history = history[:sp.offset]
        return body.model_copy(update={"text": None, "input_ids": history + new_ids})

    def record(self, session_id: str, req: "GenerateReq", response: dict[str, Any]) -> None:
        done = self._sessions.get(session_id)
        if done is None:  # closed while the request ran
            return
        done[req.rid] = list(req.input_ids) + list(response["output_ids"])
        self._prompts[session_id][req.rid] = list(req.input_ids)
        while len(done) > MAX_REQUESTS_PER_SESSION:
            old, _ = done.popitem(last=False)
            self._prompts[session_id].pop(old, None)
