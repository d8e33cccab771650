"""The embedded engine's FastAPI app: SGLang's native API in front of a DPController.

Bodies are FastAPI typed bodies (api_models); every refusal goes through one error handler as
``{"error": {"message", "type", "code"}}`` with a 4xx (bad request, auth, size) or 503 (engine
down), and the server keeps serving. Generate, info and session routes are here; admin and
weight-update routes are an APIRouter in http_admin; the guard (API key, loopback-only and
same-site admin calls) is the middleware below.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..asgi import client_gone
from ..policies.sticky_dispatch import StickyDispatch
from .api_models import CloseSessionRequest, GenerateRequest, OpenSessionRequest, SamplingParamsIn
from .dp_controller import DPController, EngineFailure, EngineUnavailable
from .http_admin import ADMIN_PATHS, ApiError, admin_router, error_response, refuse_cross_site
from .http_info import info_router
from .messages import GenerateReq
from .metrics import ServerMetrics
from .output import OutputAssembler, OutputOptions
from .request_limits import RequestLimits
from .sessions import SessionStore

logger = logging.getLogger(__name__)


@dataclass
class ServerState:
    """Everything the routes read; built by the launcher once every rank is ready."""
    server_args: Any                      # ServerArgs
    controller: DPController
    tokenizer: Any                        # encode(str) -> ids, decode(ids) -> str
    limits: RequestLimits
    model_path: str
    model_config: Any                     # DSV4Config
    ready_info: dict[int, dict] = field(default_factory=dict)  # rank -> ReadyMsg.info
    weight_version: str = "default"
    metrics: ServerMetrics | None = None  # set by create_app
    sessions: SessionStore = field(default_factory=SessionStore)
    running: asyncio.Event | None = None  # cleared by /pause_generation; set by create_app
    pending_setup: dict[str, float] = field(default_factory=dict)  # op -> start (fails /health)
    sticky: StickyDispatch = field(default_factory=StickyDispatch)  # routing_key -> DP rank
    draining: bool = False                # SIGTERM: finish in-flight requests, refuse new ones


def _is_loopback(host: str | None) -> bool:
    if host in ("localhost", "testclient"):  # testclient: starlette's in-process test transport
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}")
    return "invalid request: " + "; ".join(parts)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="sglang-dsv41 embedded engine",
                  max_body_size=state.server_args.max_request_bytes)
    app.state.server = state
    state.running = asyncio.Event()
    state.running.set()
    api_key = state.server_args.api_key

    routers = [generate_router(state), info_router(state), admin_router(state)]
    # Metric labels come from this route table only: an unknown path cannot add a series.
    route_table = [(route.path_regex, route.path) for r in routers for route in r.routes]

    def route_label(path: str) -> str:
        return next((label for regex, label in route_table if regex.match(path)), "unmatched")

    state.metrics = ServerMetrics(state.controller)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        path = request.url.path
        label = route_label(path)
        if api_key is not None:
            auth = request.headers.get("authorization", "")
            if not hmac.compare_digest(auth.encode(), f"Bearer {api_key}".encode()):
                state.metrics.count(label, 401)
                return error_response(401, "missing or wrong API key (Authorization: Bearer KEY)",
                                      "Unauthorized")
        if path in ADMIN_PATHS:
            refusal = refuse_cross_site(request, api_key is None and not _is_loopback(
                request.client and request.client.host))
            if refusal is not None:
                state.metrics.count(label, 403)
                return error_response(403, refusal, "Forbidden")
        response = await call_next(request)
        state.metrics.count(label, response.status_code)
        return response

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.err_type)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        return error_response(400, _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), "HTTPError")

    for router in routers:
        app.include_router(router)
    return app


def generate_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        if state.draining:
            raise ApiError(503, "the server is shutting down", "ServiceUnavailable")
        if body.return_routed_experts and not state.server_args.enable_return_routed_experts:
            raise ApiError(400, "return_routed_experts needs the server flag "
                           "--enable-return-routed-experts")
        try:
            if body.session_params is not None:
                body = state.sessions.extend_request(
                    body, state.tokenizer.encode, getattr(state.tokenizer, "bos_token_id", None))
            pairs = state.limits.to_generate_reqs(body, state.tokenizer.encode,
                                                  request.headers.get("x-data-parallel-rank"))
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        if body.routing_key is not None and pairs[0][0].routed_dp_rank is None:
            # Unpinned turns of one routing key stay on one DP rank (its prefix cache), by the
            # rule the SGLang plugin applies; sglang-router's own pin, when present, wins.
            rank = state.sticky.rank_for(body.routing_key, list(range(state.limits.dp_size)),
                                         state.controller.num_in_flight())
            for req, _ in pairs:
                req.routed_dp_rank = rank
        await state.running.wait()
        options = [_options(body, sp) for _, sp in pairs]
        if body.stream:
            req, _ = pairs[0]
            out, chunks = _submit(state, req, options[0])
            session = body.session_params.id if body.session_params is not None else None
            return StreamingResponse(_stream(state, req, chunks, out, session),
                                     media_type="text/event-stream")
        runs = _submit_all(state, [req for req, _ in pairs], options)
        results = asyncio.gather(*(_collect(state, req, chunks, out)
                                   for (req, _), (out, chunks) in zip(pairs, runs)))
        gone = asyncio.ensure_future(client_gone(request))
        try:
            done, _ = await asyncio.wait({results, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if results not in done:  # the client went away: stop generating for it
            for req, _ in pairs:
                state.controller.release(req.rid)
            results.cancel()
            results.add_done_callback(_retrieve)
            return Response(status_code=499)
        outputs = results.result()
        if body.session_params is not None:
            state.sessions.record(body.session_params.id, pairs[0][0], outputs[0])
        return outputs if body.is_batch or len(outputs) > 1 else outputs[0]

    @router.post("/open_session")
    async def open_session(body: OpenSessionRequest):
        try:
            return state.sessions.open(body.session_id)
        except ValueError as e:
            raise ApiError(400, str(e)) from e

    @router.post("/close_session")
    async def close_session(body: CloseSessionRequest):
        if not state.sessions.close(body.session_id):
            raise ApiError(400, f"session {body.session_id!r} is not open")
        return Response(status_code=200)

    return router


def _options(body: GenerateRequest, sp: SamplingParamsIn) -> OutputOptions:
    return OutputOptions(skip_special_tokens=sp.skip_special_tokens,
                         no_stop_trim=sp.no_stop_trim,
                         text_in_logprobs=body.return_text_in_logprobs,
                         prefill_only=sp.max_new_tokens == 0)


def _submit(state: ServerState, req: GenerateReq, options: OutputOptions):
    try:
        dp_rank, chunks = state.controller.submit(req, asyncio.get_running_loop())
    except EngineUnavailable as e:
        raise ApiError(503, f"engine unavailable: {e}", "ServiceUnavailable") from e
    except ValueError as e:
        raise ApiError(400, str(e)) from e
    return OutputAssembler(req, dp_rank, state.tokenizer, state.weight_version,
                           state.model_config, options), chunks


def _submit_all(state: ServerState, reqs: list[GenerateReq], options: list[OutputOptions]):
    """Every request of a batch submitted, or none: one refused (an id already running, a rank
    down) releases those submitted before it, so a 4xx/503 leaves nothing generating."""
    runs = []
    try:
        for req, opt in zip(reqs, options):
            runs.append(_submit(state, req, opt))
    except BaseException:
        for req in reqs[:len(runs)]:
            state.controller.release(req.rid)
        raise
    return runs


async def _collect(state: ServerState, req: GenerateReq, chunks: asyncio.Queue,
                   out: OutputAssembler) -> dict:
    try:
        while not out.finished:
            item = await chunks.get()
            if isinstance(item, EngineFailure):
                raise ApiError(503, f"{item.what}: {item.reason}", "ServiceUnavailable")
            if item.error:
                raise ApiError(400, f"request refused by the scheduler: {item.error}")
            out.add(item)
    except BaseException:
        state.controller.release(req.rid)
        raise
    state.metrics.generated_tokens.labels(str(out.dp_rank)).inc(len(out.output_ids))
    return out.response()


def _retrieve(future: asyncio.Future) -> None:
    # A cancelled gather still holds its children's outcome; reading it keeps asyncio from
    # logging "exception was never retrieved" for every client that leaves.
    if not future.cancelled():
        future.exception()


async def _stream(state: ServerState, req: GenerateReq, chunks: asyncio.Queue,
                  out: OutputAssembler, session: str | None = None):
    """SSE: one event per chunk with the cumulative text and ids, then ``data: [DONE]``. A
    finished request of a session is recorded there (a later turn may continue it)."""
    finished = False
    try:
        while not out.finished:
            item = await chunks.get()
            if isinstance(item, EngineFailure):
                finished = True
                yield _sse({"error": {"message": f"{item.what}: {item.reason}", "code": 503}})
                break
            if item.error:
                finished = True
                yield _sse({"error": {"message": f"request refused: {item.error}", "code": 400}})
                break
            out.add(item)
            finished = out.finished
            response = out.response()
            if finished and session is not None:
                state.sessions.record(session, req, response)
            yield _sse(response)
        yield b"data: [DONE]\n\n"
    finally:
        if not finished:  # the client went away mid-stream
            state.controller.release(req.rid)


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"
