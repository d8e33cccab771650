"""Agent-gateway benchmark.

1. overhead: open-loop load at ``--rate`` requests/s (one-turn chat sessions) through the
   gateway (its own process) to a stub engine that answers /generate at once (its own process),
   against the same load sent straight to the stub's /generate; p50/p99 latency of both and the
   difference (the gateway's cost: OpenAI conversion, DeepSeek V4.1 encoding, tokenization,
   routing, response parsing, one more HTTP hop), and the gateway process's CPU per request.
2. prefix: multi-turn sessions through the gateway to a real embedded server (tiny, tp=2 dp=2):
   prefix-cache hit ratio (sum cached_tokens / sum prompt_tokens, turns 2+) with the gateway's
   sticky routing vs round robin over the DP ranks, what bounds any prefix cache on the same
   turns (the tokens computed in each previous turn, per token and in whole pages), and where
   each turn's new prompt tokens come from.

    python bench/gateway.py [--rate 500] [--seconds 10] [--sessions 8] [--turns 5]
                            [--only overhead|prefix]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing as mp
import random
import statistics
import time

import httpx
import psutil
from fastapi import FastAPI, Request

from sglang_dsv41.ports import free_port
from sglang_dsv41.router.base import Route
from sglang_dsv41.router.sticky import StickyRouter
from sglang_dsv41.server_process import ServerProcess


def run_stub(port: int) -> None:
    """An engine that answers at once: SGLang's /generate shape, two DP ranks."""
    import uvicorn

    from sglang_dsv41.launch_server import bind_socket

    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        ids = [104, 105, 257]
        return {"text": "hi", "output_ids": ids, "meta_info": {
            "id": "x", "prompt_tokens": len(body["input_ids"]), "completion_tokens": 3,
            "cached_tokens": 0, "dp_rank": body.get("routed_dp_rank") or 0,
            "finish_reason": {"type": "stop", "matched": 257},
            "output_token_logprobs": [[-0.1, t, None] for t in ids]}}

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def info():
        return {"dp_size": 2, "enable_dp_attention": True, "rank_stats": {}}

    @app.get("/model_info")
    async def model_info():
        return {"context_length": 4096}

    @app.get("/health")
    async def health():
        return {}

    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(
        sockets=[bind_socket("127.0.0.1", port)])


def run_gateway(engine_url: str, port: int) -> None:
    from sglang_dsv41.gateway.__main__ import main

    main(["--engine-urls", engine_url, "--model-path", "tiny", "--port", str(port)])


def wait_ready(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(url)


async def open_loop(url: str, bodies, rate: float, seconds: float, headers_of,
                    quiet: bool = False) -> list[float]:
    """Send at a fixed rate regardless of answers (aiohttp: httpx's client alone could not
    send 150/s here); latency of each, failures counted."""
    import aiohttp

    latencies: list[float] = []
    errors: list[str] = []
    # A bounded pool of keep-alive connections, as a rollout client has; a request waiting for
    # a connection counts that wait in its latency.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64),
                                     timeout=aiohttp.ClientTimeout(total=120)) as http:
        async def one(i: int):
            t0 = time.perf_counter()
            try:
                async with http.post(url, json=bodies(i), headers=headers_of(i)) as r:
                    text = await r.text()
                    if r.status != 200:
                        errors.append(f"{r.status} {text[:200]}")
                        return
            except aiohttp.ClientError as e:
                errors.append(type(e).__name__)
                return
            latencies.append(time.perf_counter() - t0)

        tasks, start = [], time.perf_counter()
        for i in range(int(rate * seconds)):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        sent = len(tasks) / (time.perf_counter() - start)
        await asyncio.gather(*tasks)
        took = time.perf_counter() - start
    if not quiet:
        print(f"    {url}: {len(latencies)} ok, {len(errors)} failed {sorted(set(errors))[:3]}, "
              f"offered {rate:.0f}/s, sent {sent:.0f}/s, answered {len(latencies) / took:.0f}/s")
    return latencies


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] * 1e3


def overhead(rate: float, seconds: float) -> None:
    ctx = mp.get_context("spawn")
    stub_port, gw_port = free_port(), free_port()
    stub = ctx.Process(target=run_stub, args=(stub_port,), daemon=True)
    stub.start()
    wait_ready(f"http://127.0.0.1:{stub_port}/health")
    gw = ctx.Process(target=run_gateway, args=(f"http://127.0.0.1:{stub_port}", gw_port),
                     daemon=True)
    gw.start()
    wait_ready(f"http://127.0.0.1:{gw_port}/health")
    try:
        msgs = [{"role": "user", "content": "run the tests and report"}]
        direct_url = f"http://127.0.0.1:{stub_port}/generate"
        gw_url = f"http://127.0.0.1:{gw_port}/v1/chat/completions"

        def engine_body(i):
            return {"input_ids": list(range(1, 60)), "sampling_params": {"max_new_tokens": 3}}

        def chat_body(i):
            return {"model": "tiny", "messages": msgs, "max_tokens": 3}

        # Steady state: one second at the rate first (first-call imports, new connections).
        asyncio.run(open_loop(direct_url, engine_body, rate, 1.0, lambda i: {}, quiet=True))
        asyncio.run(open_loop(gw_url, chat_body, rate, 1.0, lambda i: {"X-Session-ID": f"w{i}"},
                              quiet=True))
        direct = asyncio.run(open_loop(direct_url, engine_body, rate, seconds, lambda i: {}))
        cpu = psutil.Process(gw.pid)
        cpu0 = sum(cpu.cpu_times()[:2])
        through = asyncio.run(open_loop(gw_url, chat_body, rate, seconds,
                                        lambda i: {"X-Session-ID": f"s{i}"}))
        cpu_per_request = (sum(cpu.cpu_times()[:2]) - cpu0) / len(through)
    finally:
        gw.terminate()
        stub.terminate()
    for name, xs in (("stub /generate direct", direct), ("through the gateway", through)):
        print(f"  {name:24s} p50 {pct(xs, 50):7.2f} ms   p99 {pct(xs, 99):7.2f} ms")
    print(f"  gateway overhead         p50 {pct(through, 50) - pct(direct, 50):7.2f} ms   "
          f"p99 {pct(through, 99) - pct(direct, 99):7.2f} ms")
    print(f"  gateway process CPU per request: {cpu_per_request * 1e3:.2f} ms "
          f"(one free core: ~{1 / cpu_per_request:.0f} requests/s)")


class RoundRobinRouter(StickyRouter):
    """The baseline: every turn to the next DP rank, whatever its session."""

    def _acquire(self, session_id: str, expected_tokens: int) -> Route:
        with self._cond:
            if not hasattr(self, "_rr"):
                self._rr = itertools.cycle(sorted(self._slots))
            route = next(self._rr)
            self._slots[route].in_flight += 1
            return route


async def sessions_through(gateway, sessions: int, turns: int, rng: random.Random,
                           page_size: int) -> dict[str, float]:
    """Turns 2+ of every session, summed: prompt and cached tokens, what any prefix cache could
    reuse (the tokens the engine computed in the session's previous turn: its prompt and output
    but the last token, per token or in whole pages), and the new prompt tokens of each turn
    (the message's own text, the rest the chat template's)."""
    sums = dict.fromkeys(("turns", "prompt", "cached", "computed", "computed_pages", "new",
                          "text"), 0)

    async def session(s: int):
        system = "You are an agent in a repository. " + "".join(
            rng.choice("abcdefghij ") for _ in range(1500))
        msgs = [{"role": "system", "content": system}]
        prev = None
        for t in range(turns):
            msgs.append({"role": "user", "content": f"step {t}: " + "".join(
                rng.choice("klmnop ") for _ in range(40))})
            body = {"model": "tiny", "messages": msgs, "max_tokens": 16, "temperature": 0}
            conv, turn, out = await gateway.chat(f"bench-{id(gateway)}-{s}", body)
            msgs.append({"role": "assistant", "content": gateway.tokenizer.decode(
                turn.output_ids)})
            if prev is not None:
                computed = len(prev.prompt_ids) + len(prev.output_ids) - 1
                sums["turns"] += 1
                sums["prompt"] += len(turn.prompt_ids)
                sums["cached"] += turn.cached_tokens
                sums["computed"] += computed
                sums["computed_pages"] += computed // page_size * page_size
                sums["new"] += len(turn.prompt_ids) - computed - 1
                sums["text"] += len(gateway.tokenizer.encode(msgs[-2]["content"]))
            prev = turn

    await asyncio.gather(*(session(s) for s in range(sessions)))
    await gateway.router.aclose()
    return sums


def prefix(sessions: int, turns: int) -> None:
    from sglang_dsv41.gateway.__main__ import build_gateway

    layout = ["--model-path", "tiny", "--tp-size", "2", "--dp-size", "2",
              "--enable-dp-attention", "--context-length", "4096"]
    with ServerProcess(layout) as server:
        n: dict[str, float] = {}
        for name, router_cls in (("gateway (sticky)", StickyRouter),
                                 ("round robin", RoundRobinRouter)):
            server_flush = httpx.post(server.url + "/flush_cache")
            assert server_flush.status_code == 200, server_flush.text
            gw = build_gateway([server.url], "tiny")
            gw.router = router_cls([server.url])
            page = httpx.get(server.url + "/server_info").json()["page_size"]
            sums = asyncio.run(sessions_through(gw, sessions, turns, random.Random(0), page))
            print(f"  {name:18s} prefix hit ratio (turns 2-{turns}): "
                  f"{sums['cached'] / sums['prompt']:.3f}")
            if router_cls is StickyRouter:
                n = sums
        # What bounds any prefix cache on this workload (the sticky run's turns).
        print(f"  bound: every token computed in the previous turn reused "
              f"{n['computed'] / n['prompt']:.3f}, its whole pages of {page} reused "
              f"{n['computed_pages'] / n['prompt']:.3f}")
        print(f"  per turn: {n['prompt'] / n['turns']:.0f} prompt tokens, "
              f"{n['new'] / n['turns']:.0f} new ({n['text'] / n['turns']:.0f} of the message's "
              f"text, {(n['new'] - n['text']) / n['turns']:.0f} of the chat template) + 1 (the "
              f"previous turn's last output token, never computed)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rate", type=float, default=500)
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--only", choices=("overhead", "prefix"), default=None)
    a = p.parse_args()
    if a.only != "prefix":
        print(f"1. overhead at {a.rate:.0f} requests/s for {a.seconds:.0f} s (stub engine)")
        overhead(a.rate, a.seconds)
    if a.only != "overhead":
        print(f"2. prefix hit ratio, {a.sessions} sessions x {a.turns} turns, tiny tp=2 dp=2")
        prefix(a.sessions, a.turns)


if __name__ == "__main__":
    main()
