"""The agent gateway: OpenAI-compatible ``/v1/chat/completions`` per trajectory session, in front
of one or more engines (ours or SGLang), token-in/token-out to their ``/generate``.

A session is named in the path (``/sessions/{sid}/v1/chat/completions``, the base URL an agent's
OpenAI client gets) or by an ``X-Session-ID`` header. DeepSeek's own request conversion, V4.1
prompt encoding and response parsing (``deepseek_recipe``: tool calls in DSML, reasoning) turn
the OpenAI body into a prompt and the generated text back into an OpenAI message. Routing is a
SessionRouter (router/): the session stays on one (engine, DP rank); a new session is placed by
load and free KV; a session moves only at a turn boundary, when its engine is dead or its slot
over the load threshold, with its full token history. ``GET /sessions/{sid}/trajectory`` is the
record the trainer reads.

Every OpenAI parameter is honoured or refused with a 400 that names it, never ignored: ``stop``,
the penalties, ``logit_bias`` and ``logprobs``/``top_logprobs`` go to the engine's /generate;
``response_format`` other than text and image parts are refused (no constrained decoding, a
text-only model). A turn's client that leaves (streamed or not) cancels it: the engine request
is aborted and the turn not recorded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
import uuid
import weakref
from collections import OrderedDict
from typing import Any, AsyncIterator

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from ..asgi import client_gone
from ..router.base import NoEngineAvailable, RouterError, SessionRouter
from ..tokenizer import NUM_BYTES, ByteTokenizer, IncrementalDecoder
from .trajectory import Trajectory, Turn, routed_experts_of

logger = logging.getLogger(__name__)

# Past this many sessions the least recently used one without a turn in flight is forgotten
# (a trainer that never ends its sessions must not grow the gateway without bound).
MAX_SESSIONS = 100_000
MAX_BODY_BYTES = 16 << 20
# A router without ``agenerate`` blocks a thread per turn in flight (asyncio's default pool,
# cpu_count + 4 threads, capped the gateway at a handful of turns).
ROUTER_THREADS = 32
# The engine's rid has 1 to 256 characters: the session id's share of it (the rest: the turn
# number and a random suffix, which keep rids of long ids that share a prefix apart).
RID_SESSION_CHARS = 200


class GatewayError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _error_body(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "code": status, "type": "service_unavailable"
                      if status >= 500 else "invalid_request_error"}}


def _error(status: int, message: str) -> Response:
    return _json(_error_body(status, message), status)


def _json(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


def _router_failure(e: RouterError) -> GatewayError:
    """The client's answer to a failed turn: the engine's own refusal (4xx) with its status
    and message, 504 for a turn that got no answer in time, else 502. A 401/403 is the
    gateway's own credentials to the engine, not the client's fault."""
    if e.status is not None and 400 <= e.status < 500 and e.status not in (401, 403):
        return GatewayError(e.status, f"the engine refused the request: {e.reason}")
    return GatewayError(504 if e.status == 504 else 502, str(e))


class Gateway:
    def __init__(self, router: SessionRouter, tokenizer: Any, model_name: str,
                 context_length: int, thinking: bool = False,
                 return_routed_experts: bool = False, max_new_tokens_limit: int | None = None):
        import deepseek_recipe as dr

        self.dr, self.router, self.tokenizer = dr, router, tokenizer
        self.model_name, self.context_length = model_name, context_length
        self.max_new_tokens_limit = max_new_tokens_limit   # the engines' (None: not reported)
        self.encoding = dr.DeepseekV41Encoding()
        self.options = dr.ConversionOptions(default_thinking_mode=thinking)
        self.return_routed_experts = return_routed_experts
        self.sessions: OrderedDict[str, Trajectory] = OrderedDict()
        # A session's lock lives while a turn holds or waits for it (a weak value): dropped
        # while in use, the next turn would run beside the current one; kept after, every
        # session ever seen would keep one.
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = \
            weakref.WeakValueDictionary()
        self._pool = concurrent.futures.ThreadPoolExecutor(ROUTER_THREADS, "gateway-router")

    def session(self, sid: str) -> Trajectory:
        """The record of ``sid`` (a new one for a new session), now the most recently used.
        Evicting by creation order alone dropped a long agentic session that was still
        taking turns, and its next turn started a record without the earlier ones."""
        traj = self.sessions.get(sid)
        if traj is None:
            traj = self.sessions[sid] = Trajectory(sid)
        self.sessions.move_to_end(sid)
        while len(self.sessions) > MAX_SESSIONS:
            idle = next((s for s in self.sessions if s not in self._locks), None)
            if idle is None:  # every one has a turn in flight
                break
            del self.sessions[idle]
            self.router.end_session(idle)
        return traj

    def _session_lock(self, sid: str) -> asyncio.Lock:
        """Turns of one session (and its end) run one after the other."""
        lock = self._locks.get(sid)
        if lock is None:
            lock = self._locks[sid] = asyncio.Lock()
        return lock

    async def end_session(self, sid: str) -> Trajectory | None:
        """Forget a session (its record, its pin) once its turn in flight, if any, is over:
        the record returned has every turn."""
        async with self._session_lock(sid):
            traj = self.sessions.pop(sid, None)
            self.router.end_session(sid)
        return traj

    async def turn(self, sid: str, body: dict[str, Any], stream: bool = False
                   ) -> AsyncIterator[tuple[Any, dict[str, Any], Turn | None]]:
        """One turn of a session: yields (the converted request, the engine's output so far,
        None) for each engine chunk (one when not streaming; cumulative text and ids when
        streaming), then (request, final output, the Turn) once the turn is recorded. Turns of
        one session run one after the other; an abandoned turn is not recorded."""
        body = {**body, "model": "DeepSeek-V4.1-Flash"}  # the encoding, whatever name is served
        if body.get("max_completion_tokens") is not None:  # OpenAI's newer name of max_tokens
            if body.get("max_tokens") not in (None, body["max_completion_tokens"]):
                raise GatewayError(400, "max_tokens and max_completion_tokens disagree")
            body["max_tokens"] = body["max_completion_tokens"]
        try:
            conv = self.dr.ChatCompletionRequest(body).convert(self.options)
        except self.dr.ConversionError as e:
            raise GatewayError(getattr(e, "status_code", 400) or 400, str(e)) from e
        except (ValueError, TypeError) as e:
            raise GatewayError(400, f"invalid chat request: {e}") from e
        self._refuse_unsupported(conv, body)
        sampling = self._sampling(conv, body)
        async with self._session_lock(sid):
            traj = self.session(sid)
            rendered = self.encoding.render_conversation(conv.conversation)
            text = rendered.prompt
            ids, retokenized = traj.next_prompt_ids(
                text, lambda start: self._encode_rendered(rendered, start), self.tokenizer.encode)
            if len(ids) >= self.context_length:
                raise GatewayError(400, f"the conversation has {len(ids)} tokens; the context "
                                   f"length is {self.context_length}")
            sampling["max_new_tokens"] = self._max_new_tokens(conv, len(ids))
            payload = {"input_ids": ids, "sampling_params": sampling, "return_logprob": True,
                       "rid": f"{sid[:RID_SESSION_CHARS]}-{len(traj.turns)}-"
                              f"{uuid.uuid4().hex[:8]}"}
            if conv.inference_options.top_logprobs:
                payload["top_logprobs_num"] = conv.inference_options.top_logprobs
            if self.return_routed_experts:
                payload["return_routed_experts"] = True
            out = None
            async for out in self._engine_outputs(sid, payload, len(ids) + sampling[
                    "max_new_tokens"], stream):
                if out["meta_info"].get("finish_reason") is None:
                    yield conv, out, None
            if out is None:
                raise GatewayError(502, "the engine answered no output")
            meta = out["meta_info"]
            reason = meta.get("finish_reason") or {}
            if reason.get("type") == "abort":  # cut short by the engine: not the model's answer
                raise GatewayError(int(reason.get("status_code") or 503),
                                   "the engine aborted the turn: "
                                   f"{reason.get('message') or 'no reason given'}")
            url, dp_rank = meta.get("route", [None, meta.get("dp_rank", 0)])
            # The final chunk carries every id, logprob and the routed experts: the record is
            # the same whether the turn streamed or not.
            turn = Turn(ids, list(out["output_ids"]),
                        [e[0] for e in meta.get("output_token_logprobs") or []],
                        str(url), int(dp_rank), int(meta.get("cached_tokens", 0)),
                        meta.get("finish_reason"), retokenized,
                        routed_experts_of(meta) if self.return_routed_experts else None)
            traj.turns.append(turn)
            traj.prompt_text = text
            yield conv, out, turn

    def _encode_rendered(self, rendered: Any, start: int = 0) -> list[int]:
        """DeepSeek's prompt encoding of ``rendered.prompt[start:]``: its special ranges as
        their tokens, the text between them as plain text (a tag's spelling inside a message or
        a tool result is text, as in DeepseekV41Encoding.encode)."""
        ids, pos = [], start
        for a, b in rendered.special_ranges:
            if a < start:
                continue
            ids += self.tokenizer.encode(rendered.prompt[pos:a], plain=True)
            ids += self.tokenizer.encode(rendered.prompt[a:b])
            pos = b
        return ids + self.tokenizer.encode(rendered.prompt[pos:], plain=True)

    def _refuse_unsupported(self, conv: Any, body: dict[str, Any]) -> None:
        """What the served model and engine cannot do is refused by name, never ignored."""
        # fields the chat conversion drops without a word (the recipe keeps only ``tools``)
        if body.get("parallel_tool_calls") is False:
            raise GatewayError(400, "parallel_tool_calls=false is not supported: the model may "
                               "call several tools in one answer")
        legacy = [k for k in ("functions", "function_call") if body.get(k) is not None]
        if legacy:
            raise GatewayError(400, f"{', '.join(legacy)} (the legacy function-calling fields) "
                               "are not supported: use tools and tool_choice")
        if body.get("audio") is not None or "audio" in (body.get("modalities") or []):
            raise GatewayError(400, "audio output is not supported: the served model is "
                               "text-only")
        fmt = str(conv.conversation.response_format)
        if fmt != "text":
            raise GatewayError(400, f"response_format {fmt!r} is not supported: the engine has "
                               "no constrained decoding (only 'text')")
        images = [src.path for m in conv.conversation.messages for src in m.image_sources]
        if images:
            raise GatewayError(400, "image_url content parts are not supported: the served "
                               f"model is text-only (at {', '.join(images)})")

    def _sampling(self, conv: Any, body: dict[str, Any]) -> dict[str, Any]:
        """/generate's sampling_params but max_new_tokens (it needs the prompt; a max_tokens
        over the engines' limit is refused here). The recipe has range-checked the penalties;
        the engine checks logit_bias against its vocab."""
        opts = conv.inference_options
        limit = self.max_new_tokens_limit
        if opts.max_tokens is not None and limit is not None and opts.max_tokens > limit:
            raise GatewayError(400, f"max_tokens={opts.max_tokens} exceeds this server's limit "
                               f"of {limit} new tokens a turn (the engine's "
                               "--max-new-tokens-limit)")
        sampling: dict[str, Any] = {"skip_special_tokens": False}
        for name in ("temperature", "top_p"):
            if getattr(opts, name) is not None:
                sampling[name] = getattr(opts, name)
        if opts.seed is not None:
            sampling["sampling_seed"] = opts.seed
        stops = list(conv.parsing_options.stop_sequences)
        if stops:
            sampling["stop"] = stops
        for name in ("frequency_penalty", "presence_penalty"):
            if body.get(name) is not None:
                sampling[name] = float(body[name])
        # SGLang's extensions of the chat API (extra_body), which the chat conversion drops:
        # passed on as the engine's own sampling parameters (it range-checks them: a 400)
        for name, engine_name in (("top_k", "top_k"), ("min_p", "min_p"),
                                  ("repetition_penalty", "repetition_penalty"),
                                  ("min_tokens", "min_new_tokens")):
            if body.get(name) is not None:
                sampling[engine_name] = body[name]
        if body.get("logit_bias") is not None:
            if not isinstance(body["logit_bias"], dict):
                raise GatewayError(400, "logit_bias must be an object of token id -> bias")
            sampling["logit_bias"] = body["logit_bias"]
        return sampling

    def _max_new_tokens(self, conv: Any, prompt_tokens: int) -> int:
        """The request's max_tokens, or the recipe's default lowered to what the context has
        left and to the engines' --max-new-tokens-limit (65536 in thinking mode would
        otherwise fail every request that sets none)."""
        limit = self.max_new_tokens_limit
        try:
            n = conv.resolve_max_tokens(prompt_tokens, self.context_length)
        except self.dr.ConversionError as e:
            raise GatewayError(400, f"{e} (the conversation has {prompt_tokens} tokens; the "
                               f"context length is {self.context_length})") from e
        return n if limit is None else min(n, limit)

    async def _engine_outputs(self, sid: str, payload: dict[str, Any], expected: int,
                              stream: bool) -> AsyncIterator[dict[str, Any]]:
        """The engine's outputs for one turn through the router: its stream's cumulative chunks
        (a router with ``astream``), else the one final output."""
        try:
            astream = getattr(self.router, "astream", None) if stream else None
            if astream is not None:
                async for out in astream(sid, payload, expected):
                    yield out
                return
            agenerate = getattr(self.router, "agenerate", None)
            yield await agenerate(sid, payload, expected) if agenerate else \
                await asyncio.get_running_loop().run_in_executor(
                    self._pool, self.router.generate, sid, payload, expected)
        except NoEngineAvailable as e:
            raise GatewayError(503, str(e)) from e
        except RouterError as e:
            raise _router_failure(e) from e

    async def chat(self, sid: str, body: dict[str, Any]) -> tuple[Any, Turn, dict[str, Any]]:
        """One non-streamed turn: (the converted request, the turn, the /generate output)."""
        async for conv, out, turn in self.turn(sid, body):
            pass
        return conv, turn, out

    def _processor(self, conv: Any, cid: str) -> Any:
        """DeepSeek's stream parser (content, reasoning, DSML tool calls) for one response."""
        gen = self.dr.ChatCompletionRequest.chunk_generator(conv, cid, self.model_name)
        return self.dr.StreamProcessor(gen, conv.parsing_options)

    def _finish(self, turn: Turn) -> Any:
        reason = (turn.finish_reason or {}).get("type")
        return self.dr.InferenceChunk.finish(
            self.dr.InferenceFinishReason.Length if reason == "length" else
            self.dr.InferenceFinishReason.Stop)

    def _logprobs(self, conv: Any, meta: dict[str, Any], start: int, end: int
                  ) -> list[dict[str, Any]]:
        """OpenAI's ``logprobs.content`` entries of output tokens [start, end) from the engine's
        meta_info (``output_token_logprobs``, ``output_top_logprobs``: [logprob, id, text])."""
        rows = meta.get("output_token_logprobs") or []
        tops = (meta.get("output_top_logprobs") or []) if conv.inference_options.top_logprobs \
            else []
        entries = []
        for i in range(start, min(end, len(rows))):
            entry = self._token_logprob(rows[i][1], rows[i][0])
            alternatives = tops[i] if i < len(tops) and tops[i] else []
            entry["top_logprobs"] = [self._token_logprob(a[1], a[0]) for a in alternatives]
            entries.append(entry)
        return entries

    def _token_logprob(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        # A byte token alone may be part of a character: its own byte, not U+FFFD's.
        raw = bytes([token_id]) if isinstance(self.tokenizer, ByteTokenizer) and \
            token_id < NUM_BYTES else text.encode()
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    def response(self, conv: Any, turn: Turn, cid: str, meta: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
        """The chat.completion of a recorded turn; ``meta``: the engine's meta_info (for
        logprobs)."""
        dr = self.dr
        proc = self._processor(conv, cid)
        resp = dr.ChatCompletionResponse(cid, self.model_name, int(time.time()),
                                         len(turn.prompt_ids), turn.cached_tokens)
        text = self.tokenizer.decode(turn.output_ids)
        # A stop string finishes the parser inside the text (the answer ends before it): it
        # takes nothing after that.
        usage = dr.PromptUsage(prompt_tokens=len(turn.prompt_ids),
                               prompt_cache_hit_tokens=turn.cached_tokens)
        for chunk in [dr.InferenceChunk.ready(prompt_usage=usage),
                      dr.InferenceChunk.text(text, len(turn.output_ids)), self._finish(turn)]:
            if proc.finished:
                break
            for event in proc.push(chunk):
                resp.accumulate(event)
        for event in proc.finish():
            resp.accumulate(event)
        result = orjson.loads(resp.to_json())
        if conv.inference_options.logprobs:
            result["choices"][0]["logprobs"] = {"content": self._logprobs(
                conv, meta or {}, 0, len(turn.output_ids)), "refusal": None}
        result["usage"].update(prompt_tokens=len(turn.prompt_ids),
                               total_tokens=len(turn.prompt_ids) + len(turn.output_ids))
        result["sglang_dsv41"] = {"dp_rank": turn.dp_rank, "engine": turn.engine,
                                  "cached_tokens": turn.cached_tokens}
        return result

    async def stream_events(self, sid: str, body: dict[str, Any], cid: str
                            ) -> AsyncIterator[bytes]:
        """SSE events of one streamed turn, sent as the engine's tokens arrive: each new piece
        of decoded text goes through DeepSeek's stream parser, which emits content deltas at
        once and a DSML tool call as one delta when its closing tag has arrived (DSML names the
        function and its arguments as tags, so the parser holds a call until it is complete).
        Errors before the first event raise GatewayError (an HTTP error); after it they become
        an error event. Text ending in an incomplete UTF-8 sequence waits for its next token."""
        dr = self.dr
        proc, counted, started, logprobs_sent = None, 0, False, 0
        text_stream = IncrementalDecoder(self.tokenizer.decode)
        try:
            async for conv, out, turn in self.turn(sid, body, stream=True):
                if proc is None:
                    proc = self._processor(conv, cid)
                    meta = out["meta_info"]
                    events = proc.push(dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(
                        prompt_tokens=int(meta.get("prompt_tokens", 0)),
                        prompt_cache_hit_tokens=int(meta.get("cached_tokens", 0)))))
                ids = out["output_ids"]
                delta = text_stream.step(ids, final=turn is not None)
                # A stop string finishes the parser (its answer ends before the string): what
                # the engine sends after that is recorded, not shown.
                if (delta or (turn is not None and len(ids) > counted)) and not proc.finished:
                    events += proc.push(dr.InferenceChunk.text(delta, len(ids) - counted))
                    counted = len(ids)
                if turn is not None and not proc.finished:
                    events += [*proc.push(self._finish(turn)), *proc.finish()]
                if events:
                    started = True
                    sse = [c.to_json().encode() for c in events]
                    if conv.inference_options.logprobs:
                        sse = self._attach_logprobs(sse, self._logprobs(
                            conv, out["meta_info"], logprobs_sent, len(ids)))
                        logprobs_sent = len(ids)
                    yield b"".join(b"data: " + e + b"\n\n" for e in sse)
                    events = []
        except GatewayError as e:
            if not started:
                raise
            yield _error_event(e.status, e.message)
        except Exception as e:
            # A failure nobody foresaw still ends the client's stream with an error event and
            # [DONE], not a torn connection.
            if not started:
                raise
            logger.exception("streamed turn of session %r failed", sid)
            yield _error_event(500, f"the gateway failed mid-stream: {type(e).__name__}: {e}")
        yield b"data: [DONE]\n\n"

    @staticmethod
    def _attach_logprobs(sse: list[bytes], entries: list[dict[str, Any]]) -> list[bytes]:
        """The entries of the tokens since the last event go on the last chunk of this batch
        that has a choice (a parser holding text back, e.g. a DSML call in progress, sends them
        with a later batch)."""
        for i in reversed(range(len(sse))):
            chunk = orjson.loads(sse[i])
            if chunk.get("choices"):
                chunk["choices"][0]["logprobs"] = {"content": entries, "refusal": None}
                return [*sse[:i], orjson.dumps(chunk), *sse[i + 1:]]
        return sse


def _error_event(status: int, message: str) -> bytes:
    return b"data: " + orjson.dumps(_error_body(status, message)) + b"\n\n"


def create_gateway_app(gateway: Gateway) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        aclose = getattr(gateway.router, "aclose", None)  # its pooled engine connections
        if aclose is not None:
            await aclose()

    app = FastAPI(title="sglang-dsv41 agent gateway", max_body_size=MAX_BODY_BYTES,
                  lifespan=lifespan)

    @app.exception_handler(GatewayError)
    async def gateway_error(_: Request, exc: GatewayError):
        return _error(exc.status, exc.message)

    async def completions(sid: str, request: Request):
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as e:  # also deep nesting and broken Unicode
            raise GatewayError(400, f"malformed JSON body: {e}") from e
        if not isinstance(body, dict):
            raise GatewayError(400, "the body must be a JSON object")
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        if not body.get("stream"):
            # A client that goes away cancels the turn, as a streamed one: its engine request
            # is aborted (the router closes that connection) and the turn is not recorded.
            chat = asyncio.ensure_future(gateway.chat(sid, body))
            gone = asyncio.ensure_future(client_gone(request))
            try:
                done, _ = await asyncio.wait({chat, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                if not chat.done():
                    chat.cancel()
            if chat not in done:
                return Response(status_code=499)  # nobody reads it
            conv, turn, out = chat.result()
            return _json(gateway.response(conv, turn, cid, out["meta_info"]))
        events = gateway.stream_events(sid, body, cid)
        first = await anext(events)  # placement and refusals answer as HTTP errors

        async def sse():
            # A client that goes away cancels this: the turn's engine stream is closed (the
            # engine aborts the request) and the session's lock released.
            try:
                yield first
                async for event in events:
                    yield event
            finally:
                await events.aclose()
        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/sessions/{sid}/v1/chat/completions")
    async def session_completions(sid: str, request: Request):
        return await completions(sid, request)

    @app.post("/v1/chat/completions")
    async def header_completions(request: Request):
        sid = request.headers.get("x-session-id")
        if not sid:
            raise GatewayError(400, "name the session: X-Session-ID header or "
                               "/sessions/{id}/v1/chat/completions")
        return await completions(sid, request)

    @app.get("/sessions/{sid}/trajectory")
    async def trajectory(sid: str):
        traj = gateway.sessions.get(sid)
        if traj is None:
            raise GatewayError(404, f"no session {sid!r}")
        return _json(traj.record())

    @app.delete("/sessions/{sid}")
    async def end_session(sid: str):
        traj = await gateway.end_session(sid)
        if traj is None:
            raise GatewayError(404, f"no session {sid!r}")
        return traj.record()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": gateway.model_name, "object": "model",
                                            "owned_by": "sglang-dsv41"}]}

    @app.get("/health")
    async def health():
        # Dead engines are probed again here too: one that came back is live without a turn.
        refresh = getattr(gateway.router, "arefresh", None)
        if refresh is not None:
            await refresh()
        if not gateway.router.engine_urls():
            return _error(503, "no live engine")
        return Response(status_code=200)

    return app
