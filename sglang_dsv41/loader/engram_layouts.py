"""SGLang's Engram host-table layouts for the served model's tables (model/dsv4/engram.py).

The layout comes from the shared policy (ServerArgs.resolved_engram_layout ->
policies/engram_layout.choose_engram_layout):

  shared   one copy per node: the node's first rank writes each table (fp8 rows + e8m0 scales,
           the checkpoint's bytes) into a shared-memory segment (loader/shm.py, leases,
           crash-reclaimed), every rank of the node maps it in place of its own copy (a
           forced update of a table writes the same bytes through every rank's map).
  private  SGLang's ``per_rank``: each rank keeps one row range of every table, the split on
           multiples of engram_codec.ALIGN_ROWS (so the ranks' checksum partial sums combine
           into the whole table's; SGLang's own shard_range splits on hash-column bounds, which
           moves only which rank owns a row). A lookup all-gathers the requested rows over the
           world, each rank dequantizes the rows it owns (zeros elsewhere) and a sum returns
           every rank its rows: exact, since each row comes from exactly one rank. Every rank
           runs every forward (idle batches), so every rank joins every lookup.

Either way the lookup is EngramTable's own dequantization of the same bytes, so the served
logits equal a whole-table model's. The tables always come from the checkpoint, also under
--load-format dummy (the trainer never sends them).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from ..model.dsv4.engram import EngramTable
from .engram_codec import ALIGN_ROWS
from .shm import ShmNamespace, reclaim_stale

logger = logging.getLogger("sglang_dsv41.loader")


def engram_tables(model) -> dict[str, EngramTable]:
    """Module name (``layers.N.engram.embed``) -> table."""
    return {n: m for n, m in model.named_modules() if isinstance(m, EngramTable)}


def row_shard(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank ``rank``'s [lo, hi) rows of a ``rows``-row table: whole ALIGN_ROWS chunks, spread
    as evenly as the chunks allow."""
    chunks = -(-rows // ALIGN_ROWS)
    return (min(rows, rank * chunks // world_size * ALIGN_ROWS),
            min(rows, (rank + 1) * chunks // world_size * ALIGN_ROWS))


class RowShardEngramTable(EngramTable):
    """One rank's row shard of a table (layout ``private``) with the collective lookup."""

    def __init__(self, full: EngramTable, rank: int, world_size: int, groups):
        rows = full.weight.shape[0]
        lo, hi = row_shard(rows, rank, world_size)
        super().__init__(max(hi - lo, 1), full.dim)
        self.num_rows, self.row_range, self.groups = rows, (lo, hi), groups
        self.weight = full.weight[lo:hi].clone()
        self.scale = full.scale[lo:hi].clone()

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        flat = indices.reshape(-1).to(torch.int64)
        g = self.groups
        counts = g.all_gather_world(torch.tensor([flat.numel()]), "engram_lookup").tolist()
        width = max(counts)
        padded = torch.zeros(width, dtype=torch.int64)
        padded[:flat.numel()] = flat.cpu()
        wanted = g.all_gather_world(padded, "engram_lookup")
        wanted = torch.cat([wanted[r * width:r * width + c] for r, c in enumerate(counts)])
        lo, hi = self.row_range
        mine = (wanted >= lo) & (wanted < hi)
        out = torch.zeros(wanted.numel(), self.dim, dtype=torch.float32)
        if bool(mine.any()):
            out[mine] = super().forward((wanted[mine] - lo).to(self.weight.device)).float().cpu()
        total = g.all_reduce_world(out, "engram_lookup")      # one owner per row: exact
        start = sum(counts[:g.info.rank])
        rows = total[start:start + flat.numel()].to(torch.bfloat16).to(indices.device)
        return rows.view(*indices.shape, self.dim)


@dataclass
class EngramLayoutHandle:
    layout: str
    namespace: ShmNamespace | None = None
    segments: list = field(default_factory=list)   # keeps the shared maps alive

    def close(self) -> None:
        self.segments.clear()
        if self.namespace is not None:
            self.namespace.release_lease()
            self.namespace = None


def _install_shared(model, groups, namespace: str, local_rank: int) -> EngramLayoutHandle:
    reclaim_stale()
    ns = ShmNamespace(namespace)
    ns.acquire_lease()
    handle = EngramLayoutHandle("shared", ns)
    tables = engram_tables(model)
    keys = {name: name.replace(".", "_") for name in tables}
    if local_rank == 0:
        for name, table in tables.items():
            blob = torch.cat([table.weight.view(torch.uint8).flatten(),
                              table.scale.view(torch.uint8).flatten()])
            tmp, mm = ns.create_segment(keys[name], blob.numel())
            torch.frombuffer(mm, dtype=torch.uint8, count=blob.numel()).copy_(blob)
            mm.flush()
            mm.close()
            ns.publish(tmp, keys[name])
    if groups is not None:
        groups.barrier()   # segments published before anyone attaches
    for name, table in tables.items():
        mm = ns.attach_segment(keys[name], writable=True)   # a forced update writes through
        handle.segments.append(mm)
        n_w, n_s = table.weight.numel(), table.scale.numel()
        raw = torch.frombuffer(mm, dtype=torch.uint8, count=n_w + n_s)
        table.weight = raw[:n_w].view(torch.float8_e4m3fn).view(table.weight.shape)
        table.scale = raw[n_w:].view(torch.float8_e8m0fnu).view(table.scale.shape)
    return handle


def install_engram_layout(model, layout: str, groups, namespace: str,
                          local_rank: int = 0) -> EngramLayoutHandle | None:
    """Put the model's Engram tables (already loaded) into ``layout``; None without Engram."""
    tables = engram_tables(model)
    if not tables:
        return None
    if layout == "shared":
        handle = _install_shared(model, groups, namespace, local_rank)
    elif layout == "private":
        rank = groups.info.rank if groups is not None else 0
        world = groups.info.world_size if groups is not None else 1
        for name, table in tables.items():
            owner = model.get_submodule(name.rsplit(".", 1)[0])
            owner.embed = RowShardEngramTable(table, rank, world, groups) if groups else table
        handle = EngramLayoutHandle("private")
    else:
        raise ValueError(f"unknown Engram layout {layout!r}")
    resident = sum(t.weight.numel() + t.scale.numel() for t in engram_tables(model).values())
    logger.info("Engram tables: layout %s, %d bytes mapped by rank %s (pid %d)", layout,
                resident, groups.info.rank if groups else 0, os.getpid())
    return handle
