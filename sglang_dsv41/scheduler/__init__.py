"""DP-attention scheduling policies shared by the embedded engine and the SGLang patches."""

from .policies import (PaddingPlan, mlp_sync_token_counts, needs_idle_batch, pad_to_multiple,
                       plan_prefill_padding, should_run_forward)
from .watchdog import StallReport, StallWatchdog

__all__ = ["PaddingPlan", "mlp_sync_token_counts", "needs_idle_batch", "pad_to_multiple",
           "plan_prefill_padding", "should_run_forward", "StallReport", "StallWatchdog"]
