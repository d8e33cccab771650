"""Test harness for the HTTP layer's unit tests (test_engine_server_http.py): threads that
drain each DP group's request queue and answer on the shared out_queue as the contract's leaders
do, with canned tokens. It stands in for our own scheduler ranks so that those tests can hold a
request in its queue (to abort it, or to see a dead rank fail it), make one rank refuse a control
call and check exactly what reached a queue, in milliseconds. It does not match stop strings or
sample: the end-to-end tests (test_engine_server_e2e.py) run the real ranks.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import numpy as np
import uvicorn

from sglang_dsv41.engine.messages import (AbortReq, ControlOut, ControlReq, GenerateOut,
                                          GenerateReq, RankStats, ShutdownReq)


class QueueDrainer:
    """Answers GenerateReq with tokens prompt[-1]+1, +2, ... (mod 256), one chunk per token
    when streaming; every rank of the group answers ControlReq; ``refuse`` = {op: rank} makes
    that rank refuse that op. ``hold`` = True parks generate requests until released."""

    def __init__(self, req_queues, out_queue, attn_tp_size: int, refuse=None, layers=3, top_k=2):
        self.req_queues, self.out_queue, self.attn_tp_size = req_queues, out_queue, attn_tp_size
        self.refuse = refuse or {}
        self.layers, self.top_k = layers, top_k
        self.seen: list[tuple[int, object]] = []
        self.hold = False
        self.parked: list[tuple[int, GenerateReq]] = []
        self.prompt_tokens = [0] * len(req_queues)
        self._threads = [threading.Thread(target=self._run, args=(d,), daemon=True)
                         for d in range(len(req_queues))]
        for t in self._threads:
            t.start()

    def _run(self, d: int) -> None:
        while True:
            try:
                msg = self.req_queues[d].get(timeout=5)
            except queue.Empty:
                continue
            self.seen.append((d, msg))
            if isinstance(msg, ShutdownReq):
                return
            if isinstance(msg, GenerateReq):
                if self.hold:
                    self.parked.append((d, msg))
                else:
                    self.answer(d, msg)
            elif isinstance(msg, AbortReq):
                self.out_queue.put(GenerateOut(msg.rid, [], finished=True,
                                               finish_reason={"type": "abort"}, dp_rank=d))
            elif isinstance(msg, ControlReq):
                for r in range(d * self.attn_tp_size, (d + 1) * self.attn_tp_size):
                    bad = self.refuse.get(msg.op) == r
                    self.out_queue.put(ControlOut(msg.req_id, not bad,
                                                  result={"op": msg.op, "args": sorted(msg.args)},
                                                  error=f"{msg.op} refused" if bad else None,
                                                  rank=r))

    def answer(self, d: int, req: GenerateReq) -> None:
        n = req.sampling.max_new_tokens
        ids = [(req.input_ids[-1] + i + 1) % 256 for i in range(n)]
        self.prompt_tokens[d] += len(req.input_ids)
        rows = len(req.input_ids) + n - 1
        experts = np.arange(rows * self.layers * self.top_k, dtype=np.int32).reshape(
            rows, self.layers, self.top_k)
        steps = [[t] for t in ids] if req.stream else [ids]
        for i, step in enumerate(steps):
            last = i == len(steps) - 1
            self.out_queue.put(GenerateOut(
                req.rid, step, logprobs=[-0.5] * len(step) if req.return_logprob else None,
                finished=last, finish_reason={"type": "length", "length": n} if last else None,
                prompt_tokens=len(req.input_ids), completion_tokens=n, cached_tokens=0,
                dp_rank=d, routed_experts=experts if last else None,
                routed_weights=experts.astype(np.float32) / 10 if last else None))
        self.out_queue.put(RankStats(dp_rank=d, num_running=0, num_queued=0, kv_used_tokens=5,
                                     kv_total_tokens=100, prefix_hit_tokens=3,
                                     prompt_tokens=self.prompt_tokens[d], step=1))


async def poll_until(fetch, done, timeout: float = 30.0):
    """Awaits ``fetch()`` until ``done(result)`` and returns that result: for state that reaches
    the HTTP layer on its own (rank stats, a stall report, a call in progress); fails after
    ``timeout`` seconds showing the last result."""
    deadline = time.monotonic() + timeout
    while not done(result := await fetch()):
        assert time.monotonic() < deadline, getattr(result, "text", result)
        await asyncio.sleep(0.02)
    return result


class LoopbackServer(uvicorn.Server):
    """A uvicorn server run in a thread of this process; ``stop`` ends it."""

    def stop(self, timeout: float = 10.0) -> None:
        self.should_exit = True
        self.thread.join(timeout)


def serve(app, log_level: str = "critical") -> tuple[LoopbackServer, str]:
    """``app`` on a real loopback HTTP server in a thread -> (the server, its base URL). A
    server that cannot start (its thread ended, or 30 s passed) fails here, not in a test's
    timeout."""
    from sglang_dsv41.ports import free_port

    server = LoopbackServer(uvicorn.Config(app, host="127.0.0.1", port=free_port(),
                                           log_level=log_level))
    server.thread = threading.Thread(target=server.run, daemon=True)
    server.thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not server.thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the loopback server of {app!r} did not start")
        time.sleep(0.02)
    return server, f"http://127.0.0.1:{server.config.port}"
