"""The dummy-load case of sglang_plugin_cases.py: SGLang 0.5.23's own
``DummyModelLoader.load_model`` (``--load-format dummy``) building a model that holds real
``EngramEmbedding`` and ``HashTopK`` modules, for two TP ranks, with our engram_dummy_load plugin
reading the rows and tid2eid from a small safetensors checkpoint.

The model class is the one piece of ours. SGLang's DeepseekV4ForCausalLM does not build on
CPU (tried with the tiny V4.1 preset, gloo world size 1): the sliding-window layers ask SGLang's
CPU rope factory (layers/rotary_embedding/factory.py get_rope_cpu) for an unscaled rope, which
it refuses ("Only deepseek_yarn is supported for CPU"), and its deepseek_yarn rope imports
vllm._custom_ops. So a small module registered in SGLang's ModelRegistry under its own
architecture name holds the modules the plugin fills, under DeepseekV4's parameter names (and
its checkpoint-name remapping).
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from sglang_cpu import import_sglang

ARCH = "Dsv41EngramDummyLoadTestForCausalLM"
NUM_EXPERTS = 16


def write_model_config(model_dir: str, meta: dict) -> str:
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump({"architectures": [ARCH], "model_type": "llama", "hidden_size": 4,
                   "num_attention_heads": 1, "num_hidden_layers": len(meta["layers"]),
                   "intermediate_size": 4, "vocab_size": meta["vocab"],
                   "torch_dtype": "float32", "engram_test_layout": meta}, f)
    return model_dir


def register_model_class(finished: list[str], at_post_load: list[bool]):
    import torch.nn as nn

    engram = import_sglang("sglang.srt.layers.engram")
    hash_topk = import_sglang("sglang.srt.layers.moe.hash_topk")
    v4 = import_sglang("sglang.srt.models.deepseek_v4")
    registry = import_sglang("sglang.srt.models.registry")

    class EngramDummyLoadModel(nn.Module):
        remap_weight_name_to_dpsk_hf_format = staticmethod(
            v4.DeepseekV4ForCausalLM.remap_weight_name_to_dpsk_hf_format)

        def __init__(self, config, quant_config=None):
            super().__init__()
            meta = config.engram_test_layout
            self.model = nn.Module()
            self.model.layers = nn.ModuleList()
            for layer in meta["layers"]:
                block = nn.Module()
                block.engram = nn.Module()
                block.engram.embed = engram.EngramEmbedding(
                    layer["rows"], meta["dim"], layer["id"], tuple(layer["bounds"]))
                # a sentinel the dummy fill must keep (the checkpoint rows replace it after)
                block.engram.embed.weight.data.view(torch.uint8).fill_(0x7F)
                embed = block.engram.embed
                embed.finish_load = (lambda label, _f=embed.finish_load:
                                     finished.append(label) or _f(label))
                block.engram.wkv = nn.Linear(4, 4, bias=False)
                block.mlp = nn.Module()
                block.mlp.topk = hash_topk.HashTopK(meta["topk"], NUM_EXPERTS,
                                                    vocab_size=meta["vocab"],
                                                    layer_id=layer["id"], is_draft=False)
                self.model.layers.append(block)

        def post_load_weights(self):
            """SGLang's DummyModelLoader calls this right after its dummy fill."""
            wkv = self.model.layers[0].engram.wkv.weight
            at_post_load.append(bool(0 < wkv.abs().max() <= 1e-3))  # the fill ran
            at_post_load.append(all(bool((m.weight.data.view(torch.uint8) == 0x7F).all())
                                    for m in self.modules()
                                    if isinstance(m, engram.EngramEmbedding)))

    registry.ModelRegistry.models[ARCH] = EngramDummyLoadModel


def dummy_load_case(ckpt_dir: str) -> dict:
    from safetensors.torch import load_file, save_file

    engram = import_sglang("sglang.srt.layers.engram")
    loader = import_sglang("sglang.srt.model_loader.loader")
    load_config = import_sglang("sglang.srt.configs.load_config")
    device_config = import_sglang("sglang.srt.configs.device_config")
    model_config = import_sglang("sglang.srt.configs.model_config")
    rc = import_sglang("sglang.srt.runtime_context")
    from sglang_dsv41.sglang_backend import engram_hooks

    ckpt = load_file(os.path.join(ckpt_dir, "model-00001.safetensors"))
    meta = json.load(open(os.path.join(ckpt_dir, "layout.json")))
    finished, at_post_load = [], []
    register_model_class(finished, at_post_load)
    # what a scheduler process has before it loads: SGLang's resolved and published arguments
    sa = import_sglang("sglang.srt.server_args")
    args = sa.prepare_server_args([
        "--model-path", write_model_config(os.path.join(ckpt_dir, "model"), meta),
        "--device", "cpu", "--tp-size", "2", "--load-format", "dummy"])
    args.resolve_once()
    rc.publish(args, role="scheduler")
    config = model_config.ModelConfig.from_server_args(args)
    reads: list[tuple] = []
    getitem = engram_hooks.RowSlice.__getitem__
    engram_hooks.RowSlice.__getitem__ = lambda s, rows: reads.append(
        (s.name, rows.start, rows.stop)) or getitem(s, rows)

    def load(rank: int, checkpoint: str):
        os.environ["SGLANG_DSV41_ENGRAM_CHECKPOINT"] = checkpoint  # --dsv41-engram-checkpoint
        with rc.get_parallel().override(tp_size=2, tp_rank=rank):
            chosen = loader.get_model_loader(load_config.LoadConfig(load_format="dummy"), config)
            assert type(chosen) is loader.DummyModelLoader
            return chosen.load_model(model_config=config,
                                     device_config=device_config.DeviceConfig("cpu"))

    results = {}
    try:
        for rank in range(2):
            reads.clear(), finished.clear(), at_post_load.clear()
            model = load(rank, ckpt_dir)
            tid2eid_equal = []
            for i, layer in enumerate(meta["layers"]):
                emb = model.model.layers[i].engram.embed
                lo, hi = emb.row_start, emb.row_start + emb.rows
                for part in ("weight", "scale"):
                    want = ckpt[f"layers.{layer['id']}.engram.embed.{part}"][lo:hi]
                    got = getattr(emb, part).data
                    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), \
                        (rank, i, part)
                topk = model.model.layers[i].mlp.topk
                tid2eid_equal.append(torch.equal(
                    topk.tid2eid, ckpt[f"layers.{layer['id']}.ffn.gate.tid2eid"]))
            results[rank] = {
                "reads": sorted(reads), "finished": sorted(finished),
                "dummy_fill_ran": at_post_load[0], "tables_kept_by_fill": at_post_load[1],
                "tid2eid_equal": tid2eid_equal,
                "tid2eid_in": sorted({type(m).__name__ for n, m in model.named_modules()
                                      if hasattr(m, "tid2eid")}),
                "rows": [[m.row_start, m.rows] for m in model.modules()
                         if isinstance(m, engram.EngramEmbedding)]}
        # an indexed checkpoint: a stray shard the index does not list (an older sharding's,
        # here with zero tid2eid) is not read, as SGLang's own loader does not read it
        indexed = os.path.join(ckpt_dir, "indexed")
        os.makedirs(indexed, exist_ok=True)
        shutil.copy(os.path.join(ckpt_dir, "model-00001.safetensors"), indexed)
        with open(os.path.join(indexed, "model.safetensors.index.json"), "w") as f:
            json.dump({"weight_map": {n: "model-00001.safetensors" for n in ckpt}}, f)
        save_file({n: torch.zeros_like(t) for n, t in ckpt.items() if n.endswith("tid2eid")},
                  os.path.join(indexed, "model-00002-of-00002.safetensors"))
        reads.clear(), finished.clear(), at_post_load.clear()
        model = load(0, indexed)
        results["stray_shard_ignored"] = all(
            torch.equal(model.model.layers[i].mlp.topk.tid2eid,
                        ckpt[f"layers.{layer['id']}.ffn.gate.tid2eid"])
            for i, layer in enumerate(meta["layers"]))
        # a checkpoint without the tables is refused, naming what is missing
        try:
            load(0, os.path.join(ckpt_dir, "no_tables"))
        except ValueError as e:
            results["missing"] = str(e)
    finally:
        engram_hooks.RowSlice.__getitem__ = getitem
        os.environ.pop("SGLANG_DSV41_ENGRAM_CHECKPOINT", None)
    return {str(k): v for k, v in results.items()}
