"""Health, info and metrics routes of the embedded server (an APIRouter): /health fails while
the engine is down, the server drains, or a blocking setup (a weight-sync group) holds the ranks;
``/health?dp_rank=N`` also while that DP rank is down (``rank_health`` in /server_info has every
rank's); /health_generate runs one real request, as SGLang's does."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from fastapi import APIRouter
from fastapi.responses import Response

from .dp_controller import EngineFailure, EngineUnavailable
from .http_admin import error_response
from .messages import GenerateReq, SamplingParams

if TYPE_CHECKING:
    from .http_server import ServerState


def info_router(state: "ServerState") -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health(dp_rank: int | None = None):
        if dp_rank is not None and not 0 <= dp_rank < state.controller.dp_size:
            return error_response(400, f"dp_rank {dp_rank} out of range "
                                  f"[0, {state.controller.dp_size})")
        reason = health_failure(state, dp_rank)
        if reason:
            return error_response(503, reason, "Unhealthy")
        return Response(status_code=200)

    @router.get("/health_generate")
    async def health_generate():
        ok, reason = await run_health_check(state)
        if not ok:
            return error_response(503, reason, "Unhealthy")
        return Response(status_code=200)

    @router.get("/model_info")
    @router.get("/get_model_info")
    async def model_info():
        cfg = state.model_config
        return {"model_path": state.model_path, "tokenizer_path": state.model_path,
                "weight_version": state.weight_version, "is_generation": True,
                "vocab_size": cfg.vocab_size, "num_hidden_layers": cfg.num_hidden_layers,
                "num_experts_per_tok": cfg.num_experts_per_tok,
                "context_length": state.limits.context_length}

    @router.get("/server_info")
    @router.get("/get_server_info")
    async def server_info():
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
            "rank_health": {str(d): {"healthy": not reason, "reason": reason or None}
                            for d, reason in state.controller.rank_health().items()},
            "ready_info": {str(r): i for r, i in sorted(state.ready_info.items())},
            "rank_stats": {str(d): vars(s) for d, s in sorted(state.controller.stats.items())},
            "in_flight": state.controller.num_in_flight(),
            "paused": not state.running.is_set(),
        }

    @router.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": state.weight_version}

    @router.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    return router


def health_failure(state: "ServerState", dp_rank: int | None = None) -> str:
    """Why /health (of one DP rank, when given) fails, or "" when it passes."""
    reason = state.controller.failure_reason(dp_rank)
    if reason:
        return reason
    if state.draining:
        return "the server is shutting down"
    now = time.monotonic()
    return "; ".join(f"{op} pending for {now - t0:.1f}s (the ranks are blocked in it)"
                     for op, t0 in state.pending_setup.items())


async def run_health_check(state: "ServerState") -> tuple[bool, str]:
    """As SGLang: one 1-token request with input_ids [0] and no DP rank, under a timeout."""
    c = state.controller
    reason = health_failure(state)
    if reason:
        return False, reason
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
