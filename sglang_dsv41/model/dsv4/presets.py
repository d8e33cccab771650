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
    max_position_embeddings=4096, index_n_heads=2, index_head_dim=32, index_topk=4,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
    num_hash_layers=2, hc_mult=4, bos_token_id=256, eos_token_id=257, torch_dtype="float32",
)

PRESETS: dict[str, DSV4Config] = {
    "tiny": DSV4Config(
        model_type=V41, num_hidden_layers=8,
        compress_ratios=[0, 4, 128, 1, 2, 1, 2, 0],
        # Layer 5 (ratio 1) reuses layer 3's latents and keys and picks only inside layer 3's
        # candidate blocks; layer 6 (ratio 2) reuses layer 4 entirely.
        kv_source_layer_ids=[3, 4], index_source_layer_ids=[3, 4, 5],
        candidate_source_layer_id=3, candidate_topk_blocks=2, candidate_block_size=4,
        q_head_norm=False, hc_pre_from_prev_sublayer=True,
        engram_layer_ids=[1, 5], engram_max_ngram_size=3, engram_n_heads=2, engram_head_dim=32,
        engram_vocab_size=1000, engram_pad_token_id=258,
        # Derived (tests/test_dsv4_engram_hash.py checks both against SGLang's own code): sums of
        # each layer's primes, and the byte tokenizer's vocabulary after SGLang's normalizer.
        engram_num_embeddings=[4062, 4152], engram_compressed_vocab_size=291,
        **_TINY_COMMON),
    "tiny-v4": DSV4Config(
        model_type=V4, num_hidden_layers=4, compress_ratios=[0, 4, 128, 4],
        q_head_norm=True, hc_pre_from_prev_sublayer=False,
        # 16 indexer heads: exact-zero score ties (all relus at 0) become improbable, so the
        # indexer's top-k does not depend on how ties are broken (transformers' torch.topk).
        **{**_TINY_COMMON, "index_n_heads": 16}),
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
        engram_head_dim=128, engram_vocab_size=200_000, engram_pad_token_id=258,
        engram_num_embeddings=[1600218, 1601178], engram_compressed_vocab_size=31971),
    # Real V4.1-Flash shapes for the planner (never instantiated). Source [C]: the release's
    # config.json text_config (HF deepseek-ai/DeepSeek-V4.1-Flash @dba1be0), as quoted with its
    # safetensors headers in a public research note (searchable as "DeepSeek-V4.1-Flash -
    # architecture and inference profile"); cross-checks noted per line. [S]: SGLang 0.5.23.
    "v41-flash": DSV4Config(
        model_type=V41,
        vocab_size=129280,  # [C]; head.weight (129280, 5120) BF16
        hidden_size=5120,  # [C]; hc_attn_fn (24, 20480) = (2+4)*4 x 4*5120
        num_hidden_layers=40,  # [C]; R3 = 40 x 6 x 4 = 960 B/token (seed notes)
        num_attention_heads=64, head_dim=512, qk_rope_head_dim=64,  # [C]; wq_b (32768, 1280)
        q_lora_rank=1280,  # [C]; wq_b.weight F8_E4M3 (32768, 1280)
        o_groups=8, o_lora_rank=1024,  # [C]; wo_a 8192 x 4096
        window_size=128,  # [C] sliding_window
        # [C] compress_ratios (43 entries; the last 3 are the DSpark drafts, not text layers)
        compress_ratios=[0, 0] + [2] * 18 + [1] * 20,
        kv_source_layer_ids=[2, 8, 14, 20],  # [C]; exactly four attn.compressor.* sets
        index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36],  # [C]
        candidate_source_layer_id=20, candidate_topk_blocks=2048, candidate_block_size=8,  # [C]
        rope_theta=10000.0, compress_rope_theta=160000.0,  # [C]
        rope_scaling={"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                      "beta_fast": 32, "beta_slow": 1},  # [C]
        max_position_embeddings=1048576,  # [C] = 65536 x 16
        index_n_heads=32, index_head_dim=128, index_topk=512,  # [C]
        n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=6,  # [C]; top-6 as R3
        moe_intermediate_size=2304,  # [C]; experts.N.w1 I8 (2304, 2560) = MXFP4 (2304, 5120)
        scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=10.0,  # [C]
        num_hash_layers=3,  # not in [C]: [S] configs/deepseek_v4.py default n_hash_layers = 3
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,  # [C]
        rms_norm_eps=1e-20,  # [C]
        q_head_norm=False, hc_pre_from_prev_sublayer=True,  # [S] DeepseekV41Config defaults
        engram_layer_ids=[1, 14],  # [C]
        # [C] table rows; each equals the sum of its layer's primes (SGLang's EngramLayout,
        # checked by tests/test_plan_formulas.py)
        engram_num_embeddings=[384006168, 384016682],
        engram_max_ngram_size=4, engram_n_heads=8, engram_head_dim=256,  # [C]
        engram_vocab_size=16_000_000, engram_compressed_vocab_size=99092,  # [C]
        engram_pad_token_id=2),  # [C] pad id 2
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
