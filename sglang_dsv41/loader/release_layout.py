"""The real DeepSeek V4.1 release layout and how it maps onto the text-only bf16 checkpoint.

Release (what DeepSeek ships and ``tools/make_checkpoint --layout release`` writes):
- config.json: ``model_type`` deepseek_v41, ``architectures`` [DeepseekV41ForCausalLM],
  ``text_config`` (flat SGLang schema), ``vision_config``, ``quantization_config`` {quant_method
  fp8, fmt e4m3, weight_block_size (32x32 on V4.1: read it, never assume), scale_fmt ue8m0,
  expert_dtype fp4|fp8}, draft keys (num_nextn_predict_layers, dspark_*).
- Flat tensor names (``layers.N.attn.wq_a.weight``). A quantized ``X.weight`` has ``X.scale``
  (e8m0): FP8 e4m3 dense weights with one scale per weight_block_size block; FP4 experts int8
  [out, in/2] with one scale per 32 inputs (loader/fp4.py). Engram ``embed.weight`` fp8 +
  ``embed.scale`` and ``gate.tid2eid`` int32 are copied byte for byte (the real tables are
  189 GiB: never upcast). Dropped: ``vision.*``, ``aligner.*``, ``image_*``, ``*.bias_vl``,
  ``mtp.*`` (LoongSage examples/convert_dsv41_to_bf16.py drops the same set; SGLang 0.5.23
  skips vision/bias_vl in DeepseekV4ForCausalLM.load_weights).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import torch

from ..jsonio import read_json_object
from ..model.dsv4.config import DSV4Config
from .fp4 import FP4_PACKED_DTYPE, fp4_logical_shape, fp4_scale_shape
from .fp8 import FP8_DTYPE, scale_shape
from .shards import (DTYPE_NAMES, RawShardReader, read_tensor_locations,
                     tensor_nbytes)

RELEASE_SCALE_SUFFIX = ".scale"
DROP_PREFIXES = ("vision.", "aligner.", "image_", "mtp.")
DROP_SUFFIXES = (".bias_vl",)
COPY_PATTERN = re.compile(r"(\.engram\.embed\.(weight|scale)|\.gate\.tid2eid)$")
# SGLang's _VISION_FIELDS targets (configs/deepseek_v41.py) and draft keys: not text-model keys.
VISION_KEYS = ("vision_n_layers", "vision_dim", "vision_n_heads", "vision_inter_dim",
               "vision_patch_size", "vision_rope_theta", "vision_downsample_ratio",
               "vision_max_n_token", "vision_min_pixels", "vision_max_wh_ratio")
DRAFT_KEY_PREFIXES = ("dspark_", "mtp_", "draft_")
TOKENIZER_FILE_PATTERN = re.compile(
    r"^(tokenizer.*|special_tokens_map\.json|generation_config\.json|chat_template.*)$")


def normalize_v41_config(values: dict) -> dict:
    """The same flattening as SGLang 0.5.23's normalize_deepseek_v41_config (tested against it):
    text_config lifted under the top level, vision fields copied to vision_*, model_type
    deepseek_v41, DeepseekV41ForCausalLM renamed to DeepseekV4ForCausalLM."""
    values = dict(values)
    text, vision = values.pop("text_config", None), values.pop("vision_config", None)
    if text is not None:
        text = dict(text)
        text.pop("model_type", None)
        values = {**text, **values}
    if vision is not None:
        for source, target in (("num_hidden_layers", "vision_n_layers"),
                               ("hidden_size", "vision_dim"),
                               ("num_attention_heads", "vision_n_heads"),
                               ("intermediate_size", "vision_inter_dim"),
                               ("patch_size", "vision_patch_size"),
                               ("rope_theta", "vision_rope_theta"),
                               ("downsample_ratio", "vision_downsample_ratio"),
                               ("max_image_tokens", "vision_max_n_token"),
                               ("min_pixels", "vision_min_pixels"),
                               ("max_wh_ratio", "vision_max_wh_ratio")):
            if source in vision:
                values.setdefault(target, vision[source])
    if "model_type" in values:
        values["model_type"] = "deepseek_v41"
    if values.get("architectures") == ["DeepseekV41ForCausalLM"]:
        values["architectures"] = ["DeepseekV4ForCausalLM"]
    return values


def text_config_from_release(release: dict) -> dict:
    """Release config.json -> the text-only bf16 config: normalized as SGLang does (V4.1), minus
    vision, quantization and draft keys, num_nextn_predict_layers 0, one compress ratio per
    text layer (the draft layers' ratios dropped with them)."""
    if not isinstance(release.get("text_config", {}), dict):
        raise ValueError("release config.json: text_config is not an object")
    # SGLang normalizes only V4.1 configs (DeepseekV41Config); a flat deepseek_v4 config stays
    # V4 (renaming it would switch the model to V4.1's router gate).
    is_v4 = release.get("model_type") == "deepseek_v4" and "text_config" not in release
    out = dict(release) if is_v4 else normalize_v41_config(release)
    for k in list(out):
        if k in VISION_KEYS or k.startswith(DRAFT_KEY_PREFIXES) or k in (
                "quantization_config", "expert_dtype", "image_token_id"):
            del out[k]
    out["num_nextn_predict_layers"] = 0
    out["torch_dtype"] = "bfloat16"
    try:
        cfg = DSV4Config.from_dict(out)
    except (TypeError, ValueError) as e:
        raise ValueError(f"release text_config is not a valid DeepSeek V4.1 config: {e}") from e
    out["compress_ratios"] = cfg.compress_ratios
    return out


def quant_block(release: dict) -> tuple[tuple[int, int] | None, str]:
    """-> (FP8 block from quantization_config.weight_block_size, expert dtype fp4|fp8)."""
    q = release.get("quantization_config") or (release.get("text_config") or {}).get(
        "quantization_config")
    if q is None:
        return None, "bf16"
    if not isinstance(q, dict):
        raise ValueError(f"release config.json: quantization_config must be an object, got "
                         f"{type(q).__name__} {q!r}")
    if q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"unsupported quantization_config {q}: only fp8 e4m3 block scales")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size must be [rows, cols], got "
                         f"{block!r}")
    expert = q.get("expert_dtype", release.get("expert_dtype", "fp8"))
    if expert not in ("fp4", "fp8"):
        raise ValueError(f"quantization_config.expert_dtype must be fp4 or fp8, got {expert!r}")
    return (block[0], block[1]), expert


def is_dropped(name: str) -> bool:
    return name.startswith(DROP_PREFIXES) or name.endswith(DROP_SUFFIXES)


@dataclass
class PlanEntry:
    name: str
    src_file: str
    src_dtype: torch.dtype
    shape: list[int]  # the output shape
    kind: str  # copy (byte-exact), fp8, fp4, cast (to bf16)
    scale_file: str | None = None

    @property
    def dst_dtype(self) -> torch.dtype:
        return self.src_dtype if self.kind == "copy" else torch.bfloat16

    @property
    def dst_bytes(self) -> int:
        return tensor_nbytes(self.dst_dtype, self.shape)


@dataclass
class ConversionPlan:
    src: str
    config: dict
    block: tuple[int, int] | None
    entries: list[PlanEntry]
    dropped: int = 0
    tokenizer_files: list[str] = field(default_factory=list)


def _entry(name: str, file: str, dtype: torch.dtype, shape: list[int], tensors: dict,
           block: tuple[int, int] | None) -> PlanEntry:
    where = f"tensor {name!r} in {file}"
    if COPY_PATTERN.search(name):  # its dtype is checked against the config's (plan_conversion)
        return PlanEntry(name, file, dtype, shape, "copy")
    scale = name[: -len(".weight")] + RELEASE_SCALE_SUFFIX if name.endswith(".weight") else None
    if scale in tensors:
        sfile, sdtype, sshape = tensors[scale]
        if block is None:
            raise ValueError(f"{where} has a scale but config.json has no quantization_config")
        if dtype == FP8_DTYPE:
            kind, logical, want = "fp8", shape, list(scale_shape(shape, block))
        elif dtype in (FP4_PACKED_DTYPE, torch.uint8):
            kind, logical = "fp4", fp4_logical_shape(shape)
            want = fp4_scale_shape(logical)
        else:
            raise ValueError(f"{where} has a scale but dtype {dtype} (expected F8_E4M3 or I8)")
        if sshape != want:
            raise ValueError(f"scale {scale!r} in {sfile} has shape {sshape}, expected {want} "
                             f"for {name!r} {shape}")
        return PlanEntry(name, file, dtype, logical, kind, sfile)
    if dtype in (FP8_DTYPE, FP4_PACKED_DTYPE, torch.uint8, torch.float8_e8m0fnu):
        raise ValueError(f"{where} is quantized ({dtype}) but has no {scale!r} scale")
    if not dtype.is_floating_point:
        raise ValueError(f"{where} has dtype {dtype}: not a weight this converter knows")
    kind = "copy" if dtype == torch.float32 else "cast"  # fp32 sinks, mHC, biases stay fp32
    return PlanEntry(name, file, dtype, shape, kind)


def tokenizer_files(src: str) -> list[str]:
    """The tokenizer files to copy, each checked to be a readable regular file (a directory or
    a dangling symlink would otherwise fail only after every shard was written)."""
    names = sorted(f for f in os.listdir(src) if TOKENIZER_FILE_PATTERN.match(f))
    for name in names:
        path = os.path.join(src, name)
        if not os.path.isfile(path):
            what = ("a dangling symlink" if os.path.islink(path) and not os.path.exists(path)
                    else "a directory" if os.path.isdir(path) else "not a regular file")
            raise ValueError(f"tokenizer file {path} is {what}")
        if not os.access(path, os.R_OK):
            raise ValueError(f"tokenizer file {path} is not readable")
    return names


def check_tid2eid(src: str, e: PlanEntry, n_routed_experts: int) -> None:
    """Every expert id of a hash-routed layer's tid2eid within [0, n_routed_experts): an id
    outside would index past the experts when the layer runs (a few MiB: read whole)."""
    reader = RawShardReader(os.path.join(src, e.src_file))
    try:
        ids = reader.read(e.name)
    finally:
        reader.close()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n_routed_experts):
        raise ValueError(f"tensor {e.name!r} in {e.src_file} holds expert ids "
                         f"{int(ids.min())}..{int(ids.max())}, outside [0, {n_routed_experts})"
                         f" (n_routed_experts {n_routed_experts})")


def plan_conversion(src: str) -> ConversionPlan:
    """Read every header, classify every tensor (Engram tables and tid2eid must have their
    checkpoint dtypes, tid2eid its ids within the experts) and check the text tensors against
    the config's inventory (plan/shapes.py), and the tokenizer files, before a single byte is
    written. Only the small tid2eid tables are read beyond the headers."""
    from ..plan.shapes import text_tensor_specs

    release = read_json_object(os.path.join(src, "config.json"), "config")
    config = text_config_from_release(release)
    cfg = DSV4Config.from_dict(config)
    block, _ = quant_block(release)
    tok = tokenizer_files(src)
    tensors = read_tensor_locations(src)
    expected = text_tensor_specs(cfg)
    entries, dropped = [], 0
    for name, (file, dtype, shape) in tensors.items():
        if is_dropped(name):
            dropped += 1
            continue
        if name.endswith(RELEASE_SCALE_SUFFIX) and not COPY_PATTERN.search(name):
            weight = name[: -len(RELEASE_SCALE_SUFFIX)] + ".weight"
            if weight not in tensors:
                raise ValueError(f"scale {name!r} in {file} belongs to no weight")
            continue
        e = _entry(name, file, dtype, shape, tensors, block)
        if name not in expected:
            raise ValueError(f"tensor {name!r} in {file} is neither a text-model tensor of "
                             "this config nor a vision/aligner/image/bias_vl/mtp tensor")
        want_shape, want_dtype = expected[name]
        if want_shape != e.shape:
            raise ValueError(f"tensor {name!r} in {file} has shape {e.shape}, the config "
                             f"expects {want_shape}")
        # Copied byte for byte (SGLang 0.5.23 loads them as stored): a wrong dtype is refused
        # here, since nothing converts it and the published checkpoint would not load.
        if COPY_PATTERN.search(name) and dtype != want_dtype:
            raise ValueError(f"tensor {name!r} in {file} has dtype "
                             f"{DTYPE_NAMES.get(dtype, dtype)}, expected "
                             f"{DTYPE_NAMES[want_dtype]} (it is copied byte for byte, never "
                             "converted)")
        entries.append(e)
    missing = sorted(set(expected) - {e.name for e in entries})
    if missing:
        raise ValueError(f"the release checkpoint lacks text tensor {missing[0]!r} "
                         f"({len(missing)} missing)")
    for e in entries:
        if e.name.endswith(".gate.tid2eid"):
            check_tid2eid(src, e, cfg.n_routed_experts)
    order = {n: i for i, n in enumerate(expected)}
    entries.sort(key=lambda e: (e.src_file, order[e.name]))
    return ConversionPlan(src, config, block, entries, dropped, tok)
