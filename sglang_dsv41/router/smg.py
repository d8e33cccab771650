"""The real sglang-router 0.3.2 (the Rust "SGLang Model Gateway", pip ``sglang-router``) in
front of our servers, unchanged, plus a SessionRouter that sends a trajectory's turns through it.

``python -m sglang_dsv41.router.smg --worker-urls URL ... --dp-aware --policy manual`` starts the
Rust router with sglang-router's own flags. Its ``launch_router`` module imports SGLang's Python
package for a debugging load balancer, which cannot import on a machine without SGLang's CUDA
wheels; this entry builds the Rust router from the same RouterArgs without that import.

With ``--dp-aware`` the router reads ``dp_size`` from each worker's /get_server_info and sends
every request to one (worker, DP rank) by inserting ``data_parallel_rank`` into the body; with
``--policy manual`` a request's ``X-SMG-Routing-Key`` header pins it (sticky sessions), new keys
placed by ``--assignment-mode``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import subprocess
import sys
import threading
import time
import urllib.parse
from typing import Any, AsyncIterator, Iterator

import httpx

from .base import (SSE_DONE, NoEngineAvailable, Route, RouterError, SessionRouter,
                   engine_error_message, parse_sse_line)

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
MAX_ROUTING_KEY_CHARS = 256


def routing_key(session_id: str) -> str:
    """The header value that pins ``session_id``: a header carries visible ASCII only, so the
    id is percent-encoded (UTF-8), and past MAX_ROUTING_KEY_CHARS replaced by its SHA-256 after
    a "%s" that no percent-encoding yields: the same id always gives the same key, distinct ids
    distinct keys."""
    key = urllib.parse.quote(session_id, safe="", errors="surrogatepass")
    if len(key) <= MAX_ROUTING_KEY_CHARS:
        return key
    digest = hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest()
    return f"%sha256-{digest}"


def parse_args(argv: list[str]) -> Any:
    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser(prog="python -m sglang_dsv41.router.smg")
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    return RouterArgs.from_cli_args(parser.parse_args(argv), use_router_prefix=False)


def main(argv: list[str] | None = None) -> None:
    from sglang_router.router import Router

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    args._validate_router_args()
    Router.from_args(args).start()  # blocks until the router stops


class SMGProcess:
    """The router as a child process (tests, the trainer's local mode); always reaped. Ready
    when every worker it will route to is registered and healthy: under ``--dp-aware`` one per
    (worker, DP rank), the DP sizes read from the workers' /get_server_info. The router's own
    /readiness answers 200 as soon as one of them is, and new routing keys placed before the
    others register all land on it: the likely cause (not reproduced) of a CI failure on a
    loaded 2-core machine, 8 new sessions all placed on DP rank 0."""

    def __init__(self, worker_urls: list[str], port: int, extra: list[str] = (),
                 startup_timeout: float = 60.0, log_path: str | None = None):
        self.url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "sglang_dsv41.router.smg", "--host", "127.0.0.1",
                "--port", str(port), "--worker-urls", *worker_urls, *extra]
        self.log_path = log_path or os.devnull
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + startup_timeout
        expected, listed = None, None
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"sglang-router exited with {self.proc.returncode}")
            try:
                if expected is None:
                    expected = _routed_workers(worker_urls, "--dp-aware" in extra)
                if httpx.get(self.url + "/readiness", timeout=1).status_code == 200:
                    listed = httpx.get(self.url + "/workers", timeout=1).json()["workers"]
                    if len([w for w in listed if w.get("is_healthy")]) >= expected:
                        return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                seen = [(w.get("url"), w.get("is_healthy")) for w in listed or []]
                raise TimeoutError(f"sglang-router not ready after {startup_timeout}s: "
                                   f"expected {expected} healthy workers, listed {seen}")
            time.sleep(0.2)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "SMGProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _routed_workers(worker_urls: list[str], dp_aware: bool) -> int:
    """How many workers the router lists once every one is registered: one per URL, or with
    --dp-aware one per DP rank of each (its /get_server_info's dp_size)."""
    if not dp_aware:
        return len(worker_urls)
    return sum(int(httpx.get(url.rstrip("/") + "/get_server_info", timeout=5).json()
                   .get("dp_size") or 1) for url in worker_urls)


class SMGSessionRouter(SessionRouter):
    """Turns of a trajectory go through a running sglang-router with the trajectory id as the
    routing key (``--policy manual``): the router keeps the key on one (worker, DP rank)."""

    def __init__(self, router_url: str, engine_urls: list[str], timeout: float = 300.0):
        self.router_url, self._engines = router_url.rstrip("/"), list(engine_urls)
        self._timeout = timeout
        self._client = httpx.Client(timeout=timeout)
        self._aclient: httpx.AsyncClient | None = None
        self._aclient_loop: asyncio.AbstractEventLoop | None = None
        self._routes: dict[str, Route] = {}
        self._paused = False
        self._in_flight = 0
        self._cond = threading.Condition()

    def generate(self, session_id: str, payload: dict[str, Any],
                 expected_tokens: int = 0) -> dict[str, Any]:
        with self._cond:
            while self._paused:
                self._cond.wait()
            self._in_flight += 1
        with self._turn():
            r = self._client.post(**self._request(session_id, payload))
        return self._answer(session_id, r)

    async def _aenter(self) -> None:
        while True:  # paused only while weights are replaced: polled, not a blocked loop
            with self._cond:
                if not self._paused:
                    self._in_flight += 1
                    return
            await asyncio.sleep(0.05)

    async def agenerate(self, session_id: str, payload: dict[str, Any],
                        expected_tokens: int = 0) -> dict[str, Any]:
        """generate on the caller's event loop: a turn cancelled (its client went away) closes
        its connection to the router, which drops the worker's request, instead of running to
        the end in a thread nobody waits for."""
        await self._aenter()
        with self._turn():
            r = await self._async_client().post(**self._request(session_id, payload))
        return self._answer(session_id, r)

    async def astream(self, session_id: str, payload: dict[str, Any],
                      expected_tokens: int = 0) -> AsyncIterator[dict[str, Any]]:
        """One turn with ``"stream": true`` through the router: the worker's SSE chunks as
        they arrive, each with ``meta_info.route``; a refusal raises before the first chunk.
        Closing the iterator early (the client went away) closes the router connection."""
        await self._aenter()
        where = f"sglang-router at {self.router_url}"
        try:
            async with self._async_client().stream(
                    "POST", **self._request(session_id, dict(payload, stream=True))) as r:
                if r.status_code != 200:
                    self._answer(session_id, r, await r.aread())  # raises its RouterError
                async for line in r.aiter_lines():
                    chunk = parse_sse_line(line.encode(), where)
                    if chunk is None:
                        continue
                    if chunk is SSE_DONE:
                        return
                    meta = chunk.setdefault("meta_info", {})
                    self._routes[session_id] = Route(self.router_url,
                                                     int(meta.get("dp_rank") or 0))
                    meta["route"] = [self.router_url, meta.get("dp_rank", 0)]
                    yield chunk
            raise RouterError(f"{where}: the stream ended without [DONE]", 502)
        except httpx.TimeoutException as e:
            raise RouterError(f"{where}: no answer in time ({type(e).__name__})", 504) from e
        except httpx.HTTPError as e:
            raise NoEngineAvailable(f"{where}: {type(e).__name__}: {e}") from e
        except (ValueError, AttributeError) as e:  # a chunk that is not a JSON object
            raise RouterError(f"{where}: the stream could not be read: {e}", 502) from e
        finally:
            self._leave()

    def _async_client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._aclient is None or self._aclient_loop is not loop:
            self._aclient = httpx.AsyncClient(timeout=self._timeout)
            self._aclient_loop = loop
        return self._aclient

    def _leave(self) -> None:
        with self._cond:
            self._in_flight -= 1
            self._cond.notify_all()

    def _request(self, session_id: str, payload: dict[str, Any]) -> dict[str, Any]:
        """A turn's POST to the router, pinned by the session's routing key."""
        return {"url": self.router_url + "/generate", "json": payload,
                "headers": {ROUTING_KEY_HEADER: routing_key(session_id)}}

    @contextlib.contextmanager
    def _turn(self) -> Iterator[None]:
        """One turn in flight (entered by the caller): a transport failure is the router's
        (NoEngineAvailable), and the turn leaves however it ends."""
        try:
            yield
        except httpx.HTTPError as e:
            raise NoEngineAvailable(f"sglang-router at {self.router_url}: {e}") from e
        finally:
            self._leave()

    def _answer(self, session_id: str, r: httpx.Response, body: bytes | None = None
                ) -> dict[str, Any]:
        if r.status_code != 200:
            body = r.content if body is None else body
            raise RouterError(f"sglang-router answered {r.status_code}: "
                              f"{body[:500].decode(errors='replace')}", r.status_code,
                              engine_error_message(body))
        out = r.json()
        meta = out["meta_info"]
        self._routes[session_id] = Route(self.router_url, int(meta.get("dp_rank", 0)))
        meta["route"] = [self.router_url, meta.get("dp_rank", 0)]
        return out

    def close(self) -> None:
        self._client.close()

    async def aclose(self) -> None:
        if self._aclient is not None:
            await self._aclient.aclose()
        self._client.close()

    def route_of(self, session_id: str) -> Route | None:
        return self._routes.get(session_id)

    def end_session(self, session_id: str) -> None:
        self._routes.pop(session_id, None)

    def drain(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._in_flight == 0, timeout)

    def engine_urls(self) -> list[str]:
        return list(self._engines)


if __name__ == "__main__":
    main()
