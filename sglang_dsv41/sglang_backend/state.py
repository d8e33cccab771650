"""Per-process state the patches share: this rank's identity, its stall watchdog, the last MLP
sync, and the stall reports that scheduler ranks drop for the HTTP process to read."""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from ..scheduler.watchdog import StallReport, StallWatchdog
from .env import ENV

logger = logging.getLogger(__name__)


@dataclass
class RankInfo:
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int | None = None


class ProcessState:
    def __init__(self) -> None:
        self.rank = RankInfo()
        self.watchdog: StallWatchdog | None = None
        self.step = 0                      # MLP syncs of this rank (the watchdog's step count)
        self.last_sync: Any = None         # the MLPSyncBatchInfo of the current sync
        self.run_dir = ""

    def start_watchdog(self, tp_rank: int, timeout_s: float, run_dir: str) -> None:
        def on_stall(report: StallReport) -> None:
            logger.error("sglang-dsv41 stall: %s", report.message())
            if run_dir:
                write_stall_report(run_dir, report)

        self.close()
        self.run_dir = run_dir
        self.watchdog = StallWatchdog(tp_rank, timeout_s, on_stall)

    @contextlib.contextmanager
    def guard(self, op: str, new_step: bool = False):
        """Run a blocking step under the watchdog; ``new_step`` counts a scheduler step (the
        MLP sync opens each one), so reports name the step a rank is stuck in."""
        watchdog = self.watchdog
        if watchdog is None:
            yield
            return
        if new_step:
            self.step += 1
        step = self.step
        try:
            with watchdog.guard(op, step):
                yield
        finally:
            report = watchdog.last_report
            if report is not None and (report.op, report.step) == (op, step):
                # It finished after all (a slow first forward, a JIT compile): not a deadlock,
                # so the rank is healthy again. A real deadlock never gets here.
                logger.warning("sglang-dsv41: rank %d finished '%s' at step %d after the stall "
                               "report", report.rank, op, report.step)
                watchdog.last_report = None
                if self.run_dir:
                    clear_stall_report(self.run_dir, report.rank)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
            self.watchdog = None


STATE = ProcessState()


def init_scheduler_process(tp_rank: int, tp_size: int, dp_rank: int | None) -> None:
    STATE.rank = RankInfo(tp_rank, tp_size, dp_rank)
    STATE.start_watchdog(tp_rank, ENV.STALL_TIMEOUT.get(), ENV.RUN_DIR.get())


# ---- stall reports on disk (scheduler ranks -> HTTP process, same node) ---------------------
def stall_report_path(run_dir: str, rank: int | str) -> str:
    """The report file of ``rank`` ("*": the glob pattern of every rank's file)."""
    return os.path.join(run_dir, f"stall-rank{rank}.json")


def stall_report_files(run_dir: str) -> list[str]:
    return sorted(glob.glob(stall_report_path(run_dir, "*")))


def write_stall_report(run_dir: str, report: StallReport) -> str:
    os.makedirs(run_dir, exist_ok=True)
    path = stall_report_path(run_dir, report.rank)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"rank": report.rank, "step": report.step, "op": report.op,
                   "waited_s": report.waited_s, "message": report.message()}, f)
    os.replace(tmp, path)  # readers never see a half-written report
    return path


def clear_stall_report(run_dir: str, rank: int) -> None:
    try:
        os.remove(stall_report_path(run_dir, rank))
    except FileNotFoundError:
        pass


def read_stall_reports(run_dir: str) -> list[dict]:
    out = []
    for path in stall_report_files(run_dir):
        try:
            with open(path) as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            continue  # removed or replaced while we read it: the next check sees it
    return sorted(out, key=lambda r: r.get("rank", 0))
