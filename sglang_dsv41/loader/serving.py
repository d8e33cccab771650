"""Model loading for a serving rank: weights (full or dummy) + Engram tables in host memory.

The model is built with its Engram tables on the meta device, so a rank never allocates a
table inside the model (the tables are the largest tensors of the real model); the host store
replaces them. Dummy loading fills everything else as SGLang's DummyModelLoader does.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import replace

import torch
from torch import nn

from ..model.config import DSV41Config
from ..model.engram import ParameterEngramTable
from ..model.model import DSV41ForCausalLM, is_engram_table
from .dummy import dummy_init_
from .engram_store import EngramStoreHandle, engram_layers, install_engram_tables

logger = logging.getLogger("sglang_dsv41.loader")
DUMMY_SEED = 1234  # SGLang's initialize_dummy_weights default: identical on every rank


def build_model_for_serving(cfg: DSV41Config, dtype: torch.dtype, device) -> DSV41ForCausalLM:
    """Uninitialised weights on ``device``; Engram table parameters on meta (right shape, no
    memory). Built from a 1-row-table config rather than on meta as a whole, because module
    constructors compute non-persistent buffers (RoPE inv_freq) that no checkpoint restores."""
    with _skip_default_init():
        model = DSV41ForCausalLM(replace(cfg, engram_num_rows=1), dtype, device)
    model.config = cfg
    for layer in engram_layers(model).values():
        layer.table = ParameterEngramTable(cfg.engram_num_rows, cfg.engram_dim, dtype, "meta")
    return model


@contextlib.contextmanager
def _skip_default_init():
    """nn.Linear/nn.Embedding draw kaiming/normal weights in their constructors: wasted work for
    weights that loading overwrites (about 90% of the build time of a 400M-param model on CPU).
    Patched on the classes for the duration: model loading runs before any serving thread."""
    saved = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Embedding)}
    try:
        for cls in saved:
            cls.reset_parameters = lambda self: None
        yield
    finally:
        for cls, fn in saved.items():
            cls.reset_parameters = fn


@torch.no_grad()
def load_non_engram_weights(model: DSV41ForCausalLM, model_dir: str) -> None:
    """Strict streaming load of every tensor but the Engram tables (and their fp8 scales)."""
    from .checkpoint import load_weights

    load_weights(model, model_dir, skip=is_engram_table)


def load_serving_model(model_dir: str, dtype: torch.dtype, device, load_format: str = "auto",
                       engram_layout: str = "shared", rank: int = 0, world_size: int = 1,
                       group=None, local_rank: int | None = None,
                       local_world_size: int | None = None, namespace: str | None = None,
                       guard=None) -> tuple[DSV41ForCausalLM, EngramStoreHandle]:
    """Collective over ``group`` when world_size > 1 (the Engram install)."""
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be auto or dummy, got {load_format!r}")
    cfg = DSV41Config.from_pretrained(model_dir)
    model = build_model_for_serving(cfg, dtype, device)
    if load_format == "dummy":
        dummy_init_(model, seed=DUMMY_SEED, skip=is_engram_table)
    else:
        load_non_engram_weights(model, model_dir)
    logger.info("rank %d: %s weights%s", rank, load_format,
                "" if load_format == "dummy" else f" from {model_dir}")
    handle = install_engram_tables(model, model_dir, engram_layout, rank, world_size, group,
                                   local_rank, local_world_size, namespace, guard=guard)
    left = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if left:
        handle.close()
        raise ValueError(f"{left[0]} was never loaded")
    return model.eval(), handle


def load_rank_model(server_args, rank: int, group, model_dir: str, dtype: torch.dtype, device,
                    guard=None) -> tuple[DSV41ForCausalLM, EngramStoreHandle]:
    """A scheduler rank's model from its ServerArgs (all tp_size ranks call it together).

    The shared-memory namespace is the server's main process id: the ranks are its children."""
    per_node = max(1, server_args.tp_size // server_args.nnodes)
    return load_serving_model(model_dir, dtype, device, server_args.load_format,
                              server_args.resolved_engram_layout, rank, server_args.tp_size,
                              group, rank % per_node, per_node, f"srv{os.getppid()}", guard)
