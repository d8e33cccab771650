"""Write a random-weight checkpoint: text-only bf16, or the multimodal FP8 release layout.

    python -m sglang_dsv41.tools.make_checkpoint --preset tiny --layout release OUT \
        [--seed S] [--num-shards N] [--scale-fmt float32|ue8m0] [--config cfg.json]

Weights come from build_model(cfg, bf16, seed). The release layout is described in
sglang_dsv41/loader/release_layout.py; its text weights dequantize to what the converter writes.
"""

from __future__ import annotations

import argparse
import sys
from typing import Iterator

import torch

from ..loader.checkpoint import MAX_PRESET_BUILD_PARAMS, model_tensors, save_checkpoint
from ..loader.fp8 import FP8_BLOCK, SCALE_FORMATS, quantize_fp8_blocks, scale_name
from ..loader.release_layout import RELEASE_ARCHITECTURE, RELEASE_MODEL_TYPE, TEXT_PREFIX
from ..model.config import PRESETS, DSV41Config, get_preset
from ..model.model import build_model
from ..tokenizer import ByteTokenizer


NUM_DRAFT_LAYERS = 3
VISION = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
          "num_attention_heads": 4, "patch_size": 14, "image_size": 224, "num_channels": 3}
# Kept in full precision in the release, as in DeepSeek checkpoints.
_FP32_SUFFIXES = ("sinks", "e_score_correction_bias")
_UNQUANTIZED = ("embed_tokens.weight", "lm_head.weight", "norm.weight", "layernorm.weight",
                "mlp.gate.weight", "engram.table.weight", "engram.gate.weight")


def is_quantized_weight(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith(".weight") and not name.endswith(_UNQUANTIZED)


def release_config(cfg: DSV41Config, scale_fmt: str) -> dict:
    text = cfg.to_dict()
    text["num_nextn_predict_layers"] = NUM_DRAFT_LAYERS  # DeepSeek keeps it in the text config
    return {
        "architectures": [RELEASE_ARCHITECTURE],
        "model_type": RELEASE_MODEL_TYPE,
        "torch_dtype": "bfloat16",
        "text_config": text,
        "vision_config": {"model_type": "deepseek_v41_vision", **VISION},
        "image_token_index": cfg.vocab_size - 1,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
                                "dynamic", "weight_block_size": list(FP8_BLOCK),
                                "scale_fmt": scale_fmt},
        "dspark_config": {"num_draft_layers": NUM_DRAFT_LAYERS, "draft_hidden_size":
                          cfg.hidden_size, "draft_vocab_size": cfg.vocab_size},
        "draft_model_type": "dspark",
        "tie_word_embeddings": cfg.tie_word_embeddings,
    }


def _quantized(name: str, w: torch.Tensor, scale_fmt: str) -> Iterator[tuple[str, torch.Tensor]]:
    q, s = quantize_fp8_blocks(w, FP8_BLOCK, scale_fmt)
    yield name, q
    yield scale_name(name), s


def _extra_tensors(cfg: DSV41Config, gen: torch.Generator, scale_fmt: str, prefix: str,
                   shapes: dict[str, tuple[int, ...]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, shape in shapes.items():
        w = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        if len(shape) == 2 and not name.endswith("norm.weight"):
            yield from _quantized(prefix + name, w, scale_fmt)
        else:
            yield prefix + name, w


def vision_shapes(cfg: DSV41Config) -> dict[str, tuple[int, ...]]:
    v, p = VISION["hidden_size"], VISION["patch_size"]
    out: dict[str, tuple[int, ...]] = {"patch_embed.proj.weight": (v, 3 * p * p)}
    for i in range(VISION["num_hidden_layers"]):
        b = f"blocks.{i}."
        out.update({b + "norm1.weight": (v,), b + "attn.qkv.weight": (3 * v, v),
                    b + "attn.proj.weight": (v, v), b + "norm2.weight": (v,),
                    b + "mlp.fc1.weight": (VISION["intermediate_size"], v),
                    b + "mlp.fc2.weight": (v, VISION["intermediate_size"])})
    return out


def draft_shapes(cfg: DSV41Config) -> dict[str, tuple[int, ...]]:
    h, q = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    return {"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
            "self_attn.q_proj.weight": (q, h), "mlp.up_proj.weight": (cfg.intermediate_size, h),
            "mlp.down_proj.weight": (h, cfg.intermediate_size), "shared_head.norm.weight": (h,)}


def release_tensors(cfg: DSV41Config, seed: int, scale_fmt: str
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed + 1)
    yield from _extra_tensors(cfg, gen, scale_fmt, "vision_tower.", vision_shapes(cfg))
    v = VISION["hidden_size"]
    yield from _extra_tensors(cfg, gen, scale_fmt, "multi_modal_projector.",
                              {"linear_1.weight": (cfg.hidden_size, 4 * v),
                               "linear_2.weight": (cfg.hidden_size, cfg.hidden_size)})
    model = build_model(cfg, torch.bfloat16, "cpu", seed=seed)
    for name, t in model_tensors(model).items():
        full = TEXT_PREFIX + name
        if is_quantized_weight(name, t):
            yield from _quantized(full, t.detach(), scale_fmt)
        else:
            keep_fp32 = name.endswith(_FP32_SUFFIXES)
            yield full, t.detach().to(torch.float32 if keep_fp32 else torch.bfloat16)
    for k in range(NUM_DRAFT_LAYERS):
        yield from _extra_tensors(cfg, gen, scale_fmt, f"mtp.{k}.", draft_shapes(cfg))


def make_checkpoint(out_dir: str, cfg: DSV41Config, layout: str = "bf16", seed: int = 0,
                    num_shards: int | None = None, scale_fmt: str = "float32",
                    progress: bool = False) -> str:
    tokenizer = ByteTokenizer.from_config(cfg)
    if layout == "bf16":
        model = build_model(cfg, torch.bfloat16, "cpu", seed=seed)
        config = dict(cfg.to_dict(), torch_dtype="bfloat16")
        return save_checkpoint(model_tensors(model), out_dir, config, tokenizer=tokenizer,
                               num_shards=num_shards, dtype=torch.bfloat16, progress=progress)
    if layout != "release":
        raise ValueError(f"layout must be release or bf16, got {layout!r}")
    if scale_fmt not in SCALE_FORMATS:
        raise ValueError(f"scale_fmt must be one of {SCALE_FORMATS}, got {scale_fmt!r}")
    return save_checkpoint(release_tensors(cfg, seed, scale_fmt), out_dir,
                           release_config(cfg, scale_fmt), tokenizer=tokenizer,
                           num_shards=num_shards or 4, progress=progress)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sglang_dsv41.tools.make_checkpoint",
                                description=__doc__.splitlines()[0])
    p.add_argument("out", help="output directory (replaced atomically)")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--config", default=None, help="a DSV41Config config.json (overrides --preset)")
    p.add_argument("--layout", default="bf16", choices=["release", "bf16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-shards", type=int, default=None,
                   help="exact shard count (default: 4 for release, size-based for bf16)")
    p.add_argument("--scale-fmt", default="float32", choices=list(SCALE_FORMATS),
                   help="release FP8 scales: float32 multipliers or ue8m0 (e8m0 exponents)")
    p.add_argument("--progress", action="store_true")
    args = p.parse_args(argv)
    try:
        cfg = DSV41Config.from_pretrained(args.config) if args.config else get_preset(args.preset)
        if cfg.num_parameters(include_engram=True) > MAX_PRESET_BUILD_PARAMS:
            raise ValueError(f"{args.config or args.preset!r} is too large for random weights "
                                 "on a CPU; it exists for the planner")
        out = make_checkpoint(args.out, cfg, args.layout, args.seed, args.num_shards,
                              args.scale_fmt, args.progress)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
