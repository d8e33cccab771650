"""DP-attention patches: prefill/health-check padding, no zero-token idle rank, idle batches.

Thin adapters over sglang_dsv41.scheduler.policies. SGLang's runtime helpers they need
(attention-TP size, _update_gather_batch) are looked up lazily, or passed in by tests.
"""

from __future__ import annotations

import logging
from typing import Callable

from ...scheduler.policies import (mlp_sync_token_counts, needs_idle_batch, pad_idle_ranks,
                                   should_run_forward)
from ..registry import Patch, Target
from ..state import STATE
from . import VERSIONS

logger = logging.getLogger(__name__)

FORWARD_BATCH = "sglang.srt.model_executor.forward_batch_info"
DP_ATTENTION = "sglang.srt.layers.dp_attention"
DP_ATTN_MIXIN = "sglang.srt.managers.scheduler_dp_attn_mixin"


def sync_counts(per_rank_tokens: list[int], attn_tp_size: int) -> list[int]:
    """The per-DP-rank row counts a forward runs with: every count padded to a multiple of
    attn_tp_size (the 1-token health check included), idle ranks given attn_tp_size rows."""
    return pad_idle_ranks(mlp_sync_token_counts(list(per_rank_tokens), attn_tp_size),
                          attn_tp_size)


def _sglang_attn_tp_size() -> int:
    from sglang.srt.layers.dp_attention import get_attention_tp_size

    return get_attention_tp_size()


def make_forward_batch_padding(orig: Callable, attn_tp_size_fn: Callable[[], int] | None = None
                               ) -> Callable:
    attn_tp_size_fn = attn_tp_size_fn or _sglang_attn_tp_size

    def prepare_mlp_sync_batch(self, model_runner):
        counts = self.global_num_tokens_cpu
        if counts is not None:
            self.global_num_tokens_cpu = sync_counts(counts, attn_tp_size_fn())
        return orig(self, model_runner)

    return prepare_mlp_sync_batch


def make_dp_padding_mode(orig: Callable) -> Callable:
    def get_dp_padding_mode(cls, is_extend_in_batch, global_num_tokens):
        counts = list(global_num_tokens)
        # A mode computed from unpadded counts with an idle rank: MAX_LEN pads the idle rank to
        # the longest rank, so it still holds rows in every collective.
        if any(needs_idle_batch(n, counts) for n in counts):
            return cls.MAX_LEN
        return orig(cls, is_extend_in_batch, global_num_tokens)

    return get_dp_padding_mode


def make_sync_recorder(orig: Callable) -> Callable:
    def all_gather(self, device, group):
        result = orig(self, device, group)
        STATE.last_sync = self  # read by the idle-batch guarantee right after
        return result

    return all_gather


def _sglang_update_gather_batch() -> Callable:
    from sglang.srt.managers.scheduler_dp_attn_mixin import _update_gather_batch

    return _update_gather_batch


def make_idle_batch_guarantee(orig: Callable,
                              update_gather_batch_fn: Callable[[], Callable] | None = None
                              ) -> Callable:
    update_gather_batch_fn = update_gather_batch_fn or _sglang_update_gather_batch

    def prepare_mlp_sync_batch_raw(local_batch, dp_size, attn_tp_size, attn_cp_size, tp_group,
                                   get_idle_batch, disable_cuda_graph, require_mlp_tp_gather,
                                   disable_overlap_schedule, offload_tags):
        STATE.last_sync = None
        batch = orig(local_batch, dp_size=dp_size, attn_tp_size=attn_tp_size,
                     attn_cp_size=attn_cp_size, tp_group=tp_group, get_idle_batch=get_idle_batch,
                     disable_cuda_graph=disable_cuda_graph,
                     require_mlp_tp_gather=require_mlp_tp_gather,
                     disable_overlap_schedule=disable_overlap_schedule, offload_tags=offload_tags)
        info, STATE.last_sync = STATE.last_sync, None
        counts = getattr(info, "global_num_tokens", None)
        if batch is None and counts is not None and should_run_forward(0, list(counts)):
            logger.warning("sglang-dsv41: rank had no batch while DP ranks have %s tokens; "
                           "running an idle batch", list(counts))
            batch = get_idle_batch()
            update_gather_batch_fn()(batch, info, require_mlp_tp_gather, False)
        return batch

    return prepare_mlp_sync_batch_raw


PATCHES = [
    Patch("prefill_padding.forward_batch", "prefill_padding",
          Target(FORWARD_BATCH, "ForwardBatch.prepare_mlp_sync_batch", ("self", "model_runner")),
          "scheduler", VERSIONS,
          "pads every DP rank's token count to a multiple of attn_tp_size (the 1-token health "
          "check too) and gives idle ranks attn_tp_size rows, before SGLang sizes the buffers",
          requires=((FORWARD_BATCH, "ForwardBatch.global_num_tokens_cpu"),
                    (DP_ATTENTION, "get_attention_tp_size")),
          make=make_forward_batch_padding),
    Patch("prefill_padding.dp_padding_mode", "prefill_padding",
          Target(DP_ATTENTION, "DpPaddingMode.get_dp_padding_mode",
                 ("cls", "is_extend_in_batch", "global_num_tokens")),
          "scheduler", VERSIONS,
          "picks MAX_LEN when a rank is idle while others have tokens, so no rank enters the "
          "SUM_LEN gather with zero rows",
          requires=((DP_ATTENTION, "DpPaddingMode.MAX_LEN"),),
          make=make_dp_padding_mode),
    Patch("idle_batch.record_sync", "idle_batch",
          Target(DP_ATTN_MIXIN, "MLPSyncBatchInfo.all_gather", ("self", "device", "group")),
          "scheduler", VERSIONS,
          "remembers the gathered per-rank token counts of the current MLP sync",
          requires=((DP_ATTN_MIXIN, "MLPSyncBatchInfo.global_num_tokens"),),
          make=make_sync_recorder),
    Patch("idle_batch.guarantee", "idle_batch",
          Target(DP_ATTN_MIXIN, "prepare_mlp_sync_batch_raw",
                 ("local_batch", "dp_size", "attn_tp_size", "attn_cp_size", "tp_group",
                  "get_idle_batch", "disable_cuda_graph", "require_mlp_tp_gather",
                  "disable_overlap_schedule", "offload_tags")),
          "scheduler", VERSIONS,
          "a rank left without a batch while any rank has tokens gets an idle batch, so it "
          "joins every MoE/MLP collective (eager decode would deadlock otherwise)",
          requires=((DP_ATTN_MIXIN, "_update_gather_batch"),),
          make=make_idle_batch_guarantee),
]
