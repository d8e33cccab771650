"""Install host-memory Engram tables into a model in place of its ParameterEngramTables.

``layer.engram.table = host_table``: the model code is unchanged, it only sees the EngramTable
protocol (num_rows, dim, lookup). See engram_tables for the layouts and the lookup collective.
Tables always come from the checkpoint (also under --load-format dummy, because the trainer
never sends the frozen tables), and each rank logs where its tables came from.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from ..model.engram import EngramLayer
from ..policies.engram_layout import LAYOUTS, choose_engram_layout
from .engram_source import find_engram_tables
from .fp8 import FP8_BLOCK
from .engram_tables import PrivateEngramTable, SharedEngramTable, agree
from .shm import ShmNamespace, reclaim_stale

__all__ = ["EngramStoreHandle", "PrivateEngramTable", "SharedEngramTable", "LAYOUTS",
           "install_engram_tables", "engram_layers", "resolve_layout"]

logger = logging.getLogger("sglang_dsv41.loader")


@dataclass
class EngramStoreHandle:
    layout: str
    tables: dict[str, SharedEngramTable | PrivateEngramTable]
    report: list[dict] = field(default_factory=list)
    namespace: ShmNamespace | None = None
    closed: bool = False

    def close(self) -> None:
        """Unmap/free the tables; the last local rank to close removes the shared segments."""
        if self.closed:
            return
        self.closed = True
        for table in self.tables.values():
            table.close()
        if self.namespace is not None:
            self.namespace.release_lease()

    @property
    def resident_bytes(self) -> int:
        return sum(t.resident_bytes for t in self.tables.values())


def engram_layers(model) -> dict[str, EngramLayer]:
    """Table weight name (checkpoint key) -> the EngramLayer that reads it."""
    return {f"{name}.table.weight": m for name, m in model.named_modules()
            if isinstance(m, EngramLayer)}


def resolve_layout(layout: str, world_size: int, local_world_size: int) -> str:
    """auto: private when the ranks span several nodes, shared on one node (the one rule:
    sglang_dsv41.policies.engram_layout; shared across nodes is refused there)."""
    return choose_engram_layout(layout, spans_nodes=local_world_size < world_size)


def install_engram_tables(model, ckpt_dir: str, layout: str, rank: int = 0, world_size: int = 1,
                          group=None, local_rank: int | None = None,
                          local_world_size: int | None = None, namespace: str | None = None,
                          block: tuple[int, int] = FP8_BLOCK, guard=None) -> EngramStoreHandle:
    """Load every Engram table of ``model`` from ``ckpt_dir`` into host memory and install it.

    Collective over ``group`` (default: the default process group) when world_size > 1: every
    rank of the group calls it. Ranks on one node share ``namespace`` (one per server).
    ``guard(op)`` (a context manager factory, e.g. a stall watchdog) wraps private lookups.
    """
    local_rank = rank if local_rank is None else local_rank
    local_world_size = world_size if local_world_size is None else local_world_size
    layout = resolve_layout(layout, world_size, local_world_size)
    if world_size > 1 and not dist.is_initialized():
        raise ValueError("install_engram_tables with world_size > 1 needs torch.distributed")
    if world_size > 1 and dist.get_world_size(group) != world_size:
        raise ValueError(f"group has {dist.get_world_size(group)} ranks, world_size={world_size}")
    layers = engram_layers(model)
    handle = EngramStoreHandle(layout, {})
    if not layers:
        return handle
    sources = find_engram_tables(ckpt_dir, block)
    if local_rank == 0:  # whatever layout: segments of servers that died are reclaimed at start
        reclaim_stale()
    for name, layer in layers.items():
        if name not in sources:
            raise ValueError(f"checkpoint {ckpt_dir} has no Engram table {name}")
        src = sources[name]
        want = (layer.table.num_rows, layer.table.dim)
        if (src.num_rows, src.dim) != want:
            raise ValueError(f"Engram table {name}: checkpoint shape {(src.num_rows, src.dim)}, "
                             f"model expects {want}")
    if layout == "shared":
        ns = ShmNamespace(namespace or f"pid{os.getppid() if world_size > 1 else os.getpid()}")
        handle.namespace = ns
        ns.acquire_lease()
        error = None
        if local_rank == 0:
            try:
                for i, name in enumerate(layers):
                    t0 = time.perf_counter()
                    SharedEngramTable.create_segment(sources[name], ns, f"t{i}")
                    handle.report.append({"created_s": time.perf_counter() - t0})
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                error = e
        # attachers must not look before local rank 0 has published the segments
        if not agree(error is None, group, world_size):
            handle.close()
            raise ValueError(f"rank {rank}: creating the shared Engram segments failed"
                             + (f": {error}" if error else " on another rank"))
    start_report = list(handle.report)
    handle.report = []
    try:
        for i, (name, layer) in enumerate(layers.items()):
            t0 = time.perf_counter()
            src = sources[name]
            if layout == "shared":
                table = SharedEngramTable(src, handle.namespace, f"t{i}", rank, world_size, group,
                                          is_writer=local_rank == 0)
            else:
                table = PrivateEngramTable(src, rank, world_size, group, guard)
            handle.tables[name] = table
            layer.table = table
            entry = {"name": name, "file": src.weight.path, "layout": layout,
                     "dtype": str(src.weight.dtype).replace("torch.", ""),
                     "shape": [src.num_rows, src.dim], "table_bytes": src.nbytes,
                     "resident_bytes": table.resident_bytes,
                     "seconds": time.perf_counter() - t0 + (
                         start_report[i]["created_s"] if i < len(start_report) else 0.0)}
            handle.report.append(entry)
            logger.info("rank %d: Engram table %s from %s (layout=%s, %s %s, %d bytes, this rank "
                        "holds %d bytes, %.2fs)", rank, name, entry["file"], layout,
                        entry["dtype"], entry["shape"], entry["table_bytes"],
                        entry["resident_bytes"], entry["seconds"])
        ok, error = True, None
    except Exception as e:  # noqa: BLE001 - every rank must reach agree() below
        ok, error = False, e
    if not agree(ok, group, world_size):
        handle.close()
        raise ValueError(f"rank {rank}: loading the Engram tables failed"
                         + (f": {error}" if error else " on another rank"))
    atexit.register(handle.close)
    return handle
