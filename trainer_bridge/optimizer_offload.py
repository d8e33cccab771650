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

Pinned memory: torch's caching host allocator rounds every pinned request up to a power of two
unless it exceeds ``pinned_max_round_threshold_mb`` (c10/core/AllocatorConfig.h in torch 2.13;
torch 2.11 refuses the key). ``set_pinned_alloc_conf`` sets it in the live allocator config where
torch knows it, so the chunk buffer and FSDP2's pinned shards are allocated exactly.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

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


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _like_param(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` wrapped as a DTensor sharded like ``param`` (plain when param is plain)."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
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
        self.pinned: torch.Tensor | None = None  # [2, chunk_elems] fp32, allocated once
        self.staging: torch.Tensor | None = None  # its device twin (the pinned buffer on CPU)
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
                host = torch.zeros(_local(p).shape, dtype=STATE_DTYPE, device="cpu")
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
                src = _local(values[key])
                dst = _local(state[key])
                if src.dtype != STATE_DTYPE or src.shape != dst.shape:
                    raise ValueError(f"{name}: {key} is {src.dtype} {tuple(src.shape)}, expected "
                                     f"{STATE_DTYPE} {tuple(dst.shape)} (fp32 for every role)")
                if src.data_ptr() != dst.data_ptr():
                    dst.copy_(src)

    # ---- step ---------------------------------------------------------------------------
    def _buffers(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pinned is None:
            on_cuda = device.type == "cuda"
            if on_cuda:
                set_pinned_alloc_conf()
            self.pinned = torch.empty((len(STATE_KEYS), self.chunk_elems), dtype=STATE_DTYPE,
                                      pin_memory=on_cuda)
            self.staging = (torch.empty_like(self.pinned, device=device) if on_cuda
                            else self.pinned)
        return self.pinned, self.staging

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            live = [p for p in group["params"] if p.grad is not None]
            pieces, used = [], 0
            for p in live:
                local = _local(p)
                if local.device.type == "cpu" and torch.cuda.is_available() and \
                        isinstance(p, DTensor) and p.device_mesh.device_type == "cuda":
                    raise ValueError("chunked offload streams device shards: do not combine it "
                                     "with FSDP2's CPUOffloadPolicy (optimizer_offload=fsdp)")
                state, numel, start = self._host_state(p), local.numel(), 0
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
        device = _local(pieces[0][0]).device
        pinned, staging = self._buffers(device)
        for _, state, start, length, offset in pieces:
            for row, key in enumerate(STATE_KEYS):
                pinned[row, offset:offset + length].copy_(
                    _local(state[key]).view(-1)[start:start + length])
        if staging is not pinned:
            staging[:, :used].copy_(pinned[:, :used], non_blocking=True)
        params, grads, moments, sqs, steps = [], [], [], [], []
        for p, state, start, length, offset in pieces:
            params.append(_local(p).view(-1)[start:start + length])
            grads.append(_local(p.grad).view(-1)[start:start + length])
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
                _local(state[key]).view(-1)[start:start + length].copy_(
                    pinned[row, offset:offset + length])


def build_adamw(groups: list[dict[str, Any]], mode: str, *, lr: float,
                betas: tuple[float, float], weight_decay: float,
                chunk_mb: float) -> torch.optim.Optimizer:
    """The optimizer for ``mode``: torch's AdamW (``none``: state where the shards are, on the
    device; ``fsdp``: on the host, because FSDP2 put the shards there) or ChunkedHostAdamW."""
    if check_mode(mode) == "chunked":
        return ChunkedHostAdamW(groups, lr=lr, betas=betas, weight_decay=weight_decay,
                                chunk_mb=chunk_mb)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, weight_decay=weight_decay)


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
