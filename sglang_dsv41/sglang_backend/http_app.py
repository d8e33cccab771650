"""SGLang's HTTP app with our plugins loaded: what SGLang's tokenizer worker processes import
when ``--tokenizer-worker-num > 1`` (see http_workers.py)."""

from sglang.srt.plugins import load_plugins

load_plugins()  # before the app's module is imported, as SGLang's main process does

from sglang.srt.entrypoints.http_server import app  # noqa: E402

from .plugins import INSTALLED  # noqa: E402
from .watchdog_hooks import install_health_middleware  # noqa: E402

# The stall-aware /health now, before the worker serves: SGLang's lifespan calls
# set_global_state (whose hook installs it in the main process) only after the app started,
# when Starlette refuses new middleware.
if "stall_watchdog" in INSTALLED:
    install_health_middleware(app)

__all__ = ["app"]
