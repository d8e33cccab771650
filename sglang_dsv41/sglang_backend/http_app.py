"""SGLang's HTTP app with our plugins loaded: what SGLang's tokenizer worker processes import
when ``--tokenizer-worker-num > 1`` (see http_workers.py)."""

from sglang.srt.plugins import load_plugins

load_plugins()  # before the app's module is imported, as SGLang's main process does

from sglang.srt.entrypoints.http_server import app  # noqa: E402

__all__ = ["app"]
