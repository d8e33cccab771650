"""Write a random checkpoint of a preset: the real V4.1 release layout, the converted bf16 one, or
transformers' DeepseekV4 layout.

    python -m sglang_dsv41.tools.make_checkpoint OUT --preset tiny --layout release|bf16|hf
        [--force]

The weights are the real model's (sglang_dsv41.model.dsv4.model: DSV4ForCausalLM + init_weights,
built with bf16 as the default dtype), stored in checkpoint dtypes (plan/shapes.checkpoint_dtype).
``release`` adds what the real release carries besides the text model: FP8 e4m3 dense weights
with e8m0 ``.scale`` blocks of quantization_config.weight_block_size (Engram's ``wkv`` included:
SGLang renames its ``.scale`` to weight_scale_inv), FP4 (or FP8) experts, ``gate.bias_vl``,
``vision.*``, ``aligner.*``, ``image_*``, ``mtp.*`` and the nested config with DSpark keys, over
several shards; the Engram table's ``embed.scale`` is the table's own e8m0 scale, kept as is.
``hf`` (V4 presets only) is written by transformers: DeepseekV4ForCausalLM takes our tensors
through names.to_transformers and save_pretrained writes them.

OUT is written atomically (loader/atomic_dir.py); an existing non-empty OUT is replaced only if
this tool or the converter wrote it (it holds .sglang_dsv41_output), or with --force. Exit
status: 0 written, 1 refused or failed (error: ..., OUT left as it was), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys

import torch

from ..loader.atomic_dir import staged_output
from ..loader.fp4 import quantize_fp4
from ..loader.fp8 import quantize_fp8_blocks
from ..loader.release_layout import RELEASE_SCALE_SUFFIX
from ..loader.shards import INDEX_FILE, StreamingShardWriter, shard_file_name, split_into_shards
from ..loader.shards import write_index
from ..model.dsv4.config import DSV4Config
from ..model.dsv4.names import storable_state
from ..model.dsv4.presets import get_preset
from ..plan.shapes import checkpoint_dtype
from . import help_description, run_reporting_errors

LAYOUTS = ("release", "bf16", "hf")
V41_BLOCK = [32, 32]  # V4.1-Flash's weight_block_size (the converter reads it from the config)
# FP8 block-quantized in the release (SGLang maps their ".scale" to weight_scale_inv); the
# compressor/indexer-compressor projections, weights_proj, norms and the Engram table are not.
_FP8_WEIGHTS = (".attn.wq_a.", ".attn.wq_b.", ".attn.wkv.", ".attn.wo_a.", ".attn.wo_b.",
                ".indexer.wq_b.", ".shared_experts.", ".engram.wkv.")


def random_text_tensors(cfg: DSV4Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """The real model's random weights (init_weights with ``seed``) in checkpoint dtypes."""
    from ..model.dsv4.model import DSV4ForCausalLM, default_dtype, init_weights

    with default_dtype(torch.bfloat16):  # half the memory; fp32 where the model insists
        model = DSV4ForCausalLM(cfg)
    init_weights(model, seed)
    return storable_state(model.state_dict(), lambda n, t: checkpoint_dtype(n, t.dtype))


def release_tensors(cfg: DSV4Config, text: dict[str, torch.Tensor], block: list[int],
                    expert_dtype: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    h = cfg.hidden_size
    out: dict[str, torch.Tensor] = {}
    for name, t in text.items():
        stem = name[: -len(".weight")]
        if ".ffn.experts." in name and expert_dtype == "fp4":
            out[name], out[stem + RELEASE_SCALE_SUFFIX] = quantize_fp4(t)
        elif ".ffn.experts." in name or any(p in name for p in _FP8_WEIGHTS):
            out[name], out[stem + RELEASE_SCALE_SUFFIX] = quantize_fp8_blocks(
                t, tuple(block), scale_fmt="ue8m0")
        else:
            out[name] = t
        if name.endswith(".gate.bias") and cfg.is_v41:
            out[name[: -len("bias")] + "bias_vl"] = torch.randn(t.shape, generator=g)
    extra = {"mtp.0.e_proj.weight": [h, h], "mtp.0.norm.weight": [h]}
    if cfg.is_v41:  # the multimodal V4.1 release; V4 releases are text-only
        extra.update({"vision.blocks.0.attn.wqkv.weight": [3 * 32, 32],
                      "vision.norm.weight": [32], "aligner.w1.weight": [h, 9 * 32],
                      "image_start": [h], "image_end": [h], "image_newline": [h]})
    for name, shape in extra.items():
        out[name] = torch.randn(shape, generator=g).to(torch.bfloat16)
    return out


def release_config(cfg: DSV4Config, block: list[int], expert_dtype: str) -> dict:
    """V4.1: nested text_config + vision_config (the multimodal release); V4 presets: one flat
    config with model_type deepseek_v4, as DeepSeek-V4 releases ship it."""
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
             "scale_fmt": "ue8m0", "weight_block_size": block, "expert_dtype": expert_dtype}
    text = cfg.to_dict()
    # DeepSeek's releases name the window sliding_window; SGLang 0.5.23's ModelConfig reads it.
    text["sliding_window"] = cfg.window_size
    text["compress_ratios"] = cfg.compress_ratios + [0]  # plus the draft layer's ratio
    text.pop("architectures", None)
    if not cfg.is_v41:
        return {**text, "architectures": ["DeepseekV4ForCausalLM"],
                "num_nextn_predict_layers": 1, "quantization_config": quant}
    text["model_type"] = "deepseek_v41_text"
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
            "text_config": text, "num_nextn_predict_layers": 1,
            "dspark_block_size": 2, "dspark_target_layer_ids": [cfg.num_hidden_layers - 1],
            "image_token_id": cfg.vocab_size - 1,
            "vision_config": {"model_type": "deepseek_v41_vision", "num_hidden_layers": 1,
                              "hidden_size": 32, "num_attention_heads": 2, "patch_size": 14,
                              "downsample_ratio": 3},
            "quantization_config": quant}


def write_tensors(out_dir: str, tensors: dict[str, torch.Tensor], config: dict,
                  num_shards: int) -> None:
    import json
    import os

    names = list(tensors)
    groups = split_into_shards([tensors[n].nbytes for n in names], min(num_shards, len(names)))
    weight_map = {}
    for k, group in enumerate(groups):
        file = shard_file_name(k, len(groups))
        items = [(names[i], tensors[names[i]]) for i in group]
        with StreamingShardWriter(os.path.join(out_dir, file),
                                  [(n, t.dtype, list(t.shape)) for n, t in items]) as w:
            for n, t in items:
                w.write(n, t)
                weight_map[n] = file
    write_index(out_dir, weight_map, sum(t.nbytes for t in tensors.values()))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def write_hf(out_dir: str, cfg: DSV4Config, text: dict[str, torch.Tensor],
             num_shards: int) -> None:
    """transformers' own DeepseekV4 checkpoint of ``text``: the model takes our tensors as they
    are (assign: bf16 matrices, fp32 sinks/mHC/ape/bias) and save_pretrained writes them."""
    from ..torchvision_shim import install_torchvision_shim

    install_torchvision_shim()  # transformers' DeepseekV4 import reaches torchvision
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from ..model.dsv4.names import to_transformers

    hf_cfg = DeepseekV4Config(**to_transformers_config(cfg), dtype="bfloat16")
    model = DeepseekV4ForCausalLM(hf_cfg)
    model.load_state_dict(to_transformers(text), strict=True, assign=True)
    total = sum(t.nbytes for t in text.values())
    model.save_pretrained(out_dir, max_shard_size=max(1, -(-total // num_shards)))


def to_transformers_config(cfg: DSV4Config) -> dict:
    from ..model.dsv4.names import to_transformers_config as convert

    try:
        return convert(cfg)
    except ValueError as e:
        raise ValueError(f"--layout hf needs a V4 preset (e.g. tiny-v4): {e}") from e


def make_checkpoint(out_dir: str, cfg: DSV4Config, layout: str = "release", seed: int = 0,
                    num_shards: int = 4, block: list[int] | None = None,
                    expert_dtype: str = "fp4", force: bool = False) -> str:
    """Write the checkpoint to ``out_dir`` atomically; an existing ``out_dir`` that this tool
    did not write is replaced only with ``force``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    # out_dir is refused (StagedDir) before anything is built
    with staged_output(out_dir, force=force) as tmp:
        if layout == "hf":
            to_transformers_config(cfg)  # V4.1 refused
        text = random_text_tensors(cfg, seed)
        if layout == "hf":
            write_hf(tmp, cfg, text, num_shards)
            return out_dir
        if layout == "release":
            block = list(block or V41_BLOCK)
            tensors = release_tensors(cfg, text, block, expert_dtype, seed)
            config = release_config(cfg, block, expert_dtype)
        else:
            from ..loader.release_layout import text_config_from_release

            tensors = text
            config = text_config_from_release(release_config(cfg, V41_BLOCK, expert_dtype))
        write_tensors(tmp, tensors, config, num_shards)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sglang_dsv41.tools.make_checkpoint",
                                description=help_description(__doc__))
    p.add_argument("out", help="output directory (written atomically)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--layout", choices=LAYOUTS, default="release")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-shards", type=int, default=4)
    p.add_argument("--expert-dtype", choices=("fp4", "fp8"), default="fp4")
    p.add_argument("--force", action="store_true",
                   help="replace OUT even if it is a non-empty directory this tool did not "
                   "write (everything in it is deleted)")
    args = p.parse_args(argv)
    _, failed = run_reporting_errors(lambda: make_checkpoint(
        args.out, get_preset(args.preset), args.layout, args.seed, args.num_shards,
        expert_dtype=args.expert_dtype, force=args.force))
    if failed:
        return failed
    print(f"wrote {args.out} ({args.layout}, {INDEX_FILE})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
