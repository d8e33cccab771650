"""A process group between a trainer and every scheduler rank, for distributed weight updates.

The scheduler ranks already live in their own default world, and torch.distributed.new_group
only subdivides one world, so this group is built directly: a TCPStore (the trainer, group
rank 0, hosts it) under a PrefixStore(group_name) and a backend ProcessGroup (gloo on CPU,
NCCL on GPU) constructed on it. Scheduler rank r joins as group rank ``rank_offset + r``.

Update protocol (both sides run it in the same order; the trainer is group rank 0):
1. verdict: all-reduce MIN of ok (the servers validated names, dtypes and shapes); 0 -> stop,
   the trainer sends nothing and the HTTP call answers 400;
2. the trainer broadcasts its bucket size, then the tensors packed into byte buckets
   (plan_buckets: the same plan on both sides, from the metadata alone);
3. done: all-reduce MIN of "every server rank applied" so the trainer learns the outcome.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

BUCKET_BYTES = 256 << 20
# Joining the group (reaching the trainer's store, every member arriving) blocks every scheduler
# rank: it must fail in seconds, not after the collectives' timeout, while /health says so.
SETUP_TIMEOUT_S = 30.0
_DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn,
    torch.float8_e5m2, torch.float8_e8m0fnu, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}


def parse_dtype(name: str) -> torch.dtype:
    key = str(name).replace("torch.", "")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[key]


@dataclass
class WeightSyncGroup:
    pg: Any
    store: Any            # kept alive: the trainer's TCPStore server dies with its object
    rank: int
    world_size: int
    backend: str
    device: torch.device

    def all_ok(self, ok: bool) -> bool:
        t = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.pg.allreduce([t], opts).wait()
        return bool(t.item())

    def broadcast_(self, t: torch.Tensor, src: int = 0) -> None:
        self.pg.broadcast(t, src).wait()

    def close(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError:
                pass  # already torn down by a peer
        self.pg = self.store = None


def init_weight_sync_group(master_address: str, master_port: int, rank: int, world_size: int,
                           group_name: str = "weight_update_group", backend: str = "gloo",
                           timeout_s: float = 120.0) -> WeightSyncGroup:
    """Collective over the new group: blocks until all ``world_size`` members have joined, at
    most SETUP_TIMEOUT_S; ``timeout_s`` then bounds each collective."""
    if not 0 <= rank < world_size:
        raise ValueError(f"weight sync rank {rank} outside a group of {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight sync backend must be gloo or nccl, got {backend!r}")
    timeout, setup = timedelta(seconds=timeout_s), timedelta(seconds=SETUP_TIMEOUT_S)
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0,
                          timeout=setup, wait_for_workers=False)
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        pg, device = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout), torch.device("cpu")
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        device = torch.device("cuda", torch.cuda.current_device())
    store.set_timeout(timeout)
    return WeightSyncGroup(pg, store, rank, world_size, backend, device)


def plan_buckets(dtypes: list[torch.dtype], shapes: list[list[int]],
                 bucket_bytes: int = BUCKET_BYTES) -> list[list[int]]:
    """Consecutive tensor indices grouped into buckets of at most bucket_bytes (or one tensor)."""
    buckets, cur, cur_bytes = [], [], 0
    for i, (dt, shape) in enumerate(zip(dtypes, shapes)):
        n = torch.Size(shape).numel() * dt.itemsize
        if cur and cur_bytes + n > bucket_bytes:
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += n
    if cur:
        buckets.append(cur)
    return buckets


def send_weights(group: WeightSyncGroup, named: list[tuple[str, torch.Tensor]],
                 bucket_bytes: int = BUCKET_BYTES,
                 dtypes: list[torch.dtype] | None = None) -> bool:
    """Trainer side (group rank 0), run while the HTTP update_weights_from_distributed call with
    the same names/dtypes/shapes is in flight. dtypes: what each tensor is sent as (default its
    own); the casts happen a bucket at a time, so no cast copy of the whole model exists. False
    when the servers refused the update."""
    if not group.all_ok(True):
        return False
    group.broadcast_(torch.tensor([bucket_bytes], dtype=torch.int64, device=group.device), 0)
    tensors = [t.detach() for _, t in named]
    wire = dtypes if dtypes is not None else [t.dtype for t in tensors]
    for bucket in plan_buckets(wire, [list(t.shape) for t in tensors], bucket_bytes):
        flat = torch.cat([tensors[i].to(wire[i]).contiguous().reshape(-1).view(torch.uint8)
                          for i in bucket])
        group.broadcast_(flat.to(group.device), 0)
    return group.all_ok(True)


def receive_weights(group: WeightSyncGroup, names: list[str], dtypes: list[torch.dtype],
                    shapes: list[list[int]], ok: bool) -> list[tuple[str, torch.Tensor]] | None:
    """Server side: steps 1-2 of the protocol; None when any member refused (nothing sent)."""
    if not group.all_ok(ok):
        return None
    size = torch.zeros(1, dtype=torch.int64, device=group.device)
    group.broadcast_(size, 0)  # the trainer's bucket size: both sides plan the same buckets
    bucket_bytes = int(size.item())
    out: list[tuple[str, torch.Tensor]] = []
    for bucket in plan_buckets(dtypes, shapes, bucket_bytes):
        sizes = [torch.Size(shapes[i]).numel() * dtypes[i].itemsize for i in bucket]
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=group.device)
        group.broadcast_(flat, 0)
        flat, off = flat.cpu(), 0
        for i, n in zip(bucket, sizes):
            # clone first: a view at an unaligned byte offset cannot be reinterpreted
            out.append((names[i], flat[off:off + n].clone().view(dtypes[i]).reshape(shapes[i])))
            off += n
    return out
