"""Sharded safetensors layout: streaming shard writer, shard planning, index, header reading.

The writer emits the safetensors header first (every name, dtype and shape is known up front)
and then the tensor bytes in order, chunk by chunk, so a shard is never held in memory.
"""

from __future__ import annotations

import json
import os
import struct
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
from safetensors import SafetensorError, safe_open

from ..jsonio import read_json_object

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"

DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2", torch.float8_e8m0fnu: "F8_E8M0",
}
DTYPES_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}


def shard_file_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def tensor_nbytes(dtype: torch.dtype, shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=dtype).element_size()


class StreamingShardWriter:
    """Writes one safetensors file whose tensors are declared up front and then fed in order,
    whole or in row chunks."""

    def __init__(self, path: str, entries: list[tuple[str, torch.dtype, list[int]]],
                 metadata: dict[str, str] | None = None):
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        self._order: list[tuple[str, torch.dtype, int]] = []
        for name, dtype, shape in entries:
            if name in header:
                raise ValueError(f"duplicate tensor name {name!r} in shard {path}")
            if dtype not in DTYPE_NAMES:
                raise ValueError(f"tensor {name!r}: dtype {dtype} cannot be stored in safetensors")
            size = tensor_nbytes(dtype, shape)
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": [int(d) for d in shape],
                            "data_offsets": [offset, offset + size]}
            self._order.append((name, dtype, size))
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, like safetensors' own writer
        self.path, self.data_bytes = path, offset
        with self._naming_path():
            self._f = open(path, "wb")
            try:
                self._f.write(struct.pack("<Q", len(raw)) + raw)
            except BaseException:
                self.abort()
                raise
        self._next, self._written = 0, 0

    @contextmanager
    def _naming_path(self) -> Iterator[None]:
        """Re-raise a write error (disk full, file too large) with the shard's path: the
        errno alone does not say which file or filesystem."""
        try:
            yield
        except OSError as e:
            if e.filename is not None:
                raise
            raise OSError(e.errno, e.strerror or str(e), self.path) from e

    def write(self, name: str, chunk: torch.Tensor) -> None:
        """Append ``chunk`` (the whole tensor or its next rows) to tensor ``name``."""
        if self._next >= len(self._order):
            raise ValueError(f"{self.path}: tensor {name!r} written after the declared ones")
        want, dtype, size = self._order[self._next]
        if name != want or chunk.dtype != dtype:
            raise ValueError(f"{self.path}: expected {want!r} ({dtype}), got {name!r} "
                             f"({chunk.dtype})")
        data = chunk.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        if self._written + data.nbytes > size:
            raise ValueError(f"{self.path}: tensor {name!r} got more bytes than its shape holds")
        with self._naming_path():
            self._f.write(memoryview(data))
        self._written += data.nbytes
        if self._written == size:
            self._next, self._written = self._next + 1, 0

    def close(self) -> None:
        if self._next != len(self._order):
            self.abort()
            missing = self._order[self._next][0]
            raise ValueError(f"{self.path}: closed before tensor {missing!r} was complete")
        with self._naming_path():
            try:
                self._f.flush()
                os.fsync(self._f.fileno())
            except BaseException:
                self.abort()
                raise
            self._f.close()

    def abort(self) -> None:
        """Close after a failure. The shard is incomplete anyway: flushing its buffer may fail
        again (the disk that just filled up), and that must not replace the first error."""
        try:
            self._f.close()
        except OSError:
            pass

    def __enter__(self) -> "StreamingShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """close() (the shard must be complete) on success, abort() on an exception."""
        if exc_type is None:
            self.close()
        else:
            self.abort()


def plan_shards(sizes: list[int], max_shard_bytes: int) -> list[list[int]]:
    """Greedy in-order grouping of tensor indices; a tensor over the limit gets its own shard."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards: list[list[int]] = []
    current, current_bytes = [], 0
    for i, size in enumerate(sizes):
        if current and current_bytes + size > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += size
    if current or not shards:
        shards.append(current)
    return shards


def split_into_shards(sizes: list[int], num_shards: int) -> list[list[int]]:
    """In-order split into exactly ``num_shards`` non-empty groups of similar byte size."""
    n = len(sizes)
    if not 1 <= num_shards <= max(n, 1):
        raise ValueError(f"cannot split {n} tensors into {num_shards} non-empty shards")
    total = max(sum(sizes), 1)
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    cum, prev = 0, 0
    for i, size in enumerate(sizes):
        s = int((cum + size / 2) * num_shards // total)
        # never skip a shard, and leave at least one tensor for each remaining shard
        s = min(max(min(max(s, prev), prev + 1 if i else 0), num_shards - (n - i)),
                num_shards - 1)
        shards[s].append(i)
        cum, prev = cum + size, s
    return shards


def write_index(out_dir: str, weight_map: dict[str, str], total_size: int) -> None:
    index = {"metadata": {"total_size": int(total_size)},
             "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)


def checkpoint_files(ckpt_dir: str) -> dict[str, list[str] | None]:
    """Shard file -> the names the index assigns to it, in file order; without an index every
    ``*.safetensors`` file maps to None (its names come from its header)."""
    index_path = os.path.join(ckpt_dir, INDEX_FILE)
    if os.path.exists(index_path):
        index = read_json_object(index_path, "checkpoint index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"corrupt checkpoint index {index_path}: no weight_map")
        files: dict[str, list[str] | None] = {}
        root = os.path.realpath(ckpt_dir)
        for name, file in weight_map.items():
            # An entry is a shard in this directory: never an absolute path, a parent, or a
            # symlink leading out of it (an index must not make the loader read other files).
            if not isinstance(file, str) or not file or os.path.isabs(file) or \
                    os.path.commonpath([root, os.path.realpath(os.path.join(root, file))]) != root:
                raise ValueError(f"checkpoint index {index_path}: tensor {name!r} points outside "
                                 f"the checkpoint directory ({file!r})")
            files.setdefault(file, []).append(name)  # type: ignore[union-attr]
        for file in files:
            if not os.path.isfile(os.path.join(ckpt_dir, file)):
                raise ValueError(f"checkpoint index {index_path} names {file}, which is missing")
        return dict(sorted(files.items()))
    # No index: every *.safetensors file of the directory, SGLang's rule (weight_utils
    # filter_duplicate_safetensors_files filters only by an index); names from the headers.
    files = sorted(f for f in os.listdir(ckpt_dir) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no weights in {ckpt_dir}: neither {INDEX_FILE} nor any "
                         f"*.safetensors file")
    root = os.path.realpath(ckpt_dir)
    for file in files:
        if os.path.commonpath([root, os.path.realpath(os.path.join(root, file))]) != root:
            raise ValueError(f"checkpoint file {file} in {ckpt_dir} is a link leading outside "
                             "the checkpoint directory")
    return {file: None for file in files}


def open_shard(path: str):
    """safe_open with errors that name the file (missing, truncated, bad header)."""
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint shard {path} is missing")
    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"corrupt checkpoint shard {path}: {e}") from e


def shard_headers(path: str) -> dict[str, tuple[torch.dtype, list[int]]]:
    """name -> (dtype, shape), without reading tensor data."""
    with open_shard(path) as f:
        out = {}
        for name in f.keys():
            sl = f.get_slice(name)
            dt = sl.get_dtype()
            if dt not in DTYPES_BY_NAME:
                raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {dt}")
            out[name] = (DTYPES_BY_NAME[dt], list(sl.get_shape()))
        return out


def read_tensor_locations(src: str) -> dict[str, tuple[str, torch.dtype, list[int]]]:
    """name -> (shard file, dtype, shape) from every shard header. A name stored in two shards,
    or in a shard other than the one the index names (or missing from the index), is refused:
    which copy is meant cannot be guessed."""
    files = checkpoint_files(src)
    index = {n: f for f, names in files.items() for n in names or []}
    tensors: dict[str, tuple[str, torch.dtype, list[int]]] = {}
    for file in files:
        path = os.path.join(src, file)
        for n, (dt, shape) in shard_headers(path).items():
            if n in tensors:
                named = f" (the index names {index[n]})" if n in index else ""
                raise ValueError(f"tensor {n!r} is stored in two shards, {tensors[n][0]} and "
                                 f"{file}{named}")
            if index and n not in index:
                raise ValueError(f"checkpoint shard {path} holds tensor {n!r}, which the index "
                                 "does not list")
            tensors[n] = (file, dt, shape)
    for n, file in index.items():
        if n not in tensors:
            raise ValueError(f"checkpoint shard {os.path.join(src, file)} lacks tensor {n!r} "
                             "that the index assigns to it")
        if tensors[n][0] != file:
            raise ValueError(f"the checkpoint index assigns tensor {n!r} to {file}, but it is "
                             f"stored in {tensors[n][0]}")
    return tensors


class RawShardReader:
    """Reads tensors or row ranges of one safetensors file with plain file reads, not mmap, so
    the only resident memory is what the caller keeps (the converter reads ~1 chunk at a time)."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise ValueError(f"checkpoint shard {path} is missing")
        self.path = path
        self._f = open(path, "rb")
        try:
            size = os.fstat(self._f.fileno()).st_size
            head = self._f.read(8)
            if len(head) < 8:
                raise ValueError("file shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ValueError(f"header length {n} exceeds the file size {size}")
            header = json.loads(self._f.read(n))
            header.pop("__metadata__", None)
            self._data_start = 8 + n
            end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
            if self._data_start + end > size:
                raise ValueError(f"file is truncated: data ends at {self._data_start + end}, "
                                 f"file has {size} bytes")
            self.tensors = {k: (DTYPES_BY_NAME[v["dtype"]], [int(d) for d in v["shape"]],
                                int(v["data_offsets"][0])) for k, v in header.items()}
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            self._f.close()
            raise ValueError(f"corrupt checkpoint shard {path}: {e}") from e

    def read_rows(self, name: str, a: int, b: int) -> torch.Tensor:
        """Rows a..b-1 along the first dimension (the whole tensor for a 0-dim one)."""
        if name not in self.tensors:
            raise ValueError(f"checkpoint shard {self.path} has no tensor {name!r}")
        dtype, shape, offset = self.tensors[name]
        rest = shape[1:] if shape else []
        row_bytes = tensor_nbytes(dtype, rest)
        rows = (b - a) if shape else 1
        buf = torch.empty(rows * row_bytes, dtype=torch.uint8)
        self._f.seek(self._data_start + offset + a * row_bytes)
        if self._f.readinto(buf.numpy()) != buf.numel():
            raise ValueError(f"corrupt checkpoint shard {self.path}: short read of {name!r}")
        return buf.view(dtype).reshape([rows, *rest] if shape else [])

    def read(self, name: str) -> torch.Tensor:
        shape = self.tensors[name][1] if name in self.tensors else []
        return self.read_rows(name, 0, shape[0] if shape else 1)

    def close(self) -> None:
        self._f.close()
