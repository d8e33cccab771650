"""Text-only bf16 checkpoints (HF layout): save, stream, load strictly, build presets on demand.

Layout: ``config.json`` (DSV41Config.to_dict()), ``model-0000i-of-0000N.safetensors`` shards,
``model.safetensors.index.json`` and ``tokenizer_config.json``. A single ``model.safetensors``
is read too. Every write goes through a hidden staging directory renamed into place at the end.
"""

from __future__ import annotations

import fcntl
import json
import os
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Mapping

import torch
from safetensors import SafetensorError
from tqdm import tqdm

from ..model.config import PRESETS, DSV41Config, get_preset
from ..model.model import DSV41ForCausalLM, build_model
from ..tokenizer import ByteTokenizer
from .atomic_dir import StagedDir, staged_output
from .shards import (CONFIG_FILE, StreamingShardWriter, checkpoint_files,
                     open_shard, shard_file_name, shard_headers, split_into_shards,
                     write_index)

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
# Presets above this size exist for the planner; building them on a CPU is not realistic.
MAX_PRESET_BUILD_PARAMS = 4 * 10**9
DEFAULT_CACHE_ROOT = os.path.join(os.path.expanduser("~"), ".cache", "sglang_dsv41")

TensorSource = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


# ---- writing --------------------------------------------------------------------------------
def _write_shard(path: str, items: list[tuple[str, torch.Tensor]]) -> None:
    with StreamingShardWriter(path, [(n, t.dtype, list(t.shape)) for n, t in items]) as writer:
        for name, t in items:
            writer.write(name, t)


def _normalized(tensors: TensorSource, dtype: torch.dtype | None
                ) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[str] = set()
    for name, t in (tensors.items() if isinstance(tensors, Mapping) else tensors):
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise ValueError(f"checkpoint entries are (str, Tensor), got ({name!r}, {type(t)})")
        if name in seen:
            raise ValueError(f"tensor {name!r} given twice")
        seen.add(name)
        t = t.detach().to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        yield name, t


def _shard_groups(items: Iterable[tuple[str, torch.Tensor]], max_shard_bytes: int,
                  num_shards: int | None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    if num_shards is not None:  # an exact shard count needs every tensor up front
        everything = list(items)
        for group in split_into_shards([t.nbytes for _, t in everything], num_shards):
            yield [everything[i] for i in group]
        return
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    current: list[tuple[str, torch.Tensor]] = []
    current_bytes = 0
    for name, t in items:  # streaming: at most one output shard is held
        if current and current_bytes + t.nbytes > max_shard_bytes:
            yield current
            current, current_bytes = [], 0
        current.append((name, t))
        current_bytes += t.nbytes
    yield current


def write_checkpoint_dir(out_dir: str, tensors: TensorSource, config: dict | DSV41Config,
                         max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, tokenizer=None,
                         progress: bool = False, num_shards: int | None = None,
                         dtype: torch.dtype | None = None) -> None:
    """Write the checkpoint files into an existing (staging) directory."""
    cfg_dict = config.to_dict() if isinstance(config, DSV41Config) else dict(config)
    items = _normalized(tensors, dtype)
    if progress:
        items = tqdm(items, desc="saving", unit="tensor")
    # The shard count is known only at the end: write numbered parts, then rename them.
    parts: list[tuple[str, list[str]]] = []
    total = 0
    for group in _shard_groups(items, max_shard_bytes, num_shards):
        part = os.path.join(out_dir, f"part-{len(parts)}.safetensors")
        _write_shard(part, group)
        parts.append((part, [n for n, _ in group]))
        total += sum(t.nbytes for _, t in group)
    weight_map = {}
    for k, (part, names) in enumerate(parts):
        final = shard_file_name(k, len(parts))
        os.rename(part, os.path.join(out_dir, final))
        weight_map.update({n: final for n in names})
    write_index(out_dir, weight_map, total)
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(cfg_dict, f, indent=2, sort_keys=True)
    if tokenizer is None:
        try:
            tokenizer = ByteTokenizer.from_config(cfg_dict)
        except (ValueError, KeyError, TypeError):
            tokenizer = None  # the config's ids cannot form a byte tokenizer: write none
    if tokenizer is not None and tokenizer is not False:
        tokenizer.save_pretrained(out_dir)


def save_checkpoint(tensors: TensorSource, out_dir: str, config: dict | DSV41Config,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, tokenizer=None,
                    progress: bool = False, num_shards: int | None = None,
                    dtype: torch.dtype | None = None) -> str:
    """Write a checkpoint atomically; an existing ``out_dir`` is replaced only once the new one
    is complete. ``tokenizer=None`` writes a ByteTokenizer built from the config (when its ids
    allow one), ``tokenizer=False`` writes none. ``dtype`` casts floating tensors."""
    with staged_output(out_dir) as tmp:
        write_checkpoint_dir(tmp, tensors, config, max_shard_bytes, tokenizer, progress,
                             num_shards, dtype)
    return os.path.abspath(out_dir)


def expected_tensor_shapes(cfg: DSV41Config) -> dict[str, list[int]]:
    """The checkpoint names and shapes of the model for ``cfg``, without allocating it. (The
    first meta-device build imports torch._dynamo lazily: ~1.5 s and ~150 MB, once.)"""
    model = DSV41ForCausalLM(cfg, torch.bfloat16, device="meta")
    return {n: list(t.shape) for n, t in model_tensors(model).items()}


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of a model: its state dict without tied duplicates."""
    out, seen = {}, set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


# ---- reading --------------------------------------------------------------------------------
def list_checkpoint_tensors(ckpt_dir: str) -> dict[str, tuple[torch.dtype, list[int]]]:
    """name -> (dtype, shape) of every tensor, from the shard headers (no tensor data read)."""
    out: dict[str, tuple[torch.dtype, list[int]]] = {}
    for file, index_names in checkpoint_files(ckpt_dir).items():
        path = os.path.join(ckpt_dir, file)
        headers = shard_headers(path)
        _check_index_names(path, index_names, headers)
        out.update(headers)
    return out


def _check_index_names(path: str, index_names: list[str] | None, present) -> None:
    if index_names is not None:
        absent = [n for n in index_names if n not in present]
        if absent:
            raise ValueError(f"checkpoint shard {path} lacks tensor {absent[0]!r} that the index "
                             f"assigns to it ({len(absent)} missing)")


def iter_checkpoint_tensors(ckpt_dir: str, names: Iterable[str] | None = None
                            ) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (name, tensor) shard by shard; only ``names`` when given (each must exist)."""
    files = checkpoint_files(ckpt_dir)
    wanted = set(names) if names is not None else None
    if wanted is not None and all(v is not None for v in files.values()):
        indexed = {n for v in files.values() for n in v}  # type: ignore[union-attr]
        unknown = sorted(wanted - indexed)
        if unknown:
            raise ValueError(f"tensor {unknown[0]!r} is not in checkpoint {ckpt_dir}")
    for file, index_names in files.items():
        if wanted is not None and index_names is not None and wanted.isdisjoint(index_names):
            continue  # nothing wanted in this shard: do not even open it
        path = os.path.join(ckpt_dir, file)
        with open_shard(path) as f:
            keys = list(f.keys())
            _check_index_names(path, index_names, set(keys))
            order = index_names if index_names is not None else sorted(keys)
            if wanted is not None and index_names is None:
                unknown = sorted(wanted - set(keys))
                if unknown:
                    raise ValueError(f"tensor {unknown[0]!r} is not in checkpoint {ckpt_dir}")
            for name in order:
                if wanted is not None and name not in wanted:
                    continue
                try:
                    t = f.get_tensor(name)
                except SafetensorError as e:
                    raise ValueError(f"corrupt checkpoint shard {path}: tensor {name!r}: {e}"
                                     ) from e
                yield name, t


def load_weights(model: torch.nn.Module, ckpt_dir: str,
                 skip: Callable[[str], bool] | None = None) -> list[str]:
    """Strict load into ``model`` (cast to each parameter's dtype); returns the loaded names.
    Tensors whose name satisfies ``skip`` are neither read, nor required, nor refused (a model
    may not hold them at all, e.g. Engram tables kept in a host store, with their fp8 scales)."""
    expected = model_tensors(model)
    aliases = set(model.state_dict().keys()) - set(expected)  # tied duplicates are optional
    headers = list_checkpoint_tensors(ckpt_dir)
    unexpected = sorted(n for n in set(headers) - set(expected) - aliases
                        if not (skip and skip(n)))
    if unexpected:
        raise ValueError(f"unexpected tensor {unexpected[0]!r} in checkpoint {ckpt_dir} "
                         f"({len(unexpected)} unexpected)")
    wanted = {n for n in expected if not (skip and skip(n))}
    missing = sorted(wanted - set(headers))
    if missing:
        raise ValueError(f"tensor {missing[0]!r} is missing from checkpoint {ckpt_dir} "
                         f"({len(missing)} missing)")
    for name in sorted(wanted):
        want, got = list(expected[name].shape), headers[name][1]
        if want != got:
            raise ValueError(f"tensor {name!r} in checkpoint {ckpt_dir} has shape {got}, the "
                             f"model expects {want}")
    with torch.no_grad():
        for name, t in iter_checkpoint_tensors(ckpt_dir, names=wanted):
            expected[name].copy_(t)
    return sorted(wanted)


def load_model(path_or_preset: str, dtype: torch.dtype | None = None, device="cpu",
               cache_dir: str | None = None, skip: Callable[[str], bool] | None = None
               ) -> DSV41ForCausalLM:
    """Build the model from a checkpoint directory (or a preset, built once into the cache) and
    load every tensor strictly. Skipped tensors keep build_model(seed=None)'s uninitialized
    values: the caller fills them (dummy loading)."""
    path = ensure_checkpoint(path_or_preset, cache_dir)
    cfg = DSV41Config.from_pretrained(path)
    model = build_model(cfg, dtype, device, seed=None)
    load_weights(model, path, skip)
    return model


# ---- presets --------------------------------------------------------------------------------
@contextmanager
def _file_lock(path: str):
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def preset_checkpoint_dir(preset: str, cache_dir: str | None = None, seed: int = 0) -> str:
    return os.path.join(cache_dir or DEFAULT_CACHE_ROOT, f"{preset}-seed{seed}")


def ensure_checkpoint(path_or_preset: str, cache_dir: str | None = None, seed: int = 0) -> str:
    """A checkpoint directory is returned as is. A preset name is built once (bf16, random
    weights from build_model(seed=seed)) into ``<cache_dir>/<preset>-seed<seed>`` (cache_dir
    defaults to ~/.cache/sglang_dsv41) and that path is returned; concurrent callers wait on a
    lock file and the build is published by an atomic rename."""
    if os.path.isdir(path_or_preset):
        if not os.path.isfile(os.path.join(path_or_preset, CONFIG_FILE)):
            raise ValueError(f"{path_or_preset} is not a checkpoint: it has no {CONFIG_FILE}")
        return path_or_preset
    if path_or_preset not in PRESETS:
        raise ValueError(f"{path_or_preset!r} is neither a checkpoint directory nor a preset "
                         f"({sorted(PRESETS)})")
    cfg = get_preset(path_or_preset)
    n_params = cfg.num_parameters(include_engram=True)
    if n_params > MAX_PRESET_BUILD_PARAMS:
        raise ValueError(f"preset {path_or_preset!r} has {n_params / 1e9:.0f}B parameters: it "
                         "describes the real model for planning and is never built with random "
                         "weights; convert the release checkpoint with `python -m "
                         "sglang_dsv41.convert` and pass its directory")
    target = preset_checkpoint_dir(path_or_preset, cache_dir, seed)
    if os.path.isfile(os.path.join(target, CONFIG_FILE)):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    lock = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.lock")
    with _file_lock(lock):
        if os.path.isfile(os.path.join(target, CONFIG_FILE)):
            return target  # another process built it while we waited
        model = build_model(cfg, torch.bfloat16, "cpu", seed=seed)
        staged = StagedDir(target)
        try:
            write_checkpoint_dir(staged.path, model_tensors(model),
                                 dict(cfg.to_dict(), torch_dtype="bfloat16"), dtype=torch.bfloat16)
        except BaseException:
            staged.discard()
            raise
        staged.publish(replace=False)
    return target
