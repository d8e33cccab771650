"""The text model's tensors (SGLang 0.5.23 DeepSeek-flat names, shapes, bf16-checkpoint dtypes)
computed from a DSV4Config, without building the model.

The planner counts parameters and Engram bytes from it (v41-flash is never instantiated: 550B
parameters). The model (sglang_dsv41.model.dsv4.model) is the reference; tests/test_plan_shapes.py
checks that this inventory equals its state_dict for every preset the model can build. Sources, all
SGLang 0.5.23: attention `models/deepseek_v4.py` MQALayer.__init__ (~1090-1160, 1470-1500),
V4 compressor `layers/attention/dsv4/compressor.py` (ape [ratio, coff*d] fp32, coff = 2 at
ratio 4), V4 indexer `layers/attention/dsv4/indexer.py` C4Indexer, V4.1 compressor/indexer
`layers/attention/dsv4/dsv41_sparse.py` (only on kv/index source layers; wk/k_norm only on kv
sources), mHC `make_hc_mixing_params` / `make_hc_head_params` (hc_head only when
hc_pre_from_prev_sublayer is off), MoE gate `models/deepseek_v2.py` ~510 (no correction bias
on hash layers), `layers/moe/hash_topk.py` (tid2eid int32 [vocab, top_k]), Engram
`layers/engram.py` (embed fp8 [rows, d] + e8m0 [rows, d/32], wkv, q_weight/k_weight).
"""

from __future__ import annotations

import torch

from ..model.dsv4.config import DSV4Config
from ..model.dsv4.names import is_engram_table

ENGRAM_SCALE_BLOCK = 32  # sglang kernels/ops/quantization/fp4_fake_quant.py FP8_BLOCK_SIZE
BF16, F32 = torch.bfloat16, torch.float32
TensorSpecs = dict[str, tuple[list[int], torch.dtype]]


def _v4_compressor(out: TensorSpecs, pre: str, hidden: int, dim: int, ratio: int) -> None:
    coff = 2 if ratio == 4 else 1  # overlapping windows at ratio 4
    out[f"{pre}.ape"] = ([ratio, coff * dim], F32)
    out[f"{pre}.wkv.weight"] = ([coff * dim, hidden], BF16)
    out[f"{pre}.wgate.weight"] = ([coff * dim, hidden], BF16)
    out[f"{pre}.norm.weight"] = ([dim], BF16)


def _attention(out: TensorSpecs, cfg: DSV4Config, i: int) -> None:
    h, d, heads, g = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.o_groups
    pre = f"layers.{i}.attn"
    out[f"{pre}.wq_a.weight"] = ([cfg.q_lora_rank, h], BF16)
    out[f"{pre}.q_norm.weight"] = ([cfg.q_lora_rank], BF16)
    out[f"{pre}.wq_b.weight"] = ([heads * d, cfg.q_lora_rank], BF16)
    out[f"{pre}.wkv.weight"] = ([d, h], BF16)
    out[f"{pre}.kv_norm.weight"] = ([d], BF16)
    out[f"{pre}.wo_a.weight"] = ([g * cfg.o_lora_rank, heads * d // g], BF16)
    out[f"{pre}.wo_b.weight"] = ([h, g * cfg.o_lora_rank], BF16)
    out[f"{pre}.attn_sink"] = ([heads], F32)
    ratio, ih, idim = cfg.compress_ratio(i), cfg.index_n_heads, cfg.index_head_dim
    if ratio in (4, 128):
        _v4_compressor(out, f"{pre}.compressor", h, d, ratio)
    if ratio == 4:
        out[f"{pre}.indexer.wq_b.weight"] = ([ih * idim, cfg.q_lora_rank], BF16)
        out[f"{pre}.indexer.weights_proj.weight"] = ([ih, h], BF16)
        _v4_compressor(out, f"{pre}.indexer.compressor", h, idim, ratio)
    if ratio in (1, 2) and i in cfg.kv_source_layer_ids:
        out[f"{pre}.compressor.wkv.weight"] = ([d, h], BF16)
        if ratio == 2:
            out[f"{pre}.compressor.wgate.weight"] = ([d, h], BF16)
        out[f"{pre}.compressor.norm.weight"] = ([d], BF16)
    if ratio in (1, 2) and i in cfg.index_source_layer_ids:
        out[f"{pre}.indexer.wq_b.weight"] = ([ih * idim, cfg.q_lora_rank], BF16)
        out[f"{pre}.indexer.weights_proj.weight"] = ([ih, h], BF16)
        if i in cfg.kv_source_layer_ids:
            out[f"{pre}.indexer.wk.weight"] = ([idim, d], BF16)
            out[f"{pre}.indexer.k_norm.weight"] = ([idim], BF16)


def _ffn(out: TensorSpecs, cfg: DSV4Config, i: int) -> None:
    h, e, inter = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    pre = f"layers.{i}.ffn"
    out[f"{pre}.gate.weight"] = ([e, h], BF16)
    if cfg.is_hash_layer(i):
        out[f"{pre}.gate.tid2eid"] = ([cfg.vocab_size, cfg.num_experts_per_tok], torch.int32)
    else:
        out[f"{pre}.gate.bias"] = ([e], F32)
    for k in range(e):
        out[f"{pre}.experts.{k}.w1.weight"] = ([inter, h], BF16)
        out[f"{pre}.experts.{k}.w2.weight"] = ([h, inter], BF16)
        out[f"{pre}.experts.{k}.w3.weight"] = ([inter, h], BF16)
    if cfg.n_shared_experts:
        shared = inter * cfg.n_shared_experts
        out[f"{pre}.shared_experts.w1.weight"] = ([shared, h], BF16)
        out[f"{pre}.shared_experts.w2.weight"] = ([h, shared], BF16)
        out[f"{pre}.shared_experts.w3.weight"] = ([shared, h], BF16)


def engram_columns(cfg: DSV4Config) -> int:
    return (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads


def _engram(out: TensorSpecs, cfg: DSV4Config, i: int) -> None:
    rows = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(i)]
    d, h, hc = cfg.engram_head_dim, cfg.hidden_size, cfg.hc_mult
    pre = f"layers.{i}.engram"
    out[f"{pre}.embed.weight"] = ([rows, d], torch.float8_e4m3fn)
    out[f"{pre}.embed.scale"] = ([rows, d // ENGRAM_SCALE_BLOCK], torch.float8_e8m0fnu)
    out[f"{pre}.wkv.weight"] = ([h * (hc + 1), engram_columns(cfg) * d], BF16)
    out[f"{pre}.q_weight"] = ([hc, h], BF16)
    out[f"{pre}.k_weight"] = ([hc, h], BF16)


def text_tensor_specs(cfg: DSV4Config) -> TensorSpecs:
    """name -> (shape, dtype) of every text-model tensor, in checkpoint order."""
    if cfg.engram_layer_ids and len(cfg.engram_num_embeddings) != len(cfg.engram_layer_ids):
        raise ValueError("engram_num_embeddings must give one table size per engram layer")
    if cfg.engram_layer_ids and cfg.engram_head_dim % ENGRAM_SCALE_BLOCK:
        raise ValueError(f"engram_head_dim {cfg.engram_head_dim} is not a multiple of the "
                         f"{ENGRAM_SCALE_BLOCK}-value scale block")
    h, hc = cfg.hidden_size, cfg.hc_mult
    mix = (2 + hc) * hc
    out: TensorSpecs = {"embed.weight": ([cfg.vocab_size, h], BF16)}
    for i in range(cfg.num_hidden_layers):
        _attention(out, cfg, i)
        out[f"layers.{i}.attn_norm.weight"] = ([h], BF16)
        out[f"layers.{i}.ffn_norm.weight"] = ([h], BF16)
        for sub in ("attn", "ffn"):
            out[f"layers.{i}.hc_{sub}_fn"] = ([mix, hc * h], F32)
            out[f"layers.{i}.hc_{sub}_base"] = ([mix], F32)
            out[f"layers.{i}.hc_{sub}_scale"] = ([3], F32)
        _ffn(out, cfg, i)
        if i in cfg.engram_layer_ids:
            _engram(out, cfg, i)
    out["norm.weight"] = ([h], BF16)
    if not cfg.hc_pre_from_prev_sublayer:
        out["hc_head_fn"] = ([hc, hc * h], F32)
        out["hc_head_base"] = ([hc], F32)
        out["hc_head_scale"] = ([1], F32)
    out["head.weight"] = ([cfg.vocab_size, h], BF16)
    return out


def checkpoint_dtype(name: str, held: torch.dtype) -> torch.dtype:
    """The dtype a checkpoint stores a model tensor in, from the dtype the model holds it in when
    built with bf16 as the default dtype: as held (fp8 tables, e8m0 scales, int32 tid2eid, the
    fp32 sinks, ape, mHC and router bias), except RMSNorm weights, which the model keeps in fp32
    only to compute (DeepSeek's inference model.py: "rmsnorm in the checkpoint is stored in
    bf16, while the parameter here is stored in fp32")."""
    if held == F32 and name.endswith("norm.weight"):
        return BF16
    return held


def count_parameters(cfg: DSV4Config, include_engram_tables: bool = False) -> int:
    """Elements of every text tensor (tid2eid and Engram scales excluded: not parameters)."""
    n = 0
    for name, (shape, dtype) in text_tensor_specs(cfg).items():
        if name.endswith(".tid2eid") or name.endswith(".embed.scale"):
            continue
        if is_engram_table(name) and not include_engram_tables:
            continue
        k = 1
        for s in shape:
            k *= s
        n += k
    return n
