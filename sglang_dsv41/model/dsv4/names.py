"""Parameter names: SGLang's DeepSeek-flat checkpoint names <-> transformers' DeepseekV4 names.

The flat names are what the release checkpoint, SGLang 0.5.23's loader and our model use. The
transformers side is what ``DeepseekV4ForCausalLM.state_dict()`` holds; the rename rules are the
inverse of transformers' own ``deepseek_v4`` checkpoint conversion (conversion_mapping.py), with
per-expert ``w1/w3`` stacked into ``gate_up_proj [E, 2I, H]`` and ``w2`` into ``down_proj``.
Engram tensors and V4.1's ratio-1/2 modules have no transformers counterpart (V4 only there):
``to_transformers`` refuses them.
"""

from __future__ import annotations

import re

import torch

# (flat regex, transformers template), applied to one name; first match wins.
_RULES = [
    (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"^layers\.(\d+)\.attn_norm\.weight$", r"model.layers.\1.input_layernorm.weight"),
    (r"^layers\.(\d+)\.ffn_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"^layers\.(\d+)\.hc_(attn|ffn)_(fn|base|scale)$", r"model.layers.\1.\2_hc.\3"),
    (r"^layers\.(\d+)\.attn\.attn_sink$", r"model.layers.\1.self_attn.sinks"),
    (r"^layers\.(\d+)\.attn\.indexer\.wq_b\.weight$",
     r"model.layers.\1.self_attn.compressor.indexer.q_b_proj.weight"),
    (r"^layers\.(\d+)\.attn\.indexer\.weights_proj\.weight$",
     r"model.layers.\1.self_attn.compressor.indexer.scorer.weights_proj.weight"),
    (r"^layers\.(\d+)\.attn\.indexer\.compressor\.(\w+)(\.weight)?$",
     r"model.layers.\1.self_attn.compressor.indexer.{\2}\3"),
    (r"^layers\.(\d+)\.attn\.compressor\.(\w+)(\.weight)?$",
     r"model.layers.\1.self_attn.compressor.{\2}\3"),
    (r"^layers\.(\d+)\.attn\.(wq_a|q_norm|wq_b|wkv|kv_norm|wo_a|wo_b)\.weight$",
     r"model.layers.\1.self_attn.{\2}.weight"),
    (r"^layers\.(\d+)\.ffn\.gate\.weight$", r"model.layers.\1.mlp.gate.weight"),
    (r"^layers\.(\d+)\.ffn\.gate\.bias$", r"model.layers.\1.mlp.gate.e_score_correction_bias"),
    (r"^layers\.(\d+)\.ffn\.gate\.tid2eid$", r"model.layers.\1.mlp.gate.tid2eid"),
    (r"^layers\.(\d+)\.ffn\.shared_experts\.(w[123])\.weight$",
     r"model.layers.\1.mlp.shared_experts.{\2}.weight"),
]
_LEAF = {"wq_a": "q_a_proj", "q_norm": "q_a_norm", "wq_b": "q_b_proj", "wkv": "kv_proj",
         "kv_norm": "kv_norm", "wo_a": "o_a_proj", "wo_b": "o_b_proj", "wgate": "gate_proj",
         "ape": "position_bias", "norm": "kv_norm", "w1": "gate_proj", "w2": "down_proj",
         "w3": "up_proj"}
def is_engram_table(name: str) -> bool:
    """An Engram hash table or its e8m0 scales (``layers.N.engram.embed.{weight,scale}``): frozen
    fp8 checkpoint data, loaded even under dummy loading, never upcast, never sent in a weight
    update (the release's ``engram.wkv.scale`` is wkv's FP8 scale, not a table)."""
    return ".engram.embed." in name


def is_frozen_table(name: str) -> bool:
    """Checkpoint tables the trainer never changes: Engram tables and hash layers' tid2eid."""
    return is_engram_table(name) or name.endswith("tid2eid")


_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")


def flat_to_transformers_name(name: str) -> str:
    for pattern, template in _RULES:
        m = re.match(pattern, name)
        if m:
            out = m.expand(template)
            return re.sub(r"\{(\w+)\}", lambda g: _LEAF[g.group(1)], out)
    raise KeyError(f"{name!r} has no transformers DeepseekV4 name (Engram and V4.1 ratio-1/2 "
                   "modules exist only in SGLang's V4.1)")


def to_transformers(flat: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A flat state dict -> transformers DeepseekV4ForCausalLM's state dict."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in flat.items():
        m = _EXPERT.match(name)
        if m:
            experts.setdefault(int(m.group(1)), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
            continue
        hf = flat_to_transformers_name(name)
        out[hf] = t.long() if name.endswith("tid2eid") else t
    for layer, by_id in experts.items():
        ids = sorted(by_id)
        if ids != list(range(len(ids))):
            raise ValueError(f"layer {layer}: experts {ids} are not 0..{len(ids) - 1}")
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([by_id[e]["w1"], by_id[e]["w3"]], dim=0) for e in ids])
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(
            [by_id[e]["w2"] for e in ids])
    return out


def from_transformers(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' state dict -> flat names (the inverse of ``to_transformers``)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        m = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", name)
        if m:
            layer = m.group(1)
            for e in range(t.shape[0]):
                base = f"layers.{layer}.ffn.experts.{e}"
                if m.group(2) == "down_proj":
                    out[f"{base}.w2.weight"] = t[e]
                else:
                    w1, w3 = t[e].chunk(2, dim=0)
                    out[f"{base}.w1.weight"], out[f"{base}.w3.weight"] = w1, w3
            continue
        flat = _flat_name(name)
        out[flat] = t.to(torch.int32) if flat.endswith("tid2eid") else t
    return out


def _flat_name(hf_name: str) -> str:
    """Invert one transformers name by searching the rule table over the candidate flat forms."""
    m = re.match(r"^(?:model\.)?layers\.(\d+)\.(.*)$", hf_name)
    candidates = _TOP_LEVEL if m is None else [
        f"layers.{m.group(1)}.{rest}" for rest in _LAYER_SUFFIXES]
    for cand in candidates:
        try:
            if flat_to_transformers_name(cand) == hf_name:
                return cand
        except KeyError:
            continue
    raise KeyError(f"transformers name {hf_name!r} has no flat counterpart")


_TOP_LEVEL = ["embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base",
              "hc_head_scale"]
_LAYER_SUFFIXES = (
    ["attn_norm.weight", "ffn_norm.weight", "attn.attn_sink", "attn.indexer.wq_b.weight",
     "attn.indexer.weights_proj.weight", "ffn.gate.weight", "ffn.gate.bias", "ffn.gate.tid2eid"]
    + [f"hc_{s}_{p}" for s in ("attn", "ffn") for p in ("fn", "base", "scale")]
    + [f"attn.{w}.weight" for w in ("wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "wo_a", "wo_b")]
    + [f"attn.{c}.{leaf}" for c in ("compressor", "indexer.compressor")
       for leaf in ("wkv.weight", "wgate.weight", "ape", "norm.weight")]
    + [f"ffn.shared_experts.w{i}.weight" for i in (1, 2, 3)])


def to_transformers_config(cfg) -> dict:
    """Our config -> kwargs of transformers' DeepseekV4Config (V4 configurations only)."""
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention",
             128: "heavily_compressed_attention"}
    if cfg.is_v41 or cfg.engram_layer_ids or set(cfg.compress_ratios) - set(kinds):
        raise ValueError("transformers' DeepseekV4 defines V4 only (no V4.1 ratios, Engram or "
                         "mHC pre-from-previous-sublayer)")
    rope = dict(cfg.rope_scaling or {})
    rope_type = rope.pop("type", rope.pop("rope_type", "default"))
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        moe_intermediate_size=cfg.moe_intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=1,
        head_dim=cfg.head_dim, q_lora_rank=cfg.q_lora_rank,
        num_experts_per_tok=cfg.num_experts_per_tok, n_routed_experts=cfg.n_routed_experts,
        n_shared_experts=cfg.n_shared_experts, scoring_func=cfg.scoring_func,
        norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor,
        max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta,
        compress_rope_theta=cfg.compress_rope_theta,
        layer_types=[kinds[r] for r in cfg.compress_ratios],
        mlp_layer_types=["hash_moe" if cfg.is_hash_layer(i) else "moe"
                         for i in range(cfg.num_hidden_layers)],
        hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
        swiglu_limit=cfg.swiglu_limit, sliding_window=cfg.window_size, o_groups=cfg.o_groups,
        o_lora_rank=cfg.o_lora_rank, index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
        rms_norm_eps=cfg.rms_norm_eps, partial_rotary_factor=cfg.qk_rope_head_dim / cfg.head_dim,
        rope_parameters={"rope_type": rope_type, **rope} if rope_type != "default" else None,
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, tie_word_embeddings=False,
        num_nextn_predict_layers=0)
