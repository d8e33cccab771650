"""Our HTTP-side plugins in SGLang's tokenizer worker processes (``--tokenizer-worker-num > 1``).

SGLang 0.5.23 runs those workers by importing ``SGLANG_HTTP_SERVER_APP_PATH`` (default
``sglang.srt.entrypoints.http_server:app``, environ.py) in fresh uvicorn/Granian processes that
never call ``load_plugins()`` (http_server.py ``init_multi_tokenizer``), so the /generate pin,
the Engram update guard and the health middleware would be missing there. The HTTP-side plugins
point that path at ``http_app:app``, SGLang's own app imported after ``load_plugins()``; a
deployment that set its own app path with several workers is refused before launch.
"""

from __future__ import annotations

import os

from ..policies.launch_guards import DeploymentRefused
from .plugins import PLUGINS

APP_PATH_ENV = "SGLANG_HTTP_SERVER_APP_PATH"
SGLANG_APP = "sglang.srt.entrypoints.http_server:app"
PLUGIN_APP = "sglang_dsv41.sglang_backend.http_app:app"
HTTP_SIDE_PLUGINS = tuple(p.name for p in PLUGINS if p.http_side)


def use_plugin_app(environ=None) -> None:
    """Point SGLang's worker app path at ours unless the deployment chose another app."""
    environ = os.environ if environ is None else environ
    if environ.get(APP_PATH_ENV, SGLANG_APP) == SGLANG_APP:
        environ[APP_PATH_ENV] = PLUGIN_APP


def check_http_workers(tokenizer_worker_num: int, installed, environ=None) -> None:
    """Several tokenizer workers with an HTTP-side plugin installed need our app path."""
    environ = os.environ if environ is None else environ
    app_path = environ.get(APP_PATH_ENV, SGLANG_APP)
    if (tokenizer_worker_num > 1 and set(installed) & set(HTTP_SIDE_PLUGINS)
            and app_path != PLUGIN_APP):
        raise DeploymentRefused(
            f"--tokenizer-worker-num {tokenizer_worker_num} with {APP_PATH_ENV}={app_path}: "
            f"SGLang's tokenizer worker processes import that app without loading plugins, so "
            f"X-Data-Parallel-Rank on /generate, the Engram update guard and the stall health "
            f"check would be off in them; use {APP_PATH_ENV}={PLUGIN_APP} (SGLang's app with "
            f"the plugins loaded) or --tokenizer-worker-num 1")
