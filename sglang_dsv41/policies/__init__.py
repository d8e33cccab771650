"""Policies shared by the embedded engine and the SGLang 0.5.23 plugins, as pure functions over
plain data (plus the stall watchdog both run). The backends are thin adapters over these."""

from .dp_attention import PaddingPlan, needs_idle_batch, plan_prefill_padding, should_run_forward
from .dp_rank_pin import DPRankPinError, resolve_dp_rank_pin
from .engram_layout import EngramLayoutError, choose_engram_layout
from .launch_guards import DeploymentRefused, check_attention_tp, check_pp_with_r3
from .watchdog import StallReport, StallWatchdog

__all__ = ["PaddingPlan", "needs_idle_batch", "plan_prefill_padding", "should_run_forward",
           "DPRankPinError", "resolve_dp_rank_pin", "EngramLayoutError", "choose_engram_layout",
           "DeploymentRefused", "check_attention_tp", "check_pp_with_r3", "StallReport",
           "StallWatchdog"]
