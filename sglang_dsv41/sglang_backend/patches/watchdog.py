"""Stall watchdog: every blocking step of a scheduler rank runs under the rank's StallWatchdog
(sglang_dsv41.scheduler.watchdog); a report lands in the run directory, and /health and
/health_generate answer 503 with the report's message (rank, step, collective) instead of
waiting out SGLang's health-check timeout on a silent hang."""

from __future__ import annotations

from typing import Any, Callable

from ..env import ENV
from ..registry import Patch, Target
from ..state import STATE, read_stall_reports
from . import VERSIONS

SCHEDULER = "sglang.srt.managers.scheduler"
DP_ATTN_MIXIN = "sglang.srt.managers.scheduler_dp_attn_mixin"
HTTP_SERVER = "sglang.srt.entrypoints.http_server"
HEALTH_PATHS = ("/health", "/health_generate")


def make_guarded_run_batch(orig: Callable) -> Callable:
    def run_batch(self, batch, pp_proxy_tensors=None):
        with STATE.guard("run_batch"):
            return orig(self, batch, pp_proxy_tensors)

    return run_batch


def make_guarded_mlp_sync(orig: Callable) -> Callable:
    def prepare_mlp_sync_batch(self, local_batch):
        # every rank runs one MLP sync per scheduler step, idle or not: it opens the step
        with STATE.guard("mlp_sync", new_step=True):
            return orig(self, local_batch)

    return prepare_mlp_sync_batch


def stall_response(run_dir: str):
    """(status, body) for a health check when a rank reported a stall, else None."""
    reports = read_stall_reports(run_dir) if run_dir else []
    if not reports:
        return None
    message = "; ".join(r.get("message", f"rank {r.get('rank')} stalled") for r in reports)
    return 503, {"error": {"message": f"unhealthy: {message}"}}


def install_health_middleware(owner: Any, attr: str, original: Callable,
                              run_dir: str | None = None) -> None:
    """Middleware on the module's FastAPI ``app`` (the route keeps SGLang's handler)."""
    from fastapi.responses import JSONResponse

    app = owner.app
    if getattr(app.state, "dsv41_health_middleware", False):
        return
    directory = run_dir if run_dir is not None else ENV.RUN_DIR.get()

    async def stall_aware_health(request, call_next):
        if request.url.path in HEALTH_PATHS:
            verdict = stall_response(directory)
            if verdict is not None:
                status, body = verdict
                return JSONResponse(body, status_code=status)
        return await call_next(request)

    app.middleware("http")(stall_aware_health)
    app.state.dsv41_health_middleware = True


PATCHES = [
    Patch("stall_watchdog.run_batch", "stall_watchdog",
          Target(SCHEDULER, "Scheduler.run_batch", ("self", "batch", "pp_proxy_tensors")),
          "scheduler", VERSIONS,
          "runs each forward under the rank's stall watchdog",
          make=make_guarded_run_batch),
    Patch("stall_watchdog.mlp_sync", "stall_watchdog",
          Target(DP_ATTN_MIXIN, "SchedulerDPAttnMixin.prepare_mlp_sync_batch",
                 ("self", "local_batch")),
          "scheduler", VERSIONS,
          "runs the MLP-sync all-gather (where a rank that skipped a batch hangs the others) "
          "under the watchdog",
          make=make_guarded_mlp_sync),
    Patch("stall_watchdog.health", "stall_watchdog",
          Target(HTTP_SERVER, "health_generate", ("request",)),
          "main", VERSIONS,
          "/health and /health_generate answer 503 naming the stalled rank, step and collective",
          install=install_health_middleware),
]
