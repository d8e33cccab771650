"""The release checkpoint layout (multimodal, FP8) and how it maps onto the text-only model.

Release layout (what `tools/make_checkpoint --layout release` writes and `convert` reads):
- config.json: ``architectures`` ["DeepseekV41ForConditionalGeneration"], ``model_type``
  "deepseek_v41_vl", ``text_config`` (a DSV41Config dict), ``vision_config``,
  ``quantization_config`` {quant_method fp8, fmt e4m3, weight_block_size [128, 128], scale_fmt},
  draft-model keys (``num_nextn_predict_layers``, ``dspark_config``, ``draft_*``, ``mtp_*``).
- Text tensors are prefixed ``language_model.`` (``language_model.model.layers.0...``,
  ``language_model.lm_head.weight``); the prefix is optional on input and always stripped.
- FP8 weights ``<w>.weight`` (float8_e4m3fn) come with ``<w>.weight_scale_inv``.
- Vision tensors (``vision_tower.*``, ``multi_modal_projector.*``, ...) and draft tensors
  (``mtp.<k>.*``, ``dspark.*``, or DeepSeek-V3-style ``model.layers.<i>`` with
  i >= num_hidden_layers) are dropped by the converter.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..jsonio import read_json_object
from ..model.config import ARCHITECTURE, MODEL_TYPE, DSV41Config
from .fp8 import CHUNK_BYTES, FP8_DTYPE, SCALE_SUFFIX, iter_dequantized_rows, scale_shape
from .shards import RawShardReader, checkpoint_files, shard_headers, tensor_nbytes

RELEASE_ARCHITECTURE = "DeepseekV41ForConditionalGeneration"
RELEASE_MODEL_TYPE = "deepseek_v41_vl"
TEXT_PREFIX = "language_model."
VISION_PREFIXES = ("vision_tower.", "vision_model.", "visual.", "multi_modal_projector.",
                   "mm_projector.", "image_newline", "view_seperator", "view_separator")
DRAFT_PREFIXES = ("mtp.", "dspark.", "draft_model.", "model.mtp.")
VISION_KEYS = ("vision_config", "image_token_index", "image_token_id", "video_token_id",
               "projector_config", "processor_class")
VISION_KEY_PREFIXES = ("vision_", "image_", "video_", "mm_")
DRAFT_KEYS = ("num_nextn_predict_layers", "dspark_config", "mtp_config", "draft_config",
              "speculative_config")
DRAFT_KEY_PREFIXES = ("draft_", "dspark_", "mtp_", "nextn_")
QUANT_KEYS = ("quantization_config", "compression_config")
TOKENIZER_FILE_PATTERN = re.compile(
    r"^(tokenizer.*|special_tokens_map\.json|vocab\..*|merges\.txt|.*\.tiktoken|"
    r"chat_template.*|generation_config\.json)$")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def is_vision_key(key: str) -> bool:
    return key in VISION_KEYS or key.startswith(VISION_KEY_PREFIXES)


def is_draft_key(key: str) -> bool:
    return key in DRAFT_KEYS or key.startswith(DRAFT_KEY_PREFIXES)


def text_config_from_release(release: dict) -> dict:
    """Lift text_config to the top level, drop vision, draft and quantization keys, name the
    text-only class. A config without text_config is treated as the text config itself."""
    text = release.get("text_config", {})
    if not isinstance(text, dict):
        raise ValueError("release config: text_config is not an object")

    def keep(k: str) -> bool:
        return not (is_vision_key(k) or is_draft_key(k) or k in QUANT_KEYS or k == "text_config")

    out = {k: v for k, v in release.items() if keep(k)}
    out.update({k: v for k, v in text.items() if keep(k)})
    out.update(architectures=[ARCHITECTURE], model_type=MODEL_TYPE, torch_dtype="bfloat16")
    try:
        DSV41Config.from_dict(out)
    except (ValueError, TypeError) as e:
        raise ValueError(f"release text_config is not a valid DSV41 config: {e}") from e
    return out


def quant_block(release: dict) -> tuple[int, int] | None:
    q = release.get("quantization_config")
    if q is None:
        return None
    if q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"unsupported quantization_config {q}: only fp8 e4m3 block scales")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size must be [rows, cols], got {block}")
    return (block[0], block[1])


def classify(name: str, num_layers: int) -> tuple[str, str]:
    """-> (kind, text name) with kind in text / vision / draft (scales: their weight's kind)."""
    base = name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else name
    if base.startswith(VISION_PREFIXES):
        return "vision", base
    text = base[len(TEXT_PREFIX):] if base.startswith(TEXT_PREFIX) else base
    if text.startswith(DRAFT_PREFIXES):
        return "draft", text
    m = _LAYER_RE.match(text)
    if m and int(m.group(1)) >= num_layers:
        return "draft", text
    return "text", text


@dataclass
class PlanEntry:
    dst_name: str
    src_file: str
    src_name: str
    shape: list[int]
    src_dtype: torch.dtype
    scale_file: str | None = None
    scale_name: str | None = None

    @property
    def dst_bytes(self) -> int:
        return tensor_nbytes(torch.bfloat16, self.shape)


@dataclass
class ConversionPlan:
    src: str
    config: dict
    block: tuple[int, int] | None
    entries: list[PlanEntry]
    dropped: dict[str, int] = field(default_factory=dict)
    tokenizer_files: list[str] = field(default_factory=list)


def plan_conversion(src: str) -> ConversionPlan:
    """Read every header, classify every tensor and check the result against the model's
    names and shapes before a single byte is written."""
    release = read_json_object(os.path.join(src, "config.json"), "config")
    config = text_config_from_release(release)
    cfg = DSV41Config.from_dict(config)
    block = quant_block(release)
    tensors: dict[str, tuple[str, torch.dtype, list[int]]] = {}
    for file, index_names in checkpoint_files(src).items():
        headers = shard_headers(os.path.join(src, file))
        for n in index_names or []:
            if n not in headers:
                raise ValueError(f"checkpoint shard {os.path.join(src, file)} lacks tensor "
                                 f"{n!r} that the index assigns to it")
        tensors.update({n: (file, dt, shape) for n, (dt, shape) in headers.items()})
    entries, dropped, by_dst = [], {"vision": 0, "draft": 0}, {}
    for name, (file, dtype, shape) in tensors.items():
        kind, text_name = classify(name, cfg.num_hidden_layers)
        if kind != "text":
            dropped[kind] += 1
            continue
        if name.endswith(SCALE_SUFFIX):
            weight = name[: -len(SCALE_SUFFIX)]
            if weight not in tensors or tensors[weight][1] != FP8_DTYPE:
                raise ValueError(f"scale {name!r} in {file} belongs to no FP8 weight")
            continue
        if text_name in by_dst:
            raise ValueError(f"tensors {by_dst[text_name]!r} and {name!r} both map to "
                             f"{text_name!r}")
        by_dst[text_name] = name
        entry = PlanEntry(text_name, file, name, shape, dtype)
        if dtype == FP8_DTYPE:
            sname = name + SCALE_SUFFIX
            if sname not in tensors:
                raise ValueError(f"FP8 weight {name!r} in {file} has no scale tensor {sname!r}")
            if block is None:
                raise ValueError(f"FP8 weight {name!r} but config.json has no "
                                 "quantization_config.weight_block_size")
            if len(shape) != 2:
                raise ValueError(f"FP8 weight {name!r} is not 2-D (shape {shape})")
            if tensors[sname][2] != list(scale_shape(shape, block)):
                raise ValueError(f"scale {sname!r} has shape {tensors[sname][2]}, expected "
                                 f"{list(scale_shape(shape, block))} for {name!r} {shape}")
            entry.scale_file, entry.scale_name = tensors[sname][0], sname
        elif not dtype.is_floating_point:
            raise ValueError(f"tensor {name!r} in {file} has dtype {dtype}: only FP8 block "
                             "weights and float tensors are supported")
        entries.append(entry)
    _check_against_model(cfg, entries)
    tok = sorted(f for f in os.listdir(src) if TOKENIZER_FILE_PATTERN.match(f))
    return ConversionPlan(src, config, block, entries, dropped, tok)


def _check_against_model(cfg: DSV41Config, entries: list[PlanEntry]) -> None:
    from .checkpoint import expected_tensor_shapes

    expected = expected_tensor_shapes(cfg)
    got = {e.dst_name: e for e in entries}
    for name, e in got.items():
        if name not in expected:
            raise ValueError(f"tensor {e.src_name!r} in {e.src_file} is neither a text-model, "
                             "vision nor draft tensor")
        if expected[name] != e.shape:
            raise ValueError(f"tensor {e.src_name!r} in {e.src_file} has shape {e.shape}, the "
                             f"model expects {expected[name]}")
    missing = sorted(set(expected) - set(got))
    if missing:
        raise ValueError(f"the release checkpoint lacks text tensor {missing[0]!r} "
                         f"({len(missing)} missing)")


class SourceReader:
    """Reads plan entries chunk by chunk with plain file reads, one source shard open at a
    time, so resident memory is one chunk plus its temporaries, not a whole shard."""

    def __init__(self, plan: ConversionPlan):
        self.plan = plan
        self._reader: RawShardReader | None = None

    def _open(self, file: str) -> RawShardReader:
        path = os.path.join(self.plan.src, file)
        if self._reader is None or self._reader.path != path:
            self.close()
            self._reader = RawShardReader(path)
        return self._reader

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def _scale(self, e: PlanEntry) -> torch.Tensor:
        path = os.path.join(self.plan.src, e.scale_file)
        if self._reader is not None and self._reader.path == path:
            return self._reader.read(e.scale_name)
        other = RawShardReader(path)
        try:
            return other.read(e.scale_name)
        finally:
            other.close()

    def chunks(self, e: PlanEntry, dtype: torch.dtype = torch.bfloat16
               ) -> Iterator[torch.Tensor]:
        """The entry's (dequantized) rows in ``dtype``, in order, a few MiB at a time."""
        f = self._open(e.src_file)
        if f.tensors.get(e.src_name, (None, None))[1] != e.shape:
            raise ValueError(f"checkpoint shard {f.path} changed since it was planned: "
                             f"tensor {e.src_name!r}")
        if e.scale_name is not None:
            yield from iter_dequantized_rows(lambda a, b: f.read_rows(e.src_name, a, b),
                                             e.shape, self._scale(e), self.plan.block, dtype)
        elif len(e.shape) == 0:
            yield f.read(e.src_name).to(dtype)
        else:
            step = max(1, CHUNK_BYTES // max(1, tensor_nbytes(torch.float32, e.shape[1:])))
            for a in range(0, e.shape[0], step):
                yield f.read_rows(e.src_name, a, min(a + step, e.shape[0])).to(dtype)

    def tensor(self, e: PlanEntry, dtype: torch.dtype) -> torch.Tensor:
        parts = list(self.chunks(e, dtype))
        return torch.cat(parts, 0) if len(parts) > 1 else parts[0].reshape(e.shape)
