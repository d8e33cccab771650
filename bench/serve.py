"""Serving benchmark of the embedded engine (tiny preset, CPU or GPU).

Starts ``python -m sglang_dsv41.launch_server`` itself for each layout, then prints
1. throughput: requests/s and output tokens/s for 1, 2 and 4 scheduler ranks
   (tp=1 dp=1; tp=2 dp=2 attn_tp=1; tp=4 dp=2 attn_tp=2, all with DP attention when dp > 1);
2. the prefix-cache hit ratio (sum cached_tokens / sum prompt_tokens) of a multi-turn workload
   (sessions of several turns, each turn's prompt = the previous prompt + output + new user
   tokens) dispatched pinned (routed_dp_rank fixed per session) vs round robin;
3. the decode time per token of one request at several context lengths (tp=1): a request of
   1 + --decode-tokens new tokens minus one of 1, each on its own fresh prompt (no prefix hit),
   median of 3; how a decode step's cost grows with the context.

    python bench/serve.py [--requests 32] [--concurrency 8] [--sessions 8] [--turns 4]
    python bench/serve.py --decode-only [--decode-contexts 256,1024,3072]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import httpx

from sglang_dsv41.server_process import ServerProcess

LAYOUTS = [("tp=1 dp=1", ["--tp-size", "1"]),
           ("tp=2 dp=2 (attn_tp=1)", ["--tp-size", "2", "--dp-size", "2",
                                      "--enable-dp-attention"]),
           ("tp=4 dp=2 (attn_tp=2)", ["--tp-size", "4", "--dp-size", "2",
                                      "--enable-dp-attention"])]


async def post(http: httpx.AsyncClient, body: dict) -> dict:
    r = await http.post("/generate", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"/generate failed {r.status_code}: {r.text}")
    return r.json()


async def throughput(url: str, n: int, concurrency: int, prompt_len: int, new_tokens: int,
                     rng: random.Random) -> tuple[float, float]:
    prompts = [[rng.randrange(256) for _ in range(prompt_len)] for _ in range(n)]
    sem = asyncio.Semaphore(concurrency)

    async def one(http, ids):
        async with sem:
            out = await post(http, {"input_ids": ids, "sampling_params": {
                "max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 0}})
            return out["meta_info"]["completion_tokens"]

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await one(http, prompts[0])  # warm-up, not timed
        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(one(http, p) for p in prompts))
        dt = time.perf_counter() - t0
    return n / dt, sum(tokens) / dt


async def multi_turn(url: str, dp_size: int, sessions: int, turns: int, pinned: bool,
                     rng: random.Random) -> tuple[float, int, int]:
    """Sessions run concurrently, their turns in order. Returns (hit ratio, cached, prompt)."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await http.post("/flush_cache")

        async def session(s: int):
            history = [rng.randrange(256) for _ in range(24)]
            cached = prompt = 0
            for _ in range(turns):
                body = {"input_ids": history, "sampling_params": {
                    "max_new_tokens": 8, "ignore_eos": True, "temperature": 0}}
                if pinned:
                    body["routed_dp_rank"] = s % dp_size
                out = await post(http, body)
                cached += out["meta_info"]["cached_tokens"]
                prompt += out["meta_info"]["prompt_tokens"]
                history = history + out["output_ids"] + [rng.randrange(256) for _ in range(8)]
            return cached, prompt

        results = await asyncio.gather(*(session(s) for s in range(sessions)))
    cached, prompt = sum(c for c, _ in results), sum(p for _, p in results)
    return cached / prompt, cached, prompt


async def decode_ms_per_token(url: str, context: int, new_tokens: int,
                              rng: random.Random) -> float:
    async def timed(max_new: int) -> float:
        ids = [rng.randrange(256) for _ in range(context)]
        t0 = time.perf_counter()
        out = await post(http, {"input_ids": ids, "sampling_params": {
            "max_new_tokens": max_new, "ignore_eos": True, "temperature": 0}})
        if out["meta_info"]["cached_tokens"]:
            raise RuntimeError("a decode-timing prompt hit the prefix cache")
        return time.perf_counter() - t0

    async with httpx.AsyncClient(base_url=url, timeout=1200) as http:
        await timed(2)  # warm-up
        diffs = sorted([await timed(1 + new_tokens) - await timed(1) for _ in range(3)])
    return diffs[1] / new_tokens * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model-path", default="tiny")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--decode-contexts", default="256,1024,3072",
                    help="context lengths of the decode-time table (tp=1)")
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--decode-only", action="store_true", help="only the decode-time table")
    opts = ap.parse_args()
    try:
        contexts = [int(c) for c in opts.decode_contexts.split(",") if c]
    except ValueError:
        ap.error(f"--decode-contexts {opts.decode_contexts!r}: a comma list of token counts")
    if not contexts or min(contexts) < 1:
        ap.error(f"--decode-contexts {opts.decode_contexts!r}: at least one count, each >= 1")
    if opts.decode_tokens < 1:
        ap.error(f"--decode-tokens {opts.decode_tokens}: at least 1")
    decode_rows = []
    with ServerProcess(["--model-path", opts.model_path, "--page-size", str(opts.page_size),
                        "--tp-size", "1"], startup_timeout=300) as server:
        for context in contexts:
            ms = asyncio.run(decode_ms_per_token(server.url, context, opts.decode_tokens,
                                                 random.Random(context)))
            decode_rows.append((context, ms))
            print(f"decode at context {context}: {ms:.1f} ms/token", flush=True)
    print(f"\ndecode time per token, one request, tp=1 ({opts.decode_tokens} tokens, greedy)")
    print(f"{'context':>8}{'ms/token':>10}{'vs first':>10}")
    for context, ms in decode_rows:
        print(f"{context:>8}{ms:>10.1f}{ms / decode_rows[0][1]:>9.2f}x")
    if opts.decode_only:
        return
    rows, cache_rows = [], []
    for name, layout in LAYOUTS:
        ranks = int(layout[1])
        args = ["--model-path", opts.model_path, "--page-size", str(opts.page_size), *layout]
        with ServerProcess(args, startup_timeout=300) as server:
            rng = random.Random(0)
            rps, tps = asyncio.run(throughput(server.url, opts.requests, opts.concurrency,
                                              opts.prompt_len, opts.new_tokens, rng))
            rows.append((name, ranks, rps, tps))
            print(f"{name}: {rps:.2f} req/s, {tps:.1f} tok/s", flush=True)
            dp = int(layout[3]) if "--dp-size" in layout else 1
            if dp > 1:
                for pinned in (True, False):
                    ratio, cached, prompt = asyncio.run(multi_turn(
                        server.url, dp, opts.sessions, opts.turns, pinned, random.Random(1)))
                    cache_rows.append((name, "pinned" if pinned else "round robin", ratio,
                                       cached, prompt))
    print(f"\nthroughput ({opts.requests} requests, concurrency {opts.concurrency}, prompt "
          f"{opts.prompt_len} tokens, {opts.new_tokens} new tokens, greedy)")
    print(f"{'layout':<24}{'ranks':>6}{'req/s':>10}{'tok/s':>10}")
    for name, ranks, rps, tps in rows:
        print(f"{name:<24}{ranks:>6}{rps:>10.2f}{tps:>10.1f}")
    print(f"\nprefix-cache hit ratio, multi-turn ({opts.sessions} sessions x {opts.turns} turns, "
          f"+8 output +8 user tokens per turn, page size {opts.page_size})")
    print(f"{'layout':<24}{'dispatch':>13}{'hit ratio':>11}{'cached':>8}{'prompt':>8}")
    for name, mode, ratio, cached, prompt in cache_rows:
        print(f"{name:<24}{mode:>13}{ratio:>11.3f}{cached:>8}{prompt:>8}")
    by_layout: dict[str, dict[str, float]] = {}
    for name, mode, ratio, _, _ in cache_rows:
        by_layout.setdefault(name, {})[mode] = ratio
    for name, r in by_layout.items():
        rr = r["round robin"]
        print(f"{name}: pinned / round robin = "
              + (f"{r['pinned'] / rr:.2f}x" if rr > 0 else "inf (round robin hit nothing)"))


if __name__ == "__main__":
    main()
