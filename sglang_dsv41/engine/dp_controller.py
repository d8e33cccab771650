"""DP controller: the main-process side of the scheduler queues.

It routes each GenerateReq to the request queue of one DP group's leader (the pinned
``routed_dp_rank`` or, unpinned, round robin / shortest queue), broadcasts control calls to every
leader, and runs a reader thread that drains the shared out_queue: GenerateOut chunks go to the
per-request asyncio queue of the waiting HTTP handler, ControlOut replies complete their call
once every rank has answered, RankStats are kept per DP rank.

Health is kept per DP rank. ``fail_engine`` fails every rank: the embedded engine's failures
(a dead scheduler process, a stall report) are all of this kind, because DP groups exist only
with DP attention and the MoE collectives span every rank of every group, so one rank's death
or stall blocks them all; the message names the rank that caused it. ``fail_rank`` fails one DP
group only: its requests fail, requests pinned to it are refused, unpinned ones go to the live
ranks, and the engine stays healthy while one rank serves. Nothing in the embedded engine calls
it: it keeps the per-rank half of the contract the sticky router and the gateway read, for a
deployment whose DP groups fail independently. ``rank_health()`` is what /server_info and
/health?dp_rank=N report, and what the agent gateway moves sessions by.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .messages import (AbortReq, ControlOut, ControlReq, GenerateOut, GenerateReq, RankStats,
                       ShutdownReq)

logger = logging.getLogger(__name__)
# A stall report's wait before /health names the DP ranks that sent none (see _not_stalled_text)
STALL_HINT_GRACE_S = 2.0


def rank_failure_text(dp_rank: int, reason: str) -> str:
    """How every failure message names the DP rank it concerns."""
    return f"dp_rank {dp_rank}: {reason}"


class EngineUnavailable(RuntimeError):
    """The engine cannot serve: a scheduler process died or a collective stalled."""


class ControlError(RuntimeError):
    """A control call failed on at least one rank; the message names them."""


@dataclass
class EngineFailure:
    """Sent to a waiting request instead of a GenerateOut when the engine, not the request,
    failed (or the server's shutdown cut it); the client reads ``f"{what}: {reason}"``."""
    reason: str
    what: str = "engine failed"


@dataclass
class _Pending:
    loop: asyncio.AbstractEventLoop
    chunks: asyncio.Queue
    dp_rank: int


@dataclass
class _ControlCall:
    future: concurrent.futures.Future
    waiting_for: set[int]
    replies: list[ControlOut] = field(default_factory=list)


class DPController:
    """``req_queues[d]`` feeds the leader of DP group d; ``out_queue`` is shared by every rank;
    ``control_ranks`` are the ranks expected to answer each ControlReq."""

    def __init__(self, req_queues: list[Any], out_queue: Any, control_ranks: list[int],
                 load_balance_method: str = "round_robin"):
        if not req_queues:
            raise ValueError("need at least one DP request queue")
        self.req_queues, self.out_queue = req_queues, out_queue
        self.dp_size = len(req_queues)
        self.control_ranks = list(control_ranks)
        self.load_balance_method = load_balance_method
        self._round_robin = itertools.count()
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._controls: dict[str, _ControlCall] = {}
        self.stats: dict[int, RankStats] = {}
        self.failures: list[str] = []  # sticky: a dead rank or a stall breaks the whole world
        self.rank_failures: dict[int, str] = {}   # dp_rank -> why that DP group cannot serve
        self.stalled_dp_ranks: set[int] = set()   # DP ranks with a rank waiting in a collective
        self._first_stall_at: float | None = None  # time.monotonic() of the first stall report
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read_loop, name="dp-controller-reader",
                                        daemon=True)
        self._reader.start()

    # ---- health ------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        """The engine can serve: no engine-wide failure and at least one live DP rank."""
        return not self.failures and len(self.rank_failures) < self.dp_size

    def failure_reason(self, dp_rank: int | None = None) -> str:
        """Why the engine (or, with ``dp_rank``, that rank) cannot serve; "" when it can."""
        if self.failures:
            return "; ".join(self.failures) + self._not_stalled_text()
        if dp_rank is not None:
            return self.rank_failures.get(dp_rank, "")
        if len(self.rank_failures) < self.dp_size:
            return ""
        return self._rank_failures_text()

    def _not_stalled_text(self) -> str:
        # The stall reports come from the ranks waiting in a collective; a DP rank that sent
        # none is not waiting in one: it has not reached the collective the others wait in,
        # so it is the one to look at (py-spy dump of its scheduler process).
        # Ranks waiting in one collective report within a watchdog poll of each other (their
        # entries differ by the step's skew): name the quiet ones only after a grace period.
        if self._first_stall_at is None or \
                time.monotonic() - self._first_stall_at < STALL_HINT_GRACE_S:
            return ""
        quiet = sorted(set(range(self.dp_size)) - self.stalled_dp_ranks)
        if not quiet:
            return ""
        return (f"; DP rank{'s' if len(quiet) > 1 else ''} {','.join(map(str, quiet))} "
                f"reported no stall: not waiting in a collective, so the likely cause (it "
                f"skipped an idle batch, or is busy or hung outside collectives)")

    def _rank_failures_text(self) -> str:
        return "; ".join(rank_failure_text(d, r) for d, r in sorted(self.rank_failures.items()))

    def rank_health(self) -> dict[int, str]:
        """dp_rank -> "" (serving) or the reason it cannot."""
        return {d: self.failure_reason(d) for d in range(self.dp_size)}

    def fail_engine(self, reason: str, dp_rank: int | None = None) -> str:
        """The whole engine failed, caused by ``dp_rank`` when known (the launcher's process
        monitor, a stall report): every waiting request and control call fails. Returns the
        message, which names the rank."""
        if dp_rank is not None:
            reason = rank_failure_text(dp_rank, reason)
        self._fail(reason, None)
        return reason

    def fail_rank(self, dp_rank: int, reason: str) -> None:
        """One DP group failed: its waiting requests fail, and control calls (which need every
        rank)."""
        self._fail(reason, dp_rank)

    def _fail(self, reason: str, dp_rank: int | None) -> None:
        with self._lock:
            if reason in self.failures or self.rank_failures.get(dp_rank) == reason:
                return
            if dp_rank is None:
                self.failures.append(reason)
                pending, self._pending = self._pending, {}
            else:
                self.rank_failures[dp_rank] = reason
                pending = {rid: p for rid, p in self._pending.items() if p.dp_rank == dp_rank}
                for rid in pending:
                    del self._pending[rid]
            controls, self._controls = self._controls, {}
        message = reason if dp_rank is None else rank_failure_text(dp_rank, reason)
        logger.error("%s unhealthy: %s", "engine" if dp_rank is None else "DP group", message)
        for p in pending.values():
            p.loop.call_soon_threadsafe(p.chunks.put_nowait, EngineFailure(message))
        for call in controls.values():
            if not call.future.done():
                call.future.set_exception(EngineUnavailable(message))

    # ---- generate ----------------------------------------------------------------------------
    def _in_flight(self) -> list[int]:
        """Requests awaiting their final chunk, per DP rank; the caller holds self._lock."""
        counts = [0] * self.dp_size
        for p in self._pending.values():
            counts[p.dp_rank] += 1
        return counts

    def _pick_dp_rank(self) -> int:
        """A live DP rank for an unpinned request; the caller holds self._lock."""
        live = [d for d in range(self.dp_size) if d not in self.rank_failures]
        if len(live) == 1:
            return live[0]
        if self.load_balance_method == "shortest_queue":
            load = self._in_flight()
            return min(live, key=lambda d: (load[d], d))
        while True:
            d = next(self._round_robin) % self.dp_size
            if d in live:
                return d

    def submit(self, req: GenerateReq, loop: asyncio.AbstractEventLoop
               ) -> tuple[int, asyncio.Queue]:
        """Dispatch ``req``; returns the serving DP rank and the queue its chunks arrive on."""
        if req.routed_dp_rank is not None and not 0 <= req.routed_dp_rank < self.dp_size:
            raise ValueError(f"routed_dp_rank={req.routed_dp_rank} out of range "
                             f"[0, {self.dp_size})")
        with self._lock:
            if not self.healthy:
                raise EngineUnavailable(self.failure_reason())
            if req.routed_dp_rank in self.rank_failures:
                raise EngineUnavailable(rank_failure_text(
                    req.routed_dp_rank, self.rank_failures[req.routed_dp_rank]))
            if req.rid in self._pending:
                raise ValueError(f"request id {req.rid!r} is already running")
            dp_rank = req.routed_dp_rank if req.routed_dp_rank is not None else self._pick_dp_rank()
            req.routed_dp_rank = dp_rank
            chunks: asyncio.Queue = asyncio.Queue()
            self._pending[req.rid] = _Pending(loop, chunks, dp_rank)
        self.req_queues[dp_rank].put(req)
        return dp_rank, chunks

    def release(self, rid: str) -> None:
        """Forget a request whose caller went away (the scheduler is told to abort it)."""
        with self._lock:
            p = self._pending.pop(rid, None)
        if p is not None:
            self.req_queues[p.dp_rank].put(AbortReq(rid))

    def abort(self, rid: str) -> bool:
        """Abort a running request on its owning leader; False if the id is unknown. The
        waiting caller still receives the scheduler's final (finish_reason abort) chunk."""
        with self._lock:
            p = self._pending.get(rid)
        if p is None:
            return False
        self.req_queues[p.dp_rank].put(AbortReq(rid))
        return True

    def abort_all(self) -> int:
        """Abort every running request (before a weight update); returns how many."""
        with self._lock:
            owners = [(rid, p.dp_rank) for rid, p in self._pending.items()]
        for rid, dp_rank in owners:
            self.req_queues[dp_rank].put(AbortReq(rid))
        return len(owners)

    def cut_all(self, reason: str) -> int:
        """End every waiting request now with a 503 naming ``reason`` and abort it on its
        scheduler (a shutdown whose grace runs out); returns how many."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for rid, p in pending.items():
            self.req_queues[p.dp_rank].put(AbortReq(rid))
            p.loop.call_soon_threadsafe(p.chunks.put_nowait,
                                        EngineFailure(reason, what="server shutting down"))
        return len(pending)

    def num_in_flight(self) -> list[int]:
        with self._lock:
            return self._in_flight()

    # ---- control calls -----------------------------------------------------------------------
    def control(self, op: str, args: dict[str, Any] | None = None) -> concurrent.futures.Future:
        """Broadcast ControlReq(op) to every leader; the future resolves to the replies sorted by
        rank once every control rank has answered, or raises ControlError naming the ranks that
        refused (the ops are all-or-nothing on the scheduler side)."""
        req_id = uuid.uuid4().hex
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.failures or self.rank_failures:  # a control op runs on every rank
                raise EngineUnavailable(self.failure_reason() or self._rank_failures_text())
            self._controls[req_id] = _ControlCall(fut, set(self.control_ranks))
        for q in self.req_queues:
            q.put(ControlReq(req_id, op, dict(args or {})))
        return fut

    async def control_async(self, op: str, args: dict[str, Any] | None = None,
                            timeout: float | None = None) -> list[ControlOut]:
        fut = self.control(op, args)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
        except asyncio.TimeoutError:
            raise ControlError(f"control op {op!r} got no reply from every rank in {timeout}s")

    def _on_control(self, out: ControlOut) -> None:
        with self._lock:
            call = self._controls.get(out.req_id)
            if call is None:
                return
            call.replies.append(out)
            call.waiting_for.discard(out.rank)
            if call.waiting_for:
                return
            del self._controls[out.req_id]
        replies = sorted(call.replies, key=lambda r: r.rank)
        failed = [r for r in replies if not r.ok]
        if failed:
            by_error: dict[str, list[int]] = {}
            for r in failed:  # ranks that merely followed another's veto share one message
                by_error.setdefault(str(r.error), []).append(r.rank)
            call.future.set_exception(ControlError("; ".join(
                f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}: {err}"
                for err, ranks in by_error.items())))
        else:
            call.future.set_result(replies)

    # ---- reader ------------------------------------------------------------------------------
    def _on_generate(self, out: GenerateOut) -> None:
        with self._lock:
            p = self._pending.get(out.rid)
            if p is not None and out.finished:
                del self._pending[out.rid]
        if p is not None:
            p.loop.call_soon_threadsafe(p.chunks.put_nowait, out)

    def _on_stats(self, stats: RankStats) -> None:
        if not stats.healthy:
            # a stalled collective holds every rank (see the module docstring)
            if stats.stall:
                self.stalled_dp_ranks.add(stats.dp_rank)
                if self._first_stall_at is None:
                    self._first_stall_at = time.monotonic()
            self.fail_engine(stats.stall or "reported unhealthy", stats.dp_rank)
            return
        self.stats[stats.dp_rank] = stats

    def _read_loop(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self.out_queue.get(timeout=0.1)
            except queue.Empty:
                continue
            except (EOFError, OSError):
                return
            try:
                if isinstance(msg, GenerateOut):
                    self._on_generate(msg)
                elif isinstance(msg, ControlOut):
                    self._on_control(msg)
                elif isinstance(msg, RankStats):
                    self._on_stats(msg)
                else:
                    logger.warning("dp controller: unexpected message %r", type(msg).__name__)
            except Exception:  # a bad message must not kill the reader of every other request
                logger.exception("dp controller: failed to handle %r", type(msg).__name__)

    def shutdown(self) -> None:
        """Ask every leader to stop, then stop the reader."""
        for q in self.req_queues:
            try:
                q.put(ShutdownReq())
            except (ValueError, OSError):
                pass
        self._stop.set()
        self._reader.join(timeout=2)
