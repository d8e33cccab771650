"""One scheduler rank's model: loading, the distributed ForwardContext, the paged-KV attention.

Sharding under DP attention (T ranks, D DP groups of A = T/D attention-TP ranks):
- attention: a rank computes o_groups/A output groups (its heads) on every token of its DP group;
  attn_reduce reduce-scatters the partial outputs by token inside the attention-TP group, which
  is why a DP group's token count must be a multiple of A (prefill padding);
- MLP/MoE: mlp_gather all-gathers every rank's token shard over the world (each DP group's tokens
  in order), a rank computes its experts (expert_range) and its columns of the dense MLP and the
  shared expert (mlp_slice) on all of them, mlp_reduce reduce-scatters the partial sums back to
  the token shards, attn_gather rebuilds the DP group's tokens for the next layer.
Every rank holds the full weights and computes only its shard.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..attention import sink_attention, sink_decode
from ..model import DSV41ForCausalLM, ForwardContext, build_model, get_preset, load_config
from ..model.config import PRESETS
from .batch import ForwardPlan
from .kv_cache import KVPool, default_max_total_tokens, kv_bytes_per_token

if TYPE_CHECKING:
    from ..server_args import ServerArgs
    from .dist import DistGroups

logger = logging.getLogger(__name__)
DUMMY_INIT_RANGE = 1e-3   # SGLang DummyModelLoader: uniform(-1e-3, 1e-3)
DUMMY_INIT_SEED = 1234    # the same on every rank, so all ranks hold identical dummy weights


def _split(n: int, parts: int, index: int) -> range:
    return range(index * n // parts, (index + 1) * n // parts)


@dataclass
class EngineForwardContext(ForwardContext):
    plan: ForwardPlan | None = None
    pool: KVPool | None = None
    groups: "DistGroups | None" = None
    dp_tokens: list[int] = field(default_factory=list)  # padded tokens of each DP group

    def __post_init__(self) -> None:
        info = self.groups.info
        self._a, self._w, self._rank = info.attn_tp_size, info.world_size, info.rank
        self._local = self.dp_tokens[info.dp_rank]
        self._shards = [self.dp_tokens[info.dp_of(r)] // self._a for r in range(self._w)]
        self._max_shard = max(self._shards)
        # Rows of the padded [world * max_shard] layout that hold real shards, in world order.
        m = self._max_shard
        self._gather_rows = torch.cat([torch.arange(r * m, r * m + s) for r, s in
                                       enumerate(self._shards)]).to(self.positions.device)
        self.dp_offset = sum(self.dp_tokens[:info.dp_rank])

    # ---- sharding ---------------------------------------------------------------------------
    def attn_group_range(self, o_groups: int) -> range:
        return _split(o_groups, self._a, self.groups.info.attn_tp_rank)

    def expert_range(self, n_experts: int) -> range:
        return _split(n_experts, self._w, self._rank)

    def mlp_slice(self, intermediate_size: int) -> slice:
        r = _split(intermediate_size, self._w, self._rank)
        return slice(r.start, r.stop)

    # ---- collectives ------------------------------------------------------------------------
    def attn_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        # A DP group with no tokens skips it as a whole group: nobody else is in this group.
        if self._a == 1 or self._local == 0:
            return partial
        return self.groups.reduce_scatter_attn(partial)

    def token_shard(self, x: torch.Tensor) -> torch.Tensor:
        if self._a == 1:
            return x
        s = self._local // self._a
        r = self.groups.info.attn_tp_rank
        return x[r * s:(r + 1) * s]

    def mlp_gather(self, x_shard: torch.Tensor) -> torch.Tensor:
        if self._w == 1:
            return x_shard
        padded = x_shard.new_zeros(self._max_shard, *x_shard.shape[1:])
        padded[:x_shard.shape[0]] = x_shard
        return self.groups.all_gather_world(padded).index_select(0, self._gather_rows)

    def mlp_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        if self._w == 1:
            return partial
        buf = partial.new_zeros(self._w * self._max_shard, *partial.shape[1:])
        buf.index_copy_(0, self._gather_rows, partial)
        return self.groups.reduce_scatter_world(buf)[:self._shards[self._rank]]

    def attn_gather(self, h_shard: torch.Tensor) -> torch.Tensor:
        if self._a == 1 or self._local == 0:
            return h_shard
        return self.groups.all_gather_attn(h_shard)

    # ---- attention over the paged KV cache --------------------------------------------------
    def attend(self, layer_id, q, k, v, sinks, window, scale):
        plan, out = self.plan, q.new_zeros(q.shape)
        if q.shape[0] == 0:
            return out
        self.pool.write(layer_id, plan.slots.to(q.device), k, v)
        n, dev = plan.num_tokens, q.device
        if plan.mode == "decode":
            seq_lens = torch.tensor(plan.seq_lens, dtype=torch.int32, device=dev)
            out[:n] = sink_decode(q[:n], self.pool.k[layer_id], self.pool.v[layer_id],
                                  plan.page_table.to(dev), seq_lens, sinks, window, scale)
        else:
            k_all, v_all = self.pool.gather(layer_id, plan.key_slots.to(dev))
            out[:n] = sink_attention(q[:n], k_all, v_all, sinks, _cu(plan.extend_lens, dev),
                                     _cu(plan.seq_lens, dev), causal=True, window=window,
                                     softmax_scale=scale)
        return out

    def ngram_window(self, input_ids: torch.Tensor, n: int) -> torch.Tensor:
        return self.plan.ngram[:, :n].to(input_ids.device)


def _cu(lens: list[int], device) -> torch.Tensor:
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32, device=device)
    if lens:
        cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32, device=device), 0)
    return cu


# ---- loading -----------------------------------------------------------------------------------
def resolve_device(args: "ServerArgs", rank: int) -> torch.device:
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("--device cuda but no CUDA device is available")
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def resolve_dtype(args: "ServerArgs", device: torch.device) -> torch.dtype:
    if args.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16}[args.dtype]


@torch.no_grad()
def fill_dummy_weights(model: torch.nn.Module) -> None:
    for p in model.parameters():
        if p.is_floating_point():
            gen = torch.Generator().manual_seed(DUMMY_INIT_SEED)
            val = torch.empty(p.shape, dtype=torch.float32).uniform_(
                -DUMMY_INIT_RANGE, DUMMY_INIT_RANGE, generator=gen)
            p.copy_(val.to(p.dtype))


def load_engine_model(model_dir: str, dtype: torch.dtype, device: torch.device,
                      load_format: str = "auto") -> DSV41ForCausalLM:
    """A preset name (no checkpoint: random weights with seed 0, the reference model the tests
    compare against) or, without the serving loader, a checkpoint directory with its Engram
    tables inside the model. load_format "dummy" fills SGLang's dummy weights."""
    if model_dir in PRESETS and not os.path.exists(model_dir):
        model = build_model(get_preset(model_dir), dtype, device, seed=0)
    elif load_format == "dummy":
        model = build_model(load_config(model_dir), dtype, device, seed=None)
    else:
        from ..loader.checkpoint import load_model

        model = load_model(model_dir, dtype, device)
    if load_format == "dummy":
        fill_dummy_weights(model)
    return model.eval()


def load_model_for_rank(args: "ServerArgs", groups: "DistGroups", model_dir: str,
                        device: torch.device, dtype: torch.dtype
                        ) -> tuple[DSV41ForCausalLM, object | None]:
    """(model, Engram store handle or None). A checkpoint directory goes through the loader's
    serving path: Engram tables in host memory (shared per node or private row shards; dummy
    mode still reads them from the checkpoint). Collective over the world when tp_size > 1."""
    if model_dir in PRESETS and not os.path.exists(model_dir):
        return load_engine_model(model_dir, dtype, device, args.load_format), None
    from ..loader.serving import load_rank_model

    return load_rank_model(args, groups.info.rank, groups.world_cpu, model_dir, dtype, device,
                           guard=lambda op: groups.watchdog.guard(op, groups.step))


class ModelRunner:
    def __init__(self, args: "ServerArgs", groups: "DistGroups", model_dir: str,
                 device: torch.device):
        self.args, self.groups, self.info, self.device = args, groups, groups.info, device
        self.model_dir = model_dir
        self.dtype = resolve_dtype(args, device)
        cfg, a = load_config(model_dir), self.info.attn_tp_size
        if cfg.o_groups % a:
            raise ValueError(f"attention TP size {a} must divide o_groups={cfg.o_groups} "
                             f"(tp_size {args.tp_size} / dp_size {self.info.dp_size})")
        self.model, self.engram_store = load_model_for_rank(args, groups, model_dir, device,
                                                            self.dtype)
        self.cfg = cfg = self.model.config
        hpg = cfg.num_attention_heads // cfg.o_groups
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        groups_r = _split(cfg.o_groups, a, self.info.attn_tp_rank)
        h0, h1 = groups_r.start * hpg, groups_r.stop * hpg
        self.num_local_kv_heads = -(-h1 // rep) - h0 // rep
        self.page_size = args.page_size
        self.context_length = args.context_length or cfg.max_position_embeddings
        per_token = kv_bytes_per_token(cfg.num_hidden_layers, self.num_local_kv_heads,
                                       cfg.head_dim, self.dtype)
        tokens = args.max_total_tokens or default_max_total_tokens(
            per_token, self.page_size, device, self.context_length)
        # Every DP group sizes its cache alike; ranks may see different free memory on GPU.
        tokens = groups.min_over_world(tokens, "kv_sizing")
        self.num_pages = tokens // self.page_size + 1   # + the reserved dummy page
        self.max_total_tokens = (self.num_pages - 1) * self.page_size
        self.pool = KVPool(cfg.num_hidden_layers, self.num_pages, self.page_size,
                           self.num_local_kv_heads, cfg.head_dim, self.dtype, device)
        self.weight_version = "default"
        self.flush_cache_hook = None   # set by the scheduler: () -> bool

    def forward(self, plan: ForwardPlan, dp_tokens: list[int]
                ) -> tuple[torch.Tensor, EngineForwardContext]:
        """Runs this rank's shard of the forward; returns the DP group's final hidden states
        [padded_tokens, hidden] and the context (with the recorded routing when asked)."""
        dev = self.device
        ctx = EngineForwardContext(
            cu_seqlens=_cu(plan.extend_lens, dev), positions=plan.positions.to(dev),
            record_routing=plan.record_routing and self.info.is_leader, plan=plan,
            pool=self.pool, groups=self.groups, dp_tokens=dp_tokens)
        with torch.no_grad():  # not inference_mode: kernels cache host copies by _version
            hidden = self.model(plan.input_ids.to(dev), ctx)
        return hidden, ctx

    def close(self) -> None:
        if self.engram_store is not None:
            self.engram_store.close()

    def compute_logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.model.compute_logits(hidden[rows])
