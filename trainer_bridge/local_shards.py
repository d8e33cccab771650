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

from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.optim.adam import adam

from .adamw_triton import AdamWTables, adamw_triton_

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
    need no refresh pass before the next forward."""

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
        self._tables: dict[int, AdamWTables] = {}  # per group

    @property
    def takes_grad_scale(self) -> bool:
        """The step's kernel can divide the gradients by a ``grad_scale`` as it reads them
        (torch's fused AdamW, the Triton kernel): the clipping rides in it."""
        return self.kernel == "triton" or all(g["fused"] for g in self.param_groups)

    def clip_and_step(self, max_norm: float) -> torch.Tensor:
        """Clips the gradients to a global 2-norm of ``max_norm`` and steps -> the norm before
        clipping (a 0-d device tensor). Fused, the clipping rides in the AdamW kernel: its
        ``grad_scale`` divides each gradient as it is read (torch's kernel writes it back
        divided; the Triton one does not write it), where a separate scaling reads and writes
        every fp32 gradient once more: 8 bytes a parameter become 4 or none (the scaling pass
        took ~3 ms of a 4k step of the ``small`` preset on one H200,
        bench/results/train_h200.txt, run W). After the step the gradients are the clipped
        ones, except with the Triton kernel, which leaves them as they were: nothing reads
        them before the next step's zero_grad."""
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
        for index, group in enumerate(self.param_groups):
            lists: tuple[list[torch.Tensor], ...] = ([], [], [], [], [], [])
            has_complex = self._init_group(group, *lists)
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = (
                [local(t) for t in ts] for ts in lists)
            beta1, beta2 = group["betas"]
            if self.kernel == "triton":
                if has_complex:
                    raise ValueError("the Triton AdamW kernel takes real parameters only")
                copies = self.compute_copies
                adamw_triton_(params, grads, exp_avgs, exp_avg_sqs, steps,
                              [None if copies is None else copies.copy_of(p) for p in params],
                              lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                              weight_decay=group["weight_decay"], grad_scale=grad_scale,
                              tables=self._tables.setdefault(index, AdamWTables()))
                continue
            adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                 amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2,
                 lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                 maximize=group["maximize"], foreach=group["foreach"],
                 capturable=group["capturable"], differentiable=group["differentiable"],
                 fused=group["fused"], grad_scale=grad_scale, found_inf=None,
                 decoupled_weight_decay=group["decoupled_weight_decay"])
        if self.kernel == "triton" and self.compute_copies is not None:
            self.compute_copies.written_by_step()
        return loss
