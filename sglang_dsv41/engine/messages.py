"""Messages between the embedded engine's processes (HTTP server, DP controller, scheduler ranks).

All are plain dataclasses sent over multiprocessing queues (pickle). Tensors cross as numpy or
torch CPU tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1            # -1: no top-k
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None    # per-request RNG seed (reproducible sampling)
    min_new_tokens: int = 0    # EOS, stop ids and stop strings are ignored before this many
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_regex: list[str] = field(default_factory=list)
    logit_bias: dict[int, float] = field(default_factory=dict)


@dataclass
class GenerateReq:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0   # the routing of positions [start, seqlen - 1) only
    routed_dp_rank: int | None = None   # None: the DP controller picks (--load-balance-method)
    stream: bool = False
    logprob_start_len: int = -1         # >= 0: return the prompt's logprobs from this position
    top_logprobs_num: int = 0           # with return_logprob: the N most likely at each position
    token_ids_logprob: list[int] | None = None  # with return_logprob: these ids at each position


@dataclass
class GenerateOut:
    """One chunk of output of one request. Non-streaming requests get a single chunk with
    finished=True; streaming requests get one chunk per decode step."""
    rid: str
    token_ids: list[int]                         # new tokens in this chunk
    logprobs: list[float] | None = None          # logprob of each new token (if asked)
    finished: bool = False
    finish_reason: dict[str, Any] | None = None  # {"type": "length"|"stop"|"abort", ...}
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    dp_rank: int = 0
    # R3: int32 [prompt_tokens + completion_tokens - 1, num_moe_layers, top_k] expert ids and
    # float32 weights of the same shape, for every token that went through the model.
    routed_experts: Any = None
    routed_weights: Any = None
    output_extras: Any = None    # logprobs.LogprobExtras of the new tokens' positions (if asked)
    # logprob of prompt tokens logprob_start_len+1.. given their prefix, and their extras (the
    # first chunk after the prompt is scored)
    input_logprobs: list[float] | None = None
    input_extras: Any = None
    error: str | None = None                     # set when the scheduler refused the request


@dataclass
class AbortReq:
    rid: str


@dataclass
class ControlReq:
    """A request/response call into every scheduler rank (weight updates, checksums, stats).

    ``op`` names the handler; ``args`` are its keyword arguments; ``req_id`` pairs the reply."""
    req_id: str
    op: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class ControlOut:
    req_id: str
    ok: bool
    result: Any = None
    error: str | None = None
    rank: int = 0


@dataclass
class RankStats:
    """Published by each DP group's leader every STATS_INTERVAL_S (scheduler.py), and with
    healthy=False by any rank whose watchdog saw a stall (for /metrics and /health)."""
    dp_rank: int
    num_running: int
    num_queued: int
    kv_used_tokens: int
    kv_total_tokens: int
    prefix_hit_tokens: int          # cumulative
    prompt_tokens: int              # cumulative
    step: int
    healthy: bool = True
    stall: str | None = None        # StallReport.message() when the watchdog fired


@dataclass
class ShutdownReq:
    pass


@dataclass
class ReadyMsg:
    rank: int
    dp_rank: int
    ok: bool
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
