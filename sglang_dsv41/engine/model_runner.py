"""One scheduler rank's model: loading, the cache pool, the forward over a ForwardPlan.

The model is the real DeepSeek V4 (sglang_dsv41/model/dsv4), unmodified: EngineForwardContext
(forward_context.py) shards attention and MoE and reads the cache, ModelHooks (model_hooks.py)
feed the compressors their cached rows. Cache layout: docs/structures.md, "Cache".
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import TYPE_CHECKING

import torch

from ..loader.engram_layouts import install_engram_layout
from ..loader.serving import load_serving_config, load_serving_model, serving_numerics_for
from ..loader.weight_sync_group import parse_dtype
from ..policies.launch_guards import check_attention_tp
from .batch import ForwardPlan
from .forward_context import EngineForwardContext, cu_of
from .kv_cache import TokenRowPool, default_max_total_tokens, row_bytes_per_token
from .model_hooks import ModelHooks, cached_row_widths

if TYPE_CHECKING:
    from ..server_args import ServerArgs
    from .dist import DistGroups

logger = logging.getLogger(__name__)


def resolve_device(args: "ServerArgs", rank: int) -> torch.device:
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("--device cuda but no CUDA device is available")
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def resolve_dtype(args: "ServerArgs", device: torch.device) -> torch.dtype:
    if args.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return parse_dtype(args.dtype)


_IN_PROCESS_RUNNERS = itertools.count()


def node_namespace(dist_port: int) -> str:
    """The shared-memory namespace of one launch's ranks on a node: they are the launching
    process's children, and its rendezvous port is bound while it runs, so two launches from
    one process (or from two processes of one parent) never share a name."""
    return f"srv{os.getppid()}_{dist_port}"


class ModelRunner:
    def __init__(self, args: "ServerArgs", groups: "DistGroups | None", model_dir: str,
                 device: torch.device, shm_namespace: str | None = None):
        """shm_namespace: where the node's ranks share the Engram tables (node_namespace);
        None, a runner of its own process (a name no other runner has)."""
        self.args, self.groups, self.device = args, groups, device
        self.info = groups.info if groups is not None else None
        self.model_dir = model_dir
        self.dtype = resolve_dtype(args, device)
        cfg = load_serving_config(model_dir)
        # each rank again with its own group size (the launcher checked before spawning)
        check_attention_tp(self.info.attn_tp_size if self.info else 1, cfg.o_groups)
        self.model = load_serving_model(model_dir, self.dtype, device, args.load_format)
        self.cfg = cfg
        self.serving_numerics = serving_numerics_for(model_dir)
        self.hooks = ModelHooks(self.model)
        # SGLang's host layouts for the Engram tables, chosen by the shared policy.
        per_node = max(1, args.tp_size // args.nnodes)
        rank = self.info.rank if self.info else 0
        if shm_namespace is None:
            shm_namespace = f"run{os.getpid()}_{next(_IN_PROCESS_RUNNERS)}"
        self.engram_store = install_engram_layout(self.model, args.resolved_engram_layout,
                                                  groups, shm_namespace,
                                                  local_rank=rank % per_node)
        self.page_size = args.page_size
        self.context_length = args.context_length or cfg.max_position_embeddings
        widths = cached_row_widths(self.model)
        tokens = args.max_total_tokens or default_max_total_tokens(
            row_bytes_per_token(widths, self.dtype), self.page_size, device,
            self.context_length)
        if groups is not None:  # every DP group sizes its cache alike
            tokens = groups.min_over_world(tokens, "kv_sizing")
        self.num_pages = tokens // self.page_size + 1   # + the reserved dummy page
        self.max_total_tokens = (self.num_pages - 1) * self.page_size
        self.pool = TokenRowPool(widths, self.num_pages, self.page_size, self.dtype, device)
        self.weight_version = "default"
        self.flush_cache_hook = None   # set by the scheduler: () -> bool

    def forward(self, plan: ForwardPlan, dp_tokens: list[int]
                ) -> tuple[torch.Tensor, EngineForwardContext]:
        """Runs this rank's shard of the forward; returns the DP group's final hidden states
        [padded_tokens, hidden] and the context (with the recorded routing when asked)."""
        dev = self.device
        is_leader = self.info.is_leader if self.info else True
        ctx = EngineForwardContext(
            cu_seqlens=cu_of(plan.extend_lens, dev), positions=plan.positions.to(dev),
            record_routing=plan.record_routing and is_leader,
            serving_numerics=self.serving_numerics, plan=plan, pool=self.pool,
            groups=self.groups, dp_tokens=dp_tokens)
        with torch.no_grad(), self.hooks.active(ctx):
            if plan.copy_src is not None:
                self.pool.copy_rows(plan.copy_src, plan.copy_dst)
            hidden = self.model.hidden(plan.input_ids.to(dev), ctx)
        return hidden, ctx

    def close(self) -> None:
        self.hooks.remove()
        if self.engram_store is not None:
            self.engram_store.close()

    def compute_logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        head = self.model.head
        with torch.no_grad():
            return head(hidden[rows].to(head.weight.dtype))
