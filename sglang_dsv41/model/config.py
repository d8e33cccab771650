"""DSV4.1-style text-model config: reads and writes HF ``config.json`` (model_type deepseek_v41)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ..jsonio import read_json_object

MODEL_TYPE = "deepseek_v41"
ARCHITECTURE = "DeepseekV41ForCausalLM"
CONFIG_FILE = "config.json"


@dataclass
class DSV41Config:
    vocab_size: int = 320
    hidden_size: int = 64
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 16
    # Layers not listed in global_attn_layers attend over a sliding window of this many keys
    # (the query itself included).
    sliding_window: int = 16
    global_attn_layers: list[int] = field(default_factory=lambda: [1, 3])
    use_attention_sinks: bool = True
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    # The output projection is grouped: heads are split into o_groups groups, each projected to
    # o_lora_rank before the shared up-projection, so attention TP can split at most o_groups ways.
    o_groups: int = 4
    o_lora_rank: int = 32
    intermediate_size: int = 128
    moe_intermediate_size: int = 64
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    scoring_func: str = "sigmoid"
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    engram_layers: list[int] = field(default_factory=lambda: [1])
    engram_num_rows: int = 4096
    engram_dim: int = 32
    engram_ngram_orders: list[int] = field(default_factory=lambda: [2, 3])
    engram_num_hash_heads: int = 2
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    lm_head_fp32: bool = True
    bos_token_id: int = 256
    eos_token_id: int = 257
    pad_token_id: int = 258
    torch_dtype: str = "bfloat16"
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"invalid DSV41Config: {msg}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "o_groups", "o_lora_rank"):
            need(getattr(self, name) > 0, f"{name} must be positive")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             "num_attention_heads must be a multiple of num_key_value_heads")
        need(self.num_attention_heads % self.o_groups == 0,
             "num_attention_heads must be a multiple of o_groups")
        need(self.sliding_window > 0, "sliding_window must be positive")
        for i in self.global_attn_layers + self.engram_layers:
            need(0 <= i < self.num_hidden_layers, f"layer id {i} out of range")
        need(self.scoring_func in ("sigmoid", "softmax"), "scoring_func is sigmoid or softmax")
        need(0 < self.num_experts_per_tok <= self.n_routed_experts,
             "num_experts_per_tok must be in [1, n_routed_experts]")
        need(0 <= self.first_k_dense_replace <= self.num_hidden_layers,
             "first_k_dense_replace out of range")
        need(all(n >= 1 for n in self.engram_ngram_orders), "n-gram orders must be >= 1")
        if self.engram_layers:
            need(self.engram_num_rows > 0 and self.engram_dim > 0 and self.engram_num_hash_heads > 0,
                 "engram rows, dim and hash heads must be positive")
        need(self.torch_dtype in ("bfloat16", "float16", "float32"), "torch_dtype unsupported")

    # ---- derived --------------------------------------------------------------------------
    def is_global_layer(self, layer_id: int) -> bool:
        return layer_id in self.global_attn_layers

    def window_for_layer(self, layer_id: int) -> int | None:
        return None if self.is_global_layer(layer_id) else self.sliding_window

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense_replace and self.n_routed_experts > 0

    def has_engram(self, layer_id: int) -> bool:
        return layer_id in self.engram_layers

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    @property
    def engram_lookups_per_token(self) -> int:
        return len(self.engram_ngram_orders) * self.engram_num_hash_heads

    @property
    def max_ngram_order(self) -> int:
        return max(self.engram_ngram_orders) if self.engram_ngram_orders else 1

    def num_parameters(self, include_engram: bool = False) -> int:
        """Parameter count computed from shapes (used by the planner without instantiating)."""
        h, d = self.hidden_size, self.head_dim
        hq, hkv = self.num_attention_heads, self.num_key_value_heads
        attn = h * hq * d + 2 * h * hkv * d + hq * d * self.o_lora_rank
        attn += self.o_groups * self.o_lora_rank * h + hq + 2 * h
        total = 0
        for i in range(self.num_hidden_layers):
            total += attn
            if self.is_moe_layer(i):
                m = self.moe_intermediate_size
                total += self.n_routed_experts * (3 * h * m + 0) + self.n_routed_experts * (h + 1)
                total += self.n_shared_experts * 3 * h * m
            else:
                total += 3 * h * self.intermediate_size
            if self.has_engram(i):
                total += h * self.engram_lookups_per_token * self.engram_dim + h + h
                if include_engram:
                    total += self.engram_num_rows * self.engram_dim
        total += self.vocab_size * h + h
        if not self.tie_word_embeddings:
            total += self.vocab_size * h
        return total

    # ---- HF config.json -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["model_type"] = MODEL_TYPE
        d["architectures"] = [ARCHITECTURE]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DSV41Config":
        mt = d.get("model_type", MODEL_TYPE)
        if mt != MODEL_TYPE:
            raise ValueError(f"config model_type is {mt!r}, expected {MODEL_TYPE!r}")
        if "text_config" in d or "quantization_config" in d:
            raise ValueError("this is a release (multimodal/quantized) config: run "
                             "`python -m sglang_dsv41.convert` first")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def save_pretrained(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, CONFIG_FILE), "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)

    @classmethod
    def from_pretrained(cls, path: str) -> "DSV41Config":
        file = path if path.endswith(".json") else os.path.join(path, CONFIG_FILE)
        return cls.from_dict(read_json_object(file, "model config"))


PRESETS: dict[str, DSV41Config] = {
    # A forward on a laptop CPU takes milliseconds.
    "tiny": DSV41Config(),
    # About 1B parameters (0.35B active): the GPU training benchmark's model.
    "small-1b": DSV41Config(
        vocab_size=32000, hidden_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=4, head_dim=64, sliding_window=128,
        global_attn_layers=list(range(1, 16, 2)), o_groups=8, o_lora_rank=512,
        intermediate_size=4096, moe_intermediate_size=1024, n_routed_experts=16,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        engram_layers=[1], engram_num_rows=65536, engram_dim=64, max_position_embeddings=16384,
        bos_token_id=256, eos_token_id=257, pad_token_id=258,
    ),
    # Published V4.1-Flash shapes, for the planner only: never instantiated.
    "v41-flash": DSV41Config(
        vocab_size=129280, hidden_size=4096, num_hidden_layers=40, num_attention_heads=64,
        num_key_value_heads=1, head_dim=512, sliding_window=128,
        global_attn_layers=list(range(40)), rope_theta=10000.0,
        rope_scaling={"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                      "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=1048576, o_groups=8, o_lora_rank=1024, intermediate_size=18432,
        moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=6,
        n_shared_experts=1, first_k_dense_replace=0, scoring_func="sigmoid",
        routed_scaling_factor=1.5, engram_layers=[2, 20], engram_num_rows=384_000_000,
        engram_dim=256, engram_ngram_orders=[2, 3], engram_num_hash_heads=4,
        bos_token_id=0, eos_token_id=1, pad_token_id=2,
    ),
}


def get_preset(name: str) -> DSV41Config:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return replace(PRESETS[name])


def load_config(path_or_preset: str) -> DSV41Config:
    """A preset name, a checkpoint directory or a config.json path."""
    if path_or_preset in PRESETS:
        return get_preset(path_or_preset)
    if not os.path.exists(path_or_preset):
        raise ValueError(f"{path_or_preset!r} is neither a preset ({sorted(PRESETS)}) nor a path")
    return DSV41Config.from_pretrained(path_or_preset)
