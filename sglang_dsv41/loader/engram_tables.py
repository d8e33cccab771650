"""Engram tables in host memory (SharedEngramTable / PrivateEngramTable), see engram_store.

Layouts (SPEC part 4):
- shared: one copy per node in a /dev/shm segment, written by local rank 0 straight from the
  checkpoint file and mapped read-only by every local rank; lookups read it directly.
- private: each rank reads only its row shard (rows shard_range(rank)) from the checkpoint.
  A lookup is a collective over the TP group: distinct requested rows are routed to their
  owners and the stored bytes routed back (all-to-all), then decoded by the asker with the same
  arithmetic, so the result, -0.0 and NaN included, is bit-identical to a full table. Every
  rank must call lookup the same number of times, with 0 rows on idle ranks; the embedded
  engine runs every layer on every rank each step.
  (An all-gather of the requests + a reduce-scatter of zero-padded float32 answers is also
  exact but moves world_size times the data: 0.9 s per 16k-row lookup on 4 gloo ranks.)

Tables keep the checkpoint dtype (bf16/fp32, or fp8 + block scales) and dequantize on lookup.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from typing import Callable, ContextManager

import torch
import torch.distributed as dist
from torch import nn

from .engram_codec import HASH_SPACE, RowDecoder, chunk_digest_sum, finish_checksum, shard_range
from .engram_source import TableSource
from .shm import ShmNamespace

_HEADER_BYTES = 4096
_MAGIC = "sgldsv41-engram-v1"
# torch 2.13 renamed all_gather_into_tensor (the old name warns on every call)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _comm_device(group) -> torch.device:
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(ok: bool, group=None, world_size: int | None = None) -> bool:
    """All ranks' verdicts -> True only if every rank said ok (a collective when distributed)."""
    if world_size == 1 or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return ok
    t = torch.tensor([1 if ok else 0], dtype=torch.int32, device=_comm_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def _digest_sum_all(local_sum: int, group, world_size: int) -> int:
    if world_size == 1:
        return local_sum
    dev = _comm_device(group)
    mine = torch.tensor(list(local_sum.to_bytes(32, "little")), dtype=torch.uint8, device=dev)
    every = torch.empty(world_size * 32, dtype=torch.uint8, device=dev)
    _all_gather_single(every, mine, group=group)
    raw = bytes(every.cpu().tolist())
    return sum(int.from_bytes(raw[i:i + 32], "little") for i in range(0, len(raw), 32)) % HASH_SPACE


class _HostTable(nn.Module):
    """Common part: a [rows, dim] stored tensor (+ fp8 scales) owning rows lo..hi-1."""

    layout = ""

    def __init__(self, source: TableSource, rank: int, world_size: int, group):
        super().__init__()
        self.name, self.num_rows, self.dim = source.name, source.num_rows, source.dim
        self.source, self.rank, self.world_size, self.group = source, rank, world_size, group
        self.values: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.closed = False

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"Engram table {self.name} was closed (store handle closed)")

    def _check_rows(self, rows: torch.Tensor) -> None:
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.num_rows):
            raise ValueError(f"Engram table {self.name}: row ids outside 0..{self.num_rows - 1}")

    def checksum(self) -> str:
        """Layout-independent checksum (a collective over the group when world_size > 1)."""
        self._check_open()
        lo, hi = self._hash_range()
        br = self.source.block[0]
        s = None if self.scale is None else self._scale_slice(lo, hi)
        local = chunk_digest_sum(self._value_slice(lo, hi), s, lo, br) if hi > lo else 0
        total = _digest_sum_all(local, self.group, self.world_size)
        return finish_checksum(self.source.weight.dtype, self.source.weight.shape, total)

    def _hash_range(self) -> tuple[int, int]:
        return shard_range(self.num_rows, self.rank, self.world_size)


class PrivateEngramTable(_HostTable):
    layout = "private"

    def __init__(self, source: TableSource, rank: int, world_size: int, group=None,
                 guard: Callable[[str], ContextManager] | None = None):
        """``guard(op)`` wraps each lookup's collectives (the engine's stall watchdog)."""
        super().__init__(source, rank, world_size, group)
        self.guard = guard or (lambda op: contextlib.nullcontext())
        self.lo, self.hi = shard_range(source.num_rows, rank, world_size)
        self.rows_per_rank = max(shard_range(source.num_rows, 0, world_size)[1], 1)
        self.values = source.weight.read_rows(self.lo, self.hi)
        if source.scale is not None:
            self.scale = source.scale.read_rows(*source.scale_rows(self.lo, self.hi))
        self.decoder = RowDecoder(source, self.scale, self.lo)
        self.resident_bytes = self.values.nbytes + (self.scale.nbytes if self.scale is not None
                                                    else 0)

    def _value_slice(self, lo: int, hi: int) -> torch.Tensor:
        return self.values[lo - self.lo:hi - self.lo]

    def _scale_slice(self, lo: int, hi: int) -> torch.Tensor:
        return self.scale

    def _answer(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 [n, dim] of rows this rank owns."""
        return self.decoder.decode(self.values.index_select(0, rows - self.lo), rows)

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        self._check_open()
        flat = rows.reshape(-1).to("cpu", torch.int64)
        if self.world_size == 1:
            self._check_rows(flat)
            return self._answer(flat).reshape(*rows.shape, self.dim).to(rows.device)
        # Each distinct row goes to its owner, which sends back its stored bytes (fp8 rows with
        # their float32 block scales); the asker decodes. Pure data movement plus the same
        # arithmetic as a local lookup, so the result is bit-identical.
        with self.guard(f"engram_lookup[{self.name}]"):
            return self._lookup_collective(rows, flat)

    def _lookup_collective(self, rows: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        dev, w = _comm_device(self.group), self.world_size
        bad = bool(flat.numel()) and (int(flat.min()) < 0 or int(flat.max()) >= self.num_rows)
        uniq, inverse = torch.unique(flat, sorted=True, return_inverse=True)  # grouped by owner
        send = torch.bincount((uniq // self.rows_per_rank).clamp(0, w - 1), minlength=w)
        header = torch.stack([send, torch.full((w,), int(bad))], 1).to(dev)
        recv_header = torch.empty_like(header)
        dist.all_to_all_single(recv_header, header, group=self.group)
        recv_header = recv_header.cpu()
        if bool(recv_header[:, 1].any()):  # every rank learns it, so all raise together
            raise ValueError(f"Engram table {self.name}: row ids outside 0..{self.num_rows - 1}")
        send_sizes, recv_sizes = send.tolist(), recv_header[:, 0].tolist()
        asked = torch.empty(sum(recv_sizes), dtype=torch.int64, device=dev)
        dist.all_to_all_single(asked, uniq.to(dev), recv_sizes, send_sizes, group=self.group)
        asked = asked.cpu()
        payload = self.values.index_select(0, asked - self.lo).view(torch.uint8)
        value_bytes = payload.shape[1]
        if self.decoder.is_fp8:
            scales = self.decoder.scales_for(asked).contiguous().view(torch.uint8)
            payload = torch.cat([payload, scales], 1)
        back = torch.empty(uniq.numel(), payload.shape[1], dtype=torch.uint8, device=dev)
        dist.all_to_all_single(back, payload.to(dev), send_sizes, recv_sizes, group=self.group)
        back = back.cpu()
        values = back[:, :value_bytes].contiguous().view(self.values.dtype)
        s = back[:, value_bytes:].contiguous().view(torch.float32) if self.decoder.is_fp8 else None
        out = self.decoder.decode_scaled(values, s).index_select(0, inverse)
        return out.reshape(*rows.shape, self.dim).to(rows.device)

    def overwrite_(self, weight: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        self._check_open()
        self.values.copy_(weight[self.lo:self.hi])
        if self.scale is not None and scale is not None:
            self.scale.copy_(scale[slice(*self.source.scale_rows(self.lo, self.hi))])
            self.decoder = RowDecoder(self.source, self.scale, self.lo)

    def close(self) -> None:
        self.closed, self.values, self.scale = True, None, None


class SharedEngramTable(_HostTable):
    layout = "shared"

    def __init__(self, source: TableSource, ns: ShmNamespace, key: str, rank: int,
                 world_size: int, group=None, is_writer: bool = False):
        super().__init__(source, rank, world_size, group)
        self.ns, self.key, self.is_writer = ns, key, is_writer
        self._mm = ns.attach_segment(key)
        with warnings.catch_warnings():  # a read-only mapping: writes would fault, as intended
            warnings.simplefilter("ignore", UserWarning)
            whole = torch.frombuffer(self._mm, dtype=torch.uint8)
        meta = json.loads(bytes(whole[:_HEADER_BYTES]).rstrip(b"\0"))
        if meta.get("magic") != _MAGIC or meta["name"] != source.name:
            raise ValueError(f"shared segment {ns.segment_path(key)} does not hold {source.name}")
        w = source.weight
        self.values = whole[meta["weight_offset"]:meta["weight_offset"] + w.nbytes].view(
            w.dtype).view(w.shape)
        if source.scale is not None:
            s = source.scale
            self.scale = whole[meta["scale_offset"]:meta["scale_offset"] + s.nbytes].view(
                s.dtype).view(s.shape)
        self.decoder = RowDecoder(source, self.scale, 0)
        self.resident_bytes = source.nbytes

    @staticmethod
    def create_segment(source: TableSource, ns: ShmNamespace, key: str) -> None:
        """Copy the table from the checkpoint file into a new segment (local rank 0 only)."""
        scale_offset = _HEADER_BYTES + -(-source.weight.nbytes // 64) * 64
        total = scale_offset + (source.scale.nbytes if source.scale else 0)
        meta = {"magic": _MAGIC, "name": source.name, "weight_offset": _HEADER_BYTES,
                "scale_offset": scale_offset, "source": source.weight.path}
        tmp, mm = ns.create_segment(key, total)
        try:
            buf = memoryview(mm)
            rows_per_read = max(1, (64 << 20) // max(source.weight.row_bytes, 1))
            for lo in range(0, source.num_rows, rows_per_read):
                hi = min(source.num_rows, lo + rows_per_read)
                a = _HEADER_BYTES + lo * source.weight.row_bytes
                source.weight.read_rows_into(lo, hi, buf[a:a + (hi - lo) * source.weight.row_bytes])
            if source.scale is not None:
                s = source.scale
                s.read_rows_into(0, s.shape[0], buf[scale_offset:scale_offset + s.nbytes])
            raw = json.dumps(meta).encode()
            buf[:len(raw)] = raw
            buf.release()
            mm.flush()
        finally:
            mm.close()
        ns.publish(tmp, key)

    def _value_slice(self, lo: int, hi: int) -> torch.Tensor:
        return self.values[lo:hi]

    def _scale_slice(self, lo: int, hi: int) -> torch.Tensor:
        return self.scale[slice(*self.source.scale_rows(lo, hi))]

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        self._check_open()
        flat = rows.reshape(-1).to("cpu", torch.int64)
        self._check_rows(flat)
        out = self.decoder.decode(self.values.index_select(0, flat), flat)
        return out.reshape(*rows.shape, self.dim).to(rows.device)

    def overwrite_(self, weight: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        """Forced update: local rank 0 writes the node copy; a barrier keeps readers out."""
        self._check_open()
        if self.is_writer:
            mm = self.ns.attach_segment(self.key, writable=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                whole = torch.frombuffer(mm, dtype=torch.uint8)
            def raw(t: torch.Tensor) -> torch.Tensor:
                return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)

            a = _HEADER_BYTES
            whole[a:a + self.values.nbytes].copy_(raw(weight))
            if self.scale is not None and scale is not None:
                o = json.loads(bytes(whole[:_HEADER_BYTES]).rstrip(b"\0"))["scale_offset"]
                whole[o:o + self.scale.nbytes].copy_(raw(scale))
            del whole
            mm.close()
        if self.scale is not None:
            self.decoder = RowDecoder(self.source, self.scale, 0)
        agree(True, self.group, self.world_size)

    def close(self) -> None:
        self.closed, self.values, self.scale, self.decoder = True, None, None, None
        try:
            self._mm.close()
        except BufferError:  # a caller still holds a lookup view; the GC unmaps it later
            pass
