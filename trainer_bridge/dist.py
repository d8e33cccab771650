"""Process-group setup and the few scalar collectives the trainer needs (never logits)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from sglang_dsv41.ports import free_port


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    mesh: DeviceMesh

    @property
    def is_primary(self) -> bool:
        return self.rank == 0


def init_distributed(device: torch.device) -> DistInfo:
    """torchrun env (RANK/WORLD_SIZE/MASTER_*) or a single process on a free local port."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("fsdp",))
    return DistInfo(dist.get_rank(), world, mesh)


def close_distributed(barrier: bool = True) -> None:
    """``barrier``: wait for every rank first (a clean end). Never on an error path: a rank
    that failed alone would wait there for ranks that wait in another collective (an FSDP
    all-gather) for it, and the job would hang instead of ending with its error."""
    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()


def _collective_device() -> torch.device:
    """Where a collective's tensor must live: NCCL reduces device tensors only."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_scalar(value: float, op: str = "sum") -> float:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                           "min": dist.ReduceOp.MIN}[op])
    return float(t.item())


def all_reduce_tensor(t: torch.Tensor) -> torch.Tensor:
    """Sum of a small tensor over ranks (metrics only), on the collective's device."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return t.clone()
    t = t.to(_collective_device(), copy=True)
    dist.all_reduce(t)
    return t


def broadcast_object(obj, src: int = 0):
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


class PrimaryError(RuntimeError):
    """Raised on every rank when the work rank 0 did for all of them failed."""


def on_primary(fn, *args):
    """Runs ``fn(*args)`` on rank 0 and hands its result (or its failure) to every rank, so a
    failed HTTP call raises everywhere instead of leaving the other ranks in a collective."""
    result, error = None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            result = fn(*args)
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            error = f"{type(e).__name__}: {e}"
    result, error = broadcast_object((result, error))
    if error is not None:
        raise PrimaryError(f"rank 0 failed: {error}")
    return result


def run_spawned(target, args_per_worker: list[tuple], timeout: float,
                join_timeout: float = 10.0) -> list:
    """Starts ``target(*args, queue)`` per entry in spawned processes and returns the one item
    each puts on ``queue``, in arrival order. Fails fast when a worker dies without answering
    or the time runs out, and always joins or kills every worker (tests and benches of
    multi-rank gloo runs)."""
    import multiprocessing as mp
    import queue as queue_mod
    import time

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, results)) for args in args_per_worker]
    for p in procs:
        p.start()
    out, deadline, failed = [], time.monotonic() + timeout, True
    try:
        while len(out) < len(procs):
            try:
                out.append(results.get(timeout=1.0))
            except queue_mod.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"workers died (exit codes {dead}) or timed out "
                                       f"after {timeout:.0f} s") from None
        failed = False
    finally:
        # A failed (or interrupted: pytest-timeout) run's workers may wait in a collective
        # for good: killed at once, not after a join that the interruption may cut short.
        for p in procs:
            if failed and p.is_alive():
                p.kill()
        for p in procs:
            p.join(join_timeout)
            if p.is_alive():
                p.kill()
    return out
