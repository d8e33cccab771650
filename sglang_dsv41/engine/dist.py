"""Process groups of the scheduler ranks and the guarded collectives they use.

One world of tp_size ranks; attention-TP groups of attn_tp_size consecutive ranks (one per DP
group). Tensor collectives of the forward run on the data groups (gloo on CPU, NCCL on GPU);
the per-step control plane (plan fan-out, the MLP sync, control-op agreement) runs on separate
gloo groups. Keeping them apart matters: a rank that skipped a forward collective then waits in
the next step's sync on another group, so the mistake becomes a clean deadlock that the stall
watchdog names, instead of two unrelated collectives being paired with each other.
"""

from __future__ import annotations

import datetime
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from ..policies.watchdog import StallWatchdog
    from ..server_args import ServerArgs

# gloo in torch 2.13 warns that the *_tensor collectives are deprecated aliases.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*deprecated")
warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.*deprecated")


@dataclass
class ParallelInfo:
    rank: int
    world_size: int
    dp_size: int
    dp_rank: int
    attn_tp_size: int
    attn_tp_rank: int

    @property
    def is_leader(self) -> bool:
        return self.attn_tp_rank == 0

    @property
    def leader_rank(self) -> int:
        return self.dp_rank * self.attn_tp_size

    def leaders(self) -> list[int]:
        return [d * self.attn_tp_size for d in range(self.dp_size)]

    def dp_of(self, rank: int) -> int:
        return rank // self.attn_tp_size

    @classmethod
    def from_server_args(cls, args: "ServerArgs", rank: int) -> "ParallelInfo":
        if not 0 <= rank < args.tp_size:
            raise ValueError(f"rank {rank} out of range for tp_size {args.tp_size}")
        dp_rank, attn_tp_rank = args.rank_to_dp(rank)
        return cls(rank, args.tp_size, args.effective_dp_size, dp_rank, args.attn_tp_size,
                   attn_tp_rank)


class DistGroups:
    """The process groups of one rank plus guarded collectives (each wrapped in the watchdog)."""

    def __init__(self, info: ParallelInfo, backend: str, watchdog: "StallWatchdog"):
        self.info, self.backend, self.watchdog = info, backend, watchdog
        self.step = 0
        self.world = dist.group.WORLD
        self.world_cpu = dist.new_group(list(range(info.world_size)), backend="gloo")
        self.attn = self.attn_cpu = None
        # new_group is collective over the world: every rank creates every DP group's groups.
        for d in range(info.dp_size):
            ranks = list(range(d * info.attn_tp_size, (d + 1) * info.attn_tp_size))
            g = dist.new_group(ranks, backend=backend)
            g_cpu = dist.new_group(ranks, backend="gloo")
            if d == info.dp_rank:
                self.attn, self.attn_cpu = g, g_cpu

    # ---- control plane (gloo, picklable objects) --------------------------------------------
    def broadcast_in_group(self, obj: Any) -> Any:
        """The DP group's leader sends obj to its attention-TP peers; everyone returns it."""
        if self.info.attn_tp_size == 1:
            return obj
        box = [obj]
        with self.watchdog.guard("plan_broadcast", self.step):
            dist.broadcast_object_list(box, src=self.info.leader_rank, group=self.attn_cpu)
        return box[0]

    def all_gather_objects(self, obj: Any, op: str = "step_sync") -> list[Any]:
        if self.info.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.info.world_size
        with self.watchdog.guard(op, self.step):
            dist.all_gather_object(out, obj, group=self.world_cpu)
        return out

    def all_gather_ints(self, values: list[int], op: str = "step_sync") -> list[list[int]]:
        """The per-step MLP sync: one small tensor all-gather over the world."""
        if self.info.world_size == 1:
            return [list(values)]
        mine = torch.tensor(values, dtype=torch.int64)
        out = mine.new_empty(self.info.world_size * mine.numel())
        with self.watchdog.guard(op, self.step):
            _all_gather_single(out, mine, group=self.world_cpu)
        return out.view(self.info.world_size, -1).tolist()

    def all_agree(self, ok: bool, op: str) -> bool:
        """True when every rank says ok (the all-or-nothing verdict of a control op)."""
        return all(self.all_gather_objects(bool(ok), op))

    def min_over_world(self, value: int, op: str) -> int:
        return min(self.all_gather_objects(int(value), op))

    def barrier(self) -> None:
        if self.info.world_size > 1:
            with self.watchdog.guard("barrier", self.step):
                dist.barrier(group=self.world_cpu)

    # ---- data plane (the forward's tensors) -------------------------------------------------
    def reduce_scatter_attn(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H] partial sums -> this rank's [T / attn_tp, H] token shard of the total. T must be
        a multiple of attn_tp_size: otherwise the collective fails exactly as SGLang's does."""
        out = x.new_empty(x.shape[0] // self.info.attn_tp_size, *x.shape[1:])
        with self.watchdog.guard("attn_reduce_scatter", self.step):
            _reduce_scatter_single(out, x.contiguous(), group=self.attn)
        return out

    def all_gather_attn(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(x.shape[0] * self.info.attn_tp_size, *x.shape[1:])
        with self.watchdog.guard("attn_all_gather", self.step):
            _all_gather_single(out, x.contiguous(), group=self.attn)
        return out

    def all_gather_world(self, x: torch.Tensor, op: str = "mlp_gather") -> torch.Tensor:
        out = x.new_empty(x.shape[0] * self.info.world_size, *x.shape[1:])
        with self.watchdog.guard(op, self.step):
            _all_gather_single(out, x.contiguous(), group=self.world)
        return out

    def all_reduce_world(self, x: torch.Tensor, op: str = "mlp_reduce") -> torch.Tensor:
        x = x.contiguous()
        with self.watchdog.guard(op, self.step):
            dist.all_reduce(x, group=self.world)
        return x

    def reduce_scatter_world(self, x: torch.Tensor, op: str = "mlp_reduce") -> torch.Tensor:
        out = x.new_empty(x.shape[0] // self.info.world_size, *x.shape[1:])
        with self.watchdog.guard(op, self.step):
            _reduce_scatter_single(out, x.contiguous(), group=self.world)
        return out

    def shutdown(self) -> None:
        self.barrier()
        dist.destroy_process_group()


def init_distributed(args: "ServerArgs", rank: int, dist_port: int, device: torch.device,
                     watchdog: "StallWatchdog") -> DistGroups:
    info = ParallelInfo.from_server_args(args, rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank,
                            world_size=info.world_size,
                            timeout=datetime.timedelta(minutes=30))
    return DistGroups(info, backend, watchdog)
