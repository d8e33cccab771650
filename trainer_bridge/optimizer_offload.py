"""CPU optimizer offload: the ``none | fsdp | chunked`` switch and the chunked streamed AdamW.

Where each piece of an fp32 FSDP2 shard of n parameters lives (bytes per parameter):

==========  =======================================  ==========================================
mode        device                                   host
==========  =======================================  ==========================================
none        master 4, grad 4, moments 8              -
fsdp        the all-gathered compute copy only       master 4, grad 4, moments 8 (FSDP2's
                                                     ``CPUOffloadPolicy``; pinned on CUDA)
chunked     master 4, grad 4, one chunk              moments 8 + one pinned chunk
==========  =======================================  ==========================================

``chunked`` keeps Adam's moments in pageable host memory and streams them through one reusable
pinned buffer of ``offload_chunk_mb`` (both moments of ``chunk_mb * 2**20 / 8`` elements): host
-> pinned -> device, torch's own functional AdamW on the device slices (so the arithmetic is
torch's, bit for bit), device -> pinned -> host. The masters stay the FSDP2 fp32 shards on the
device, so there is no second fp32 copy and no bf16 staging copy on the host: the host peak is
8n + one chunk (the issue's 12n assumed a host master next to a bf16 device copy; FSDP2 keeps
one fp32 original dtype per group and casts to bf16 only at all-gather).

The state dict is torch's per-parameter layout (``step``, ``exp_avg``, ``exp_avg_sq`` per
parameter, DTensors sharded like the parameter), so it is independent of the chunk size and
interchangeable with ``none`` and ``fsdp`` checkpoints. Every state tensor is fp32 whatever the
parameter's role (sinks, mHC, router bias, fp32 lm_head): loading refuses anything else by name.

Pinned memory: the chunk buffer is its own anonymous mapping of ceil(bytes / page) pages,
page-locked in place with cudaHostRegister (as SGLang pins its host tables) and unregistered on
``close()``: exact on every torch, where torch's caching host allocator rounds each pinned request
up to a power of two (96.5 MiB takes 128). ``host_mapping`` reads a buffer's VMA from
/proc/self/smaps, so bench/offload.py measures reserved bytes without torch's stats (empty on
torch 2.11). FSDP2's pinned shards (``fsdp``) come from the caching allocator: there
``set_pinned_alloc_conf`` sets ``pinned_max_round_threshold_mb`` where torch knows the key (2.13,
c10/core/AllocatorConfig.h; torch 2.11 refuses it and its shards stay rounded).
"""

from __future__ import annotations

import mmap
import os
import re
import weakref
from typing import Any, Iterable

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

from .local_shards import local

OFFLOAD_MODES = ("none", "fsdp", "chunked")
STATE_KEYS = ("exp_avg", "exp_avg_sq")
STATE_DTYPE = torch.float32
MIB = 1 << 20
PINNED_ROUND_KEY = "pinned_max_round_threshold_mb"
# Pinned requests above this many MiB are exact (the chunk buffer must be larger; see config).
PINNED_ROUND_THRESHOLD_MB = 1


def check_mode(mode: str) -> str:
    if mode not in OFFLOAD_MODES:
        raise ValueError(f"optimizer_offload={mode!r}: choose from {OFFLOAD_MODES}")
    return mode


def offload_policy_for(mode: str, device: torch.device) -> OffloadPolicy:
    """FSDP2's offload policy for ``mode``: only ``fsdp`` moves the shards to the host."""
    if check_mode(mode) == "fsdp":
        if device.type == "cuda":
            set_pinned_alloc_conf()  # FSDP2 pins every shard and gradient
        return CPUOffloadPolicy(pin_memory=device.type == "cuda")
    return OffloadPolicy()


def set_pinned_alloc_conf(threshold_mb: int = PINNED_ROUND_THRESHOLD_MB) -> bool:
    """Turn off power-of-two rounding of pinned requests above ``threshold_mb`` in the live
    allocator config; False where this torch has no such key (torch 2.11 refuses it: its pinned
    requests stay rounded, bench/offload.py shows by how much). A value the user put in
    ``PYTORCH_ALLOC_CONF`` is kept. Never written to the environment: an unknown key there
    makes older torch fail at CUDA start-up."""
    if PINNED_ROUND_KEY in os.environ.get("PYTORCH_ALLOC_CONF", ""):
        return True
    try:
        torch.cuda.memory._set_allocator_settings(f"{PINNED_ROUND_KEY}:{threshold_mb}")
    except (RuntimeError, ValueError):
        return False
    return True


class HostChunkBuffer:
    """A host tensor on its own anonymous mapping of whole pages; with ``pin`` page-locked at
    exactly that size by cudaHostRegister (no allocator rounding) until ``close()``.
    ``cudart`` defaults to torch.cuda.cudart()."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, *, pin: bool, cudart=None):
        self.requested_bytes = dtype.itemsize * int(torch.Size(shape).numel())
        if self.requested_bytes < 1:
            raise ValueError(f"host chunk buffer of shape {shape} holds no byte")
        self.mapped_bytes = -(-self.requested_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self._map = mmap.mmap(-1, self.mapped_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # A forked child must not share or copy pinned pages (CUDA's advice for registered
        # memory); the flag also keeps this VMA from merging with neighbouring anonymous ones,
        # so its size in smaps is the buffer's own.
        self._map.madvise(mmap.MADV_DONTFORK)
        # frombuffer keeps the mapping alive as long as any view of the tensor lives.
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8,
                                       count=self.requested_bytes).view(dtype).view(shape)
        self._unregister = None
        if pin:
            cudart = torch.cuda.cudart() if cudart is None else cudart
            ptr = self.tensor.data_ptr()
            err = int(cudart.cudaHostRegister(ptr, self.mapped_bytes, 0))
            if err != 0:
                raise RuntimeError(f"cudaHostRegister of the {self.mapped_bytes}-byte optimizer "
                                   f"chunk buffer failed with cudaError {err}")
            # Unpinned when the buffer object goes, before its pages can be unmapped.
            self._unregister = weakref.finalize(self, cudart.cudaHostUnregister, ptr)

    @property
    def pinned(self) -> bool:
        return self._unregister is not None and self._unregister.alive

    def close(self) -> None:
        """Unregister the pages (idempotent); the mapping goes with the last tensor view."""
        if self._unregister is not None:
            self._unregister()


_VMA_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ")


def host_mappings(ptrs: Iterable[int], smaps_path: str = "/proc/self/smaps") -> dict[int, dict]:
    """For each address, the VMA holding it: start, size and its Rss / Locked bytes from smaps
    (the kernel's view, whatever allocator made it). Raises if no mapping holds an address."""
    wanted, found, current = sorted(set(ptrs)), {}, None
    with open(smaps_path) as f:
        for line in f:
            head = _VMA_HEADER.match(line)
            if head:
                start, end = int(head.group(1), 16), int(head.group(2), 16)
                current = {"start": start, "size": end - start, "rss": 0, "locked": 0}
                for ptr in wanted:
                    if start <= ptr < end:
                        found[ptr] = current
            elif line.split(":")[0] in ("Rss", "Locked") and current is not None:
                key, value = line.split(":")
                current[key.lower()] = int(value.split()[0]) * 1024  # smaps counts in kB
    missing = [f"{ptr:#x}" for ptr in wanted if ptr not in found]
    if missing:
        raise LookupError(f"no mapping of this process holds address {', '.join(missing)}")
    return found


def host_mapping(ptr: int, smaps_path: str = "/proc/self/smaps") -> dict[str, int]:
    return host_mappings([ptr], smaps_path)[ptr]


def _like_param(param: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """``shard`` wrapped as a DTensor sharded like ``param`` (plain when param is plain)."""
    if not isinstance(param, DTensor):
        return shard
    return DTensor.from_local(shard, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


class ChunkedHostAdamW(torch.optim.Optimizer):
    """AdamW whose moments live on the host and are streamed through one pinned chunk."""

    def __init__(self, params: Iterable[Any], *, lr: float, betas: tuple[float, float],
                 weight_decay: float = 0.0, eps: float = 1e-8, chunk_mb: float = 64):
        chunk_elems = int(chunk_mb * MIB) // (len(STATE_KEYS) * STATE_DTYPE.itemsize)
        if chunk_elems < 1:
            raise ValueError(f"offload_chunk_mb={chunk_mb} holds no element of the Adam state")
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, eps=eps))
        self.chunk_elems = chunk_elems
        self.chunk_buffer: HostChunkBuffer | None = None  # allocated at the first step
        self.pinned: torch.Tensor | None = None  # its [2, chunk_elems] fp32 tensor
        self.staging: torch.Tensor | None = None  # its device twin (the host buffer on CPU)
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.dtype != STATE_DTYPE:
                    raise ValueError(f"chunked offload keeps fp32 masters: a {p.dtype} "
                                     "parameter cannot be trained (build the model in fp32)")

    # ---- state --------------------------------------------------------------------------
    def _host_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            for key in STATE_KEYS:
                host = torch.zeros(local(p).shape, dtype=STATE_DTYPE, device="cpu")
                state[key] = _like_param(p, host)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch's loader would cast every state to the parameter's device (the whole state on
        # the GPU at once): load the groups through it, copy the moments straight to the host.
        saved = state_dict["state"]
        super().load_state_dict({**state_dict, "state": {}})
        # Saved ids (ints, or FQNs from torch.distributed.checkpoint) in group order, as torch.
        params = dict(zip((i for g in state_dict["param_groups"] for i in g["params"]),
                          (p for g in self.param_groups for p in g["params"])))
        for key_id, values in saved.items():
            if key_id not in params:
                raise ValueError(f"optimizer state for {key_id!r}, which no param group holds")
            p = params[key_id]
            state = self._host_state(p)
            name = f"optimizer state of {key_id!r} {tuple(p.shape)}"
            if set(values) != {"step", *STATE_KEYS}:
                raise ValueError(f"{name} has keys {sorted(values)}, expected "
                                 f"{sorted(('step', *STATE_KEYS))} (not an AdamW checkpoint?)")
            state["step"] = torch.tensor(float(values["step"]), dtype=torch.float32)
            for key in STATE_KEYS:
                src = local(values[key])
                dst = local(state[key])
                if src.dtype != STATE_DTYPE or src.shape != dst.shape:
                    raise ValueError(f"{name}: {key} is {src.dtype} {tuple(src.shape)}, expected "
                                     f"{STATE_DTYPE} {tuple(dst.shape)} (fp32 for every role)")
                if src.data_ptr() != dst.data_ptr():
                    dst.copy_(src)

    # ---- step ---------------------------------------------------------------------------
    def _buffers(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pinned is None:
            on_cuda = device.type == "cuda"  # a CPU "device" needs no pinning (no CUDA copy)
            self.chunk_buffer = HostChunkBuffer((len(STATE_KEYS), self.chunk_elems), STATE_DTYPE,
                                                pin=on_cuda)
            self.pinned = self.chunk_buffer.tensor
            self.staging = (torch.empty_like(self.pinned, device=device) if on_cuda
                            else self.pinned)
        return self.pinned, self.staging

    def close(self) -> None:
        """Unpin and drop the chunk buffer now (the next step allocates a new one)."""
        if self.chunk_buffer is not None:
            self.chunk_buffer.close()
        self.chunk_buffer = self.pinned = self.staging = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            live = [p for p in group["params"] if p.grad is not None]
            pieces, used = [], 0
            for p in live:
                shard = local(p)
                if shard.device.type == "cpu" and torch.cuda.is_available() and \
                        isinstance(p, DTensor) and p.device_mesh.device_type == "cuda":
                    raise ValueError("chunked offload streams device shards: do not combine it "
                                     "with FSDP2's CPUOffloadPolicy (optimizer_offload=fsdp)")
                state, numel, start = self._host_state(p), shard.numel(), 0
                while start < numel:
                    length = min(numel - start, self.chunk_elems - used)
                    pieces.append((p, state, start, length, used))
                    start, used = start + length, used + length
                    if used == self.chunk_elems:
                        self._stream(group, pieces, used)
                        pieces, used = [], 0
            if pieces:
                self._stream(group, pieces, used)
            for p in live:
                self.state[p]["step"] += 1
        return loss

    def _stream(self, group: dict[str, Any], pieces: list, used: int) -> None:
        """One chunk: host moments -> pinned -> device, torch's AdamW, and back."""
        device = local(pieces[0][0]).device
        pinned, staging = self._buffers(device)
        for _, state, start, length, offset in pieces:
            for row, key in enumerate(STATE_KEYS):
                pinned[row, offset:offset + length].copy_(
                    local(state[key]).view(-1)[start:start + length])
        if staging is not pinned:
            staging[:, :used].copy_(pinned[:, :used], non_blocking=True)
        params, grads, moments, sqs, steps = [], [], [], [], []
        for p, state, start, length, offset in pieces:
            params.append(local(p).view(-1)[start:start + length])
            grads.append(local(p.grad).view(-1)[start:start + length])
            moments.append(staging[0, offset:offset + length])
            sqs.append(staging[1, offset:offset + length])
            # adamw() advances the step it is given; every slice of a parameter must see the
            # same count, so each gets a copy and step() advances the real one once.
            steps.append(state["step"].clone())
        beta1, beta2 = group["betas"]
        adamw(params, grads, moments, sqs, [], steps, amsgrad=False, beta1=beta1, beta2=beta2,
              lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
              maximize=False)
        if staging is not pinned:
            pinned[:, :used].copy_(staging[:, :used])  # blocking: the host reads it next
        for _, state, start, length, offset in pieces:
            for row, key in enumerate(STATE_KEYS):
                local(state[key]).view(-1)[start:start + length].copy_(
                    pinned[row, offset:offset + length])


def offload_optimizer(optimizer: torch.optim.Optimizer, scheduler, mode: str, chunk_mb: float):
    """Rebuild a freshly made (never stepped) AdamW and its LambdaLR for ``mode``: the groups,
    their hyper-parameters and the LR lambdas come from the schedule, only the class changes."""
    if check_mode(mode) != "chunked":
        return optimizer, scheduler
    if optimizer.state:
        raise ValueError("offload_optimizer needs an optimizer that has not stepped yet")
    defaults = optimizer.defaults
    groups = [dict(g) for g in optimizer.param_groups]
    chunked = ChunkedHostAdamW(groups, lr=defaults["lr"], betas=defaults["betas"],
                               weight_decay=defaults["weight_decay"], eps=defaults["eps"],
                               chunk_mb=chunk_mb)
    new_scheduler = type(scheduler)(chunked, scheduler.lr_lambdas)
    return chunked, new_scheduler
