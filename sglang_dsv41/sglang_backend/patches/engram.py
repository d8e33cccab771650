"""Engram patches: dummy load still loads the frozen Engram tables, bit-exact, from the
checkpoint; and the Engram host layout (shared / private row shard per rank) for every load.

Settings come from the environment (sglang_dsv41.sglang_backend.env) because the dummy loader
rejects ``model_loader_extra_config``. Tensor names: sglang_dsv41.model.is_engram_table;
streaming: sglang_dsv41.loader.checkpoint; row shards: sglang_dsv41.loader.engram_codec.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from ..env import ENV
from ..registry import Patch, Target
from ..state import STATE
from . import VERSIONS

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

LOADER = "sglang.srt.model_loader.loader"


def is_engram_table(name: str) -> bool:
    # imported on use: the model package pulls in torch, which a spawned SGLang child that
    # never loads weights (the DP controller) should not pay for
    from ...model.model import is_engram_table as is_table

    return is_table(name)


def _table_of(name: str) -> str:
    """The table a tensor belongs to: '...engram.table.weight_scale_inv' -> '...engram.table'."""
    return name[:name.index(".engram.table.") + len(".engram.table")]


def engram_row_slice(name: str, headers: dict[str, tuple[torch.dtype, list[int]]],
                     rank: int, world_size: int) -> tuple[int, int]:
    """Rows [lo, hi) of tensor ``name`` that ``rank`` owns in the private layout. The table's
    weight decides the row shard (loader.engram_codec.shard_range); a companion tensor with
    fewer rows (fp8 block scales) gets the block rows that cover it."""
    from ...loader.engram_codec import shard_range
    from ...loader.fp8 import FP8_BLOCK, scale_row_range

    weight_name = _table_of(name) + ".weight"
    if weight_name not in headers:
        raise ValueError(f"Engram tensor {name!r} has no table weight {weight_name!r} in the "
                         f"checkpoint")
    table_rows = headers[weight_name][1][0]
    lo, hi = shard_range(table_rows, rank, world_size)
    rows = headers[name][1][0]
    if rows == table_rows:
        return lo, hi
    block_rows = FP8_BLOCK[0]
    if rows != -(-table_rows // block_rows):
        raise ValueError(f"Engram tensor {name!r} has {rows} rows; {table_rows} table rows in "
                         f"blocks of {block_rows} need {-(-table_rows // block_rows)} scale rows")
    return scale_row_range(lo, hi, block_rows)


def place_engram(weights: Iterable[tuple[str, torch.Tensor]], layout: str, rank: int,
                 world_size: int, headers: dict | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass every tensor through; in the private layout Engram tensors shrink to this rank's
    rows (the whole table never reaches the model)."""
    for name, t in weights:
        if layout == "private" and is_engram_table(name):
            if headers is None or name not in headers:
                raise ValueError(f"private Engram layout: no checkpoint header for {name!r}")
            lo, hi = engram_row_slice(name, headers, rank, world_size)
            t = t[lo:hi]
        yield name, t


def load_engram_tables(model, ckpt_dir: str, layout: str, rank: int, world_size: int) -> list[str]:
    """Stream the checkpoint's Engram tensors into ``model.load_weights`` (SGLang's model
    interface); returns the loaded names. Nothing else is read."""
    from ...loader.checkpoint import iter_checkpoint_tensors, list_checkpoint_tensors

    headers = list_checkpoint_tensors(ckpt_dir)
    names = sorted(n for n in headers if is_engram_table(n))
    params = dict(model.named_parameters())
    if not names:
        wanted = sorted(n for n in params if is_engram_table(n))
        if wanted:
            raise ValueError(f"the model has Engram tables ({wanted[0]}, ...) but checkpoint "
                             f"{ckpt_dir} holds none")
        return []
    loaded: list[str] = []

    def stream():
        for name, t in place_engram(iter_checkpoint_tensors(ckpt_dir, names), layout, rank,
                                    world_size, headers):
            p = params.get(name)
            if p is not None and tuple(p.shape) != tuple(t.shape):
                raise ValueError(f"Engram tensor {name!r}: the model holds {tuple(p.shape)}, the "
                                 f"{layout} layout gives rank {rank} {tuple(t.shape)}")
            loaded.append(name)
            yield name, t

    model.load_weights(stream())
    return loaded


def _rank() -> tuple[int, int]:
    return STATE.rank.tp_rank, STATE.rank.tp_size


def make_dummy_load_engram(orig: Callable) -> Callable:
    def load_model(self, *, model_config, device_config):
        model = orig(self, model_config=model_config, device_config=device_config)
        if not ENV.ENGRAM_DUMMY_LOAD.get():
            return model
        import torch

        ckpt_dir = ENV.ENGRAM_CHECKPOINT.get() or model_config.model_path
        rank, world = _rank()
        with torch.no_grad():
            names = load_engram_tables(model, ckpt_dir, ENV.ENGRAM_LAYOUT.get(), rank, world)
        logger.info("sglang-dsv41: dummy load, %d Engram tensors loaded from %s (%s layout)",
                    len(names), ckpt_dir, ENV.ENGRAM_LAYOUT.get())
        return model

    return load_model


def make_engram_placement(orig: Callable) -> Callable:
    def load_weights_and_postprocess(model, weights, target_device):
        layout = ENV.ENGRAM_LAYOUT.get()
        if layout == "private":
            from ...loader.checkpoint import list_checkpoint_tensors

            ckpt_dir = ENV.ENGRAM_CHECKPOINT.get()
            if not ckpt_dir:
                raise ValueError("private Engram layout needs SGLANG_DSV41_ENGRAM_CHECKPOINT "
                                 "(the launcher sets it to --model-path)")
            rank, world = _rank()
            weights = place_engram(weights, layout, rank, world,
                                   list_checkpoint_tensors(ckpt_dir))
        return orig(model, weights, target_device)

    return load_weights_and_postprocess


PATCHES = [
    Patch("engram_dummy_load.load_model", "engram_dummy_load",
          Target(LOADER, "DummyModelLoader.load_model",
                 ("self", "model_config", "device_config")),
          "scheduler", VERSIONS,
          "after the dummy fill, streams the Engram tables from the checkpoint into the model's "
          "load_weights (the trainer never sends them)",
          requires=(("sglang.srt.configs.model_config", "ModelConfig.model_path"),),
          make=make_dummy_load_engram),
    Patch("engram_dummy_load.extra_config", "engram_dummy_load",
          Target(LOADER, "DummyModelLoader.__init__", ("self", "load_config")),
          "scheduler", VERSIONS,
          "checked only: the dummy loader rejects model_loader_extra_config, so the settings "
          "travel as SGLANG_DSV41_* environment variables"),
    Patch("engram_layout.placement", "engram_layout",
          Target(LOADER, "DefaultModelLoader.load_weights_and_postprocess",
                 ("model", "weights", "target_device")),
          "scheduler", VERSIONS,
          "private layout: each rank receives only its row shard of every Engram table",
          make=make_engram_placement),
]
