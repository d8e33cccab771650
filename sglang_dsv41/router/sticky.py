"""StickyRouter: pins each session to (engine url, dp_rank); places by load and KV budget.

Placement of a new session: among the live slots (one per engine and DP rank), those whose free
KV tokens cover ``expected_tokens`` are preferred; among them the fewest in-flight turns win,
then the most free KV tokens, then the fewest pinned sessions. Free KV comes from each engine's
/get_server_info (``rank_stats[dp].kv_total_tokens - kv_used_tokens``), refreshed at most every
``refresh_interval`` seconds. A transport error or a failing /health marks an engine dead: its
sessions are re-pinned elsewhere on their next turn (their prefix is recomputed there). With
``max_in_flight``, a session whose slot already has that many turns in flight is moved, at its
turn boundary, to the best live slot when that one has fewer.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

from .base import NoEngineAvailable, Route, RouterError, SessionRouter


@dataclass
class SlotState:
    route: Route
    in_flight: int = 0
    sessions: int = 0
    kv_free_tokens: int | None = None   # None: unknown (engine does not report it)


def kv_free_by_dp_rank(server_info: dict[str, Any]) -> dict[int, int]:
    """Free KV tokens per DP rank from a /get_server_info body (missing stats are skipped)."""
    out = {}
    for key, st in (server_info.get("rank_stats") or {}).items():
        if isinstance(st, dict) and "kv_total_tokens" in st and "kv_used_tokens" in st:
            used, total = int(st["kv_used_tokens"]), int(st["kv_total_tokens"])
            out[int(st.get("dp_rank", key))] = total - used
    return out


def dp_size_of(server_info: dict[str, Any]) -> int:
    if server_info.get("enable_dp_attention"):
        return int(server_info.get("dp_size", 1))
    return 1


class StickyRouter(SessionRouter):
    def __init__(self, engine_urls: list[str], *, api_key: str | None = None,
                 timeout: float = 300.0, refresh_interval: float = 1.0, max_attempts: int = 3,
                 client: httpx.Client | None = None, max_in_flight: int | None = None):
        if not engine_urls:
            raise ValueError("StickyRouter needs at least one engine url")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = client or httpx.Client(
            timeout=timeout, headers=headers,
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=256))
        self._refresh_interval, self._max_attempts = refresh_interval, max_attempts
        self._max_in_flight = max_in_flight
        self._async_client: httpx.AsyncClient | None = None
        self._cond = threading.Condition()
        self._slots: dict[Route, SlotState] = {}
        self._pins: dict[str, Route] = {}
        self._dead: dict[str, str] = {}          # url -> reason
        self._paused = False
        self._last_refresh: dict[str, float] = {}
        for url in engine_urls:
            url = url.rstrip("/")
            try:
                info = self._get_json(url, "/get_server_info")
            except httpx.TransportError as e:
                raise NoEngineAvailable(f"engine {url} is unreachable: {e}") from e
            free = kv_free_by_dp_rank(info)
            for dp in range(dp_size_of(info)):
                route = Route(url, dp)
                self._slots[route] = SlotState(route, kv_free_tokens=free.get(dp))
            self._last_refresh[url] = time.monotonic()

    # ---- SessionRouter ----------------------------------------------------------------------
    def generate(self, session_id: str, payload: dict[str, Any],
                 expected_tokens: int = 0) -> dict[str, Any]:
        attempt = self._attempts(session_id, payload, expected_tokens)
        request = next(attempt)
        while True:
            route, body = request
            try:
                resp = self._client.post(route.url + "/generate", json=body)
            except httpx.TransportError as e:
                resp = e
            try:
                request = attempt.send(resp)
            except StopIteration as done:
                return done.value

    async def agenerate(self, session_id: str, payload: dict[str, Any],
                        expected_tokens: int = 0) -> dict[str, Any]:
        """generate() for an event loop (the agent gateway): the same placement and retries,
        the engine call on a shared httpx.AsyncClient."""
        if self._async_client is None:
            self._async_client = httpx.AsyncClient(
                timeout=self._client.timeout, headers=self._client.headers,
                limits=httpx.Limits(max_connections=512, max_keepalive_connections=256))
        attempt = self._attempts(session_id, payload, expected_tokens)
        request = next(attempt)
        while True:
            route, body = request
            try:
                resp = await self._async_client.post(route.url + "/generate", json=body)
            except httpx.TransportError as e:
                resp = e
            try:
                request = attempt.send(resp)
            except StopIteration as done:
                return done.value

    def _attempts(self, session_id: str, payload: dict[str, Any], expected_tokens: int):
        """The retry policy as a generator: yields (route, body) to send, receives the
        response (or the transport error), returns the output or raises."""
        last_error: Exception | None = None
        for _ in range(self._max_attempts):
            route = self._acquire(session_id, expected_tokens)
            body = dict(payload, routed_dp_rank=route.dp_rank)
            body.pop("data_parallel_rank", None)
            try:
                resp = yield route, body
            finally:
                self._release(route)
            if isinstance(resp, httpx.TransportError):
                last_error = resp
                self._mark_dead(route.url, f"{type(resp).__name__}: {resp}")
                continue
            if resp.status_code >= 500 and not self._healthy(route.url):
                last_error = RouterError(f"{route.url} answered {resp.status_code}: {resp.text}")
                continue
            if resp.status_code != 200:
                raise RouterError(f"{route.url}/generate answered {resp.status_code}: {resp.text}")
            out = resp.json()
            out.setdefault("meta_info", {})["route"] = [route.url, route.dp_rank]
            return out
        raise NoEngineAvailable(f"session {session_id}: no engine answered after "
                                f"{self._max_attempts} attempts (last error: {last_error})")

    def route_of(self, session_id: str) -> Route | None:
        with self._cond:
            return self._pins.get(session_id)

    def end_session(self, session_id: str) -> None:
        with self._cond:
            route = self._pins.pop(session_id, None)
            if route is not None and route in self._slots:
                self._slots[route].sessions -= 1

    def drain(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(s.in_flight for s in self._slots.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def engine_urls(self) -> list[str]:
        with self._cond:
            return sorted({r.url for r in self._slots if r.url not in self._dead})

    # ---- introspection (tests, telemetry) ------------------------------------------------------
    def slot_states(self) -> list[SlotState]:
        with self._cond:
            return [SlotState(s.route, s.in_flight, s.sessions, s.kv_free_tokens)
                    for s in self._slots.values()]

    def dead_engines(self) -> dict[str, str]:
        with self._cond:
            return dict(self._dead)

    def close(self) -> None:
        self._client.close()

    # ---- internals ------------------------------------------------------------------------------
    def _acquire(self, session_id: str, expected_tokens: int) -> Route:
        self._refresh_kv()
        with self._cond:
            while self._paused:
                self._cond.wait()
            route = self._pins.get(session_id)
            if route is not None and (route.url in self._dead or self._overloaded(route)):
                self._slots[route].sessions -= 1
                route = None
            if route is None:
                route = self._place(expected_tokens)
                self._pins[session_id] = route
                self._slots[route].sessions += 1
            self._slots[route].in_flight += 1
            return route

    def _place(self, expected_tokens: int) -> Route:
        live = [s for s in self._slots.values() if s.route.url not in self._dead]
        if not live:
            raise NoEngineAvailable(f"every engine is dead: {self._dead}")

        def key(s: SlotState):
            free = s.kv_free_tokens
            short = free is not None and free < expected_tokens
            return (short, s.in_flight, -(free if free is not None else 0), s.sessions, s.route)

        return min(live, key=key).route

    def _overloaded(self, route: Route) -> bool:
        if self._max_in_flight is None or self._slots[route].in_flight < self._max_in_flight:
            return False
        best = self._place(0)
        return self._slots[best].in_flight < self._slots[route].in_flight

    def _release(self, route: Route) -> None:
        with self._cond:
            self._slots[route].in_flight -= 1
            self._cond.notify_all()

    def _refresh_kv(self) -> None:
        now = time.monotonic()
        for url in self.engine_urls():
            if now - self._last_refresh.get(url, 0.0) < self._refresh_interval:
                continue
            self._last_refresh[url] = now
            try:
                free = kv_free_by_dp_rank(self._get_json(url, "/get_server_info"))
            except (httpx.TransportError, RouterError) as e:
                self._mark_dead(url, str(e))
                continue
            with self._cond:
                for dp, n in free.items():
                    if Route(url, dp) in self._slots:
                        self._slots[Route(url, dp)].kv_free_tokens = n

    def _healthy(self, url: str) -> bool:
        try:
            ok = self._client.get(url + "/health").status_code == 200
        except httpx.TransportError as e:
            ok, reason = False, str(e)
        else:
            reason = "/health is not 200"
        if not ok:
            self._mark_dead(url, reason)
        return ok

    def _mark_dead(self, url: str, reason: str) -> None:
        with self._cond:
            self._dead.setdefault(url, reason)
            self._cond.notify_all()

    def _get_json(self, url: str, path: str) -> dict[str, Any]:
        resp = self._client.get(url + path)
        if resp.status_code != 200:
            raise RouterError(f"{url}{path} answered {resp.status_code}: {resp.text}")
        return resp.json()
