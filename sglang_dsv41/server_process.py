"""Run ``python -m sglang_dsv41.launch_server`` as a child process (benchmarks, tests, the
trainer's local mode): free port, wait until /health answers, and always reap the whole process
group (the server and its scheduler ranks) on exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from .ports import free_port

# A server started under torchrun builds its own process group: with these variables (and
# TORCHELASTIC_USE_AGENT_STORE) inherited, its ranks would join the trainer's store and hang.
TORCHRUN_ENV = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT"}


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")}
    env.setdefault("OMP_NUM_THREADS", "1")
    return {**env, **(extra or {})}


class ServerProcess:
    def __init__(self, args: list[str], startup_timeout: float = 120.0, api_key: str | None = None,
                 env: dict[str, str] | None = None, log_path: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        argv = [sys.executable, "-m", "sglang_dsv41.launch_server", "--backend", "embedded",
                "--host", "127.0.0.1", "--port", str(self.port), *args]
        if api_key:
            argv += ["--api-key", api_key]
        self.orphans = False
        self._stopping = False
        self.log = (open(log_path, "w+") if log_path else
                    tempfile.NamedTemporaryFile("w+", prefix="sglang_dsv41_server_", suffix=".log"))
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=server_env(env))
        try:
            self._wait_healthy(startup_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode}:\n"
                                   f"{self.log_text()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", headers=self.headers, timeout=2).status_code \
                        == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.log_text()[-4000:]}")

    def log_text(self) -> str:
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False

    def begin_stop(self) -> None:
        """SIGTERM without waiting: the server drains and stops its ranks meanwhile (once; a
        second SIGTERM would make uvicorn skip the drain)."""
        if self.proc.poll() is None and not self._stopping:
            self._stopping = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (the server stops its ranks), then SIGKILL the process group if needed.
        Sets ``orphans``: whether any process of the group outlived the server by 5 s."""
        self.begin_stop()
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 5
        while self.proc.poll() is not None and self._group_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        self.orphans = self._group_alive()
        if self.orphans:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(5)
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        self.log.close()
