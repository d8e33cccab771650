"""Model loading for a serving rank: what ``--model-path`` names, the weights, the serving dtype.

``--model-path`` accepts
  a preset name     (not an existing path): random weights from init_weights(seed 0), the
                    reference model the tests recompute against;
  our bf16 layout   a directory with config.json in SGLang's flat schema and safetensors shards
                    under SGLang's flat names (what convert.py / make_checkpoint --layout bf16
                    write; the release layout after conversion);
  a transformers    DeepseekV4 directory (config.json with model_type deepseek_v4 and
                    ``layer_types``, ``model.layers...`` names from save_pretrained): the config
                    is mapped back to ours and the names through names.from_transformers.
A tokenizer is optional: requests with input_ids need none (``has_tokenizer`` says which).
"""

from __future__ import annotations

import glob
import logging
import os

import torch
from safetensors import safe_open

from ..jsonio import read_json_object
from ..model.dsv4.config import CONFIG_FILE, V4, DSV4Config
from ..model.dsv4.model import DSV4ForCausalLM, init_weights
from ..model.dsv4.presets import PRESETS, get_preset
from .dummy import DUMMY_SEED, dummy_init_

logger = logging.getLogger("sglang_dsv41.loader")
LAYOUTS = ("preset", "flat", "transformers")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def model_layout(model_path: str) -> str:
    if model_path in PRESETS and not os.path.exists(model_path):
        return "preset"
    if not os.path.isfile(os.path.join(model_path, CONFIG_FILE)):
        raise ValueError(f"--model-path {model_path!r} is neither a preset ({sorted(PRESETS)}) "
                         f"nor a directory with a {CONFIG_FILE}")
    raw = read_json_object(os.path.join(model_path, CONFIG_FILE), "model config")
    return "transformers" if "layer_types" in raw else "flat"


def config_from_transformers(raw: dict) -> DSV4Config:
    """transformers' DeepseekV4Config dict -> ours (the inverse of names.to_transformers_config)."""
    if raw.get("model_type") != V4:
        raise ValueError(f"a transformers checkpoint must have model_type {V4!r}, got "
                         f"{raw.get('model_type')!r}")
    ratios = {"sliding_attention": 0, "compressed_sparse_attention": 4,
              "heavily_compressed_attention": 128}
    unknown = sorted(set(raw["layer_types"]) - set(ratios))
    if unknown:
        raise ValueError(f"unknown transformers layer_types {unknown}")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling")
    rope = dict(rope) if rope and rope.get("rope_type", rope.get("type")) != "default" else None
    if rope is not None:
        rope["type"] = rope.pop("rope_type", rope.get("type"))
        for key in ("rope_theta", "partial_rotary_factor"):
            rope.pop(key, None)
    mlp_types = raw.get("mlp_layer_types") or []
    keys = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "head_dim", "q_lora_rank", "num_experts_per_tok",
            "n_routed_experts", "n_shared_experts", "scoring_func", "norm_topk_prob",
            "routed_scaling_factor", "max_position_embeddings", "rope_theta",
            "compress_rope_theta", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "swiglu_limit",
            "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk",
            "rms_norm_eps", "bos_token_id", "eos_token_id")
    d = {k: raw[k] for k in keys if raw.get(k) is not None}
    d.update(model_type=V4, compress_ratios=[ratios[t] for t in raw["layer_types"]],
             window_size=raw["sliding_window"], rope_scaling=rope,
             qk_rope_head_dim=int(round(raw["head_dim"] * raw["partial_rotary_factor"])),
             num_hash_layers=sum(t == "hash_moe" for t in mlp_types), q_head_norm=True,
             hc_pre_from_prev_sublayer=False, torch_dtype=str(raw.get("dtype") or "float32"))
    if isinstance(d["eos_token_id"], list):
        d["eos_token_id"] = d["eos_token_id"][0]
    return DSV4Config.from_dict(d)


def load_serving_config(model_path: str) -> DSV4Config:
    layout = model_layout(model_path)
    if layout == "preset":
        return get_preset(model_path)
    raw = read_json_object(os.path.join(model_path, CONFIG_FILE), "model config")
    return config_from_transformers(raw) if layout == "transformers" else DSV4Config.from_dict(raw)


def has_tokenizer(model_path: str) -> bool:
    """Whether text requests can be served: presets use the byte tokenizer; a directory needs
    its own tokenizer files (without them only input_ids requests are served)."""
    if model_layout(model_path) == "preset":
        return True
    return any(os.path.isfile(os.path.join(model_path, f)) for f in TOKENIZER_FILES)


def read_checkpoint(model_path: str, layout: str) -> dict[str, torch.Tensor]:
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors in {model_path}")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(path, "pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    if layout == "transformers":
        from ..model.dsv4.names import from_transformers

        tensors = from_transformers(tensors)
    return tensors


def keeps_fp32(name: str) -> bool:
    """Sinks, norms, mHC parameters, compressor position biases: fp32 at any serving dtype."""
    leaf = name.rsplit(".", 1)[-1]
    return (leaf in ("attn_sink", "ape") or leaf.startswith("hc_") or
            name.rsplit(".", 2)[-2].endswith("norm"))


@torch.no_grad()
def cast_for_serving_(model: torch.nn.Module, dtype: torch.dtype) -> None:
    for name, p in model.named_parameters():
        if p.is_floating_point() and not keeps_fp32(name):
            p.data = p.data.to(dtype)


@torch.no_grad()
def load_serving_model(model_path: str, dtype: torch.dtype, device,
                       load_format: str = "auto") -> DSV4ForCausalLM:
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be auto or dummy, got {load_format!r}")
    layout = model_layout(model_path)
    cfg = load_serving_config(model_path)
    model = DSV4ForCausalLM(cfg)
    if layout == "preset":
        init_weights(model, seed=0)
    else:
        state = read_checkpoint(model_path, layout)
        if load_format == "dummy":   # keep what dummy weights must not replace
            state = {n: t for n, t in state.items() if n.endswith("tid2eid") or ".engram.embed." in n}
        result = model.load_state_dict(state, strict=load_format != "dummy")
        logger.info("loaded %d tensors from %s (%s layout)", len(state), model_path, layout)
        del result
    if load_format == "dummy":
        dummy_init_(model, seed=DUMMY_SEED)
    cast_for_serving_(model, dtype)
    return model.to(device).eval()
