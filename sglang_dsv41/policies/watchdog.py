"""StallWatchdog: turns a collective stuck past a timeout into a clear, named error."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class StallReport:
    rank: int
    step: int
    op: str
    waited_s: float

    def message(self) -> str:
        return (f"rank {self.rank} stuck in collective '{self.op}' at step {self.step} for "
                f"{self.waited_s:.1f}s, waiting for a rank that has not joined it")


class StallWatchdog:
    """Wrap each blocking collective in ``with watchdog.guard(op, step):``. A monitor thread
    reports (once per stall) through ``on_stall`` when a guard has been open longer than
    ``timeout_s``. ``timeout_s <= 0`` disables it."""

    def __init__(self, rank: int, timeout_s: float, on_stall: Callable[[StallReport], None],
                 poll_s: float | None = None):
        self.rank, self.timeout_s, self.on_stall = rank, timeout_s, on_stall
        self._lock = threading.Lock()
        self._open: tuple[str, int, float] | None = None
        self._reported = False
        self.last_report: StallReport | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if timeout_s > 0:
            self._poll = poll_s or min(0.5, timeout_s / 4)
            self._thread = threading.Thread(target=self._run, name=f"stall-watchdog-{rank}",
                                            daemon=True)
            self._thread.start()

    @contextmanager
    def guard(self, op: str, step: int):
        with self._lock:
            self._open, self._reported = (op, step, time.monotonic()), False
        try:
            yield
        finally:
            with self._lock:
                self._open = None

    def check(self, now: float | None = None) -> StallReport | None:
        with self._lock:
            if self._open is None or self._reported or self.timeout_s <= 0:
                return None
            op, step, t0 = self._open
            waited = (now if now is not None else time.monotonic()) - t0
            if waited < self.timeout_s:
                return None
            self._reported = True
        report = StallReport(self.rank, step, op, waited)
        self.last_report = report
        return report

    def _run(self) -> None:
        while not self._stop.wait(self._poll):
            report = self.check()
            if report is not None:
                self.on_stall(report)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
