"""Named configurations.

tiny      every V4.1 layer kind on a CPU: sliding, CSA (4, an indexer that really selects), HCA
          (128: two blocks at 256 tokens), ratio-1/2 layers sharing kv/index sources, hash-routed
          MoE, Engram on two layers, mHC; the vocabulary of our byte tokenizer.
tiny-v4   the same sizes restricted to V4 (what transformers' DeepseekV4 defines): the parity
          preset against transformers.
small     about 1.5B parameters for one H200 (trainer benchmarks).
v41-flash the real V4.1-Flash shapes, for the planner only (never instantiated).
"""

from __future__ import annotations

from dataclasses import replace

from .config import V4, V41, DSV4Config

_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
         "beta_fast": 32, "beta_slow": 1}

_TINY_COMMON = dict(
    vocab_size=320, hidden_size=64, num_attention_heads=4, head_dim=32, qk_rope_head_dim=8,
    q_lora_rank=32, o_groups=2, o_lora_rank=16, window_size=16, rope_scaling=_YARN,
    max_position_embeddings=4096, index_n_heads=2, index_head_dim=16, index_topk=4,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
    num_hash_layers=2, hc_mult=4, bos_token_id=256, eos_token_id=257, torch_dtype="float32",
)

PRESETS: dict[str, DSV4Config] = {
    "tiny": DSV4Config(
        model_type=V41, num_hidden_layers=8,
        compress_ratios=[0, 4, 128, 1, 2, 1, 2, 0],
        kv_source_layer_ids=[3, 4], index_source_layer_ids=[3, 4],
        q_head_norm=False, hc_pre_from_prev_sublayer=True,
        engram_layer_ids=[1, 5], engram_max_ngram_size=3, engram_n_heads=2, engram_head_dim=32,
        engram_vocab_size=1000, engram_pad_token_id=258,
        **_TINY_COMMON),
    "tiny-v4": DSV4Config(
        model_type=V4, num_hidden_layers=4, compress_ratios=[0, 4, 128, 4],
        q_head_norm=True, hc_pre_from_prev_sublayer=False, **_TINY_COMMON),
    "small": DSV4Config(
        model_type=V41, vocab_size=32000, hidden_size=1024, num_hidden_layers=12,
        num_attention_heads=16, head_dim=512, qk_rope_head_dim=64, q_lora_rank=512,
        o_groups=4, o_lora_rank=512, window_size=128,
        compress_ratios=[0, 4, 128, 1, 2, 4, 128, 1, 2, 4, 128, 0],
        kv_source_layer_ids=[3, 4], index_source_layer_ids=[3, 4],
        rope_scaling={**_YARN, "factor": 16.0, "original_max_position_embeddings": 65536},
        max_position_embeddings=1 << 20, index_n_heads=16, index_head_dim=128, index_topk=512,
        n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=512,
        num_hash_layers=2, engram_layer_ids=[1, 7], engram_max_ngram_size=3, engram_n_heads=4,
        engram_head_dim=128, engram_vocab_size=200_000, engram_pad_token_id=2),
    # Real V4.1-Flash shapes for the planner. Sources: transformers DeepseekV4Config defaults
    # (heads, head_dim, ranks, o_groups, window, indexer, experts, hc), the release's
    # hc_attn_fn (24, 20480) -> hidden 5120 with hc_mult 4, and R3 = 40 layers x top-6 x 4 B.
    "v41-flash": DSV4Config(
        model_type=V41, vocab_size=129280, hidden_size=5120, num_hidden_layers=40,
        num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024,
        o_groups=8, o_lora_rank=1024, window_size=128, index_n_heads=64, index_head_dim=128,
        index_topk=512, n_routed_experts=256, num_experts_per_tok=6, moe_intermediate_size=2048,
        num_hash_layers=3, hc_mult=4),
}


def get_preset(name: str) -> DSV4Config:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name])


def load_config(path_or_preset: str) -> DSV4Config:
    """A preset name or a checkpoint directory holding config.json."""
    if path_or_preset in PRESETS:
        return get_preset(path_or_preset)
    return DSV4Config.from_pretrained(path_or_preset)
