"""DeepSeek V4 / V4.1 text-model config in SGLang 0.5.23's flat schema.

Field names are those of the text part of a real ``config.json`` after SGLang's
``normalize_deepseek_v41_config`` (``compress_ratios`` per layer, ``window_size``,
``num_hash_layers``, ``kv_source_layer_ids``, ``engram_*``), so a converted checkpoint's config
loads here, in SGLang's ``DeepseekV41Config`` and (V4 parts) in transformers' ``DeepseekV4Config``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ...jsonio import read_json_object

CONFIG_FILE = "config.json"
V4, V41 = "deepseek_v4", "deepseek_v41"
COMPRESS_RATIOS = (0, 1, 2, 4, 128)  # SGLang's MqaAttentionBase accepts exactly these


@dataclass
class DSV4Config:
    model_type: str = V41
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    compress_ratios: list[int] = field(default_factory=list)
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    # YaRN on layers with a compressor: {"type": "yarn", "factor", "original_max_position_embeddings",
    # "beta_fast", "beta_slow"}; no mscale (the reference does not scale cos/sin).
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 1048576
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    num_hash_layers: int = 3
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    # V4.1: no per-head q norm, the next sublayer's mHC "pre" computed from the previous one,
    # ratio-1/2 compressors and indexers only on these layers (later layers reuse them).
    q_head_norm: bool = False
    hc_pre_from_prev_sublayer: bool = True
    kv_source_layer_ids: list[int] = field(default_factory=list)
    index_source_layer_ids: list[int] = field(default_factory=list)
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    engram_layer_ids: list[int] = field(default_factory=list)
    engram_num_embeddings: list[int] = field(default_factory=list)
    engram_max_ngram_size: int = 1
    engram_vocab_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 0
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    bos_token_id: int = 0
    eos_token_id: int = 1
    initializer_range: float = 0.02
    torch_dtype: str = "bfloat16"
    architectures: list[str] = field(default_factory=lambda: ["DeepseekV4ForCausalLM"])

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"invalid DSV4Config: {msg}")

        need(self.model_type in (V4, V41), f"model_type must be {V4!r} or {V41!r}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "window_size",
                     "n_routed_experts", "moe_intermediate_size", "hc_mult"):
            need(getattr(self, name) > 0, f"{name} must be positive")
        need(self.num_key_value_heads == 1, "V4 attention has one K=V latent head")
        need(0 < self.qk_rope_head_dim <= self.head_dim and self.qk_rope_head_dim % 2 == 0,
             "qk_rope_head_dim must be even and <= head_dim")
        need(self.num_attention_heads % self.o_groups == 0,
             "num_attention_heads must be a multiple of o_groups")
        if not self.compress_ratios:
            self.compress_ratios = [0] * self.num_hidden_layers
        need(len(self.compress_ratios) >= self.num_hidden_layers,
             f"compress_ratios has {len(self.compress_ratios)} entries for "
             f"{self.num_hidden_layers} layers")
        self.compress_ratios = [int(r) for r in self.compress_ratios[:self.num_hidden_layers]]
        bad = [r for r in self.compress_ratios if r not in COMPRESS_RATIOS]
        need(not bad, f"compress ratios {bad} not in {COMPRESS_RATIOS}")
        if self.model_type == V4:
            need(not {1, 2} & set(self.compress_ratios), "ratios 1/2 are V4.1 only")
        for ids in (self.kv_source_layer_ids, self.index_source_layer_ids):
            for i in ids:
                need(0 <= i < self.num_hidden_layers and self.compress_ratios[i] in (1, 2),
                     f"source layer {i} must be a ratio-1/2 layer")
        for i, r in enumerate(self.compress_ratios):
            if r in (1, 2):
                need(self.kv_source_for(i) is not None,
                     f"layer {i} (ratio {r}) has no kv source layer at or before it")
        need(self.scoring_func in ("sqrtsoftplus", "sigmoid", "softmax"),
             f"scoring_func {self.scoring_func!r} unknown")
        need(0 < self.num_experts_per_tok <= self.n_routed_experts,
             "num_experts_per_tok must be in [1, n_routed_experts]")
        need(self.n_routed_experts < 1 << 15,
             "n_routed_experts must be below 32768 (the MoE sorts expert ids as int16)")
        need(0 <= self.num_hash_layers <= self.num_hidden_layers, "num_hash_layers out of range")
        need(len(self.engram_num_embeddings) in (0, len(self.engram_layer_ids)),
             "engram_num_embeddings needs one entry per engram layer")
        for i in self.engram_layer_ids:
            need(0 <= i < self.num_hidden_layers, f"engram layer {i} out of range")

    # ---- layer kinds --------------------------------------------------------------------------
    def compress_ratio(self, layer_id: int) -> int:
        return self.compress_ratios[layer_id]

    def kv_source_for(self, layer_id: int) -> int | None:
        """The ratio-1/2 layer whose compressor this layer reads (the nearest source at or before
        it with the same ratio)."""
        return _nearest_source(self.kv_source_layer_ids, self.compress_ratios, layer_id)

    def index_source_for(self, layer_id: int) -> int | None:
        return _nearest_source(self.index_source_layer_ids, self.compress_ratios, layer_id)

    def is_hash_layer(self, layer_id: int) -> bool:
        return layer_id < self.num_hash_layers

    @property
    def is_v41(self) -> bool:
        return self.model_type == V41

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    # ---- (de)serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DSV4Config":
        """A flat dict (config.json after SGLang's normalisation); unknown keys are ignored."""
        d = dict(d)
        if "n_hash_layers" in d and "num_hash_layers" not in d:
            d["num_hash_layers"] = d.pop("n_hash_layers")
        if "sliding_window" in d and "window_size" not in d:
            d["window_size"] = d["sliding_window"]
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def save_pretrained(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, CONFIG_FILE), "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    @classmethod
    def from_pretrained(cls, path: str) -> "DSV4Config":
        return cls.from_dict(read_json_object(os.path.join(path, CONFIG_FILE), "model config"))


def _nearest_source(sources: list[int], ratios: list[int], layer_id: int) -> int | None:
    ratio = ratios[layer_id]
    found = [s for s in sources if s <= layer_id and ratios[s] == ratio]
    return max(found) if found else None
