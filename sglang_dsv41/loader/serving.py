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
Numerics: SGLang's inference rounding, except for a transformers checkpoint
(``serving_numerics_for``).
"""

from __future__ import annotations

import logging
import os

import torch
from safetensors import SafetensorError

from ..jsonio import read_json_object
from ..model.dsv4.config import CONFIG_FILE, V4, DSV4Config
from ..model.dsv4.model import DSV4ForCausalLM, init_weights
from ..model.dsv4.presets import PRESETS, get_preset
from .dummy import DUMMY_SEED, dummy_init_, is_engram_table
from .shards import open_shard, read_tensor_locations

logger = logging.getLogger("sglang_dsv41.loader")
LAYOUTS = ("preset", "flat", "transformers")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


# Keys only a release (multimodal, quantized) config.json has at its top level.
RELEASE_ONLY_KEYS = ("text_config", "vision_config", "quantization_config")
# The sizes a flat config must name (DSV4Config's defaults are V4.1-Flash's, never a guess).
FLAT_SIZE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "head_dim", "n_routed_experts")


def model_layout(model_path: str) -> str:
    if model_path in PRESETS and not os.path.exists(model_path):
        return "preset"
    if not os.path.isfile(os.path.join(model_path, CONFIG_FILE)):
        raise ValueError(f"--model-path {model_path!r} is neither a preset ({sorted(PRESETS)}) "
                         f"nor a directory with a {CONFIG_FILE}")
    raw = read_json_object(os.path.join(model_path, CONFIG_FILE), "model config")
    release = sorted(k for k in RELEASE_ONLY_KEYS if k in raw)
    if release:
        # A release config nests the text model under text_config: read flat, every size
        # took its default and a full-size model was built on random weights, silently.
        raise ValueError(f"--model-path {model_path!r} is a release checkpoint (its config.json "
                         f"has {', '.join(release)}): convert it first with `python -m "
                         f"sglang_dsv41.convert {model_path} DST` and serve DST")
    if "layer_types" in raw:
        return "transformers"
    missing = [k for k in FLAT_SIZE_KEYS if k not in raw]
    if missing:
        raise ValueError(f"--model-path {model_path!r}: its config.json lacks {missing}; a "
                         f"DeepSeek V4/V4.1 text config (SGLang's flat schema, as "
                         f"sglang_dsv41.convert writes it) names every size")
    return "flat"


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
    rope_theta, compress_theta, rope = _rope_from_transformers(raw)
    mlp_types = raw.get("mlp_layer_types") or []
    keys = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "head_dim", "q_lora_rank", "num_experts_per_tok",
            "n_routed_experts", "n_shared_experts", "scoring_func", "norm_topk_prob",
            "routed_scaling_factor", "max_position_embeddings", "hc_mult", "hc_sinkhorn_iters",
            "hc_eps", "swiglu_limit", "o_groups", "o_lora_rank", "index_n_heads",
            "index_head_dim", "index_topk", "rms_norm_eps", "bos_token_id", "eos_token_id")
    d = {k: raw[k] for k in keys if raw.get(k) is not None}
    d.update(model_type=V4, compress_ratios=[ratios[t] for t in raw["layer_types"]],
             window_size=raw["sliding_window"], rope_scaling=rope, rope_theta=rope_theta,
             compress_rope_theta=compress_theta,
             qk_rope_head_dim=int(round(raw["head_dim"] * _partial_rotary(raw))),
             num_hash_layers=sum(t == "hash_moe" for t in mlp_types), q_head_norm=True,
             hc_pre_from_prev_sublayer=False, torch_dtype=str(raw.get("dtype") or "float32"))
    if isinstance(d["eos_token_id"], list):
        d["eos_token_id"] = d["eos_token_id"][0]
    return DSV4Config.from_dict(d)


def _partial_rotary(raw: dict) -> float:
    params = raw.get("rope_parameters") or {}
    return raw.get("partial_rotary_factor") or params.get("main", params)["partial_rotary_factor"]


def _rope_from_transformers(raw: dict) -> tuple[float, float, dict | None]:
    """(rope_theta, compress_rope_theta, our rope_scaling) from transformers' rope_parameters:
    {"main": {...}, "compress": {...}} as written by save_pretrained, or one flat dict."""
    params = raw.get("rope_parameters") or {}
    main = params.get("main", params)
    compress = params.get("compress", main)
    theta = main.get("rope_theta", raw.get("rope_theta", 10000.0))
    compress_theta = compress.get("rope_theta", raw.get("compress_rope_theta", theta))
    kind = compress.get("rope_type", compress.get("type", "default"))
    if kind == "default":
        return theta, compress_theta, None
    if kind != "yarn":
        raise ValueError(f"unsupported rope_type {kind!r} in a transformers DeepseekV4 config")
    yarn = {k: compress[k] for k in ("factor", "original_max_position_embeddings", "beta_fast",
                                     "beta_slow") if k in compress}
    return theta, compress_theta, {"type": "yarn", **yarn}


def load_serving_config(model_path: str) -> DSV4Config:
    layout = model_layout(model_path)
    if layout == "preset":
        return get_preset(model_path)
    raw = read_json_object(os.path.join(model_path, CONFIG_FILE), "model config")
    return config_from_transformers(raw) if layout == "transformers" else DSV4Config.from_dict(raw)


def serving_numerics_for(model_path: str) -> bool:
    """Whether the engine computes SGLang 0.5.23's inference rounding (fp8 KV-cache round trip,
    FP4 V4.1 indexer and compressed KV; DSV4Context.serving_numerics, the trainer's default).
    A transformers checkpoint is served with transformers' plain math, which defines it; every
    other layout as SGLang serves it."""
    return model_layout(model_path) != "transformers"


def has_tokenizer(model_path: str) -> bool:
    """Whether text requests can be served: presets use the byte tokenizer; a directory needs
    its own tokenizer files (without them only input_ids requests are served)."""
    if model_layout(model_path) == "preset":
        return True
    return any(os.path.isfile(os.path.join(model_path, f)) for f in TOKENIZER_FILES)


def read_checkpoint(model_path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, each from the shard its index names (a stray
    ``*.safetensors`` the index does not list is not read); errors name the file (missing,
    corrupt) or the tensor (stored twice, or elsewhere than the index says)."""
    by_file: dict[str, list[str]] = {}
    for name, (file, _, _) in read_tensor_locations(model_path).items():
        by_file.setdefault(file, []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        path = os.path.join(model_path, file)
        try:
            with open_shard(path) as f:
                for name in names:
                    tensors[name] = f.get_tensor(name)
        except SafetensorError as e:  # a tensor's bytes past a truncated end, ...
            raise ValueError(f"corrupt checkpoint shard {path}: {e}") from e
    return tensors


def read_transformers_checkpoint(model_path: str) -> dict[str, torch.Tensor]:
    """transformers reads its own directory (its save_pretrained renames on the way out, and
    reverses them on the way in); its state dict then maps to our names."""
    from ..torchvision_shim import install_torchvision_shim

    install_torchvision_shim()  # transformers' DeepseekV4 import reaches torchvision
    from transformers import DeepseekV4ForCausalLM

    from ..model.dsv4.names import from_transformers

    hf = DeepseekV4ForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return from_transformers(hf.state_dict())


def read_model_tensors(model_path: str) -> dict[str, torch.Tensor]:
    """A checkpoint directory's tensors under our flat names, whatever its layout."""
    if model_layout(model_path) == "transformers":
        return read_transformers_checkpoint(model_path)
    return read_checkpoint(model_path)


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
        state = read_model_tensors(model_path)
        if load_format == "dummy":   # keep what dummy weights must not replace
            frozen = {n for n in model.state_dict() if n.endswith("tid2eid") or is_engram_table(n)}
            missing = sorted(frozen - state.keys())
            if missing:  # left at their construction values: every token routed to expert 0
                raise ValueError(f"{model_path} lacks {len(missing)} frozen tensor(s) the model "
                                 f"needs, e.g. {missing[:3]}; a dummy load cannot make them up")
            state = {n: state[n] for n in frozen}
        model.load_state_dict(state, strict=load_format != "dummy")
        logger.info("loaded %d tensors from %s (%s layout)", len(state), model_path, layout)
    if load_format == "dummy":
        dummy_init_(model, seed=DUMMY_SEED)
    cast_for_serving_(model, dtype)
    return model.to(device).eval()
