"""Launcher: spawns one scheduler process per TP rank, waits for every ReadyMsg, then hands the
queues to a DPController and watches the children. A rank that dies is fatal: the controller
fails every waiting request with the reason and ``on_fatal`` stops the HTTP server, whose process
then exits non-zero (a supervisor restarts it), instead of answering 503 forever.

The ranks' rendezvous store is hosted here, on a socket bound to loopback (the ranks are all on
this machine), and the ranks join it as clients; their gloo pairs bind to loopback too. Nothing
of the engine's control plane listens on an outside interface.

Each child's stdout/stderr go to a per-rank log file that a thread echoes to our stderr with a
``[rank r]`` prefix: a rank killed by a C++ check (e.g. gloo's reduce-scatter shape check) leaves
its last words only there, and the death report quotes them.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

from ..model.dsv4.config import DSV4Config
from ..server_args import ServerArgs
from .dp_controller import DPController
from .messages import ReadyMsg

logger = logging.getLogger(__name__)

_ERROR_MARKERS = ("Check failed", "enforce fail", "what()", "Error", "Exception", "Killed")
LOOPBACK = "127.0.0.1"
# torch.distributed's tcp:// rendezvous joins an existing store (no rank hosts one) when these
# are set; GLOO_SOCKET_IFNAME keeps gloo's pair sockets off outside interfaces.
RANK_ENV = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
            "GLOO_SOCKET_IFNAME": "lo"}


@dataclass
class RendezvousStore:
    store: Any                 # torch TCPStore serving on a loopback socket it owns
    port: int

    def close(self) -> None:
        self.store = None      # the store's server closes its socket


def host_rendezvous_store(port: int | None) -> RendezvousStore:
    """A TCPStore listening on loopback only (torch's own server binds every interface)."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((LOOPBACK, port or 0))
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise EngineStartError(f"--dist-init-port {port}: cannot listen on {LOOPBACK}:{port} for "
                               f"the ranks' rendezvous ({e.strerror or e}); pick a free port or "
                               "leave the flag out") from None
    store = dist.TCPStore(LOOPBACK, sock.getsockname()[1], None, is_master=True,
                          timeout=timedelta(minutes=30), wait_for_workers=False,
                          master_listen_fd=sock.fileno())
    sock.detach()  # the store's server owns the descriptor now and closes it with the store
    return RendezvousStore(store, store.port)


class EngineStartError(RuntimeError):
    """A scheduler rank failed to start; the message names the rank and the reason."""


def resolve_model_dir(server_args: ServerArgs) -> str:
    """A preset name (random weights, built by each rank) or a model directory; the ranks load
    either through loader/serving. Fails here, before anything is spawned, if it is neither."""
    from ..loader.serving import model_layout

    model_layout(server_args.model_path)
    return server_args.model_path


def context_length_for(server_args: ServerArgs, config: DSV4Config) -> int:
    limit = config.max_position_embeddings
    if server_args.context_length is None:
        return limit
    if server_args.context_length > limit:
        raise ValueError(f"--context-length {server_args.context_length} exceeds the model's "
                         f"max_position_embeddings {limit}")
    return server_args.context_length


def rank_log_path(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"rank{rank}.log")


def describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exit code {code}"


def log_tail(path: str, max_lines: int = 4) -> str:
    """The last error-looking lines of a rank's log (or its last lines if none look like one)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 16384))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines()]
    except OSError:
        return ""
    lines = [ln for ln in lines if ln]
    picked = [ln for ln in lines if any(m in ln for m in _ERROR_MARKERS)] or lines
    return " | ".join(dict.fromkeys(picked[-max_lines:]))


def _scheduler_main(log_path: str, server_args: ServerArgs, rank: int, model_dir: str,
                    dist_port: int, req_queue: Any, out_queue: Any, ready_queue: Any) -> None:
    """Child entry: die with the parent, log to the rank's file, run the scheduler; any failure
    before the scheduler could say so itself is reported as a ReadyMsg(ok=False)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no orphans
    except (OSError, AttributeError):
        pass
    os.environ.update(RANK_ENV)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout.reconfigure(line_buffering=True)
    try:
        from .scheduler import run_scheduler_process

        run_scheduler_process(server_args, rank, model_dir, dist_port, req_queue, out_queue,
                              ready_queue)
    except SystemExit:
        raise  # the scheduler's own exit: it has reported its failure itself
    except BaseException as e:
        traceback.print_exc()
        dp_rank = server_args.rank_to_dp(rank)[0]
        ready_queue.put(ReadyMsg(rank, dp_rank, ok=False, error=f"{type(e).__name__}: {e}"))
        raise


@dataclass
class Engine:
    server_args: ServerArgs
    model_dir: str
    config: DSV4Config
    processes: list[mp.Process]
    controller: DPController
    ready_info: dict[int, dict]
    log_dir: str
    store: RendezvousStore | None = None  # the ranks' rendezvous store (hosted here)
    fatal_reason: str | None = None       # set when a rank died
    on_fatal: Callable[[str], None] | None = None   # e.g. stop the HTTP server
    _stop: threading.Event = field(default_factory=threading.Event)

    def start_watchers(self, echo_logs: bool = True) -> None:
        threading.Thread(target=self._monitor, name="rank-monitor", daemon=True).start()
        if echo_logs:
            threading.Thread(target=self._echo_logs, name="rank-log-echo", daemon=True).start()

    def log_path(self, rank: int) -> str:
        return rank_log_path(self.log_dir, rank)

    def _monitor(self) -> None:
        reported: set[int] = set()
        while not self._stop.wait(0.2):
            for rank, p in enumerate(self.processes):
                if p.exitcode is None or self._stop.is_set() or rank in reported:
                    continue
                reported.add(rank)
                dp_rank, attn_rank = self.server_args.rank_to_dp(rank)
                time.sleep(0.2)  # let the dying rank's last words reach its log
                tail = log_tail(self.log_path(rank))
                # Fatal for every DP group: the MoE collectives span all ranks.
                reason = self.controller.fail_engine(
                    f"scheduler rank {rank} (attn_tp_rank {attn_rank}) died with "
                    f"{describe_exit(p.exitcode)}" + (f": {tail}" if tail else ""), dp_rank)
                if self.fatal_reason is None:
                    self.fatal_reason = reason
                    if self.on_fatal is not None:
                        self.on_fatal(reason)

    def _echo_logs(self) -> None:
        offsets = [0] * len(self.processes)
        while not self._stop.wait(0.2):
            for rank in range(len(self.processes)):
                try:
                    with open(self.log_path(rank), "rb") as f:
                        f.seek(offsets[rank])
                        data = f.read()
                except OSError:
                    continue
                cut = data.rfind(b"\n") + 1  # whole lines only
                offsets[rank] += cut
                for line in data[:cut].decode(errors="replace").splitlines():
                    sys.stderr.write(f"[rank {rank}] {line}\n")

    def shutdown(self, timeout: float = 5.0) -> None:
        """ShutdownReq to every leader, then terminate, then kill whatever is left."""
        self._stop.set()
        if not self.controller.healthy:
            timeout = min(timeout, 1.0)  # survivors of a dead rank sit in a broken collective
        self.controller.shutdown()
        deadline = time.monotonic() + timeout
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.processes:
            if p.is_alive():
                p.terminate()
        for p in self.processes:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(1.0)
        shutil.rmtree(self.log_dir, ignore_errors=True)
        if self.store is not None:
            self.store.close()


def _kill_all(processes: list[mp.Process]) -> None:
    for p in processes:
        if p.is_alive():
            p.kill()
    for p in processes:
        p.join(2.0)


def launch_engine(server_args: ServerArgs, echo_logs: bool = True) -> Engine:
    from ..loader.serving import load_serving_config
    from ..policies.launch_guards import check_attention_tp

    model_dir = resolve_model_dir(server_args)
    config = load_serving_config(model_dir)
    context_length_for(server_args, config)  # fail before spawning anything
    check_attention_tp(server_args.attn_tp_size, config.o_groups)
    ctx = mp.get_context("spawn")
    a = server_args
    req_queues = [ctx.Queue() for _ in range(a.effective_dp_size)]
    out_queue, ready_queue = ctx.Queue(), ctx.Queue()
    store = host_rendezvous_store(a.dist_init_port)
    dist_port = store.port
    log_dir = tempfile.mkdtemp(prefix="sglang_dsv41_ranks_")
    logger.info("starting %d scheduler rank(s); their logs, while they load: %s", a.tp_size,
                log_dir)
    processes = []
    for rank in range(a.tp_size):
        dp_rank, attn_rank = a.rank_to_dp(rank)
        leader_queue = req_queues[dp_rank] if attn_rank == 0 else None
        p = ctx.Process(target=_scheduler_main, name=f"scheduler-rank{rank}", daemon=True,
                        args=(rank_log_path(log_dir, rank), a, rank, model_dir,
                              dist_port, leader_queue, out_queue, ready_queue))
        p.start()
        processes.append(p)
    try:
        ready_info = _wait_ready(a, processes, ready_queue, log_dir)
    except BaseException as e:
        _kill_all(processes)
        store.close()
        if echo_logs and isinstance(e, EngineStartError):  # the ranks' logs say why: kept
            raise EngineStartError(f"{e} (every rank's log: {log_dir})") from None
        shutil.rmtree(log_dir, ignore_errors=True)  # interrupted, or a caller without logs
        raise
    controller = DPController(req_queues, out_queue, list(range(a.tp_size)),
                              a.load_balance_method)
    engine = Engine(a, model_dir, config, processes, controller, ready_info, log_dir, store)
    engine.start_watchers(echo_logs)
    return engine


def _wait_ready(a: ServerArgs, processes: list[mp.Process], ready_queue: Any,
                log_dir: str) -> dict[int, dict]:
    info: dict[int, dict] = {}
    deadline = time.monotonic() + a.startup_timeout
    while len(info) < a.tp_size:
        try:
            msg: ReadyMsg = ready_queue.get(timeout=0.2)
        except queue.Empty:
            for rank, p in enumerate(processes):
                if p.exitcode is not None and rank not in info:
                    tail = log_tail(rank_log_path(log_dir, rank))
                    raise EngineStartError(f"scheduler rank {rank} died during startup with "
                                           f"{describe_exit(p.exitcode)}: {tail}")
            if time.monotonic() > deadline:
                missing = sorted(set(range(a.tp_size)) - set(info))
                raise EngineStartError(f"scheduler ranks {missing} sent no ReadyMsg within "
                                       f"--startup-timeout {a.startup_timeout}s")
            continue
        if not msg.ok:
            raise EngineStartError(f"scheduler rank {msg.rank} (dp_rank {msg.dp_rank}) failed to "
                                   f"start: {msg.error}")
        info[msg.rank] = dict(msg.info)
        logger.info("scheduler rank %d (dp_rank %d) ready: %s", msg.rank, msg.dp_rank, msg.info)
    return info
