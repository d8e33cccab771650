"""StickyRouter against small real HTTP engines (FastAPI + uvicorn in threads)."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time

import orjson
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine_server_fakes import serve
from sglang_dsv41.router import NoEngineAvailable, Route, RouterError, StickyRouter


class FakeEngine:
    """Answers /generate like the server (echoing the dp rank it was pinned to)."""

    def __init__(self, dp_size: int = 2, kv_free: dict[int, int] | None = None):
        self.calls: list[dict] = []
        # Set: answers at once; cleared by a test, /generate waits until the test sets it again
        # (a turn held in flight for as long as the test needs, on a machine of any speed).
        self.release = threading.Event()
        self.release.set()
        self.kv_free = kv_free or {d: 10_000 for d in range(dp_size)}
        self.healthy = True          # False: /health answers 503 and /generate 500
        self.weight_version = "1"
        # A streamed answer: one cumulative event per entry (its size in bytes), or b"..." sent
        # as one raw data line.
        self.stream_events: list[int | bytes] = [10, 20]
        app = FastAPI()

        @app.get("/get_server_info")
        def info():
            return {"dp_size": dp_size, "enable_dp_attention": dp_size > 1,
                    "weight_version": self.weight_version,
                    "rank_stats": {str(d): {"dp_rank": d, "kv_used_tokens": 20_000 - f,
                                            "kv_total_tokens": 20_000}
                                   for d, f in self.kv_free.items()}}

        @app.get("/health")
        def health():
            return JSONResponse({}, status_code=200 if self.healthy else 503)

        @app.post("/generate")
        async def generate(request: Request):
            body = await request.json()
            if body.get("input_ids") == [-1]:
                return JSONResponse({"error": {"message": "bad token"}}, status_code=400)
            if not self.healthy:
                return JSONResponse({"error": {"message": "scheduler died"}}, status_code=500)
            self.calls.append(body)
            await asyncio.to_thread(self.release.wait, 60)
            if body.get("stream"):
                return StreamingResponse(self._events(body), media_type="text/event-stream")
            return {"text": "x", "output_ids": [1],
                    "meta_info": {"dp_rank": body.get("routed_dp_rank")}}

        self.server, self.url = serve(app, "error")
        self.port = self.server.config.port

    async def _events(self, body: dict):
        for i, event in enumerate(self.stream_events):
            if isinstance(event, bytes):
                yield b"data: " + event + b"\n\n"
                continue
            last = i == len(self.stream_events) - 1
            chunk = {"text": "x" * event, "output_ids": [1] * (i + 1), "meta_info": {
                "dp_rank": body.get("routed_dp_rank"),
                "finish_reason": {"type": "length"} if last else None}}
            yield b"data: " + orjson.dumps(chunk) + b"\n\n"
        yield b"data: [DONE]\n\n"

    def stop(self) -> None:
        self.release.set()
        self.server.stop(5)


@pytest.fixture
def engines():
    started: list[FakeEngine] = []

    def make(**kw) -> FakeEngine:
        started.append(FakeEngine(**kw))
        return started[-1]

    yield make
    for e in started:
        e.stop()


def turn(router, sid, tokens=8):
    return router.generate(sid, {"input_ids": [1, 2], "sampling_params": {}}, tokens)


def test_session_stays_on_its_engine_and_dp_rank(engines):
    a, b = engines(), engines()
    router = StickyRouter([a.url, b.url])
    routes = {}
    for sid in [f"s{i}" for i in range(8)]:
        seen = {tuple(turn(router, sid)["meta_info"]["route"]) for _ in range(3)}
        assert len(seen) == 1, f"{sid} moved between {seen}"
        routes[sid] = seen.pop()
    # Every slot (2 engines x 2 DP ranks) got two sessions: placement spreads by session count.
    assert sorted(list(routes.values()).count(r) for r in set(routes.values())) == [2, 2, 2, 2]
    for call in a.calls + b.calls:
        assert call["routed_dp_rank"] in (0, 1)
    assert router.route_of("s0") == Route(*routes["s0"])
    router.end_session("s0")
    assert router.route_of("s0") is None


def in_flight_soon(router, n: int) -> None:
    deadline = time.monotonic() + 30
    while sum(s.in_flight for s in router.slot_states()) != n:
        assert time.monotonic() < deadline, router.slot_states()
        time.sleep(0.01)


def test_new_sessions_avoid_busy_and_kv_short_slots(engines):
    e = engines(dp_size=2, kv_free={0: 50, 1: 10_000})
    router = StickyRouter([e.url], refresh_interval=0.0)
    # Slot 0 has 50 free KV tokens: a 500-token session goes to slot 1.
    assert turn(router, "big", tokens=500)["meta_info"]["route"][1] == 1
    # While "busy" runs on one slot, the next new session is placed on the idle one.
    e.release.clear()
    t = threading.Thread(target=turn, args=(router, "busy", 10))
    t.start()
    in_flight_soon(router, 1)
    busy = router.route_of("busy")
    assert router.route_of("x") is None
    placed = threading.Thread(target=turn, args=(router, "x", 10))
    placed.start()
    in_flight_soon(router, 2)
    assert router.route_of("x") != busy
    e.release.set()
    t.join(30)
    placed.join(30)


def test_a_rank_without_kv_stats_still_gets_new_sessions(engines):
    # Rank 1 reports no free KV (not served yet): free KV cannot rank it, session counts do.
    e = engines(dp_size=2, kv_free={0: 95})
    router = StickyRouter([e.url], refresh_interval=0.0)
    assert {turn(router, sid)["meta_info"]["route"][1] for sid in ("a", "b")} == {0, 1}
    # With both reported, more free KV wins over fewer sessions.
    e.kv_free[1] = 50
    assert turn(router, "c")["meta_info"]["route"][1] == 0


def test_failover_when_an_engine_dies(engines):
    a, b = engines(dp_size=1), engines(dp_size=1)
    router = StickyRouter([a.url, b.url])
    first = {sid: turn(router, sid)["meta_info"]["route"][0] for sid in ("s1", "s2")}
    assert set(first.values()) == {a.url, b.url}
    victim = next(s for s, u in first.items() if u == a.url)
    a.stop()
    assert turn(router, victim)["meta_info"]["route"][0] == b.url
    assert Route(a.url, 0) in router.dead_slots() and router.engine_urls() == [b.url]
    b.stop()
    with pytest.raises(NoEngineAvailable):
        turn(router, "s3")


class ResettingProxy:
    """A TCP proxy on loopback in front of an engine that, once armed, resets (RST, SO_LINGER 0)
    the client connection whose next request is a POST /generate: what a client sees when it
    sends on a keep-alive connection the server is closing at that moment."""

    def __init__(self, port: int):
        self.arm = threading.Event()
        self.resets = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.target = port
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False),
                             daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        try:
            while data := src.recv(65536):
                if from_client and self.arm.is_set() and data.startswith(b"POST /generate"):
                    self.arm.clear()
                    self.resets += 1
                    src.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    break
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            sock.close()

    def close(self) -> None:
        self.listener.close()


def test_a_reset_connection_is_tried_again_not_a_dead_engine(engines):
    # The engine answers its /health probe: the reset was the connection's, so the turn goes
    # again to the same slot and no rank is marked dead (marking the engine dead left a trainer
    # with no engine at all).
    engine = engines(dp_size=2)
    proxy = ResettingProxy(engine.port)
    try:
        router = StickyRouter([proxy.url])
        route = turn(router, "s1")["meta_info"]["route"]
        proxy.arm.set()
        assert turn(router, "s1")["meta_info"]["route"] == route
        assert proxy.resets == 1 and not router.dead_slots()
        assert len(engine.calls) == 2
    finally:
        proxy.close()


def test_a_timed_out_turn_fails_with_504_and_its_live_engine_stays_live(engines):
    # A turn slower than the router's timeout, on an engine that answers /health, is a slow
    # turn: it fails (504), and the engine keeps its sessions (it was marked dead for good).
    engine = engines(dp_size=1)
    router = StickyRouter([engine.url], timeout=0.5)
    engine.release.clear()
    with pytest.raises(RouterError, match="no answer in 0.5s") as e:
        turn(router, "s1")
    assert e.value.status == 504 and not router.dead_slots()
    assert len(engine.calls) == 1
    engine.release.set()
    assert turn(router, "s1")["meta_info"]["route"] == [engine.url, 0]
    assert router.engine_urls() == [engine.url]


def test_a_dead_engine_is_probed_again_and_revived(engines):
    # Its turn failed with a 500 and its /health with a 503: dead. Probed again after
    # revive_interval (by a turn, or by refresh(): the gateway's /health), it is live again
    # once it answers.
    a = engines(dp_size=2)
    router = StickyRouter([a.url], revive_interval=0.3)
    a.healthy = False
    with pytest.raises(NoEngineAvailable, match="every engine rank is dead"):
        turn(router, "s1")
    assert set(router.dead_slots()) == {Route(a.url, 0), Route(a.url, 1)}
    with pytest.raises(NoEngineAvailable):  # still down when probed again
        time.sleep(0.3)
        turn(router, "s1")
    a.healthy = True
    time.sleep(0.3)
    router.refresh()
    assert router.engine_urls() == [a.url] and not router.dead_slots()
    assert turn(router, "s1")["meta_info"]["route"][0] == a.url


def test_an_engine_that_missed_a_weight_update_stays_dead(engines):
    # A weight update goes to the live engines only: revived on its old weights, an engine
    # would roll out another policy. It stays dead until it serves the live engines' version.
    a, b = engines(dp_size=1), engines(dp_size=1)
    router = StickyRouter([a.url, b.url], revive_interval=0.2, refresh_interval=0.0)
    a.healthy = False
    for sid in ("s1", "s2"):
        assert turn(router, sid)["meta_info"]["route"][0] == b.url
    assert Route(a.url, 0) in router.dead_slots()
    b.weight_version = "2"
    a.healthy = True
    time.sleep(0.2)
    assert turn(router, "s3")["meta_info"]["route"][0] == b.url
    assert "missed a weight update" in router.dead_slots()[Route(a.url, 0)]
    a.weight_version = "2"
    time.sleep(0.2)
    router.refresh()
    assert router.engine_urls() == sorted([a.url, b.url])


def test_a_live_engine_serving_another_weight_version_is_out_until_a_push(engines):
    # A live engine restarted on its base weights (or left half-pushed) reports another
    # weight_version: taken out like one that missed an update; the trainer's push to it
    # (weights_updated) brings it back at once, whatever revive_interval.
    a, b = engines(dp_size=1), engines(dp_size=1)
    a.weight_version = b.weight_version = "step-1"
    router = StickyRouter([a.url, b.url], revive_interval=60.0, refresh_interval=0.0)
    router.weights_updated("step-1", [a.url, b.url])
    a.weight_version = "default"
    for sid in ("s1", "s2", "s3"):
        assert turn(router, sid)["meta_info"]["route"][0] == b.url
    reason = router.dead_slots()[Route(a.url, 0)]
    assert "weight_version default" in reason and "step-1" in reason
    a.weight_version = "step-1"  # what the push does, then:
    router.weights_updated("step-1", [a.url, b.url])
    assert router.engine_urls() == sorted([a.url, b.url]) and not router.dead_slots()
    # Without a push the majority decides; paused (a push relabelling the engines one by
    # one) nobody is taken out.
    c = engines(dp_size=1)
    plain = StickyRouter([a.url, b.url, c.url], refresh_interval=0.0)
    with plain.paused():
        c.weight_version = "step-2"
        plain.refresh()
        assert not plain.dead_slots()
    plain.refresh()
    assert list(plain.dead_slots()) == [Route(c.url, 0)]
    # An engine with a dead rank due for its revival probe: its live rank on another version
    # is taken out all the same (it stayed live while the probe ran)
    d = engines(dp_size=2)
    d.weight_version = "step-1"
    mixed = StickyRouter([d.url, b.url], revive_interval=0.0, refresh_interval=0.0)
    mixed.weights_updated("step-1", [d.url, b.url])
    mixed._mark_dead(d.url, 1, "rank 1 failed a turn")
    d.weight_version = "default"
    mixed.refresh()
    assert mixed.engine_urls() == [b.url]
    assert "weight_version default" in mixed.dead_slots()[Route(d.url, 0)]


def stream(router, sid):
    async def run():
        try:
            return [c async for c in router.astream(sid, {"input_ids": [1, 2]}, 8)]
        finally:
            await router.aclose()
    return asyncio.run(run())


def test_a_stream_reads_chunks_of_any_size(engines):
    # The engine's cumulative chunks (every id and logprob so far) pass aiohttp's 512 KiB line
    # limit at about 12k tokens: a long turn must still arrive whole.
    e = engines(dp_size=1)
    e.stream_events = [600_000, 1_300_000]
    router = StickyRouter([e.url])
    chunks = stream(router, "s1")
    assert [len(c["text"]) for c in chunks] == [600_000, 1_300_000]
    assert chunks[-1]["meta_info"]["route"] == [e.url, 0] and not router.dead_slots()


def test_an_unreadable_stream_fails_the_turn_with_a_router_error(engines):
    e = engines(dp_size=1)
    e.stream_events = [10, b"{not json"]
    router = StickyRouter([e.url])
    with pytest.raises(RouterError, match="stream could not be read: JSONDecodeError") as err:
        stream(router, "s1")
    assert err.value.status == 502 and not router.dead_slots()
    assert all(s.in_flight == 0 for s in router.slot_states())


def test_pause_blocks_new_turns_and_drain_waits(engines):
    e = engines(dp_size=1)
    router = StickyRouter([e.url])
    e.release.clear()
    t = threading.Thread(target=turn, args=(router, "a"))
    t.start()
    in_flight_soon(router, 1)
    assert not router.drain(timeout=0.01)
    e.release.set()
    assert router.drain(timeout=5)
    done = []
    with router.paused():
        blocked = threading.Thread(target=lambda: done.append(turn(router, "b")))
        blocked.start()
        time.sleep(0.3)
        assert not done, "a turn ran while the router was paused"
    blocked.join(5)
    assert done
    t.join()


def test_client_errors_are_not_retried(engines):
    e = engines(dp_size=1)
    router = StickyRouter([e.url])
    with pytest.raises(RouterError, match="400") as refused:
        router.generate("s", {"input_ids": [-1]})
    assert (refused.value.status, refused.value.reason) == (400, "bad token")
    assert router.engine_urls() == [e.url]
    with pytest.raises(ValueError):
        StickyRouter([])
