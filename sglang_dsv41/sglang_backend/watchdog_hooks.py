"""Stall watchdog: a scheduler rank's batch run and MLP sync run under its StallWatchdog
(sglang_dsv41.policies.watchdog); a stall report lands in the run directory, and ``/health``
and ``/health_generate`` answer 503 naming the rank, step and collective.

SGLang 0.5.23 has no way to name a wedged rank: a DP rank stuck in the MLP-sync all-gather
(managers/scheduler_components/dp_attn.py) leaves every health check waiting
SGLANG_HEALTH_CHECK_TIMEOUT and then answering a bare 503.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import threading
from collections import Counter

from ..policies.watchdog import StallReport, StallWatchdog
from .env import ENV

logger = logging.getLogger(__name__)
HEALTH_PATHS = ("/health", "/health_generate")


# ---- stall reports on disk (scheduler ranks -> HTTP process of the same node) ---------------
def stall_report_path(run_dir: str, rank: int | str, replica: int | None = None) -> str:
    """A rank's report file. ``replica``: SGLang's DP replica (--dp-size without DP attention),
    each of which numbers its ranks from 0 in a world of its own."""
    where = "" if replica is None else f"dp{replica}-"
    return os.path.join(run_dir, f"stall-{where}rank{rank}.json")


def write_stall_report(run_dir: str, report: StallReport, replica: int | None = None) -> str:
    os.makedirs(run_dir, exist_ok=True)
    path = stall_report_path(run_dir, report.rank, replica)
    tmp = f"{path}.{os.getpid()}.tmp"
    message = report.message() if replica is None else f"DP replica {replica}: {report.message()}"
    with open(tmp, "w") as f:
        json.dump({"rank": report.rank, "replica": replica, "step": report.step, "op": report.op,
                   "waited_s": report.waited_s, "message": message}, f)
    os.replace(tmp, path)  # a reader never sees half a report
    return path


def clear_stall_report(run_dir: str, rank: int, replica: int | None = None) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(stall_report_path(run_dir, rank, replica))


def clear_all_stall_reports(run_dir: str) -> None:
    for path in glob.glob(os.path.join(run_dir, "stall-*.json")):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def read_stall_reports(run_dir: str) -> list[dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(run_dir, "stall-*.json"))):
        try:
            with open(path) as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            continue  # replaced or removed while read: the next check sees it
    return sorted(out, key=lambda r: (r.get("replica") or 0, r.get("rank", 0)))


def _replica() -> int | None:
    """This scheduler's DP replica in SGLang's published context; None without a DP
    controller, or outside a scheduler."""
    try:
        from sglang.srt.runtime_context import get_parallel

        replica = get_parallel().dp_rank
    except (ImportError, AttributeError, RuntimeError, ValueError):
        return None
    return replica if isinstance(replica, int) else None


# ---- the rank's watchdog ---------------------------------------------------------------------
class RankGuard:
    """This process's watchdog, started on its first guarded call (only scheduler processes
    make one), named by its global rank (and DP replica). A report is written and withdrawn
    under one lock, and only for a guard still open: an operation that finishes while its
    report is being made leaves none behind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.watchdog: StallWatchdog | None = None
        self.steps: Counter[str] = Counter()
        self.run_dir = ""
        self.replica: int | None = None
        self._open: set[tuple[str, int]] = set()   # guards entered and not yet left

    def _start(self) -> StallWatchdog:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        self.run_dir, self.replica = ENV.RUN_DIR.get(), _replica()

        def on_stall(report: StallReport) -> None:
            with self._lock:
                if (report.op, report.step) not in self._open:
                    return  # it finished between the watchdog's check and this report
                logger.error("sglang-dsv41 stall: %s", report.message())
                if self.run_dir:
                    write_stall_report(self.run_dir, report, self.replica)

        return StallWatchdog(rank, ENV.STALL_TIMEOUT.get(), on_stall)

    @contextlib.contextmanager
    def guard(self, op: str):
        with self._lock:
            if self.watchdog is None:
                self.watchdog = self._start()
            self.steps[op] += 1
            watchdog, step = self.watchdog, self.steps[op]
            self._open.add((op, step))
        try:
            with watchdog.guard(op, step):
                yield
        finally:
            with self._lock:
                self._open.discard((op, step))
                report = watchdog.last_report
                if report is not None and (report.op, report.step) == (op, step):
                    # it finished after all (a slow first forward, a JIT compile): healthy again
                    logger.warning("sglang-dsv41: rank %d finished '%s' step %d after its stall "
                                   "report", report.rank, op, step)
                    watchdog.last_report = None
                    if self.run_dir:
                        clear_stall_report(self.run_dir, report.rank, self.replica)


GUARD = RankGuard()


def around_run_batch(original, self, *args, **kwargs):
    with GUARD.guard("run_batch"):
        return original(self, *args, **kwargs)


def around_mlp_sync_all_gather(original, self, *args, **kwargs):
    with GUARD.guard("mlp_sync"):
        return original(self, *args, **kwargs)


# ---- the HTTP side -----------------------------------------------------------------------------
def stall_response(run_dir: str) -> tuple[int, dict] | None:
    reports = read_stall_reports(run_dir) if run_dir else []
    if not reports:
        return None
    message = "; ".join(r.get("message", f"rank {r.get('rank')} stalled") for r in reports)
    # a rank number alone is ambiguous with DP replicas (each numbers its ranks from 0)
    return 503, {"error": {"message": f"unhealthy: {message}",
                           "stalled_ranks": [{"rank": r.get("rank"),
                                              "dp_replica": r.get("replica")}
                                             for r in reports]}}


def _route_path(scope) -> str:
    """The path the app's routes see: under SGLang's --fastapi-root-path uvicorn puts the root
    path in front of scope["path"] (Starlette's router strips it again)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] or "/" if root and path.startswith(root) else path


class StallAwareHealth:
    """Pure ASGI middleware on SGLang's FastAPI app (SGLang replaces ``@app.middleware("http")``
    with a dispatcher that ignores returned responses, utils/http_middleware_patch.py): a health
    check answers 503 naming the stalled ranks; everything else goes to SGLang's routes."""

    def __init__(self, app, run_dir: str | None = None):
        self.app, self.run_dir = app, run_dir

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and _route_path(scope) in HEALTH_PATHS:
            verdict = stall_response(self.run_dir if self.run_dir is not None
                                     else ENV.RUN_DIR.get())
            if verdict is not None:
                from starlette.responses import JSONResponse

                await JSONResponse(verdict[1], status_code=verdict[0])(scope, receive, send)
                return
        await self.app(scope, receive, send)


def install_health_middleware(app, run_dir: str | None = None) -> bool:
    """False when the app is already serving (Starlette refuses new middleware then)."""
    if getattr(app.state, "dsv41_health_middleware", False):
        return True
    try:
        app.add_middleware(StallAwareHealth, run_dir=run_dir)
    except RuntimeError as e:  # "Cannot add middleware after an application has started"
        logger.error("sglang-dsv41: stall-aware health checks not installed: %s", e)
        return False
    app.state.dsv41_health_middleware = True
    return True


def after_set_global_state(result, *args, **kwargs):
    """http_server.set_global_state runs once in the HTTP process before uvicorn starts."""
    from sglang.srt.entrypoints import http_server

    install_health_middleware(http_server.app)
