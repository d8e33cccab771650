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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from ..router.base import NoEngineAvailable, RouterError, SessionRouter
from ..tokenizer import IncrementalDecoder
from .trajectory import Trajectory, Turn, routed_experts_of

MAX_SESSIONS = 100_000   # the oldest finished sessions are forgotten past this
MAX_BODY_BYTES = 16 << 20
# A router without ``agenerate`` blocks a thread per turn in flight (asyncio's default pool,
# cpu_count + 4 threads, capped the gateway at a handful of turns).
ROUTER_THREADS = 32


class GatewayError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _error(status: int, message: str, err_type: str = "invalid_request_error") -> Response:
    return _json({"error": {"message": message, "type": err_type, "code": status}}, status)


def _json(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


class Gateway:
    def __init__(self, router: SessionRouter, tokenizer: Any, model_name: str,
                 context_length: int, thinking: bool = False,
                 return_routed_experts: bool = False):
        import deepseek_recipe as dr

        self.dr, self.router, self.tokenizer = dr, router, tokenizer
        self.model_name, self.context_length = model_name, context_length
        self.encoding = dr.DeepseekV41Encoding()
        self.options = dr.ConversionOptions(default_thinking_mode=thinking)
        self.return_routed_experts = return_routed_experts
        self.sessions: OrderedDict[str, Trajectory] = OrderedDict()
        self._locks: dict[str, asyncio.Lock] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(ROUTER_THREADS, "gateway-router")

    def session(self, sid: str) -> Trajectory:
        traj = self.sessions.get(sid)
        if traj is None:
            traj = self.sessions[sid] = Trajectory(sid)
            while len(self.sessions) > MAX_SESSIONS:
                old, _ = self.sessions.popitem(last=False)
                self._locks.pop(old, None)
        return traj

    async def turn(self, sid: str, body: dict[str, Any], stream: bool = False
                   ) -> AsyncIterator[tuple[Any, dict[str, Any], Turn | None]]:
        """One turn of a session: yields (the converted request, the engine's output so far,
        None) for each engine chunk (one when not streaming; cumulative text and ids when
        streaming), then (request, final output, the Turn) once the turn is recorded. Turns of
        one session run one after the other; an abandoned turn is not recorded."""
        body = {**body, "model": "DeepSeek-V4.1-Flash"}  # the encoding, whatever name is served
        try:
            conv = self.dr.ChatCompletionRequest(body).convert(self.options)
        except self.dr.ConversionError as e:
            raise GatewayError(getattr(e, "status_code", 400) or 400, str(e)) from e
        except (ValueError, TypeError) as e:
            raise GatewayError(400, f"invalid chat request: {e}") from e
        async with self._locks.setdefault(sid, asyncio.Lock()):
            traj = self.session(sid)
            text = self.encoding.render_conversation(conv.conversation).prompt
            ids, retokenized = traj.next_prompt_ids(text, self.tokenizer.encode)
            if len(ids) >= self.context_length:
                raise GatewayError(400, f"the conversation has {len(ids)} tokens; the context "
                                   f"length is {self.context_length}")
            opts = conv.inference_options
            sampling = {"max_new_tokens": conv.resolve_max_tokens(len(ids), self.context_length),
                        "skip_special_tokens": False}
            for name in ("temperature", "top_p"):
                if getattr(opts, name) is not None:
                    sampling[name] = getattr(opts, name)
            if opts.seed is not None:
                sampling["sampling_seed"] = opts.seed
            payload = {"input_ids": ids, "sampling_params": sampling, "return_logprob": True,
                       "rid": f"{sid}-{len(traj.turns)}-{uuid.uuid4().hex[:8]}"}
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
            raise GatewayError(502, str(e)) from e

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

    def response(self, conv: Any, turn: Turn, cid: str) -> dict[str, Any]:
        dr = self.dr
        proc = self._processor(conv, cid)
        resp = dr.ChatCompletionResponse(cid, self.model_name, int(time.time()),
                                         len(turn.prompt_ids), turn.cached_tokens)
        text = self.tokenizer.decode(turn.output_ids)
        for chunk in [*proc.push(dr.InferenceChunk.ready(prompt_usage=None)),
                      *proc.push(dr.InferenceChunk.text(text, len(turn.output_ids))),
                      *proc.push(self._finish(turn)), *proc.finish()]:
            resp.accumulate(chunk)
        result = orjson.loads(resp.to_json())
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
        proc, counted, started = None, 0, False
        text_stream = IncrementalDecoder(self.tokenizer.decode)
        try:
            async for conv, out, turn in self.turn(sid, body, stream=True):
                if proc is None:
                    proc = self._processor(conv, cid)
                    events = proc.push(dr.InferenceChunk.ready(prompt_usage=None))
                ids = out["output_ids"]
                delta = text_stream.step(ids, final=turn is not None)
                if delta:
                    events += proc.push(dr.InferenceChunk.text(delta, len(ids) - counted))
                    counted = len(ids)
                if turn is not None:
                    events += [*proc.push(self._finish(turn)), *proc.finish()]
                if events:
                    started = True
                    yield b"".join(b"data: " + c.to_json().encode() + b"\n\n" for c in events)
                    events = []
        except GatewayError as e:
            if not started:
                raise
            yield b"data: " + orjson.dumps({"error": {
                "message": e.message, "type": "service_unavailable" if e.status >= 500 else
                "invalid_request_error", "code": e.status}}) + b"\n\n"
        yield b"data: [DONE]\n\n"


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
        return _error(exc.status, exc.message,
                      "service_unavailable" if exc.status >= 500 else "invalid_request_error")

    async def completions(sid: str, request: Request):
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as e:  # also deep nesting and broken Unicode
            raise GatewayError(400, f"malformed JSON body: {e}") from e
        if not isinstance(body, dict):
            raise GatewayError(400, "the body must be a JSON object")
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        if not body.get("stream"):
            conv, turn, _ = await gateway.chat(sid, body)
            return _json(gateway.response(conv, turn, cid))
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
        traj = gateway.sessions.pop(sid, None)
        gateway.router.end_session(sid)
        if traj is None:
            raise GatewayError(404, f"no session {sid!r}")
        return traj.record()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": gateway.model_name, "object": "model",
                                            "owned_by": "sglang-dsv41"}]}

    @app.get("/health")
    async def health():
        if not gateway.router.engine_urls():
            return _error(503, "no live engine", "service_unavailable")
        return Response(status_code=200)

    return app
