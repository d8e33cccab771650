"""The scheduler rank process: one per TP rank, all in one torch.distributed world.

Every step, in lockstep on every rank:
1. the DP group's leader drains its request queue, updates its queues and builds the step's
   ForwardPlan (or an empty one) and fans it out, with new control calls, to its peers;
2. the MLP sync: an all-gather over the world of every rank's padded token count, pending
   control-call ids and shutdown flag;
3. the forward, if this rank has tokens or (idle batch) any rank has: every rank must join
   every MLP collective;
4. the leader samples and answers; control calls pending on every rank run; RankStats.
Every blocking collective runs under the StallWatchdog; a stall puts an unhealthy RankStats,
naming the rank and step, on the out queue.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..policies.dp_attention import should_run_forward
from ..policies.watchdog import StallReport, StallWatchdog
from ..server_args import ServerArgs
from .batch import idle_plan
from .control import run_control_op
from .dist import DistGroups, ParallelInfo, init_distributed
from .leader import LeaderScheduler
from .messages import AbortReq, ControlReq, GenerateReq, RankStats, ReadyMsg, ShutdownReq
from .model_runner import ModelRunner, node_namespace, resolve_device

logger = logging.getLogger("sglang_dsv41.engine")
IDLE_POLL_S = 0.05         # how long an idle leader waits for a request before the next sync
STATS_INTERVAL_S = 0.5
INTEGRITY_CHECK_EVERY = 64  # idle steps between prefix-cache integrity checks


@dataclass
class StepInput:
    """What a leader fans out to its attention-TP peers each step."""
    plan: Any
    control: list[ControlReq] = field(default_factory=list)
    shutdown: bool = False


class SchedulerRank:
    def __init__(self, args: ServerArgs, groups: DistGroups, runner: ModelRunner, req_queue,
                 out_queue, watchdog: StallWatchdog):
        self.args, self.groups, self.runner, self.info = args, groups, runner, groups.info
        self.req_queue, self.out_queue, self.watchdog = req_queue, out_queue, watchdog
        self.leader = LeaderScheduler(runner, out_queue) if self.info.is_leader else None
        runner.flush_cache_hook = self.leader.flush_cache if self.leader else (lambda: True)
        self.pending_control: list[ControlReq] = []
        self.shutdown_seen = False
        self.step = 0
        self.world_idle = True
        self._last_stats = 0.0
        self._idle_steps = 0

    # ---- leader intake ----------------------------------------------------------------------
    def _receive(self) -> list[Any]:
        msgs = []
        try:
            if self.world_idle and not self.leader.running and not self.leader.waiting:
                msgs.append(self.req_queue.get(timeout=IDLE_POLL_S))
            while True:
                msgs.append(self.req_queue.get_nowait())
        except queue.Empty:
            pass
        return msgs

    def _leader_step_input(self) -> StepInput:
        new_control = []
        for msg in self._receive():
            if isinstance(msg, GenerateReq):
                self.leader.add_request(msg)
            elif isinstance(msg, AbortReq):
                self.leader.abort(msg.rid)
            elif isinstance(msg, ControlReq):
                new_control.append(msg)
            elif isinstance(msg, ShutdownReq):
                self.shutdown_seen = True
            else:
                logger.warning("ignoring unknown message %r", type(msg).__name__)
        plan, reqs, chunks = self.leader.schedule()
        self._batch = (reqs, chunks)
        return StepInput(plan, new_control, self.shutdown_seen)

    # ---- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            self.groups.step = self.step
            step_in = self.groups.broadcast_in_group(
                self._leader_step_input() if self.leader else None)
            self.pending_control += step_in.control
            self.shutdown_seen = step_in.shutdown
            plan = step_in.plan or idle_plan()
            busy = plan.num_tokens > 0 or (self.leader is not None and bool(
                self.leader.running or self.leader.waiting))
            sync = self.groups.all_gather_ints(
                [plan.padded_tokens, len(self.pending_control), int(self.shutdown_seen), int(busy)])
            leaders = self.info.leaders()
            dp_tokens = [sync[r][0] for r in leaders]
            if should_run_forward(plan.padded_tokens, dp_tokens, self.args.enable_idle_batch):
                hidden, ctx = self.runner.forward(plan, dp_tokens)
                if self.leader is not None and step_in.plan is not None:
                    self.leader.process_results(plan, *self._batch, hidden, ctx)
            if any(s[1] for s in sync):
                self._run_agreed_control()
            self.world_idle = not any(s[3] for s in sync) and not self.pending_control
            self._publish_stats()
            self.step += 1
            if all(sync[r][2] for r in leaders):
                return

    def _run_agreed_control(self) -> None:
        """Runs the calls every DP group has received, in rank 0's order on every rank (their
        collectives must line up even if the groups received them in different orders)."""
        pending = self.groups.all_gather_objects([c.req_id for c in self.pending_control],
                                                 "control_sync")
        order = pending[0]
        agreed = set.intersection(*(set(pending[r]) for r in self.info.leaders()))
        mine = {c.req_id: c for c in self.pending_control}
        for req_id in [i for i in order if i in agreed]:
            req = mine[req_id]
            self.out_queue.put(run_control_op(self.runner, req))
            self.pending_control.remove(req)

    def _publish_stats(self) -> None:
        if self.leader is None:
            return
        if self.world_idle and not self.leader.running:
            self._idle_steps += 1
            if self._idle_steps % INTEGRITY_CHECK_EVERY == 1:
                self.leader.check_integrity()
        now = time.monotonic()
        if now - self._last_stats >= STATS_INTERVAL_S:
            self._last_stats = now
            self.out_queue.put(self.stats())

    def stats(self, healthy: bool = True, stall: str | None = None) -> RankStats:
        lead = self.leader
        return RankStats(self.info.dp_rank, len(lead.running) if lead else 0,
                         len(lead.waiting) if lead else 0, lead.kv_used_tokens if lead else 0,
                         self.runner.max_total_tokens, lead.prefix_hit_tokens if lead else 0,
                         lead.prompt_tokens if lead else 0, self.step, healthy, stall)

    def close(self) -> None:
        if self.leader is not None:
            self.leader.abort_all()
        self.groups.shutdown()
        self.runner.close()


def _setup_logging(args: ServerArgs, info: ParallelInfo) -> None:
    level = getattr(logging, args.log_level.upper(), logging.INFO)
    prefix = f"[dp {info.dp_rank} leader]" if info.is_leader else f"[rank {info.rank}]"
    logging.basicConfig(level=level if info.is_leader else max(level, logging.WARNING),
                        format=f"%(asctime)s {prefix} %(levelname)s %(message)s", force=True)


def run_scheduler_process(server_args: ServerArgs, rank: int, model_dir: str, dist_port: int,
                          req_queue, out_queue, ready_queue) -> None:
    """Process target: one scheduler rank. Exits 0 after ShutdownReq (os._exit, _exit_flushed),
    non-zero on a failure."""
    args = server_args
    info = ParallelInfo.from_server_args(args, rank)
    _setup_logging(args, info)
    # Cores shared by every rank (and the HTTP server): oversubscribed OpenMP threads spin
    # against each other and slow small CPU forwards by 10x or more.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // (2 * args.tp_size)))
    rank_loop: SchedulerRank | None = None

    def on_stall(report: StallReport) -> None:
        logger.error(report.message())
        stats = rank_loop.stats(False, report.message()) if rank_loop else RankStats(
            info.dp_rank, 0, 0, 0, 0, 0, 0, report.step, False, report.message())
        out_queue.put(stats)

    watchdog = StallWatchdog(rank, args.stall_timeout, on_stall)
    try:
        device = resolve_device(args, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        groups = init_distributed(args, rank, dist_port, device, watchdog)
        runner = ModelRunner(args, groups, model_dir, device, node_namespace(dist_port))
        rank_loop = SchedulerRank(args, groups, runner, req_queue, out_queue, watchdog)
        groups.barrier()
    except Exception as e:
        logger.exception("rank %d failed to start", rank)
        error = f"rank {rank}: {type(e).__name__}: {e}"
        ready_queue.put(ReadyMsg(rank, info.dp_rank, False, error))
        watchdog.close()
        raise SystemExit(1)
    if info.is_leader:
        logger.info("ready: tp=%d dp=%d attn_tp=%d, %d KV tokens (page %d), %s",
                    args.tp_size, info.dp_size, info.attn_tp_size, runner.max_total_tokens,
                    runner.page_size, runner.dtype)
    ready_queue.put(ReadyMsg(rank, info.dp_rank, True, info={
        "max_total_tokens": runner.max_total_tokens, "num_pages": runner.num_pages,
        "page_size": runner.page_size, "weight_version": runner.weight_version,
        "context_length": runner.context_length}))
    try:
        rank_loop.run()
        rank_loop.close()
    except Exception:
        logger.exception("rank %d step %d failed", rank, rank_loop.step)
        raise SystemExit(1)
    finally:
        watchdog.close()
    if info.is_leader:
        logger.info("shut down")
    _exit_flushed(out_queue, ready_queue)


def _exit_flushed(*queues: Any) -> None:
    """A rank's clean exit: its messages delivered and its logs written, then os._exit(0),
    which skips the interpreter's teardown. There the C++ objects still alive (torch's and
    gloo's threads) are destroyed in no fixed order: once in CI a rank that had shut down
    cleanly aborted in it ("terminate called without an active exception", exit -6), which
    the launcher and the tests read as a crashed rank."""
    for q in queues:
        q.close()
        q.join_thread()  # the queue's feeder thread has written everything put
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
