"""Parameter names: SGLang's DeepSeek-flat checkpoint names <-> transformers' DeepseekV4 names.

The flat names are what the release checkpoint, SGLang 0.5.23's loader and our model use. The
transformers side is what ``DeepseekV4ForCausalLM.state_dict()`` holds; the rename rules are the
inverse of transformers' own ``deepseek_v4`` checkpoint conversion (conversion_mapping.py), with
per-expert ``w1/w3`` stacked into ``gate_up_proj [E, 2I, H]`` and ``w2`` into ``down_proj``: the
layout our model holds them in (moe.RoutedExperts ``w13``, ``w2``), split and joined here only.
Engram tensors and V4.1's ratio-1/2 modules have no transformers counterpart (V4 only there):
``to_transformers`` refuses them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

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
    # Our stacks (named_parameters(); the state dict shows them per expert) are transformers'.
    (r"^layers\.(\d+)\.ffn\.experts\.w13$", r"model.layers.\1.mlp.experts.gate_up_proj"),
    (r"^layers\.(\d+)\.ffn\.experts\.w2$", r"model.layers.\1.mlp.experts.down_proj"),
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
# A routed-expert stack (moe.RoutedExperts) under any prefix: "layers.3.ffn.experts.w13".
_STACKED = re.compile(r"^((?:.*\.)?experts\.)(w13|w2)$")


def expert_names(prefix: str, n_experts: int) -> list[str]:
    """SGLang's per-expert names in checkpoint order (expert by expert: w1, w2, w3)."""
    return [f"{prefix}{e}.{w}.weight" for e in range(n_experts) for w in ("w1", "w2", "w3")]


def split_experts(prefix: str, w13: torch.Tensor, w2: torch.Tensor) -> dict[str, torch.Tensor]:
    """Stacks ``w13`` [E, 2I, H] (w1 rows, then w3 rows) and ``w2`` [E, H, I] -> SGLang's
    per-expert names under ``prefix``, as views (writing one writes the stack)."""
    inter = w2.shape[-1]
    out: dict[str, torch.Tensor] = {}
    for e in range(w13.shape[0]):  # expert_names' order
        out[f"{prefix}{e}.w1.weight"] = w13[e, :inter]
        out[f"{prefix}{e}.w2.weight"] = w2[e]
        out[f"{prefix}{e}.w3.weight"] = w13[e, inter:]
    return out


def join_experts(prefix: str, tensors: dict[str, torch.Tensor], n_experts: int, hidden: int,
                 inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's per-expert tensors under ``prefix`` in ``tensors`` -> the stacks
    (``w13`` [E, 2I, H], ``w2`` [E, H, I]); ValueError naming a missing or misshapen one."""
    want = {"w1": (inter, hidden), "w2": (hidden, inter), "w3": (inter, hidden)}
    names = expert_names(prefix, n_experts)
    for name in names:
        if name not in tensors:
            raise ValueError(f"{name}: missing (the routed experts of {prefix!r} are loaded "
                             f"together: every one of 0..{n_experts - 1} needs w1, w2, w3)")
        shape = want[name.rsplit(".", 2)[-2]]
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{name}: shape {list(tensors[name].shape)} does not match the "
                             f"model's {list(shape)}")
    got = [tensors[name] for name in names]
    w1, w2, w3 = got[0::3], got[1::3], got[2::3]
    return (torch.stack([torch.cat(pair) for pair in zip(w1, w3)]), torch.stack(w2))


def per_expert_state(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Names -> tensors with every routed-expert stack (``...experts.w13``/``w2``, e.g. from
    named_parameters() or a sharded model's gathered state dict) shown under SGLang's
    per-expert names, in checkpoint order; other entries unchanged."""
    out: dict[str, torch.Tensor] = {}
    for name, t in named.items():
        m = _STACKED.match(name)
        if m is None:
            out[name] = t
        elif m.group(2) == "w13":
            out.update(split_experts(m.group(1), t, named[m.group(1) + "w2"]))
    return out


def storable_state(named: Mapping[str, torch.Tensor],
                   dtype_of: Callable[[str, torch.Tensor], torch.dtype] | None = None
                   ) -> dict[str, torch.Tensor]:
    """``named`` with each tensor in ``dtype_of(name, tensor)`` (default: its own), as a
    safetensors file takes it, copying only where needed: a cast (the cast is the copy), a
    non-contiguous tensor, or one whose memory overlaps another's (safetensors refuses those
    two). ``per_expert_state``'s views are contiguous and disjoint slices of their stacks, so
    they pass as they are and no second copy of the model is made."""
    target = {n: t.dtype if dtype_of is None else dtype_of(n, t) for n, t in named.items()}
    spans: dict[tuple, list[tuple[int, int, str]]] = {}
    for n, t in named.items():
        if target[n] == t.dtype and t.is_contiguous() and t.numel():
            start = t.data_ptr()
            spans.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(
                (start, start + t.numel() * t.element_size(), n))
    copy = {n for n, t in named.items() if target[n] != t.dtype or not t.is_contiguous()}
    for group in spans.values():
        end = None
        # By start, the widest first: of tensors overlapping one kept, the smaller are copied.
        for start, stop, n in sorted(group, key=lambda span: (span[0], -span[1])):
            if end is not None and start < end:
                copy.add(n)
            else:
                end = stop
    return {n: t.to(target[n], memory_format=torch.contiguous_format, copy=True) if n in copy
            else t for n, t in named.items()}


def flat_to_transformers_name(name: str) -> str:
    for pattern, template in _RULES:
        m = re.match(pattern, name)
        if m:
            out = m.expand(template)
            return re.sub(r"\{(\w+)\}", lambda g: _LEAF[g.group(1)], out)
    raise ValueError(f"parameter {name!r} has no transformers DeepseekV4 name (Engram and V4.1 "
                     "ratio-1/2 modules exist only in SGLang's V4.1)")


def to_transformers(flat: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A flat state dict -> transformers DeepseekV4ForCausalLM's state dict."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[int, int] = {}  # layer -> number of experts
    for name, t in flat.items():
        m = _EXPERT.match(name)
        if m:
            layer = int(m.group(1))
            experts[layer] = max(experts.get(layer, 0), int(m.group(2)) + 1)
            continue
        hf = flat_to_transformers_name(name)
        out[hf] = t.long() if name.endswith("tid2eid") else t
    for layer, n_experts in sorted(experts.items()):
        prefix = f"layers.{layer}.ffn.experts."
        if f"{prefix}0.w1.weight" not in flat:
            raise ValueError(f"parameter {prefix}0.w1.weight: missing (the routed experts of "
                             f"layer {layer} are joined together)")
        w1 = flat[f"{prefix}0.w1.weight"]
        gate_up, down = join_experts(prefix, flat, n_experts, w1.shape[1], w1.shape[0])
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = gate_up
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = down
    return out


def from_transformers(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' state dict -> flat names (the inverse of ``to_transformers``)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        m = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj$", name)
        if m:
            down_name = f"model.layers.{m.group(1)}.mlp.experts.down_proj"
            if down_name not in hf:
                raise ValueError(f"parameter {down_name}: missing (split together with {name})")
            down = hf[down_name]
            out.update(split_experts(f"layers.{m.group(1)}.ffn.experts.", t, down))
            continue
        if name.endswith(".mlp.experts.down_proj"):
            if name[:-len("down_proj")] + "gate_up_proj" not in hf:
                raise ValueError(f"parameter {name}: its layer's gate_up_proj is missing")
            continue  # split with its layer's gate_up_proj
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
        except ValueError:
            continue
    raise ValueError(f"parameter {hf_name!r} has no counterpart in SGLang's flat names")


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
