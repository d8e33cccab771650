"""The embedded engine's FastAPI app: SGLang's native API in front of a DPController.

Every error is ``{"error": {"message": ...}}`` with a 4xx (bad request, auth) or 503 (engine
down) status, and the server keeps serving. Admin and weight-update routes are in http_admin.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .api_models import GenerateRequest, RequestLimits
from .dp_controller import DPController, EngineFailure, EngineUnavailable
from .messages import GenerateReq, SamplingParams
from .metrics import ServerMetrics
from .output import OutputAssembler

logger = logging.getLogger(__name__)

# Only a loopback caller (or one holding the API key) may change weights or drop state.
ADMIN_PATHS = frozenset({
    "/update_weights_from_tensor", "/update_weights_from_disk", "/init_weights_update_group",
    "/update_weights_from_distributed", "/flush_cache", "/abort_request"})


@dataclass
class ServerState:
    """Everything the routes read; built by the launcher once every rank is ready."""
    server_args: Any                      # ServerArgs
    controller: DPController
    tokenizer: Any                        # encode(str) -> ids, decode(ids) -> str
    limits: RequestLimits
    model_path: str
    model_config: Any                     # DSV41Config
    ready_info: dict[int, dict] = field(default_factory=dict)  # rank -> ReadyMsg.info
    weight_version: str = "default"
    metrics: ServerMetrics | None = None  # set by create_app


def error_response(status: int, message: str, err_type: str = "BadRequest") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": err_type, "code": status}},
                        status_code=status)


def _is_loopback(host: str | None) -> bool:
    if host in ("localhost", "testclient"):  # testclient: starlette's in-process test transport
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


async def read_json_model(request: Request, model: type) -> Any:
    """Parse the body into ``model``; raises ValueError with a readable message."""
    raw = await request.body()
    try:
        data = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"malformed JSON body: {e}") from e
    try:
        return model.model_validate(data)
    except ValidationError as e:
        parts = [f"{'.'.join(str(x) for x in err['loc']) or 'body'}: {err['msg']}"
                 for err in e.errors()]
        raise ValueError("invalid request: " + "; ".join(parts)) from e


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="sglang-dsv41 embedded engine")
    app.state.server = state
    state.metrics = ServerMetrics(state.controller)
    api_key = state.server_args.api_key

    @app.middleware("http")
    async def guard(request: Request, call_next):
        path = request.url.path
        if api_key is not None:
            auth = request.headers.get("authorization", "")
            if not hmac.compare_digest(auth.encode(), f"Bearer {api_key}".encode()):
                state.metrics.requests.labels(path, "401").inc()
                return error_response(401, "missing or wrong API key (Authorization: Bearer KEY)",
                                      "Unauthorized")
        elif path in ADMIN_PATHS and not _is_loopback(request.client and request.client.host):
            state.metrics.requests.labels(path, "403").inc()
            return error_response(403, f"{path} is only open to loopback callers unless the "
                                  "server runs with --api-key", "Forbidden")
        response = await call_next(request)
        route = request.scope.get("route")
        state.metrics.requests.labels(getattr(route, "path", "unknown"),
                                      str(response.status_code)).inc()
        return response

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), "HTTPError")

    @app.post("/generate")
    async def generate(request: Request):
        try:
            body = await read_json_model(request, GenerateRequest)
            if body.return_routed_experts and not state.server_args.enable_return_routed_experts:
                raise ValueError("return_routed_experts needs the server flag "
                                 "--enable-return-routed-experts")
            text_ids = state.tokenizer.encode(body.text) if body.text is not None else None
            req = state.limits.to_generate_req(
                body, text_ids, request.headers.get("x-data-parallel-rank"))
        except ValueError as e:
            return error_response(400, str(e))
        try:
            dp_rank, chunks = state.controller.submit(req, asyncio.get_running_loop())
        except EngineUnavailable as e:
            return error_response(503, f"engine unavailable: {e}", "ServiceUnavailable")
        except ValueError as e:
            return error_response(400, str(e))
        out = OutputAssembler(req, dp_rank, state.tokenizer, state.weight_version,
                              state.model_config)
        if req.stream:
            return StreamingResponse(_stream(state, req, chunks, out),
                                     media_type="text/event-stream")
        try:
            while not out.finished:
                item = await chunks.get()
                if isinstance(item, EngineFailure):
                    return error_response(503, f"engine failed: {item.reason}",
                                          "ServiceUnavailable")
                if item.error:
                    return error_response(400, f"request refused by the scheduler: {item.error}")
                if out.add(item):  # a stop string matched: the scheduler need not go on
                    state.controller.release(req.rid)
        except asyncio.CancelledError:
            state.controller.release(req.rid)
            raise
        state.metrics.generated_tokens.labels(str(dp_rank)).inc(len(out.output_ids))
        return JSONResponse(out.response())

    @app.get("/health")
    async def health():
        if not state.controller.healthy:
            return error_response(503, state.controller.failure_reason(), "Unhealthy")
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        ok, reason = await run_health_check(state)
        if not ok:
            return error_response(503, reason, "Unhealthy")
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info():
        cfg = state.model_config
        return {"model_path": state.model_path, "tokenizer_path": state.model_path,
                "weight_version": state.weight_version, "is_generation": True,
                "vocab_size": cfg.vocab_size, "num_hidden_layers": cfg.num_hidden_layers,
                "num_experts_per_tok": cfg.num_experts_per_tok,
                "context_length": state.limits.context_length}

    @app.get("/get_server_info")
    async def get_server_info():
        a = state.server_args
        infos = list(state.ready_info.values())
        return {
            "backend": "embedded", "model_path": state.model_path, "tp_size": a.tp_size,
            "dp_size": a.dp_size, "attn_tp_size": a.attn_tp_size,
            "enable_dp_attention": a.enable_dp_attention, "page_size": a.page_size,
            "max_total_tokens": infos[0].get("max_total_tokens") if infos else a.max_total_tokens,
            "context_length": state.limits.context_length,
            "max_new_tokens_limit": a.max_new_tokens_limit,
            "load_balance_method": a.load_balance_method, "load_format": a.load_format,
            "enable_prefill_padding": a.enable_prefill_padding,
            "enable_idle_batch": a.enable_idle_batch, "stall_timeout": a.stall_timeout,
            "engram_layout": a.resolved_engram_layout,
            "enable_return_routed_experts": a.enable_return_routed_experts,
            "weight_version": state.weight_version, "healthy": state.controller.healthy,
            "ready_info": {str(r): i for r, i in sorted(state.ready_info.items())},
            "rank_stats": {str(d): vars(s) for d, s in sorted(state.controller.stats.items())},
            "in_flight": state.controller.num_in_flight(),
        }

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": state.weight_version}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    from .http_admin import add_admin_routes  # after the app exists: it registers routes on it

    add_admin_routes(app, state)
    return app


async def run_health_check(state: ServerState) -> tuple[bool, str]:
    """As SGLang: one 1-token request with input_ids [0] and no DP rank, under a timeout."""
    c = state.controller
    if not c.healthy:
        return False, c.failure_reason()
    timeout = state.server_args.health_check_timeout
    req = GenerateReq(rid=f"HEALTH_CHECK_{time.time()}", input_ids=[0],
                      sampling=SamplingParams(max_new_tokens=1))
    try:
        dp_rank, chunks = c.submit(req, asyncio.get_running_loop())
    except EngineUnavailable as e:
        return False, str(e)
    deadline = time.monotonic() + timeout
    try:
        while True:
            item = await asyncio.wait_for(chunks.get(), max(0.0, deadline - time.monotonic()))
            if isinstance(item, EngineFailure):
                return False, item.reason
            if item.error:
                return False, f"health check refused on dp_rank {dp_rank}: {item.error}"
            if item.finished:
                return True, ""
    except asyncio.TimeoutError:
        c.release(req.rid)
        # A rank that just died may be noticed by the monitor a moment later: say so if it was.
        await asyncio.sleep(0.5)
        extra = f" ({c.failure_reason()})" if not c.healthy else ""
        return False, f"health check got no answer from dp_rank {dp_rank} in {timeout}s{extra}"


async def _stream(state: ServerState, req: GenerateReq, chunks: asyncio.Queue,
                  out: OutputAssembler):
    """SSE: one event per chunk with the cumulative text and ids, then ``data: [DONE]``."""
    finished = False
    try:
        while not out.finished:
            item = await chunks.get()
            if isinstance(item, EngineFailure):
                finished = True
                yield _sse({"error": {"message": f"engine failed: {item.reason}", "code": 503}})
                break
            if item.error:
                finished = True
                yield _sse({"error": {"message": f"request refused: {item.error}", "code": 400}})
                break
            if out.add(item):
                state.controller.release(req.rid)
            finished = out.finished
            yield _sse(out.response())
        yield b"data: [DONE]\n\n"
    finally:
        if not finished:  # the client went away mid-stream
            state.controller.release(req.rid)


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"
