"""Per-step metrics: JSONL always, TensorBoard when installed, PNG plots at the end."""

from __future__ import annotations

import errno
import json
import logging
import os
from typing import Any

import numpy as np
import psutil
import torch

from sglang_dsv41.loader.atomic_dir import write_file_atomically

from .batch import Sample

log = logging.getLogger("trainer_bridge")


def host_rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def memory_metrics(device: torch.device) -> dict[str, float]:
    """The process's memory now; mem_peak_bytes: the most the device allocator held since its
    peak was last reset (the trainer resets it as each step begins: the step's peak)."""
    out = {"host_rss_bytes": float(host_rss_bytes()), "mem_allocated_bytes": 0.0,
           "mem_reserved_bytes": 0.0, "mem_peak_bytes": 0.0, "pinned_bytes": 0.0}
    if device.type == "cuda":
        out["mem_allocated_bytes"] = float(torch.cuda.memory_allocated(device))
        out["mem_reserved_bytes"] = float(torch.cuda.memory_reserved(device))
        out["mem_peak_bytes"] = float(torch.cuda.max_memory_allocated(device))
        stats = torch.cuda.host_memory_stats()
        out["pinned_bytes"] = float(stats.get("allocated_bytes.current", 0))
    return out


def rollout_metrics(samples: list[Sample]) -> dict[str, float]:
    rewards = np.array([s.reward for s in samples], dtype=np.float64)
    lengths = np.array([s.response_length for s in samples], dtype=np.float64)
    prompt = sum(s.prompt_tokens for s in samples)
    return {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
            "response_len_mean": float(lengths.mean()),
            "response_len_p50": float(np.percentile(lengths, 50)),
            "response_len_p90": float(np.percentile(lengths, 90)),
            "response_len_max": float(lengths.max()),
            "prefix_cache_hit_ratio": sum(s.cached_tokens for s in samples) / prompt
            if prompt else 0.0,
            "num_samples": float(len(samples))}


class Telemetry:
    """Rank 0 writes; other ranks hold a disabled instance (every method is then a no-op).

    ``metrics.jsonl`` gets one row a step, each in one append-mode write. A fresh run appends to
    what is there (train.py refuses to start a fresh run where one left metrics); ``fresh``
    empties the file first (the dry run's own directory). ``resume(step)`` keeps only the rows
    before ``step`` and drops a torn last line, rewriting the file atomically, so the resumed
    run's rows follow the kept ones and the plots show every step."""

    def __init__(self, out_dir: str, enabled: bool, tensorboard: bool = True,
                 fresh: bool = False):
        self.enabled, self.out_dir = enabled, out_dir
        self.rows: list[dict[str, Any]] = []
        self._first_alloc: tuple[int, float] = (0, 0.0)
        self._calls = 0
        self._tb = None
        if not enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, "metrics.jsonl")
        if fresh and os.path.exists(self.path):
            os.remove(self.path)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(os.path.join(out_dir, "tb"))
            except ImportError:
                log.info("tensorboard is not installed: TensorBoard logging skipped")

    def log(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        metrics = dict(metrics)
        alloc = metrics.get("mem_allocated_bytes", 0.0) or metrics.get("host_rss_bytes", 0.0)
        self._calls += 1
        if self._calls <= 2:  # the first step pays for lazy initialisation: measure from the 2nd
            self._first_alloc = (step, alloc)
        s0, a0 = self._first_alloc
        metrics["mem_growth_per_100_steps"] = (alloc - a0) / (step - s0) * 100 if step > s0 else 0.0
        if not self.enabled:
            return metrics
        row = {"step": step, **metrics}
        self.rows.append(row)
        data = (json.dumps(row) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            try:
                written = os.write(fd, data)
            except OSError as e:  # os.write names no file: the caller's message needs it
                raise OSError(e.errno, e.strerror, self.path) from e
            if written != len(data):  # a short write: the disk filled up mid-row
                raise OSError(errno.ENOSPC, f"short write of the step-{step} metrics row",
                              self.path)
        finally:
            os.close(fd)
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(k, v, step)
        return metrics

    def resume(self, step: int) -> int:
        """Keep the rows of steps before ``step`` (a resumed run logs ``step`` on), drop any
        torn or unparseable line; rewrites metrics.jsonl atomically. -> the rows dropped."""
        if not self.enabled or not os.path.exists(self.path):
            return 0
        kept, dropped = [], 0
        with open(self.path, "rb") as f:
            for line in f.read().split(b"\n"):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    keep = int(row["step"]) < step
                except (ValueError, KeyError, TypeError):
                    keep = False
                if keep:
                    kept.append(row)
                else:
                    dropped += 1
        write_file_atomically(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self.rows = kept
        if dropped:
            log.info("metrics.jsonl: kept the %d rows before step %d, dropped %d (logged after "
                     "the checkpoint, or torn)", len(kept), step, dropped)
        return dropped

    def close(self, plots: bool = True) -> list[str]:
        if not self.enabled:
            return []
        if self._tb is not None:
            self._tb.close()
        return self.plot() if plots and self.rows else []

    def plot(self) -> list[str]:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            log.info("matplotlib is not installed: plots skipped")
            return []
        panels = {"reward": ["reward_mean"], "mismatch": ["mismatch_abs_logp", "mismatch_k3"],
                  "routing": ["routing_agreement", "routing_agreement_min_layer"],
                  "memory": ["mem_allocated_bytes", "mem_peak_bytes", "mem_reserved_bytes",
                             "host_rss_bytes"]}
        steps = [r["step"] for r in self.rows]
        paths = []
        for name, keys in panels.items():
            fig, ax = plt.subplots(figsize=(6, 3.5))
            for k in keys:
                if any(k in r for r in self.rows):
                    ax.plot(steps, [r.get(k, float("nan")) for r in self.rows], label=k)
            ax.set_xlabel("step")
            ax.legend()
            path = os.path.join(self.out_dir, f"{name}.png")
            fig.tight_layout()
            fig.savefig(path)
            plt.close(fig)
            paths.append(path)
        return paths
