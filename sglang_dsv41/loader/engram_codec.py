"""Row sharding, dequantize-on-lookup and layout-independent checksums of Engram tables.

Checksums: a table is cut into global chunks of ALIGN_ROWS rows (shard boundaries are multiples
of ALIGN_ROWS, so every chunk belongs to exactly one rank). Each chunk is hashed with its index
(sha256 of index + row bytes + its scale rows) and the digests are summed mod 2^256. The sum
does not depend on who hashed which chunk, so the private layout's per-rank partial sums combine
into the same value the shared layout, a ParameterEngramTable or the checkpoint file gives.
"""

from __future__ import annotations

import hashlib
import struct

import torch

from .engram_source import ALIGN_ROWS, TableSource, tensor_bytes
from .fp8 import FP8_DTYPE, apply_column_scales, scale_row_range, scale_to_float32

HASH_SPACE = 1 << 256


def shard_range(num_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows [lo, hi) owned by ``rank``: equal slices rounded up to ALIGN_ROWS."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of {world_size}")
    per_rank = -(-num_rows // world_size)
    per_rank = -(-per_rank // ALIGN_ROWS) * ALIGN_ROWS
    lo = min(rank * per_rank, num_rows)
    return lo, min(lo + per_rank, num_rows)


class RowDecoder:
    """Turns stored rows (bf16/fp16/fp32, or fp8 + block scales) into float32 on lookup.

    fp8 rows dequantize through loader.fp8.apply_column_scales, as the full load does, so a
    lookup equals the full-load parameter bit for bit."""

    def __init__(self, source: TableSource, scale: torch.Tensor | None, first_row: int):
        self.is_fp8 = source.weight.dtype == FP8_DTYPE
        self.block = source.block
        self.first_scale_row = first_row // source.block[0]
        self.scale = scale_to_float32(scale) if self.is_fp8 else None

    def scales_for(self, rows: torch.Tensor) -> torch.Tensor | None:
        """float32 [n, ceil(dim / block)] scale row of each global row (None unless fp8)."""
        if not self.is_fp8:
            return None
        return self.scale.index_select(0, rows // self.block[0] - self.first_scale_row)

    def decode(self, values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """values: stored rows [n, dim] for global rows ``rows`` [n] -> float32 [n, dim]."""
        return self.decode_scaled(values, self.scales_for(rows))

    def decode_scaled(self, values: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
        """values [n, dim] with their per-row block scales [n, nb] (from scales_for)."""
        if not self.is_fp8:
            return values.float()
        return apply_column_scales(values, s, self.block[1])


def chunk_digest_sum(values: torch.Tensor, scale: torch.Tensor | None, first_row: int,
                     block_rows: int = 128) -> int:
    """Sum of chunk digests of stored rows ``values`` (global rows first_row..), scale rows
    ``scale`` starting at first_row // block_rows."""
    if first_row % ALIGN_ROWS:
        raise ValueError(f"chunks start at multiples of {ALIGN_ROWS}, got row {first_row}")
    data = tensor_bytes(values.contiguous())
    row_bytes = len(data) // values.shape[0] if values.shape[0] else 0
    sdata = tensor_bytes(scale.contiguous()) if scale is not None else None
    srow_bytes = len(sdata) // scale.shape[0] if scale is not None and scale.shape[0] else 0
    total = 0
    for a in range(0, values.shape[0], ALIGN_ROWS):
        b = min(values.shape[0], a + ALIGN_ROWS)
        h = hashlib.sha256(struct.pack("<Q", (first_row + a) // ALIGN_ROWS))
        h.update(data[a * row_bytes:b * row_bytes])
        if sdata is not None:
            sa, sb = scale_row_range(a, b, block_rows)
            h.update(sdata[sa * srow_bytes:sb * srow_bytes])
        total = (total + int.from_bytes(h.digest(), "little")) % HASH_SPACE
    return total


def finish_checksum(dtype: torch.dtype, shape: tuple[int, ...], digest_sum: int) -> str:
    h = hashlib.sha256(f"{dtype}|{tuple(shape)}|".encode())
    h.update(digest_sum.to_bytes(32, "little"))
    return "sha256:" + h.hexdigest()


def tensor_checksum(values: torch.Tensor, scale: torch.Tensor | None = None,
                    block_rows: int = 128) -> str:
    """Checksum of a whole table held in one tensor (parameter tables, checkpoint tensors)."""
    values = values.detach().cpu()
    s = None if scale is None else scale.detach().cpu()
    return finish_checksum(values.dtype, tuple(values.shape),
                           chunk_digest_sum(values, s, 0, block_rows))


def source_checksum(source: TableSource, rows_per_read: int = 64 * ALIGN_ROWS) -> str:
    """Checksum of a table as stored in the checkpoint, read in bounded chunks."""
    total, br = 0, source.block[0]
    scale = source.scale.read_rows(0, source.scale.shape[0]) if source.scale else None
    for lo in range(0, source.num_rows, rows_per_read):
        hi = min(source.num_rows, lo + rows_per_read)
        s = scale[slice(*scale_row_range(lo, hi, br))] if scale is not None else None
        total += chunk_digest_sum(source.weight.read_rows(lo, hi), s, lo, br)
    return finish_checksum(source.weight.dtype, source.weight.shape, total % HASH_SPACE)
