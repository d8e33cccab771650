"""Shared helpers of the test_loader_* files: checkpoints with bf16/fp8 Engram tables and a
spawn runner for gloo worlds (hard timeout, children always reaped)."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import traceback

import torch

from sglang_dsv41.loader.checkpoint import model_tensors, save_checkpoint
from sglang_dsv41.loader.fp8 import quantize_fp8_blocks, scale_name
from sglang_dsv41.model import build_model, get_preset
from sglang_dsv41.model.model import is_engram_table
from sglang_dsv41.server_process import free_port


def tiny_cfg(**kw):
    cfg = get_preset("tiny")
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def write_checkpoint(path: str, cfg, table: str = "bf16", seed: int = 0) -> dict:
    """A checkpoint of build_model(cfg, seed) in bf16; Engram tables bf16 or fp8 + scales.
    Returns the tensors written."""
    model = build_model(cfg, torch.float32, seed=seed)
    tensors = {}
    for name, t in model_tensors(model).items():
        t = t.detach()
        if is_engram_table(name) and table == "fp8":
            q, s = quantize_fp8_blocks(t)
            tensors[name], tensors[scale_name(name)] = q, s
        else:
            tensors[name] = t.to(torch.bfloat16)
    save_checkpoint(tensors, path, cfg, tokenizer=False)
    return tensors


def _entry(fn, rank, world, port, args, queue):
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        # plain pickle: the queue's torch reducers would pass tensors as fds of a dying process
        queue.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - shipped to the test as text
        queue.put((rank, "error", traceback.format_exc()))


def start_world(fn, world: int, args=()):
    """Spawn ``world`` gloo ranks running fn(rank, world, *args); returns (procs, queue)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, queue), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    return procs, queue


def collect(procs, queue, timeout: float = 60.0) -> list:
    """One result per rank (by rank); a failed rank fails the test with its traceback."""
    results: dict[int, object] = {}
    try:
        for _ in procs:
            rank, status, value = queue.get(timeout=timeout)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
        for p in procs:
            p.join(timeout=timeout)
    finally:
        kill_all(procs)
    return [results[r] for r in range(len(procs))]


def kill_all(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def run_world(fn, world: int, args=(), timeout: float = 60.0) -> list:
    """Run fn(rank, world, *args) in ``world`` spawned gloo ranks; returns results by rank."""
    procs, queue = start_world(fn, world, args)
    return collect(procs, queue, timeout)


def vm_hwm_bytes() -> int:
    """Peak resident set of this process (VmHWM)."""
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")
