"""Validate and apply named-tensor weight updates; Engram checksums.

Targets are the model's parameters and buffers (tied aliases included) plus the host Engram
tables installed by engram_store (``<layer>.engram.table.weight`` and, for fp8 tables,
``...weight_scale_inv``). Engram tables are frozen: overwriting one is refused unless forced.
Validation never writes, so a caller can validate on every rank, agree, and only then apply.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from ..model.model import is_engram_table
from .engram_codec import tensor_checksum
from .engram_store import engram_layers
from .fp8 import SCALE_SUFFIX

NamedTensors = list[tuple[str, torch.Tensor]]


class WeightUpdateError(ValueError):
    """A refused update; the message names the offending tensor."""


def _param_targets(model) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(dict(model.named_buffers(remove_duplicate=False)))
    return out


def _host_targets(model) -> dict[str, tuple[Any, str]]:
    """name -> (host table, "weight" | "scale") for tables that are not parameters."""
    out = {}
    for name, layer in engram_layers(model).items():
        table = layer.table
        if isinstance(table, torch.nn.Module) and hasattr(table, "overwrite_"):
            out[name] = (table, "weight")
            if getattr(table, "scale", None) is not None:
                out[name + SCALE_SUFFIX] = (table, "scale")
    return out


def served_specs(model) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of every tensor an update may target (parameters win over host
    tables). Built once per update: a per-tensor rebuild would walk the model N times."""
    specs = {}
    for name, (table, part) in _host_targets(model).items():
        entry = table.source.weight if part == "weight" else table.source.scale
        specs[name] = (tuple(entry.shape), entry.dtype)
    specs.update({n: (tuple(t.shape), t.dtype) for n, t in _param_targets(model).items()})
    return specs


def validate_named_tensors(model, named: Iterable[tuple[str, torch.Tensor]],
                           allow_engram: bool = False) -> None:
    """Raise WeightUpdateError naming the first bad tensor: unknown name, shape or dtype
    mismatch, a duplicate, a non-finite value, or an Engram table when not allowed."""
    seen: set[str] = set()
    specs = served_specs(model)
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
        if (t.is_floating_point() and t.dtype.itemsize > 1 and t.device.type != "meta"
                and not bool(torch.isfinite(t).all())):
            raise WeightUpdateError(f"{name}: holds NaN or inf values")


@torch.no_grad()
def apply_named_tensors(model, named: NamedTensors) -> None:
    """Copy validated tensors into the model (call validate_named_tensors first). Host Engram
    tables are collective: every rank must apply the same list."""
    params, host = _param_targets(model), _host_targets(model)
    pending: dict[int, dict[str, Any]] = {}
    for name, t in named:
        if name in params:
            params[name].copy_(t)
        elif name in host:
            table, part = host[name]
            pending.setdefault(id(table), {"table": table})[part] = t
        else:
            raise WeightUpdateError(f"{name}: the served model has no tensor of this name")
    for entry in pending.values():
        entry["table"].overwrite_(entry.get("weight", entry["table"].values), entry.get("scale"))


def engram_checksums(model) -> dict[str, str]:
    """Table name -> checksum of its stored bytes, independent of layout and TP size (equal to
    engram_codec.source_checksum of the checkpoint tensor). Collective for host tables."""
    out = {}
    for name, layer in engram_layers(model).items():
        table = layer.table
        if hasattr(table, "checksum"):
            out[name] = table.checksum()
        else:
            out[name] = tensor_checksum(table.weight)
    return out
