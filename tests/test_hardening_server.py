"""Hardening of the embedded server as a process: the ranks' control plane listens on loopback
only, SIGTERM drains in-flight requests, and a dead scheduler rank makes the server exit
non-zero instead of answering 503 forever."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from sglang_dsv41.server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
LAYOUT = ["--model-path", "tiny", "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention",
          "--context-length", "512", "--max-new-tokens-limit", "200"]


def group_processes(server: ServerProcess) -> list[psutil.Process]:
    root = psutil.Process(server.proc.pid)
    return [root, *root.children(recursive=True)]


def scheduler_ranks(server: ServerProcess) -> list[psutil.Process]:
    return [p for p in group_processes(server)[1:]
            if "multiprocessing" in " ".join(p.cmdline()) and "spawn_main" in " ".join(
                p.cmdline())]


@pytest.mark.parametrize("grace", [None, 1.0], ids=["default-grace", "short-grace"])
def test_listens_on_loopback_only_and_sigterm_drains(grace):
    flags = [] if grace is None else ["--shutdown-grace", str(grace)]
    with ServerProcess(LAYOUT + flags, startup_timeout=150) as server:
        listening = [(p.pid, c.laddr) for p in group_processes(server)
                     for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN]
        assert listening and all(addr.ip in ("127.0.0.1", "::1") for _, addr in listening), \
            listening
        result: dict = {}

        def long_request():
            try:
                r = httpx.post(server.url + "/generate", timeout=120, json={
                    "input_ids": [1, 2, 3], "sampling_params": {
                        "max_new_tokens": 200, "ignore_eos": True, "temperature": 0}})
            except httpx.HTTPError as e:  # the server cut the connection at the grace's end
                result["error"] = repr(e)
                return
            result["status"] = r.status_code
            result["body"] = r.json() if r.status_code == 200 else r.text

        t = threading.Thread(target=long_request)
        t.start()
        deadline = time.monotonic() + 30
        while httpx.get(server.url + "/server_info").json()["in_flight"] == [0, 0]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # ~10 s of decoding on 2 cores (tiny DSV4): past uvicorn's old 5 s grace, within the
        # default 30 s; a 1 s --shutdown-grace cuts it and the server stops soon after.
        t0 = time.monotonic()
        os.kill(server.proc.pid, signal.SIGTERM)
        if grace is None:
            t.join(120)
            assert result.get("status") == 200, result
            assert result["body"]["meta_info"]["completion_tokens"] == 200
            assert server.proc.wait(60) == 0, server.log_text()[-2000:]
        else:
            assert server.proc.wait(60) == 0, server.log_text()[-2000:]
            stopped = time.monotonic() - t0
            t.join(30)
            assert "error" in result or result.get("status") != 200, result
            assert stopped < grace + 8, (stopped, server.log_text()[-2000:])


def test_dead_rank_makes_the_server_exit_nonzero():
    with ServerProcess(LAYOUT, startup_timeout=150) as server:
        ranks = scheduler_ranks(server)
        assert len(ranks) == 2, [p.cmdline() for p in group_processes(server)]
        ranks[1].kill()
        code = server.proc.wait(60)
        assert code not in (0, None), server.log_text()[-2000:]
        assert "died with exit code -9 (SIGKILL)" in server.log_text()
