"""A command run as a job of its own (a new session: its whole process tree is killed on a
timeout), for tests of the trainer's CLI under torchrun and of whole runs."""

from __future__ import annotations

import os
import signal
import subprocess


def run_job(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int, str]:
    """-> (return code, stdout and stderr together); on a timeout the process group is killed
    and the test fails showing the output's end."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(map(str, cmd[:6]))} ... timed out after {timeout:g} s:"
                             f"\n{out[-3000:]}") from None
    return proc.returncode, out
