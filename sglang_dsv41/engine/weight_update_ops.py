"""Control-op handlers for weight updates and Engram checksums (registered by engine/control.py).

Each op is ``apply(runner, **args)`` with an optional ``validate(runner, **args)``; the engine
runs validate on every rank, agrees on the verdict, then applies on every rank. ``runner`` is
duck-typed (the engine's ModelRunner): ``model``, ``weight_version``, ``flush_cache_hook``,
``args`` (ServerArgs), ``info.rank``, ``groups.all_agree(ok, op)``.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ..loader.dummy import is_engram_table
from ..loader.weight_sync_group import init_weight_sync_group, parse_dtype, receive_weights
from ..loader.weight_update import (WeightUpdateError, apply_named_tensors, engram_checksums,
                            served_specs, validate_named_tensors)


def _allow_engram(runner, flag: bool) -> bool:
    return bool(flag) or bool(getattr(runner.args, "allow_engram_update", False))


def _finish(runner, n: int, flush_cache: bool, weight_version: str | None) -> dict[str, Any]:
    flushed = bool(runner.flush_cache_hook()) if flush_cache and runner.flush_cache_hook else False
    if weight_version is None:  # bump a trailing number: "default" -> "1", "step-7" -> "step-8"
        m = re.match(r"^(.*?)(\d+)$", str(runner.weight_version))
        weight_version = f"{m.group(1)}{int(m.group(2)) + 1}" if m else "1"
    runner.weight_version = str(weight_version)
    return {"weight_version": runner.weight_version, "num_tensors": n, "flushed_cache": flushed}


# ---- update_weights_from_tensor ------------------------------------------------------------
def _validate_tensor(runner, named_tensors, flush_cache: bool = True,
                     weight_version: str | None = None, allow_engram_update: bool = False):
    validate_named_tensors(runner.model, named_tensors, _allow_engram(runner, allow_engram_update))


def _apply_tensor(runner, named_tensors, flush_cache: bool = True,
                  weight_version: str | None = None, allow_engram_update: bool = False):
    apply_named_tensors(runner.model, list(named_tensors))
    return _finish(runner, len(named_tensors), flush_cache, weight_version)


# ---- update_weights_from_disk --------------------------------------------------------------
def read_disk_update(model, model_path: str) -> list[tuple[str, torch.Tensor]]:
    """Every non-Engram tensor of the checkpoint (any --model-path layout but a preset), cast to
    the served dtype, validated; it must cover every served tensor but Engram tables and the
    non-persistent buffers."""
    from ..loader.serving import model_layout, read_model_tensors

    if model_layout(model_path) == "preset":
        raise WeightUpdateError(f"{model_path!r} is a preset name, not a checkpoint directory")
    tensors = {n: t for n, t in read_model_tensors(model_path).items() if not is_engram_table(n)}
    expected = {n for n in model.state_dict() if not is_engram_table(n)}
    missing = sorted(expected - set(tensors))
    if missing:
        raise WeightUpdateError(f"{missing[0]}: missing from checkpoint {model_path} "
                                f"({len(missing)} missing)")
    named, specs = [], served_specs(model)
    for name, t in tensors.items():
        want = specs.get(name)
        if want is not None and t.is_floating_point():
            t = t.to(want[1])
        named.append((name, t))
    validate_named_tensors(model, named)
    return named


def _validate_disk(runner, model_path: str, flush_cache: bool = True,
                   weight_version: str | None = None):
    try:
        runner.pending_disk_update = read_disk_update(runner.model, model_path)
    except WeightUpdateError:
        raise
    except Exception as e:  # noqa: BLE001 - any read failure is a refusal, never a crash
        raise WeightUpdateError(f"cannot read checkpoint {model_path}: {e}") from e


def _apply_disk(runner, model_path: str, flush_cache: bool = True,
                weight_version: str | None = None):
    named, runner.pending_disk_update = runner.pending_disk_update, None
    apply_named_tensors(runner.model, named)
    out = _finish(runner, len(named), True, weight_version)
    runner.model_dir = model_path
    return out


# ---- init_weights_update_group / update_weights_from_distributed -------------------------------
def _groups(runner) -> dict:
    if getattr(runner, "weight_sync_groups", None) is None:
        runner.weight_sync_groups = {}
    return runner.weight_sync_groups


def _validate_init(runner, master_address: str, master_port: int, rank_offset: int,
                   world_size: int, group_name: str = "weight_update_group",
                   backend: str = "gloo"):
    tp = runner.args.tp_size
    if rank_offset < 1 or rank_offset + tp > world_size:
        raise ValueError(f"scheduler ranks {rank_offset}..{rank_offset + tp - 1} do not fit a "
                         f"group of {world_size} with the trainer at rank 0")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be gloo or nccl, got {backend!r}")


def _apply_init(runner, master_address: str, master_port: int, rank_offset: int,
                world_size: int, group_name: str = "weight_update_group", backend: str = "gloo"):
    old = _groups(runner).pop(group_name, None)
    if old is not None:
        old.close()
    rank = rank_offset + runner.info.rank
    _groups(runner)[group_name] = init_weight_sync_group(master_address, master_port, rank,
                                                         world_size, group_name, backend)
    return {"group_name": group_name, "rank": rank, "world_size": world_size}


def _apply_distributed(runner, names: list[str], dtypes: list[str], shapes: list[list[int]],
                       group_name: str = "weight_update_group", flush_cache: bool = True,
                       weight_version: str | None = None, allow_engram_update: bool = False):
    # Validation happens here, not in a validate hook: the trainer waits in the verdict
    # exchange of the protocol and must learn a refusal too (weight_sync_group docstring).
    group = _groups(runner).get(group_name)
    error = None if group is not None else f"no weight update group {group_name!r} (call " \
                                           "init_weights_update_group first)"
    wire: list[torch.dtype] = []  # parsed once, inside the try: a bad name is a refusal
    try:
        if error is None:
            if not len(names) == len(dtypes) == len(shapes):
                raise WeightUpdateError("names, dtypes and shapes differ in length")
            wire = [parse_dtype(d) for d in dtypes]
            metas = [(n, torch.empty(s, dtype=dt, device="meta"))
                     for n, dt, s in zip(names, wire, shapes)]
            validate_named_tensors(runner.model, metas, _allow_engram(runner, allow_engram_update))
    except (ValueError, TypeError, RuntimeError) as e:
        error = str(e)
    ok = runner.groups.all_agree(error is None, "weights_dist_validate")
    if group is None:
        raise WeightUpdateError(error)
    # a refusal still joins the trainer's verdict exchange (receive_weights with ok False):
    # raising before it left the trainer waiting there until the collective's timeout
    named = receive_weights(group, names, wire, shapes, ok)
    if named is None:
        raise WeightUpdateError(error or "refused: another rank rejected the update")
    try:
        validate_named_tensors(runner.model, named, _allow_engram(runner, allow_engram_update))
        error = None
    except WeightUpdateError as e:
        error = str(e)
    ok = runner.groups.all_agree(error is None, "weights_dist_received")
    if ok:
        apply_named_tensors(runner.model, named)
    group.all_ok(ok)  # step 3: tell the trainer
    if not ok:
        raise WeightUpdateError(error or "refused: another rank rejected the received tensors")
    return _finish(runner, len(named), flush_cache, weight_version)


def _apply_destroy(runner, group_name: str = "weight_update_group"):
    group = _groups(runner).pop(group_name, None)
    if group is not None:
        group.close()
    return {"destroyed": group is not None}


def _apply_checksum(runner):
    return engram_checksums(runner.model)


def _apply_engram_info(runner):
    """Where this rank's Engram tables live: the layout and the rows it holds per table."""
    from ..loader.engram_layouts import engram_tables

    store = getattr(runner, "engram_store", None)
    return {"layout": store.layout if store is not None else None,
            "rows": {n: int(t.weight.shape[0]) for n, t in engram_tables(runner.model).items()},
            "shared_memory": bool(store is not None and store.segments)}


LOADER_CONTROL_OPS = {
    "update_weights_from_tensor": (_apply_tensor, _validate_tensor),
    "update_weights_from_disk": (_apply_disk, _validate_disk),
    "init_weights_update_group": (_apply_init, _validate_init),
    "update_weights_from_distributed": (_apply_distributed, None),
    "destroy_weights_update_group": (_apply_destroy, None),
    "engram_checksum": (_apply_checksum, None),
    "engram_info": (_apply_engram_info, None),
}
