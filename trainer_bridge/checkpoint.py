"""Checkpoints that resume exactly: sharded model + optimizer state through
torch.distributed.checkpoint, plus the LR schedule, the data position and every rank's RNG.

The frozen tables (Engram, tid2eid) are not written: they come from the base checkpoint, and a
V4.1-Flash Engram table alone is ~95 GiB.

Layout: ``<dir>/step-000042/`` (DCP files, ``trainer_state.pt``, ``rng_rank<r>.pt``) written as
``<dir>/.step-000042.tmp`` and renamed once every rank has finished; then ``<dir>/latest`` is
replaced atomically. A crash mid-save leaves only a ``.tmp`` directory, which is never loaded.
"""

from __future__ import annotations

import os
import random
import shutil
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)

from sglang_dsv41.model.dsv4.names import is_frozen_table

LATEST = "latest"
STATELESS = "stateless_params"  # trainer_state.pt: _stateless at the save


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:06d}")


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(root: str, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any], rank: int) -> str:
    """Collective. ``trainer_state`` (schedule, data position, ...) is written by rank 0."""
    final, tmp = step_dir(root, step), os.path.join(root, f".step-{step:06d}.tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    model_sd, optim_sd = _trained_state(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    torch.save(rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt"))
    if rank == 0:
        torch.save({"step": step, STATELESS: _stateless(optim_sd), **trainer_state},
                   os.path.join(tmp, "trainer_state.pt"))
    _barrier()
    if rank == 0:
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_latest(root, os.path.basename(final))
    _barrier()
    return final


def _write_latest(root: str, name: str) -> None:
    tmp = os.path.join(root, f".{LATEST}.tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))


def latest_checkpoint(root: str) -> str | None:
    """The newest complete checkpoint (``latest``, else the highest complete step dir)."""
    pointer = os.path.join(root, LATEST)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            path = os.path.join(root, f.read().strip())
        if _complete(path):
            return path
    if not os.path.isdir(root):
        return None
    dirs = sorted(d for d in os.listdir(root) if d.startswith("step-"))
    for d in reversed(dirs):
        if _complete(os.path.join(root, d)):
            return os.path.join(root, d)
    return None


def _complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "trainer_state.pt")) and os.path.isfile(
        os.path.join(path, ".metadata"))


def _trained_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {k: v for k, v in model_sd.items() if not is_frozen_table(k)}, optim_sd


def _stateless(optim_sd: dict[str, Any]) -> list[str]:
    """Optimized parameters that have no optimizer state yet: they never had a gradient (on one
    rank the indexers, which only select, get none; several ranks give every parameter one)."""
    listed = [fqn for group in optim_sd["param_groups"] for fqn in group["params"]]
    return [fqn for fqn in listed if fqn not in optim_sd["state"]]


def load_checkpoint(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    rank: int) -> dict[str, Any]:
    """Collective. Restores model, optimizer and this rank's RNG; returns the trainer state."""
    if not _complete(path):
        raise ValueError(f"{path} is not a complete checkpoint")
    trainer_state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
    # A fresh optimizer's state dict holds every parameter's state (DCP initialises it); those
    # saved without any are not read, and stay without (so their first step is a first step).
    model_sd, optim_sd = _trained_state(model, optimizer)
    for fqn in trainer_state.pop(STATELESS, []):
        optim_sd["state"].pop(fqn, None)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    missing = set_state_dict(model, optimizer, model_state_dict=state["model"],
                             optim_state_dict=state["optim"],
                             options=StateDictOptions(strict=False)).missing_keys
    unexpected = [k for k in missing if not is_frozen_table(k)]
    if unexpected:
        raise ValueError(f"{path}: the model state lacks {unexpected[:5]}")
    rng_file = os.path.join(path, f"rng_rank{rank}.pt")
    if not os.path.isfile(rng_file):
        raise ValueError(f"{path} has no RNG state for rank {rank} (saved with fewer ranks?)")
    set_rng_state(torch.load(rng_file, weights_only=False))
    return trainer_state
