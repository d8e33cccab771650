"""Where an Engram table lives in a checkpoint, and row-range reads straight from its file.

Reads go through ``readinto`` into the caller's buffer instead of a memory map: a mapped file's
touched pages count in the reader's RSS, so slicing a mapping would charge a rank twice for its
shard (mapped pages + the copy). With ``readinto`` only the destination buffer is resident.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import torch

from .fp8 import FP8_BLOCK, FP8_DTYPE, scale_name, scale_row_range, scale_shape
from .shards import DTYPES_BY_NAME, checkpoint_files

TABLE_SUFFIX = ".engram.table.weight"
ALIGN_ROWS = 128  # shard boundaries and checksum chunks; a multiple of every fp8 row block
_READ_CHUNK = 64 << 20


@dataclass(frozen=True)
class TensorEntry:
    name: str
    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int   # absolute byte offset of the tensor's data in the file
    nbytes: int

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.shape[0] if self.shape[0] else 0

    def read_rows(self, lo: int, hi: int) -> torch.Tensor:
        out = torch.empty((hi - lo, *self.shape[1:]), dtype=self.dtype)
        self.read_rows_into(lo, hi, tensor_bytes(out))
        return out

    def read_rows_into(self, lo: int, hi: int, dst: memoryview) -> None:
        if not 0 <= lo <= hi <= self.shape[0]:
            raise ValueError(f"{self.name}: rows {lo}..{hi} outside 0..{self.shape[0]}")
        want = (hi - lo) * self.row_bytes
        if len(dst) != want:
            raise ValueError(f"{self.name}: buffer of {len(dst)} bytes for {want} bytes of rows")
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.offset + lo * self.row_bytes)
            done = 0
            while done < want:
                n = f.readinto(dst[done:min(want, done + _READ_CHUNK)])
                if not n:
                    raise ValueError(f"{self.path}: truncated while reading {self.name}")
                done += n


@dataclass(frozen=True)
class TableSource:
    """One Engram table in a checkpoint: bf16/fp32 rows, or fp8 rows plus block scales."""

    weight: TensorEntry
    scale: TensorEntry | None = None
    block: tuple[int, int] = FP8_BLOCK

    @property
    def name(self) -> str:
        return self.weight.name

    @property
    def num_rows(self) -> int:
        return self.weight.shape[0]

    @property
    def dim(self) -> int:
        return self.weight.shape[1]

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (self.scale.nbytes if self.scale else 0)

    def scale_rows(self, lo: int, hi: int) -> tuple[int, int]:
        """The scale rows that cover table rows lo..hi-1."""
        return scale_row_range(lo, hi, self.block[0])


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (works for bf16/fp8, unlike .numpy())."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def read_safetensors_header(path: str) -> dict[str, TensorEntry]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"corrupt checkpoint shard {path}: no header")
        (size,) = struct.unpack("<Q", raw)
        if size > 100 << 20:
            raise ValueError(f"corrupt checkpoint shard {path}: header of {size} bytes")
        try:
            header = json.loads(f.read(size))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"corrupt checkpoint shard {path}: {e}") from e
    file_size, base = os.path.getsize(path), 8 + size
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in DTYPES_BY_NAME:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        if base + end > file_size:
            raise ValueError(f"corrupt checkpoint shard {path}: {name!r} runs past the end")
        out[name] = TensorEntry(name, path, DTYPES_BY_NAME[info["dtype"]], tuple(info["shape"]),
                                base + begin, end - begin)
    return out


def find_engram_tables(ckpt_dir: str, block: tuple[int, int] = FP8_BLOCK
                       ) -> dict[str, TableSource]:
    """Every ``...engram.table.weight`` of a checkpoint (index or single file), by name."""
    entries: dict[str, TensorEntry] = {}
    for file, names in checkpoint_files(ckpt_dir).items():
        if names is not None and not any(".engram.table." in n for n in names):
            continue  # skip shards without Engram tensors: no need to read their headers
        entries.update(read_safetensors_header(os.path.join(ckpt_dir, file)))
    tables = {}
    for name, entry in entries.items():
        if not name.endswith(TABLE_SUFFIX):
            continue
        if len(entry.shape) != 2:
            raise ValueError(f"Engram table {name} must be 2-D, has shape {entry.shape}")
        scale = entries.get(scale_name(name))
        if entry.dtype == FP8_DTYPE:
            if scale is None:
                raise ValueError(f"fp8 Engram table {name} has no {scale_name(name)}")
            want = scale_shape(entry.shape, block)
            if tuple(scale.shape) != want or ALIGN_ROWS % block[0]:
                raise ValueError(f"{scale.name} has shape {scale.shape}, expected {want} for "
                                 f"{block[0]}x{block[1]} blocks")
        elif scale is not None:
            raise ValueError(f"{scale.name} given for a {entry.dtype} table (only fp8 has scales)")
        elif not entry.dtype.is_floating_point:
            raise ValueError(f"Engram table {name} has non-float dtype {entry.dtype}")
        tables[name] = TableSource(entry, scale if entry.dtype == FP8_DTYPE else None, block)
    return tables
