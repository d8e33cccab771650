"""Checkpoints that resume exactly: sharded model + optimizer state through
torch.distributed.checkpoint, plus the LR schedule, the data position and every rank's RNG.

The frozen tables (Engram, tid2eid) are not written: they come from the base checkpoint, and a
V4.1-Flash Engram table alone is ~95 GiB.

Layout: ``<dir>/step-000042/`` (DCP files, ``trainer_state.pt``, ``rng_rank<r>.pt``) written
into a staged sibling (sglang_dsv41.loader.atomic_dir.StagedDir: a name of this save's own, so a
save never deletes a directory it did not make) and swapped into place atomically once every
rank has finished, replacing an earlier save of the same step whole; then ``<dir>/latest`` is
replaced atomically. A save that fails (disk full, ...) removes its staged directory and raises
CheckpointSaveError naming it; a process killed mid-save leaves only the staged directory, which
is never loaded, and which the next run in that directory removes (remove_abandoned_saves).
``trainer_state.pt`` records the world size and the run's config.
"""

from __future__ import annotations

import glob
import os
import random
import re
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)

from sglang_dsv41.loader.atomic_dir import (OLD_TAG, STAGING_TAG, TRASH_TAG, StagedDir,
                                           clean_stale_siblings, os_error_text,
                                           write_file_atomically)
from sglang_dsv41.model.dsv4.names import is_frozen_table

from .dist import all_reduce_scalar, broadcast_object

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


class CheckpointSaveError(OSError):
    """A save failed on some rank; its temporary directory is gone, earlier checkpoints stay."""


class CheckpointLoadError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file and the alternatives."""



def remove_abandoned_saves(root: str) -> list[str]:
    """Remove the staged directories of saves killed midway under ``root`` (those of processes
    that no longer run), after putting back a step a killed save had moved aside
    (atomic_dir.clean_stale_siblings). The caller holds the run directory's lock."""
    if not os.path.isdir(root):
        return []
    tags = "|".join(re.escape(t) for t in (STAGING_TAG, OLD_TAG, TRASH_TAG))
    steps = sorted({m.group(1) for name in os.listdir(root)
                    if (m := re.match(rf"\.(step-\d+)(?:{tags})", name))})
    return [n for step in steps for n in clean_stale_siblings(os.path.join(root, step))]

def save_checkpoint(root: str, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any], rank: int) -> str:
    """Collective. ``trainer_state`` (schedule, data position, ...) is written by rank 0, with
    the step and the world size."""
    final = step_dir(root, step)
    world = dist.get_world_size() if dist.is_initialized() else 1
    staged, tmp, error = None, None, None
    if rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            # force: the run's own step directory (a resume from an older step saves it again)
            staged = StagedDir(final, force=True)
            tmp = staged.path
        except (OSError, ValueError) as e:
            error = f"cannot create a checkpoint directory under {root}: {_os_error(e)}"
    tmp, error = broadcast_object((tmp, error))
    if error:
        raise CheckpointSaveError(error)
    failed = ""
    try:
        model_sd, optim_sd = _trained_state(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
        torch.save(rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt"))
        if rank == 0:
            torch.save({"step": step, "world_size": world, STATELESS: _stateless(optim_sd),
                        **trainer_state}, os.path.join(tmp, "trainer_state.pt"))
    except (Exception, CheckpointException) as e:  # every rank learns of it: none waits
        failed = _os_error(e)
    if all_reduce_scalar(float(bool(failed)), "max") > 0:
        if rank == 0:
            staged.discard()
        where = f"rank {rank}: {failed}" if failed else "on another rank"
        raise CheckpointSaveError(f"saving the step-{step} checkpoint into {tmp} failed ({where});"
                                  f" its temporary directory was removed, earlier checkpoints "
                                  f"are kept")
    if rank == 0:
        try:
            staged.publish()  # discards the staged copy itself on failure
            _write_latest(root, os.path.basename(final))
        except OSError as e:
            failed = _os_error(e)
    failed = broadcast_object(failed)
    if failed:
        raise CheckpointSaveError(f"publishing the step-{step} checkpoint as {final} failed: "
                                  f"{failed}")
    return final


def _os_error(e: BaseException) -> str:
    """The root cause of a (possibly wrapped, e.g. DCP's CheckpointException) error, one line."""
    while True:
        if isinstance(e, CheckpointException) and e.failures:
            e = next(iter(e.failures.values()))[0]
        elif e.__cause__ is not None and not isinstance(e, OSError):
            e = e.__cause__
        else:
            break
    if isinstance(e, OSError) and e.strerror:
        return os_error_text(e)
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}"


def _write_latest(root: str, name: str) -> None:
    write_file_atomically(os.path.join(root, LATEST), name + "\n")


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


def read_trainer_state(path: str) -> dict[str, Any]:
    """``path``'s trainer_state.pt (a CheckpointLoadError naming the file if unreadable)."""
    if not _complete(path):
        raise CheckpointLoadError(f"{path} is not a complete checkpoint (no trainer_state.pt or "
                                  f".metadata){_alternatives(path)}")
    return _read(path, "trainer_state.pt", lambda f: torch.load(f, weights_only=False))


def saved_world_size(path: str, state: dict[str, Any]) -> int:
    """The world size ``path`` was saved with (older checkpoints: its RNG files)."""
    if "world_size" in state:
        return int(state["world_size"])
    return len(glob.glob(os.path.join(path, "rng_rank*.pt")))


def check_world_size(path: str, state: dict[str, Any], world_size: int) -> None:
    saved = saved_world_size(path, state)
    if saved != world_size:
        raise CheckpointLoadError(
            f"{path} was saved by {saved} rank(s), this run has {world_size}: resume with "
            f"--nproc-per-node {saved} (each rank's RNG state and data share depend on the "
            f"world size, so a resume on another one would not continue exactly)")


def _read(path: str, name: str, fn):
    f = os.path.join(path, name)
    try:
        return fn(f)
    except (Exception, CheckpointException) as e:
        raise CheckpointLoadError(f"cannot read {f}: {_os_error(e)}{_alternatives(path)}"
                                  ) from None


def _alternatives(path: str) -> str:
    """How to resume from the newest complete checkpoint older than ``path``, if any."""
    root, name = os.path.split(os.path.normpath(path))
    older = [d for d in sorted(os.listdir(root)) if d.startswith("step-") and d < name
             and _complete(os.path.join(root, d))] if os.path.isdir(root) else []
    if not older:
        return "; there is no older complete checkpoint to resume from"
    return (f"; the older complete checkpoint {os.path.join(root, older[-1])} can be resumed "
            f"with --resume-from {os.path.join(root, older[-1])}")


def load_checkpoint(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    rank: int, world_size: int | None = None) -> dict[str, Any]:
    """Collective. Restores model, optimizer and this rank's RNG; returns the trainer state.
    Refuses (every rank, before any collective) a checkpoint of another world size."""
    trainer_state = read_trainer_state(path)
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    check_world_size(path, trainer_state, world_size)
    # A fresh optimizer's state dict holds every parameter's state (DCP initialises it); those
    # saved without any are not read, and stay without (so their first step is a first step).
    model_sd, optim_sd = _trained_state(model, optimizer)
    for fqn in trainer_state.pop(STATELESS, []):
        optim_sd["state"].pop(fqn, None)
    state = {"model": model_sd, "optim": optim_sd}
    _read(path, ".metadata", lambda f: dcp.FileSystemReader(path).read_metadata())
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as e:
        raise CheckpointLoadError(f"cannot read the model/optimizer shards "
                                  f"{os.path.join(path, '__*.distcp')}: {_os_error(e)}"
                                  f"{_alternatives(path)}") from None
    missing = set_state_dict(model, optimizer, model_state_dict=state["model"],
                             optim_state_dict=state["optim"],
                             options=StateDictOptions(strict=False)).missing_keys
    unexpected = [k for k in missing if not is_frozen_table(k)]
    if unexpected:
        raise ValueError(f"{path}: the model state lacks {unexpected[:5]}")
    set_rng_state(_read(path, f"rng_rank{rank}.pt", lambda f: torch.load(f, weights_only=False)))
    return trainer_state
