"""The dummy-load case of sglang_plugin_cases.py: our engram_dummy_load plugin filling real
SGLang 0.5.23 EngramEmbedding modules, for two TP ranks, from a small safetensors checkpoint."""

from __future__ import annotations

import json
import os

import torch

from sglang_cpu import import_sglang


def dummy_load_case(ckpt_dir: str) -> dict:
    import torch.nn as nn
    from safetensors.torch import load_file

    engram = import_sglang("sglang.srt.layers.engram")
    loader = import_sglang("sglang.srt.model_loader.loader")
    v4 = import_sglang("sglang.srt.models.deepseek_v4")
    rc = import_sglang("sglang.srt.runtime_context")
    from sglang_dsv41.sglang_backend import engram_hooks

    ckpt = load_file(os.path.join(ckpt_dir, "model-00001.safetensors"))
    meta = json.load(open(os.path.join(ckpt_dir, "layout.json")))
    reads: list[tuple] = []
    getitem = engram_hooks.RowSlice.__getitem__
    engram_hooks.RowSlice.__getitem__ = lambda s, rows: reads.append(
        (s.name, rows.start, rows.stop)) or getitem(s, rows)

    class TinyV4(nn.Module):
        """The tensors of a V4.1 model this plugin touches, under SGLang's parameter names,
        named from checkpoint names by SGLang's own DeepseekV4 remapping."""
        remap_weight_name_to_dpsk_hf_format = staticmethod(
            v4.DeepseekV4ForCausalLM.remap_weight_name_to_dpsk_hf_format)

        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.layers = nn.ModuleList()
            for layer in meta["layers"]:
                block = nn.Module()
                block.engram = nn.Module()
                block.engram.embed = engram.EngramEmbedding(
                    layer["rows"], meta["dim"], layer["id"], tuple(layer["bounds"]))
                block.engram.wkv = nn.Linear(4, 4, bias=False)
                block.mlp = nn.Module()
                block.mlp.topk = nn.Module()
                block.mlp.topk.tid2eid = nn.Parameter(
                    torch.zeros(meta["vocab"], meta["topk"], dtype=torch.int32),
                    requires_grad=False)
                self.model.layers.append(block)

    results = {}
    for rank in range(2):
        with rc.get_parallel().override(tp_size=2, tp_rank=rank):
            model = TinyV4()
        finished = []
        for name, m in model.named_modules():
            if isinstance(m, engram.EngramEmbedding):
                m.weight.data.view(torch.uint8).fill_(0x7F)  # sentinel the dummy fill must keep
                m.finish_load = (lambda label, _f=m.finish_load: finished.append(label) or _f(label))
        loader.initialize_dummy_weights(model)  # SGLang's fill, through the loader's binding
        wkv = model.model.layers[0].engram.wkv.weight
        assert wkv.abs().max() <= 1e-3 and wkv.abs().max() > 0, "the dummy fill did not run"
        for m in model.modules():
            if isinstance(m, engram.EngramEmbedding):
                assert bool((m.weight.data.view(torch.uint8) == 0x7F).all()), \
                    "the dummy fill touched an Engram table"
        reads.clear()
        loaded = engram_hooks.load_frozen_tables(model, ckpt_dir)
        for i, layer in enumerate(meta["layers"]):
            emb = model.model.layers[i].engram.embed
            lo, hi = emb.row_start, emb.row_start + emb.rows
            for part in ("weight", "scale"):
                want = ckpt[f"layers.{layer['id']}.engram.embed.{part}"][lo:hi]
                got = getattr(emb, part).data
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (rank, i, part)
            assert torch.equal(model.model.layers[i].mlp.topk.tid2eid,
                               ckpt[f"layers.{layer['id']}.ffn.gate.tid2eid"])
        results[rank] = {"loaded": sorted(loaded), "reads": sorted(reads),
                         "finished": sorted(finished),
                         "rows": [[m.row_start, m.rows] for m in model.modules()
                                  if isinstance(m, engram.EngramEmbedding)]}
    # a checkpoint without the tables is refused, naming what is missing
    with rc.get_parallel().override(tp_size=2, tp_rank=0):
        model = TinyV4()
    empty = os.path.join(ckpt_dir, "no_tables")
    try:
        engram_hooks.load_frozen_tables(model, empty)
    except ValueError as e:
        results["missing"] = str(e)
    engram_hooks.RowSlice.__getitem__ = getitem
    return {str(k): v for k, v in results.items()}
