"""``python -m sglang_dsv41.gateway --engine-urls URL [URL ...] --model-path PATH``: the agent
gateway in front of running engines (ours or SGLang 0.5.23), with our sticky router or, with
``--smg-url``, a running sglang-router (``--dp-aware --policy manual``)."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys

import httpx


def load_tokenizer(model_path: str):
    """The served model's tokenizer (our byte tokenizer for presets and converted checkpoints)."""
    from ..loader.serving import load_serving_config, model_layout
    from ..tokenizer import load_model_tokenizer

    model_dir = None if model_layout(model_path) == "preset" else model_path
    return load_model_tokenizer(model_dir, load_serving_config(model_path))


def build_gateway(engine_urls: list[str], model_path: str, smg_url: str | None = None,
                  api_key: str | None = None, thinking: bool = False,
                  max_in_flight: int | None = 32):
    from ..router.smg import SMGSessionRouter
    from ..router.sticky import StickyRouter
    from .app import Gateway

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    info = httpx.get(engine_urls[0].rstrip("/") + "/model_info", timeout=30,
                     headers=headers).json()
    # Our engines report --max-new-tokens-limit in /get_server_info (SGLang's do not: None); a
    # turn may ask for the smallest, whichever engine it lands on.
    limits = [httpx.get(url.rstrip("/") + "/get_server_info", timeout=30, headers=headers)
              .json().get("max_new_tokens_limit") for url in engine_urls]
    limits = [int(n) for n in limits if n is not None]
    router = SMGSessionRouter(smg_url, engine_urls) if smg_url else StickyRouter(
        engine_urls, api_key=api_key, max_in_flight=max_in_flight)
    return Gateway(router, load_tokenizer(model_path), os.path.basename(model_path.rstrip("/")),
                   int(info["context_length"]), thinking=thinking,
                   max_new_tokens_limit=min(limits) if limits else None)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from .app import create_gateway_app

    p = argparse.ArgumentParser(prog="python -m sglang_dsv41.gateway")
    p.add_argument("--engine-urls", nargs="+", required=True)
    p.add_argument("--model-path", required=True, help="for the tokenizer (preset or directory)")
    p.add_argument("--smg-url", default=None, help="route through a running sglang-router")
    p.add_argument("--api-key", default=None, help="the engines' API key")
    p.add_argument("--thinking", action="store_true", help="thinking mode by default")
    p.add_argument("--max-in-flight", type=int, default=32,
                   help="a session leaves a slot with more turns in flight (at a turn boundary)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30100)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    gateway = build_gateway(a.engine_urls, a.model_path, a.smg_url, a.api_key, a.thinking,
                            a.max_in_flight)
    from ..launch_server import bind_socket  # TCP_NODELAY: no 40 ms delayed-ACK stalls

    sock = bind_socket(a.host, a.port)
    # Startup leaves ~2e5 long-lived objects (torch, the tokenizer, the encoding; a full
    # collection of them took 117 ms): frozen, the collector no longer walks them while
    # requests wait.
    gc.freeze()
    # httptools and uvloop, uvicorn's C parser and event loop (its "standard" extras), not the
    # pure-Python h11 and asyncio loop: the gateway's CPU per request is mostly HTTP handling.
    config = uvicorn.Config(create_gateway_app(gateway), access_log=False, http="httptools",
                            loop="uvloop")
    uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
