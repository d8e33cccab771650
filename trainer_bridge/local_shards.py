"""The optimizer phase on FSDP2's local shards: gradient norms, clipping and AdamW.

FSDP2's parameters and gradients are DTensors. torch's clip_grad_norm_ and AdamW work on them
correctly, but DTensor dispatches each op on the host, per op and per tensor: over the ``tiny``
preset's 186 tensors clipping took 4.1x and AdamW.step 3.5x the time of the same work on the
local shards (bench/optimizer_dtensor.py, CPU), and on one H200 the optimizer phase held the
host 16-25 ms for 6.5 ms of GPU work (bench/results/train_h200.txt, run R).

AdamW and the clipping scale are elementwise, so the local shards take exactly the same
arithmetic; only a norm needs the other ranks, and gets one all-reduce of a scalar per mesh
dimension its gradients are sharded over. The optimizer state stays torch's (DTensors sharded
like the parameters, made by torch's own ``_init_group``), so distributed checkpoints save and
load it as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.optim.adam import adam

from .adamw_triton import AdamWTables, adamw_triton_, grad_square_sum

ADAMW_KERNELS = ("auto", "torch", "triton")


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's shard of a DTensor (the tensor itself when plain). The attribute, not
    ``to_local()``: that is an autograd Function, host time per call that adds up here."""
    return t._local_tensor if isinstance(t, DTensor) else t


def global_norm(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of the full tensors (DTensors or plain), as one fp32 0-d tensor on the first
    tensor's device, identical on every rank; no host sync. A shard's squares are summed over
    the mesh dimensions it is sharded over, a replica's counted once."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        key = (t.device_mesh, tuple(t.placements)) if isinstance(t, DTensor) else None
        groups.setdefault(key, []).append(local(t))
    if not groups:
        raise ValueError("global_norm of no tensors")
    device = next(iter(groups.values()))[0].device
    total = torch.zeros((), dtype=torch.float32, device=device)
    for key, shards in groups.items():
        squares = torch.nn.utils.get_total_norm(shards).float().pow(2)
        if key is not None:
            mesh, placements = key
            squares = squares.to(mesh.device_type)  # the collective's device (CPU offload)
            for dim, placement in enumerate(placements):
                if isinstance(placement, Partial):
                    raise ValueError("global_norm of a Partial DTensor: reduce it first")
                if isinstance(placement, Shard):
                    dist.all_reduce(squares, group=mesh.get_group(dim))
                elif not isinstance(placement, Replicate):
                    raise ValueError(f"global_norm: unsupported placement {placement}")
        total += squares.to(device)
    return total.sqrt()


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor clip_grads_with_norm_ scales gradients of total ``norm`` by: the clamped
    coefficient, a device tensor (no host-side branch on the norm)."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ over DTensor or plain parameters, on their local shards: scales the
    gradients in place so that their global 2-norm is at most ``max_norm`` -> the norm before
    clipping (a 0-d device tensor; no host sync)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = global_norm(grads)
    coef = clip_coefficient(total, max_norm)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for shard in map(local, grads):
        by_device.setdefault(shard.device, []).append(shard)
    for device, shards in by_device.items():
        torch._foreach_mul_(shards, coef.to(device))
    return total


class LocalShardAdamW(torch.optim.AdamW):
    """torch's AdamW, stepped on the local shards: state made by torch for the (DTensor)
    parameters, then torch's functional ``adam`` over the shards of the parameters, gradients,
    moments and steps (fused on CUDA, as the trainer asks). ``kernel="triton"``: the same
    arithmetic as one Triton kernel per group (adamw_triton.py) that also writes the
    ``compute_copies`` of the parameters (ComputeCopies, one rank without FSDP), so that they
    need no refresh pass before the next forward, and reads the gradients the copies hold
    pending (the step's last micro-batch's, ComputeCopies.defer_next_backward) where they
    are: it is the copies' reader, and its zero_grad drops them."""

    def __init__(self, params, *args, kernel: str = "torch", compute_copies=None, **kwargs):
        if kernel not in ("torch", "triton"):
            raise ValueError(f"LocalShardAdamW kernel {kernel!r}: torch or triton")
        super().__init__(params, *args, **kwargs)
        self.kernel, self.compute_copies = kernel, compute_copies
        if kernel == "triton":
            bad = [k for k in ("amsgrad", "maximize", "differentiable")
                   if any(g[k] for g in self.param_groups)]
            if bad or not all(g["decoupled_weight_decay"] for g in self.param_groups):
                raise ValueError(f"the Triton AdamW kernel is plain AdamW: {bad} unsupported")
            if compute_copies is not None:
                compute_copies.set_reader(self)
        self._tables: dict[int, AdamWTables] = {}  # per group
        self._prepared: list[_KernelGroup] | None = None  # clip_and_step's, for its step()

    @property
    def takes_grad_scale(self) -> bool:
        """The step's kernel can divide the gradients by a ``grad_scale`` as it reads them
        (torch's fused AdamW, the Triton kernel): the clipping rides in it."""
        return self.kernel == "triton" or all(g["fused"] for g in self.param_groups)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if self.kernel == "triton" and self.compute_copies is not None:
            self.compute_copies.drop_pending()

    def clip_and_step(self, max_norm: float) -> torch.Tensor:
        """Clips the gradients to a global 2-norm of ``max_norm`` and steps -> the norm before
        clipping (a 0-d device tensor). Fused, the clipping rides in the AdamW kernel: its
        ``grad_scale`` divides each gradient as it is read (torch's kernel writes it back
        divided; the Triton one does not write it), where a separate scaling reads and writes
        every fp32 gradient once more: 8 bytes a parameter become 4 or none (the scaling pass
        took ~3 ms of a 4k step of the ``small`` preset on one H200,
        bench/results/train_h200.txt, run W). The Triton kernel's norm is a kernel over the
        tables its step then uses, reading the pending gradients as the step does. After the
        step the gradients are the clipped ones, except with the Triton kernel, which leaves
        them as they were: nothing reads them before the next step's zero_grad."""
        if self.kernel == "triton":
            groups = self._kernel_groups()
            if not groups:
                self.step()
                return torch.zeros(())
            total = torch.stack([grad_square_sum(*g.lists, g.copies, g.pending,
                                                 tables=g.tables) for g in groups]).sum().sqrt()
            self._prepared = groups  # step() takes them: one walk over the groups a step
            self.step(grad_scale=clip_coefficient(total, max_norm).reciprocal())
            return total
        params = [p for g in self.param_groups for p in g["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        if not grads or not self.takes_grad_scale:
            total = clip_grad_norm(params, max_norm)
            self.step()
            return total
        total = global_norm(grads)
        self.step(grad_scale=clip_coefficient(total, max_norm).reciprocal())
        return total

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: torch.Tensor | None = None):
        """``grad_scale`` (fused or the Triton kernel; torch's AMP grad scaler passes it): every
        gradient is divided by it before the update (and left so by torch's fused kernel)."""
        if grad_scale is not None and not self.takes_grad_scale:
            raise ValueError("grad_scale needs a fused AdamW (torch applies it only there) or "
                             "the Triton kernel")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.kernel == "triton":
            groups, self._prepared = self._prepared or self._kernel_groups(), None
            self._step_kernel(groups, grad_scale)
            return loss
        for group in self.param_groups:
            lists: tuple[list[torch.Tensor], ...] = ([], [], [], [], [], [])
            has_complex = self._init_group(group, *lists)
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = (
                [local(t) for t in ts] for ts in lists)
            beta1, beta2 = group["betas"]
            adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                 amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2,
                 lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                 maximize=group["maximize"], foreach=group["foreach"],
                 capturable=group["capturable"], differentiable=group["differentiable"],
                 fused=group["fused"], grad_scale=grad_scale, found_inf=None,
                 decoupled_weight_decay=group["decoupled_weight_decay"])
        return loss

    def _kernel_groups(self) -> list["_KernelGroup"]:
        """Each group's tensors for the Triton kernels: the parameters with a gradient or a
        pending one, local shards, with their state. Once every such parameter has its state
        the lists are read from it; before, torch's _init_group makes it (a parameter whose
        gradient is all pending gets a stand-in fp32 .grad for that call only, never read):
        made each step, that walk held the host ~8 ms a step over the small preset on an H200
        (bench/results/train_h200.txt, run AA)."""
        copies = self.compute_copies
        pending = copies.pending_by_master() if copies is not None else {}
        out = []
        for index, group in enumerate(self.param_groups):
            held = [p for p in group["params"] if p.grad is not None or id(p) in pending]
            if not held:
                continue
            if any(not self.state[p] for p in held):
                self._init_state(group, [p for p in held if p.grad is None])
            states = [self.state[p] for p in held]
            out.append(_KernelGroup(
                group, [local(p) for p in held],
                [None if p.grad is None else local(p.grad) for p in held],
                [local(st["exp_avg"]) for st in states],
                [local(st["exp_avg_sq"]) for st in states],
                [local(st["step"]) for st in states],
                [None if copies is None else copies.copy_of(p) for p in held],
                [pending.get(id(p)) for p in held],
                self._tables.setdefault(index, AdamWTables())))
        return out

    def _init_state(self, group: dict, stand_in_for: list[torch.Tensor]) -> None:
        """torch's _init_group over ``group``, for the state it makes (torch's layout, which
        checkpoints save); ``stand_in_for``: parameters given a never-read fp32 .grad for it."""
        for p in stand_in_for:
            p.grad = torch.empty((), dtype=p.dtype, device=p.device).expand_as(p)
        try:
            if self._init_group(group, [], [], [], [], [], []):
                raise ValueError("the Triton AdamW kernel takes real parameters only")
        finally:
            for p in stand_in_for:
                p.grad = None

    def _step_kernel(self, groups: list["_KernelGroup"], grad_scale) -> None:
        for g in groups:
            beta1, beta2 = g.group["betas"]
            adamw_triton_(*g.lists, g.steps, g.copies, lr=g.group["lr"], beta1=beta1,
                          beta2=beta2, eps=g.group["eps"], weight_decay=g.group["weight_decay"],
                          grad_scale=grad_scale, pending=g.pending, tables=g.tables)
        if self.compute_copies is not None:
            self.compute_copies.written_by_step()
            self.compute_copies.drop_pending()  # read: the step's gradients are spent


@dataclass
class _KernelGroup:
    group: dict
    params: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    steps: list[torch.Tensor]
    copies: list[torch.Tensor | None]
    pending: list[torch.Tensor | None]
    tables: AdamWTables

    @property
    def lists(self) -> tuple[list, list, list, list]:
        return self.params, self.grads, self.exp_avgs, self.exp_avg_sqs
