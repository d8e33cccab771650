"""Engram plugins: a dummy load that still loads the frozen Engram tables and ``tid2eid``, and
weight updates that would overwrite an Engram table refused (from distributed, tensor and IPC).

SGLang 0.5.23's ``DummyModelLoader.load_model`` (model_loader/loader.py) never reads the
checkpoint, so the Engram tables stay uninitialised and ``tid2eid`` keeps HashTopK's
``(token + k) % E`` placeholder; its ``initialize_dummy_weights`` upcasts every sub-16-bit
tensor to an fp16 temporary (a whole Engram table per rank), and ``finish_load`` (which
publishes the shared host table) is never called. The trainer never sends these frozen tensors,
so an RL server started with ``--load-format dummy`` serves a different model than it trains.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

from ..loader.shards import read_tensor_locations
from ..model.dsv4.names import is_engram_table
from .env import ENV

logger = logging.getLogger(__name__)

ENGRAM_TABLE_SUFFIXES = (".engram.embed.weight", ".engram.embed.scale")
TID2EID_SUFFIX = ".topk.tid2eid"


@contextlib.contextmanager
def engram_tables_detached(model) -> Iterator[list[str]]:
    """Take every EngramEmbedding out of ``model`` for the duration, so a walk over
    ``model.state_dict()`` (SGLang's dummy fill) never sees the tables."""
    import torch.nn as nn
    from sglang.srt.layers.engram import EngramEmbedding

    detached = [(name, m) for name, m in model.named_modules() if isinstance(m, EngramEmbedding)]
    for name, module in detached:
        parent_name, _, child = name.rpartition(".")
        model.get_submodule(parent_name)._modules[child] = nn.Module()
    try:
        yield [name for name, _ in detached]
    finally:
        for name, module in detached:
            parent_name, _, child = name.rpartition(".")
            model.get_submodule(parent_name)._modules[child] = module


def around_initialize_dummy_weights(original, model, *args, **kwargs):
    """SGLang's own dummy fill (same seed rule) on everything but the Engram tables."""
    with engram_tables_detached(model):
        return original(model, *args, **kwargs)


class RowSlice:
    """A checkpoint tensor read lazily by rows: EngramEmbedding._load_rows indexes the full
    table with its own row range, and only those rows are read from the file."""

    def __init__(self, name: str, file_slice):
        self.name, self._slice = name, file_slice
        self.shape = tuple(file_slice.get_shape())

    def __getitem__(self, rows):
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError(f"{self.name}: only contiguous row ranges are read lazily, "
                            f"got {rows!r}")
        return self._slice[rows]


def _sglang_name(model, name: str) -> str:
    remap = getattr(type(model), "remap_weight_name_to_dpsk_hf_format", None)
    return remap(name) if remap is not None else name


def load_frozen_tables(model, ckpt_dir: str) -> list[str]:
    """Stream the checkpoint's Engram tables (each rank its rows) and tid2eid into ``model``
    through the parameters' own weight loaders, then run every table's finish_load.
    Returns the parameter names loaded; raises naming what the checkpoint lacks."""
    from safetensors import safe_open
    from sglang.srt.layers.engram import EngramEmbedding
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    params = dict(model.named_parameters())
    wanted = {n for n in params if n.endswith(ENGRAM_TABLE_SUFFIXES + (TID2EID_SUFFIX,))}
    if not wanted:
        return []  # a model without Engram or hash routing: nothing frozen to read
    try:  # the index's shards only (a stray *.safetensors is not read), as SGLang's loader
        locations = read_tensor_locations(ckpt_dir)
    except ValueError as e:
        raise ValueError(f"{e} (a dummy load reads the Engram tables and tid2eid from there; "
                         f"set --dsv41-engram-checkpoint)") from None
    by_file: dict[str, list[tuple[str, str]]] = {}
    for ckpt_name, (file, _, _) in locations.items():
        name = _sglang_name(model, ckpt_name)
        if name in wanted:  # else not a frozen table, or a layer this (pipeline) rank lacks
            by_file.setdefault(file, []).append((ckpt_name, name))
    loaded: list[str] = []
    for file, entries in sorted(by_file.items()):
        with safe_open(os.path.join(ckpt_dir, file), framework="pt") as f:
            for ckpt_name, name in entries:
                param = params[name]
                loader = getattr(param, "weight_loader", default_weight_loader)
                if name.endswith(TID2EID_SUFFIX):
                    loader(param, f.get_tensor(ckpt_name))
                else:
                    loader(param, RowSlice(ckpt_name, f.get_slice(ckpt_name)))
                loaded.append(name)
    missing = sorted(wanted - set(loaded))
    if missing:
        raise ValueError(f"checkpoint {ckpt_dir} lacks {len(missing)} frozen tensor(s) the model "
                         f"needs, e.g. {missing[:3]}; a dummy load cannot make them up")
    for name, module in model.named_modules():
        if isinstance(module, EngramEmbedding):
            module.finish_load(label=name)
    return loaded


def around_dummy_load_model(original, self, *, model_config, device_config):
    model = original(self, model_config=model_config, device_config=device_config)
    import torch

    ckpt_dir = ENV.ENGRAM_CHECKPOINT.get() or model_config.model_path
    with torch.no_grad():
        loaded = load_frozen_tables(model, ckpt_dir)
    logger.info("sglang-dsv41: dummy load read %d frozen tensors (Engram rows of this rank, "
                "tid2eid) from %s", len(loaded), ckpt_dir)
    return model


def engram_update_refusal(names) -> str | None:
    """Why a weight update naming these tensors is refused, or None. The trainer never trains
    the Engram tables; an update naming one would have to send the whole table
    (EngramEmbedding._load_rows slices the full table), so it is refused unless
    --dsv41-allow-engram-update."""
    tables = [n for n in names if is_engram_table(n)]
    if not tables or ENV.ALLOW_ENGRAM_UPDATE.get():
        return None
    return (f"refused: the update names {len(tables)} frozen Engram table(s) ({tables[0]}, ...); "
            f"leave them out of weight updates or start the server with "
            f"--dsv41-allow-engram-update")


def around_load_weights_from_distributed(original, self, named_tensors):
    """Model runner WeightUpdater.load_weights_from_distributed: refused after SGLang has
    received the broadcast, not before (a refusal in the HTTP process left the sender, which
    broadcasts while its HTTP call runs, waiting in a collective no scheduler joined); the
    scheduler's reply is success False (HTTP 400) and nothing is loaded."""
    refusal = engram_update_refusal([name for name, _ in named_tensors])
    if refusal:
        return False, refusal
    return original(self, named_tensors)


def tensor_update_names(named_tensors, load_format: str | None) -> list[str]:
    """The names of an update_weights_from_tensor payload, read as WeightUpdater reads it:
    load_format "flattened_bucket" is SGLang's bucket ({"flattened_tensor", "metadata":
    [FlattenedTensorMetadata]}), any other format (name, tensor) pairs."""
    if load_format == "flattened_bucket":
        return [meta.name for meta in named_tensors["metadata"]]
    return [name for name, _ in named_tensors]


def around_update_weights_from_tensor(original, self, named_tensors, load_format=None):
    """Model runner WeightUpdater.update_weights_from_tensor: the names exist only once the
    scheduler has deserialized the tensors, so the refusal is the runner's result
    (success False: the scheduler's reply, HTTP 400), before any tensor is loaded."""
    refusal = engram_update_refusal(tensor_update_names(named_tensors, load_format))
    if refusal:
        return False, refusal
    return original(self, named_tensors=named_tensors, load_format=load_format)


def around_update_weights_from_ipc(original, self, recv_req):
    """Model runner WeightUpdater.update_weights_from_ipc (checkpoint-engine): the names arrive
    bucket by bucket inside the call, so each bucket is checked before the model loads it; a
    refused bucket ends the call with success False (SGLang's own except) and the message says
    that earlier buckets were loaded."""
    model = self.get_model()
    load_weights = model.load_weights

    def checked_load_weights(weights):
        weights = list(weights)
        refusal = engram_update_refusal([name for name, _ in weights])
        if refusal:
            raise ValueError(f"{refusal} (buckets before this one are loaded: push the full "
                             f"weights again)")
        return load_weights(weights)

    model.load_weights = checked_load_weights  # what checkpoint-engine's worker calls
    try:
        return original(self, recv_req)
    finally:
        del model.load_weights
