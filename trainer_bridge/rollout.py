"""Rollout sources: episodes over HTTP through the sticky router, or replayed from a file.

Each episode is one router session, so all its turns run on one (engine, dp_rank) and reuse the
KV cache of the growing prefix. Requests ask for logprobs and, with R3, the routed experts; the
last turn's routing covers every position of the episode but the last.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from sglang_dsv41.router import SessionRouter
from sglang_dsv41.wire import decode_array

from .batch import Sample
from .config import RolloutConfig
from .envs import Environment


class RolloutSource(ABC):
    @abstractmethod
    def collect(self, step: int) -> list[Sample]:
        """Every sample of one train step (called on rank 0 only)."""

    def close(self) -> None:
        pass


def decode_routing(meta: dict[str, Any], key: str, dtype) -> np.ndarray | None:
    if meta.get(key) is None:
        return None
    shape = meta.get("routed_experts_shape")
    if shape is None:
        raise ValueError(f"meta_info has {key} but no routed_experts_shape")
    return decode_array(meta[key], shape, dtype)


def sampling_seed(seed: int, session_id: str, turn: int) -> int:
    """The sampling seed of one turn: fixed by the run's seed, the session and the turn, so a
    step's rollouts do not depend on which request reached the server first."""
    digest = hashlib.blake2b(f"{seed}/{session_id}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # non-negative int64


class WeightVersionMismatch(RuntimeError):
    """A rollout came from weights other than the ones the trainer pushed last (a restarted
    engine serving its base weights, a half-pushed one): it must not be trained on."""

    def __init__(self, engine: str, served: str | None, expected: str,
                 secondary: bool = False):
        super().__init__(f"engine {engine} served weight_version {served!r}, expected "
                         f"{expected!r}")
        self.engine, self.served, self.expected = engine, served, expected
        self.secondary = secondary  # an episode stopped because another one mismatched


class VersionCheck:
    """The weight_version every response of a step must carry: ``expected`` (the trainer's
    last push), or before any push the first response's (the server's own initial weights),
    kept from then on. ``stop`` is set at the first mismatch: the step's other episodes end
    at their next turn."""

    def __init__(self, expected: str | None):
        self.expected = expected
        self.stop = threading.Event()
        self._lock = threading.Lock()

    def check(self, resp: dict[str, Any]) -> None:
        meta = resp.get("meta_info") or {}
        served = meta.get("weight_version")
        served = None if served is None else str(served)
        with self._lock:
            if self.expected is None and served is not None:
                self.expected = served
            expected = self.expected
        if served != expected:
            route = meta.get("route")
            engine = f"{route[0]} dp_rank {route[1]}" if route else "?"
            self.stop.set()
            raise WeightVersionMismatch(engine, served, str(expected))


def run_episode(router: SessionRouter, env: Environment, prompt_index: int, group_id: int,
                session_id: str, cfg: RolloutConfig, routed_experts: bool,
                seed: int = 0, versions: VersionCheck | None = None) -> Sample:
    episode = env.new_episode(prompt_index)
    tokens = list(episode.prompt)
    mask, lps = [0] * len(tokens), [0.0] * len(tokens)
    prompt_tokens = cached = 0
    try:
        for turn in range(env.max_turns):
            if versions is not None and versions.stop.is_set():
                raise WeightVersionMismatch("(stopped: another episode's)", None,
                                            str(versions.expected), secondary=True)
            resp = router.generate(session_id, {
                "input_ids": tokens,
                "sampling_params": {"max_new_tokens": cfg.max_new_tokens,
                                    "temperature": cfg.temperature, "top_p": 1.0, "top_k": -1,
                                    "sampling_seed": sampling_seed(seed, session_id, turn)},
                "return_logprob": True, "return_routed_experts": routed_experts,
            }, expected_tokens=len(tokens) + cfg.max_new_tokens)
            if versions is not None:
                versions.check(resp)
            meta, out = resp["meta_info"], list(resp["output_ids"])
            out_lps = [float(x[0]) for x in meta.get("output_token_logprobs") or []]
            if not out or len(out_lps) != len(out):
                raise ValueError(f"session {session_id}: {len(out)} output ids but "
                                 f"{len(out_lps)} logprobs")
            tokens += out
            mask += [1] * len(out)
            lps += out_lps
            prompt_tokens += int(meta.get("prompt_tokens", 0))
            cached += int(meta.get("cached_tokens", 0))
            result = episode.step(out)
            if result.done:
                break
            if turn == env.max_turns - 1:
                raise ValueError(f"{env.name}: episode not done after max_turns={env.max_turns}")
            tokens += result.observation
            mask += [0] * len(result.observation)
            lps += [0.0] * len(result.observation)
    finally:
        router.end_session(session_id)
    return Sample(tokens, mask, lps, result.reward, group_id,
                  routed_experts=decode_routing(meta, "routed_experts", np.int32),
                  routed_weights=decode_routing(meta, "routed_expert_weights", np.float32),
                  prompt_tokens=prompt_tokens, cached_tokens=cached,
                  route=tuple(meta["route"]) if meta.get("route") else None)


class ServerRolloutSource(RolloutSource):
    """GRPO groups of episodes run concurrently against the server(s) through ``router``.
    With ``record_path`` every step's samples are appended there (JSONL) for offline replay."""

    def __init__(self, router: SessionRouter, env: Environment, cfg: RolloutConfig,
                 routed_experts: bool, record_path: str | None = None, seed: int = 0):
        self.router, self.env, self.cfg, self.seed = router, env, cfg, seed
        self.routed_experts, self.record_path = routed_experts, record_path
        self._pool = ThreadPoolExecutor(cfg.concurrency, thread_name_prefix="rollout")
        self._lock = threading.Lock()
        # The weight_version every response must carry: the trainer sets it after each push;
        # None before the first: the first response's (the server's initial weights) is kept.
        self.expected_version: str | None = None

    def collect(self, step: int) -> list[Sample]:
        """Every episode of the step; raises WeightVersionMismatch (after every episode ended)
        when a response came from other weights than ``expected_version``."""
        cfg = self.cfg
        versions = VersionCheck(self.expected_version)
        futures = []
        for p in range(cfg.prompts_per_step):
            prompt_index = step * cfg.prompts_per_step + p
            for g in range(cfg.group_size):
                sid = f"step{step}-p{prompt_index}-g{g}"
                futures.append(self._pool.submit(run_episode, self.router, self.env,
                                                 prompt_index, prompt_index, sid, cfg,
                                                 self.routed_experts, self.seed, versions))
        samples, errors = [], []
        for f in futures:  # wait for all: no episode of this step runs on into the next
            try:
                samples.append(f.result())
            except Exception as e:  # noqa: BLE001 - re-raised below, a mismatch first
                errors.append(e)
        self.expected_version = versions.expected
        mismatch = [e for e in errors if isinstance(e, WeightVersionMismatch)]
        first = [e for e in mismatch if not e.secondary] or mismatch or errors
        if first:
            raise first[0]
        if self.record_path:
            append_record(self.record_path, step, samples)
        return samples

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def append_record(path: str, step: int, samples: list[Sample]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, "samples": [s.to_json() for s in samples]}) + "\n")


def check_routing_present(samples: list[Sample], routed_layers: list[int], top_k: int) -> None:
    """R3: every sample must carry the server's routing for every routed layer, ids and
    weights [len(tokens) - 1, > max(routed_layers), top_k] without -1 rows. Checked where rank 0
    collects the step, before the samples are scattered, so every rank fails with the reason
    (one rank failing alone in ``pack`` would leave the others in a collective)."""
    if not routed_layers:
        return
    for i, s in enumerate(samples):
        where = f"sample {i} (group {s.group_id}, route {s.route})"
        if s.routed_experts is None or s.routed_weights is None:
            raise ValueError(f"R3 is on but {where} has no routed experts/weights from the "
                             "server (was the server started with --enable-return-routed-"
                             "experts?)")
        e, w = s.routed_experts, s.routed_weights
        if (e.ndim != 3 or e.shape[0] != len(s.tokens) - 1 or e.shape[1] <= max(routed_layers)
                or e.shape[2] != top_k or w.shape != e.shape):
            raise ValueError(f"{where}: the server's routing has shape {tuple(e.shape)} (weights "
                             f"{tuple(w.shape)}); expected [{len(s.tokens) - 1}, "
                             f">{max(routed_layers)} layers, {top_k}] for both")
        bad = [layer for layer in routed_layers if (e[:, layer] < 0).any()]
        if bad:
            raise ValueError(f"{where}: the server's routing has -1 rows in layer(s) {bad}")


class OfflineRolloutSource(RolloutSource):
    """Replays recorded steps (step i reads record i modulo the number of records)."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise ValueError(f"offline rollouts file {path} does not exist")
        with open(path) as f:
            self.records = [json.loads(line) for line in f if line.strip()]
        if not self.records:
            raise ValueError(f"offline rollouts file {path} is empty")

    def collect(self, step: int) -> list[Sample]:
        rec = self.records[step % len(self.records)]
        return [Sample.from_json(s) for s in rec["samples"]]
