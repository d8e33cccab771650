"""Validate and apply named-tensor weight updates; Engram checksums.

Targets are the served model's parameters and buffers under SGLang's flat names (tied aliases
included). Engram tables (``layers.N.engram.embed.{weight,scale}``, fp8 + e8m0) are frozen:
overwriting one is refused unless forced, and a forced one must match the table byte-exactly
in shape and dtype. Validation never writes, so a caller can validate on every rank, agree, and
only then apply.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..model.dsv4.names import per_expert_state
from .dummy import is_engram_table
from .engram_codec import HASH_SPACE, chunk_digest_sum, finish_checksum, tensor_checksum

NamedTensors = list[tuple[str, torch.Tensor]]
# A pushed tensor may not exceed SCALE_LIMIT x the current one's largest magnitude (at least
# SCALE_FLOOR): finite but huge weights overflow the forward and take the engine down, and no
# training step moves weights by three orders of magnitude.
SCALE_LIMIT = 1e3
SCALE_FLOOR = 1.0


class WeightUpdateError(ValueError):
    """A refused update; the message names the offending tensor."""


def _targets(model) -> dict[str, torch.Tensor]:
    """SGLang name -> the model's tensor; routed experts as views of their stacks."""
    out = per_expert_state(dict(model.named_parameters(remove_duplicate=False)))
    out.update(dict(model.named_buffers(remove_duplicate=False)))
    return out


def served_specs(model) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of every tensor an update may target, built once per update."""
    return {n: (tuple(t.shape), t.dtype) for n, t in _targets(model).items()}


def validate_named_tensors(model, named: Iterable[tuple[str, torch.Tensor]],
                           allow_engram: bool = False) -> None:
    """Raise WeightUpdateError naming the first bad tensor: unknown name, shape or dtype
    mismatch, a duplicate, a non-finite value, a value far beyond the current tensor's scale,
    a tid2eid expert id outside the experts, or an Engram table when not allowed."""
    seen: set[str] = set()
    specs = served_specs(model)
    targets = _targets(model)
    for i, item in enumerate(named):
        if not (isinstance(item, (tuple, list)) and len(item) == 2
                and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)):
            raise WeightUpdateError(f"entry {i} is not a (name, tensor) pair")
        name, t = item
        if name in seen:
            raise WeightUpdateError(f"{name}: given twice in one update")
        seen.add(name)
        if is_engram_table(name) and not allow_engram:
            raise WeightUpdateError(
                f"{name}: refusing to overwrite a frozen Engram table (start the server with "
                "--allow-engram-update or pass allow_engram_update in the request)")
        want = specs.get(name)
        if want is None:
            raise WeightUpdateError(f"{name}: the served model has no tensor of this name")
        shape, dtype = want
        if tuple(t.shape) != shape:
            raise WeightUpdateError(f"{name}: shape {list(t.shape)} does not match the served "
                                    f"shape {list(shape)}")
        if t.dtype != dtype:
            raise WeightUpdateError(f"{name}: dtype {str(t.dtype).replace('torch.', '')} does "
                                    f"not match the served dtype "
                                    f"{str(dtype).replace('torch.', '')}")
        if name.endswith("tid2eid") and t.device.type != "meta" and t.numel():
            # an id past the experts indexes out of bounds in the next forward (a device-side
            # assert on CUDA): the rank would die on the update's first request
            experts = model.cfg.n_routed_experts
            low, high = int(t.min()), int(t.max())
            if low < 0 or high >= experts:
                raise WeightUpdateError(f"{name}: expert ids {low}..{high} outside "
                                        f"[0, {experts})")
        if (t.is_floating_point() and t.dtype.itemsize > 1 and t.device.type != "meta"
                and t.numel()):
            if not bool(torch.isfinite(t).all()):
                raise WeightUpdateError(f"{name}: holds NaN or inf values")
            current = targets[name]
            if current.device.type != "meta" and current.numel():
                limit = SCALE_LIMIT * max(float(current.detach().abs().max()), SCALE_FLOOR)
                largest = float(t.detach().abs().max())
                if largest > limit:
                    raise WeightUpdateError(
                        f"{name}: largest magnitude {largest:.3g} exceeds {SCALE_LIMIT:g} x the "
                        f"current tensor's scale (limit {limit:.3g})")


@torch.no_grad()
def apply_named_tensors(model, named: NamedTensors) -> None:
    """Copy validated tensors into the model (call validate_named_tensors first)."""
    targets = _targets(model)
    for name, t in named:
        if name not in targets:
            raise WeightUpdateError(f"{name}: the served model has no tensor of this name")
        target = targets[name]
        if target.dtype.itemsize == 1 and target.is_floating_point():   # fp8 tables: bytes
            target.view(torch.uint8).copy_(t.view(torch.uint8))
        else:
            target.copy_(t)


def engram_checksums(model) -> dict[str, str]:
    """Engram tensor name (table and e8m0 scale) -> checksum of its stored bytes, equal to
    engram_codec.tensor_checksum of the checkpoint tensor in every layout. Collective under the
    private layout (every rank calls it): a rank holds one row shard, and the ranks' partial
    digest sums are combined over the world."""
    out = {}
    for name, t in model.state_dict().items():
        if not is_engram_table(name):
            continue
        table = model.get_submodule(name.rsplit(".", 1)[0])
        shard = getattr(table, "row_range", None)  # loader/engram_layouts.RowShardEngramTable
        if shard is None:
            out[name] = tensor_checksum(t)
            continue
        digest = chunk_digest_sum(t.detach().cpu(), None, shard[0])
        limbs = torch.tensor([(digest >> (32 * i)) & 0xFFFFFFFF for i in range(8)],
                             dtype=torch.int64)
        every = table.groups.all_gather_world(limbs, "engram_checksum").view(-1, 8)
        total = sum(sum(int(v) << (32 * i) for i, v in enumerate(row)) for row in every.tolist())
        out[name] = finish_checksum(t.dtype, (table.num_rows, *t.shape[1:]),
                                    total % HASH_SPACE)
    return out
