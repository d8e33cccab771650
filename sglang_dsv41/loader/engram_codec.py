"""Layout-independent checksums of Engram tables (the weight-update guard and /engram_checksum).

Checksums: a table is cut into global chunks of ALIGN_ROWS rows (shard boundaries are multiples
of ALIGN_ROWS, so every chunk belongs to exactly one rank). Each chunk is hashed with its index
(sha256 of index + row bytes + its scale rows) and the digests are summed mod 2^256. The sum
does not depend on who hashed which chunk, so the private layout's per-rank partial sums combine
into the same value the shared layout, a whole table or the checkpoint tensor gives.
"""

from __future__ import annotations

import hashlib
import struct

import torch

from .fp8 import scale_row_range

HASH_SPACE = 1 << 256
ALIGN_ROWS = 128  # checksum chunk; shard boundaries are multiples of it


def tensor_bytes(t: torch.Tensor) -> memoryview:
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


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
