"""Deployment planner: parallel-layout rules and host-memory formulas (``python -m
sglang_dsv41.plan``). The formulas are plain functions so the engine and ServerArgs can reuse
them."""

from .memory import (DSV4KVSizing, dsv4_kv_sizing, engram_host_bytes, engram_row_bytes,
                     engram_table_bytes, kv_bytes_per_token, kv_tokens_for_budget,
                     largest_tokens_within, mmap_bytes, next_pow2, optimizer_host_bytes,
                     pinned_alloc_bytes, r3_buffer_bytes, r3_bytes_per_token, r3_host_bytes,
                     r3_largest_tokens)
from .planner import NodeBudget, PlanInput, PlanResult, make_plan
from .rules import (ParallelLayout, PlanError, attn_tp_from_sglang, validate_parallel_layout,
                    validate_sglang_layout)

__all__ = [
    "DSV4KVSizing", "NodeBudget", "ParallelLayout", "PlanError", "PlanInput", "PlanResult",
    "attn_tp_from_sglang", "dsv4_kv_sizing", "engram_host_bytes", "engram_row_bytes",
    "engram_table_bytes",
    "kv_bytes_per_token", "kv_tokens_for_budget", "largest_tokens_within", "make_plan",
    "mmap_bytes", "next_pow2", "optimizer_host_bytes", "pinned_alloc_bytes", "r3_buffer_bytes",
    "r3_bytes_per_token", "r3_host_bytes", "r3_largest_tokens",
    "validate_parallel_layout", "validate_sglang_layout",
]
