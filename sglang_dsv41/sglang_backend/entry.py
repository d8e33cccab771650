"""The functions SGLang's ``load_plugins()`` calls, one per entry point of the group
``sglang.srt.plugins`` (pyproject.toml). Each registers its plugin's hooks; SGLang applies them.

SGLang logs and swallows an exception raised here, so a plugin whose targets changed is also
logged at ERROR level by us, naming the target; ``launch_server --backend sglang`` checks every
target against the installed source before anything starts and refuses to start instead.
"""

from __future__ import annotations

import logging
import os
import tempfile

from .env import ENV
from .http_workers import HTTP_SIDE_PLUGINS, use_plugin_app
from .plugins import install

logger = logging.getLogger(__name__)


def _in_detokenizer() -> bool:
    # SGLang names the process before it loads plugins there; none of ours applies to it
    try:
        import setproctitle
    except ImportError:
        return False
    return setproctitle.getproctitle() == "sglang::detokenizer"


def _install(name: str) -> None:
    if _in_detokenizer():
        return
    try:
        installed = install(name)
    except Exception:
        logger.exception("sglang-dsv41 plugin %s failed to install", name)
        raise
    if installed and name in HTTP_SIDE_PLUGINS:
        use_plugin_app()  # SGLang's tokenizer worker processes load them too


def engram_dummy_load() -> None:
    _install("engram_dummy_load")


def engram_layout() -> None:
    _install("engram_layout")


def layout_guards() -> None:
    _install("layout_guards")


def generate_dp_rank_header() -> None:
    _install("generate_dp_rank_header")


def stall_watchdog() -> None:
    # The first process to load plugins (SGLang's main process) picks the report directory;
    # the schedulers it spawns inherit it through the environment. A directory given again
    # (--dsv41-run-dir) may hold an earlier server's reports: that process clears them, or
    # the new server's /health would answer 503 naming a rank of the old one.
    if not ENV.RUN_DIR.get():
        ENV.RUN_DIR.set(tempfile.mkdtemp(prefix="sglang-dsv41-"))
    if not ENV.SERVER_PID.get():
        ENV.SERVER_PID.set(str(os.getpid()))
        from .watchdog_hooks import clear_all_stall_reports

        clear_all_stall_reports(ENV.RUN_DIR.get())
    _install("stall_watchdog")


def hash_r3_rows() -> None:
    _install("hash_r3_rows")


def engram_update_guard() -> None:
    _install("engram_update_guard")


def routing_key_dispatch() -> None:
    _install("routing_key_dispatch")
