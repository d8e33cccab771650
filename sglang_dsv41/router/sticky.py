"""StickyRouter: pins each session to (engine url, dp_rank); places by load and KV budget.

Placement of a new session: among the live slots (one per engine and DP rank), those whose free
KV tokens cover ``expected_tokens`` are preferred; among them the fewest in-flight turns win,
then the most free KV tokens (only when every live slot reports them), then the fewest pinned
sessions. Free KV and each rank's health come from each engine's /get_server_info
(``rank_stats[dp].kv_total_tokens - kv_used_tokens``, ``rank_health[dp].healthy``), refreshed
at most every ``refresh_interval`` seconds.

Health is per slot: a rank the engine reports unhealthy, or whose ``/health?dp_rank=N`` fails
after a 5xx, is dead and only its sessions move; a timeout, or a refused or dropped connection
whose ``/health`` probe fails too, kills every slot of that engine (a dropped connection whose
engine answers its probe was the connection's fault, not a dead engine: the turn is tried
again; a timed-out turn whose engine answers its probe was a slow turn: it fails with a 504
and the engine stays live). Dead is not for good: an engine with dead slots has its
``/health`` probed again at most every ``revive_interval`` seconds, when a turn starts or the
gateway checks its health, and once it answers, its slots live again except the ranks its
/get_server_info still reports unhealthy (and none while it serves another weight_version than
the expected one: the last weight update's, ``weights_updated``, else the live engines'
majority); a live engine seen serving another one (restarted on its base weights, or half
pushed) is marked dead the same way, until a push brings it up to date. A moved session is
re-pinned on its next turn (a turn boundary), with its whole history in that turn's prompt
(the prefix is recomputed there). With ``max_in_flight``, a session whose slot already has
that many turns in flight is moved, at its turn boundary, to the best live slot when that one
has fewer.

The placement, retry and health policy of a turn is one generator of HTTP calls (``_turn``);
``generate`` drives it with a blocking httpx client (the trainer), ``agenerate``/``astream``
with a pooled keep-alive aiohttp session (the agent gateway): measured on the gateway's
stub-engine benchmark, httpx's async client cost 0.6-2.0 ms of CPU per call (its pool scans
every connection per request), aiohttp's 0.1 ms.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, AsyncIterator, Generator

import aiohttp
import httpx
import orjson

from .base import (SSE_DONE, NoEngineAvailable, Route, RouterError, SessionRouter,
                   engine_error_message, parse_sse_line)

JSON_HEADERS = {"content-type": "application/json"}
# How long the router keeps an idle connection to an engine: under the engines' own keep-alive
# (SGLang 0.5.23 and uvicorn: 5 s), so that it never sends on a connection the server is
# closing at that moment, which the server answers with a reset (at equal timeouts, httpx's
# default, a trainer whose step took about 5 s saw its engine's both ranks reset at once).
ENGINE_KEEPALIVE_S = 2.0
# A health or info probe waits this long at most: a wedged engine must not hold a turn (or the
# gateway's /health) for the router's whole generation timeout.
PROBE_TIMEOUT_S = 10.0


@dataclass
class SlotState:
    route: Route
    in_flight: int = 0
    sessions: int = 0
    kv_free_tokens: int | None = None   # None: unknown (engine does not report it)


@dataclass(frozen=True)
class Call:
    """One HTTP call the turn policy wants made; ``stream``: answer once the head arrived;
    ``timeout``: seconds, else the router's own."""
    method: str
    url: str
    body: dict[str, Any] | None = None
    stream: bool = False
    timeout: float | None = None


@dataclass
class Reply:
    """An engine's answer to a Call, whichever client made it."""
    status_code: int
    body: bytes = b""       # the whole body (empty for an accepted stream)
    stream: Any = None      # an accepted stream call's open aiohttp response

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")


class TransportFailure(Exception):
    """The engine could not be reached, dropped the connection or timed out; the engine is
    taken for dead only when its /health probe fails too (``_turn``)."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


def kv_free_by_dp_rank(server_info: dict[str, Any]) -> dict[int, int]:
    """Free KV tokens per DP rank from a /get_server_info body (missing stats are skipped)."""
    out = {}
    for key, st in (server_info.get("rank_stats") or {}).items():
        if isinstance(st, dict) and "kv_total_tokens" in st and "kv_used_tokens" in st:
            used, total = int(st["kv_used_tokens"]), int(st["kv_total_tokens"])
            out[int(st.get("dp_rank", key))] = total - used
    return out


def unhealthy_dp_ranks(server_info: dict[str, Any]) -> dict[int, str]:
    """dp_rank -> reason for the ranks a /get_server_info body reports down (an engine without
    ``rank_health``, e.g. SGLang's, reports none: its /health covers every rank)."""
    return {int(d): str(h.get("reason") or "reported unhealthy")
            for d, h in (server_info.get("rank_health") or {}).items()
            if isinstance(h, dict) and not h.get("healthy", True)}


def dp_size_of(server_info: dict[str, Any]) -> int:
    if server_info.get("enable_dp_attention"):
        return int(server_info.get("dp_size", 1))
    return 1


class StickyRouter(SessionRouter):
    def __init__(self, engine_urls: list[str], *, api_key: str | None = None,
                 timeout: float = 300.0, refresh_interval: float = 1.0, max_attempts: int = 3,
                 client: httpx.Client | None = None, max_in_flight: int | None = None,
                 revive_interval: float = 5.0):
        if not engine_urls:
            raise ValueError("StickyRouter needs at least one engine url")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = client or httpx.Client(
            timeout=timeout, headers=headers,
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=256,
                                keepalive_expiry=ENGINE_KEEPALIVE_S))
        self._refresh_interval, self._max_attempts = refresh_interval, max_attempts
        self._revive_interval = revive_interval
        self._max_in_flight = max_in_flight
        self._timeout = timeout
        self._headers = headers
        self._session: aiohttp.ClientSession | None = None   # made in the caller's event loop
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._cond = threading.Condition()
        self._slots: dict[Route, SlotState] = {}
        self._pins: dict[str, Route] = {}
        self._dead: dict[Route, str] = {}        # slot -> reason
        self._paused = False
        self._last_refresh: dict[str, float] = {}
        self._last_probe: dict[str, float] = {}  # url -> when its dead slots were last probed
        # The weight_version every engine should serve: the last weight update's
        # (weights_updated), else None: the version most live engines report.
        self._expected_version: str | None = None
        self._versions: dict[str, str] = {}      # url -> weight_version it last reported
        for url in engine_urls:
            url = url.rstrip("/")
            try:
                info = self._get_json(url, "/get_server_info")
            except httpx.TransportError as e:
                raise NoEngineAvailable(f"engine {url} is unreachable: {e}") from e
            for dp in range(dp_size_of(info)):
                self._slots[Route(url, dp)] = SlotState(Route(url, dp))
            self._apply_server_info(url, info)
            if info.get("weight_version") is not None:
                self._versions[url] = str(info["weight_version"])
            self._last_refresh[url] = time.monotonic()

    # ---- SessionRouter ----------------------------------------------------------------------
    def generate(self, session_id: str, payload: dict[str, Any],
                 expected_tokens: int = 0) -> dict[str, Any]:
        route, reply = self._drive(self._turn(session_id, payload, expected_tokens))
        try:
            return self._output(route, reply.body)
        finally:
            self._release(route)

    async def agenerate(self, session_id: str, payload: dict[str, Any],
                        expected_tokens: int = 0) -> dict[str, Any]:
        """generate() for an event loop (the agent gateway): the same placement and retries,
        the engine calls on the shared aiohttp session."""
        route, reply = await self._adrive(self._turn(session_id, payload, expected_tokens))
        try:
            return self._output(route, reply.body)
        finally:
            self._release(route)

    async def astream(self, session_id: str, payload: dict[str, Any],
                      expected_tokens: int = 0) -> AsyncIterator[dict[str, Any]]:
        """One turn with ``"stream": true``: the engine's SSE chunks (SGLang's: cumulative text,
        output_ids and meta_info) as they arrive, each with ``meta_info.route``. Placement and
        retries happen before the first chunk; closing the iterator early (the client went
        away) closes the engine connection, which aborts the request there. Every failure
        after that raises a RouterError (NoEngineAvailable when the engine is dead)."""
        route, reply = await self._adrive(self._turn(session_id, dict(payload, stream=True),
                                                     expected_tokens, stream=True))
        where = f"{route.url} dp_rank {route.dp_rank}"
        resp: aiohttp.ClientResponse = reply.stream
        done = False
        try:
            async for line in _lines(resp.content):
                chunk = parse_sse_line(line, where)
                if chunk is None:
                    continue
                if chunk is SSE_DONE:
                    done = True
                    return
                chunk.setdefault("meta_info", {})["route"] = [route.url, route.dp_rank]
                yield chunk
            failure, timed_out = "the stream ended without [DONE]", False
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            failure = f"{type(e).__name__} mid-stream: {e}"
            timed_out = isinstance(e, asyncio.TimeoutError)
        except RouterError:
            raise
        except Exception as e:
            # Whatever else goes wrong reading the stream (a chunk that is not JSON) fails the
            # turn with a message the gateway can send, not a torn client stream.
            raise RouterError(f"{where}: the engine's stream could not be read: "
                              f"{type(e).__name__}: {e}", 502) from e
        finally:
            # Closing a stream that did not finish drops its connection: the engine aborts the
            # request. A finished one goes back to the pool.
            if done:
                resp.release()
            else:
                resp.close()
            self._release(route)
        # The stream broke off: the engine is dead only if it does not answer /health either.
        if await self._adrive(self._answers_health(route, failure)):
            raise RouterError(f"{where}: {failure} (the engine answers /health)",
                              504 if timed_out else 502)
        raise NoEngineAvailable(f"{where} failed mid-stream: {failure}")

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
            return sorted({r.url for r in self._slots if r not in self._dead})

    def all_engine_urls(self) -> list[str]:
        with self._cond:
            return sorted({r.url for r in self._slots})

    def refresh(self) -> None:
        """What a turn does first: re-read stale engines' stats and probe the dead ones due
        for it (a health check that must see a revived engine even while no turn comes)."""
        self._drive(self._refresh())

    async def arefresh(self) -> None:
        await self._adrive(self._refresh())

    # ---- introspection (tests, telemetry) ------------------------------------------------------
    def slot_states(self) -> list[SlotState]:
        with self._cond:
            return [SlotState(s.route, s.in_flight, s.sessions, s.kv_free_tokens)
                    for s in self._slots.values()]

    def dead_slots(self) -> dict[Route, str]:
        with self._cond:
            return dict(self._dead)

    def close(self) -> None:
        self._client.close()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ---- the turn policy ------------------------------------------------------------------------
    def _turn(self, session_id: str, payload: dict[str, Any], expected_tokens: int,
              stream: bool = False) -> Generator[Call, Any, tuple[Route, Reply]]:
        """Placement, retries and health checks of one turn as a generator: it yields the HTTP
        calls to make and receives each one's Reply (or TransportFailure); it returns the
        accepted /generate (route, 200 reply), whose slot stays in flight until the caller's
        ``_release(route)``, or raises."""
        yield from self._refresh()
        last_error: str | None = None
        for _ in range(self._max_attempts):
            route = self._acquire(session_id, expected_tokens)
            body = dict(payload, routed_dp_rank=route.dp_rank)
            body.pop("data_parallel_rank", None)
            try:
                resp = yield Call("POST", route.url + "/generate", body, stream)
            except BaseException:  # the caller gave up (cancelled): the slot is free again
                self._release(route)
                raise
            if not isinstance(resp, TransportFailure) and resp.status_code == 200:
                return route, resp
            self._release(route)
            last_error = f"{route.url} dp_rank {route.dp_rank}: {_describe(resp)}"
            broken = isinstance(resp, TransportFailure)
            if not broken and resp.status_code < 500:
                raise RouterError(f"{route.url}/generate answered {resp.status_code}: "
                                  f"{resp.text}", resp.status_code, engine_error_message(resp.body))
            # A dropped connection, a timeout or a 5xx: retry elsewhere only if the rank is
            # down. Up, a 5xx is this request's fault, a timeout a turn slower than the
            # router's timeout (retried elsewhere it would be as slow), and a dropped
            # connection was the connection's (tried again).
            if not (yield from self._answers_health(route, _describe(resp) if broken else None)):
                continue
            if broken and resp.timed_out:
                raise RouterError(f"{route.url} dp_rank {route.dp_rank}: no answer in "
                                  f"{self._timeout:g}s ({resp}); the engine answers /health, "
                                  "so the turn failed, not the engine", 504)
            if not broken:
                raise RouterError(f"{route.url}/generate answered {resp.status_code}: "
                                  f"{resp.text}", resp.status_code, engine_error_message(resp.body))
        raise NoEngineAvailable(f"session {session_id}: no engine answered after "
                                f"{self._max_attempts} attempts (last error: {last_error})")

    def _answers_health(self, route: Route, failure: str | None
                        ) -> Generator[Call, Any, bool]:
        """After a failed call on ``route``: True when its /health?dp_rank answers 200; else
        its slot (another status) or its whole engine (no answer: ``failure``, or the probe's
        own error) is marked dead."""
        health = yield Call("GET", f"{route.url}/health?dp_rank={route.dp_rank}",
                            timeout=PROBE_TIMEOUT_S)
        if isinstance(health, TransportFailure):
            self._mark_dead(route.url, None, failure or _describe(health))
            return False
        if health.status_code != 200:
            self._mark_dead(route.url, route.dp_rank, f"/health: {_describe(health)}")
            return False
        return True

    def _aio_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            self._session_loop = loop
            self._session = aiohttp.ClientSession(
                headers={**self._headers, **JSON_HEADERS},
                connector=aiohttp.TCPConnector(limit=512, keepalive_timeout=ENGINE_KEEPALIVE_S),
                # No total limit: a streamed turn lasts as long as it generates.
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=30,
                                              sock_read=self._timeout))
        return self._session

    def _drive(self, turn: Generator[Call, Any, Any]) -> Any:
        """Runs ``_turn`` (or another generator of Calls) on the blocking httpx client."""
        try:
            call = next(turn)
            while True:
                try:
                    resp = self._client.request(
                        call.method, call.url, headers=JSON_HEADERS,
                        content=None if call.body is None else orjson.dumps(call.body),
                        timeout=call.timeout or httpx.USE_CLIENT_DEFAULT)
                    reply: Reply | TransportFailure = Reply(resp.status_code, resp.content)
                except httpx.TransportError as e:
                    reply = TransportFailure(f"{type(e).__name__}: {e}",
                                             isinstance(e, httpx.TimeoutException))
                call = turn.send(reply)
        except StopIteration as done:
            return done.value
        finally:
            turn.close()

    async def _adrive(self, turn: Generator[Call, Any, Any]) -> Any:
        """Runs ``_turn`` (or another generator of Calls) on the shared aiohttp session."""
        http = self._aio_session()
        try:
            call = next(turn)
            while True:
                try:
                    resp = await http.request(
                        call.method, call.url,
                        data=None if call.body is None else orjson.dumps(call.body),
                        **({"timeout": aiohttp.ClientTimeout(total=call.timeout)}
                           if call.timeout else {}))
                    if call.stream and resp.status == 200:
                        reply: Reply | TransportFailure = Reply(200, stream=resp)
                    else:
                        async with resp:
                            reply = Reply(resp.status, await resp.read())
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    reply = TransportFailure(f"{type(e).__name__}: {e}",
                                             isinstance(e, asyncio.TimeoutError))
                call = turn.send(reply)
        except StopIteration as done:
            return done.value
        finally:
            turn.close()

    def _refresh(self) -> Generator[Call, Any, None]:
        """Re-reads /get_server_info of live engines older than ``refresh_interval``, and
        probes the /health of engines with dead slots not probed for ``revive_interval``: one
        that answers has its slots revived, but for the ranks its info reports unhealthy, and
        only if it serves the expected weight_version (``_reference_versions``: revived on
        older weights, it would roll out with another policy). A live engine whose re-read
        info reports another weight_version (it restarted on its base weights, or a push to it
        failed half-way) is marked dead the same way; not while the router is paused (a
        weight update in progress relabels the engines one after the other)."""
        stale, due = self._due_engines()
        answered = []
        for url in due:
            health = yield Call("GET", url + "/health", timeout=PROBE_TIMEOUT_S)
            if not isinstance(health, TransportFailure) and health.status_code == 200:
                answered.append(url)
        if answered:  # the live engines' versions now, not as of their last refresh
            stale = self.engine_urls()
        infos = {}
        for url in dict.fromkeys(stale + answered):
            resp = yield Call("GET", url + "/get_server_info", timeout=PROBE_TIMEOUT_S)
            if isinstance(resp, TransportFailure) or resp.status_code != 200:
                self._mark_dead(url, None, f"/get_server_info failed: {_describe(resp)}")
                continue
            infos[url] = orjson.loads(resp.body)
            if url not in answered:
                self._apply_server_info(url, infos[url])
        with self._cond:
            for url, info in infos.items():
                if info.get("weight_version") is not None:
                    self._versions[url] = str(info["weight_version"])
            paused = self._paused
        expected = self._reference_versions()
        for url, info in infos.items():
            version = info.get("weight_version")
            wrong = bool(expected) and version is not None and str(version) not in expected
            if wrong and not paused:
                self._mark_dead(url, None, self._version_reason(version, expected), replace=True)
            elif url in answered and not wrong:
                self._apply_server_info(url, info, revive=True)

    def weights_updated(self, version: str, urls: list[str]) -> None:
        """A weight update labelled ``version`` reached ``urls`` (the trainer's push, which
        every scheduler rank of an engine takes part in): every engine must serve ``version``
        from now on, and the dead slots of ``urls`` (a restarted engine the push brought up to
        date) live again at once; their info is re-read on the next turn (a rank it reports
        unhealthy is dead again)."""
        with self._cond:
            self._expected_version = str(version)
            for url in urls:
                url = url.rstrip("/")
                self._versions[url] = str(version)
                self._last_refresh[url] = float("-inf")
                for route in [r for r in self._dead if r.url == url]:
                    del self._dead[route]
            self._cond.notify_all()

    def _reference_versions(self) -> set[str]:
        """The weight_version(s) an engine may serve and stay live: the last weight update's,
        else the one most live engines last reported (none when they tie)."""
        with self._cond:
            if self._expected_version is not None:
                return {self._expected_version}
            live = [self._versions[u] for u in self.engine_urls() if u in self._versions]
        counts = Counter(live).most_common()
        if not counts:
            return set()
        if len(counts) > 1 and counts[0][1] == counts[1][1]:
            return set(live)  # no majority: none of them is singled out
        return {counts[0][0]}

    def _version_reason(self, version: Any, expected: set[str]) -> str:
        return (f"weight_version {version}, the engines should serve {sorted(expected)}: it "
                "restarted or missed a weight update")

    def _output(self, route: Route, content: bytes) -> dict[str, Any]:
        out = orjson.loads(content)
        out.setdefault("meta_info", {})["route"] = [route.url, route.dp_rank]
        return out

    # ---- internals ------------------------------------------------------------------------------
    def _acquire(self, session_id: str, expected_tokens: int) -> Route:
        with self._cond:
            while self._paused:
                self._cond.wait()
            route = self._pins.get(session_id)
            if route is not None and (route in self._dead or self._overloaded(route)):
                self._slots[route].sessions -= 1
                route = None
            if route is None:
                route = self._place(expected_tokens)
                self._pins[session_id] = route
                self._slots[route].sessions += 1
            self._slots[route].in_flight += 1
            return route

    def _place(self, expected_tokens: int) -> Route:
        live = [s for s in self._slots.values() if s.route not in self._dead]
        if not live:
            dead = "; ".join(f"{r.url} dp_rank {r.dp_rank}: {m}" for r, m in self._dead.items())
            raise NoEngineAvailable(f"every engine rank is dead ({dead})")

        # Free KV orders slots only when every live slot reports it: a rank that has not
        # reported yet (an engine lists a rank's stats once it served something) or never does
        # would otherwise lose to any rank with a single free token.
        ranked_by_free = all(s.kv_free_tokens is not None for s in live)

        def key(s: SlotState):
            free = s.kv_free_tokens
            short = free is not None and free < expected_tokens
            return (short, s.in_flight, -free if ranked_by_free else 0, s.sessions, s.route)

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

    def _due_engines(self) -> tuple[list[str], list[str]]:
        """(live engines whose free KV and rank health are older than ``refresh_interval``,
        engines with dead slots not probed for ``revive_interval``), claimed here so that
        concurrent turns do not all refresh or probe the same engine."""
        now = time.monotonic()
        with self._cond:   # an RLock: engine_urls takes it again
            stale = [url for url in self.engine_urls()
                     if now - self._last_refresh.get(url, 0.0) >= self._refresh_interval]
            for url in stale:
                self._last_refresh[url] = now
            due = sorted({r.url for r in self._dead
                          if now - self._last_probe.get(r.url, 0.0) >= self._revive_interval})
            for url in due:
                self._last_probe[url] = now
        return stale, due

    def _apply_server_info(self, url: str, info: dict[str, Any], revive: bool = False) -> None:
        """Free KV and rank health of an engine; ``revive``: it answered its /health probe, its
        dead slots live again (the ranks this info reports unhealthy stay dead)."""
        free = kv_free_by_dp_rank(info)
        unhealthy = unhealthy_dp_ranks(info)
        with self._cond:
            if revive:
                for route in [r for r in self._dead if r.url == url]:
                    if route.dp_rank not in unhealthy:
                        del self._dead[route]
                self._cond.notify_all()
            for dp, n in free.items():
                if Route(url, dp) in self._slots:
                    self._slots[Route(url, dp)].kv_free_tokens = n
        for dp, reason in unhealthy.items():
            self._mark_dead(url, dp, reason)

    def _mark_dead(self, url: str, dp_rank: int | None, reason: str,
                   replace: bool = False) -> None:
        """One slot (``dp_rank``) or, for None, every slot of the engine; probed again for
        revival after ``revive_interval``."""
        with self._cond:
            for route in self._slots:
                if route.url == url and dp_rank in (None, route.dp_rank):
                    if route not in self._dead:
                        self._last_probe[url] = time.monotonic()
                    if replace:
                        self._dead[route] = reason
                    else:
                        self._dead.setdefault(route, reason)
            self._cond.notify_all()

    def _get_json(self, url: str, path: str) -> dict[str, Any]:
        resp = self._client.get(url + path)
        if resp.status_code != 200:
            raise RouterError(f"{url}{path} answered {resp.status_code}: {resp.text}")
        return orjson.loads(resp.content)


def _describe(resp: Reply | TransportFailure) -> str:
    if isinstance(resp, TransportFailure):
        return str(resp)
    return f"HTTP {resp.status_code}: {resp.text[:300]}"


async def _lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The lines of a response body, however long: aiohttp's own line reader refuses lines
    over 512 KiB (LineTooLong), and an engine's cumulative SSE chunk (every id and logprob so
    far) passes that at about 12k tokens. Each byte is searched once."""
    buf = bytearray()
    async for data in content.iter_any():
        searched = len(buf)
        buf += data
        start = 0
        while (end := buf.find(b"\n", searched)) >= 0:
            yield bytes(buf[start:end])
            start = searched = end + 1
        del buf[:start]
    if buf:
        yield bytes(buf)
