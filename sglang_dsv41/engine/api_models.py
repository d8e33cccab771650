"""Pydantic models of the HTTP API (SGLang's native field names) and their conversion into engine
messages. Every model forbids unknown fields, so a typo is a 400 rather than a silent default.

Range checks that need the served model (vocab, context length, dp_size) live in
``RequestLimits.to_generate_req``; they raise ``ValueError`` with the reason, which the HTTP
layer turns into a 400.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .messages import GenerateReq, SamplingParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingParamsIn(_Strict):
    max_new_tokens: int = 128
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        return v

    @field_validator("max_new_tokens")
    @classmethod
    def _max_new(cls, v: int) -> int:
        if v < 1:
            raise ValueError("max_new_tokens must be >= 1")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        words = [v] if isinstance(v, str) else (v or [])
        if any(not w for w in words):
            raise ValueError("stop strings must be non-empty")
        return v


class GenerateRequest(_Strict):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParamsIn = Field(default_factory=SamplingParamsIn)
    rid: str | None = None
    return_logprob: bool = False
    return_routed_experts: bool = False
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None  # deprecated alias of routed_dp_rank
    stream: bool = False


class AbortRequest(_Strict):
    rid: str


class UpdateWeightsFromTensorRequest(_Strict):
    serialized_named_tensors: str  # base64 of safetensors bytes
    flush_cache: bool = True
    weight_version: str | None = None
    abort_all_requests: bool = False
    allow_engram_update: bool = False  # force overwriting frozen Engram tables (else refused)


class UpdateWeightsFromDiskRequest(_Strict):
    model_path: str
    flush_cache: bool = True  # accepted as SGLang does; a disk update always flushes
    weight_version: str | None = None
    abort_all_requests: bool = False


class InitWeightsUpdateGroupRequest(_Strict):
    master_address: str
    master_port: int = Field(gt=0, lt=65536)
    rank_offset: int = Field(ge=0)
    world_size: int = Field(ge=1)
    group_name: str = "weight_update_group"
    backend: str = "gloo"


class UpdateWeightsFromDistributedRequest(_Strict):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    weight_version: str | None = None
    abort_all_requests: bool = False
    allow_engram_update: bool = False  # force overwriting frozen Engram tables (else refused)

    @field_validator("shapes")
    @classmethod
    def _same_lengths(cls, v: list[list[int]], info: Any) -> list[list[int]]:
        names, dtypes = info.data.get("names"), info.data.get("dtypes")
        if names is not None and dtypes is not None and not len(names) == len(dtypes) == len(v):
            raise ValueError("names, dtypes and shapes must have the same length")
        return v


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against: the served model and the server's flags."""

    vocab_size: int
    context_length: int
    max_new_tokens_limit: int
    dp_size: int

    def pick_dp_rank(self, body: GenerateRequest, header: str | None) -> int | None:
        """routed_dp_rank, its deprecated alias and the X-Data-Parallel-Rank header must agree;
        a rank outside [0, dp_size) is an error, never a silent round robin."""
        given: dict[str, int] = {}
        if body.routed_dp_rank is not None:
            given["routed_dp_rank"] = body.routed_dp_rank
        if body.data_parallel_rank is not None:
            given["data_parallel_rank"] = body.data_parallel_rank
        if header is not None and header.strip() != "":
            try:
                given["X-Data-Parallel-Rank"] = int(header)
            except ValueError:
                raise ValueError(f"X-Data-Parallel-Rank must be an integer, got {header!r}")
        if not given:
            return None
        if len(set(given.values())) > 1:
            raise ValueError(f"conflicting DP ranks: {given}")
        name, rank = next(iter(given.items()))
        if not 0 <= rank < self.dp_size:
            raise ValueError(f"{name}={rank} out of range: dp_size is {self.dp_size}, "
                             f"valid ranks are [0, {self.dp_size})")
        return rank

    def to_generate_req(self, body: GenerateRequest, input_ids: list[int] | None,
                        dp_header: str | None = None) -> GenerateReq:
        """``input_ids`` is the tokenized ``text`` (None when the request gave input_ids)."""
        if body.text is not None and body.input_ids is not None:
            raise ValueError("give either text or input_ids, not both")
        if body.text is None and body.input_ids is None:
            raise ValueError("one of text or input_ids is required")
        ids = body.input_ids if body.input_ids is not None else input_ids
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:8]} outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.context_length:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context length is "
                             f"{self.context_length} (at least one token must be generated)")
        sp = body.sampling_params
        if sp.max_new_tokens > self.max_new_tokens_limit:
            raise ValueError(f"max_new_tokens={sp.max_new_tokens} exceeds "
                             f"--max-new-tokens-limit {self.max_new_tokens_limit}")
        if len(ids) + sp.max_new_tokens > self.context_length:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens "
                             f"({sp.max_new_tokens}) exceeds the context length "
                             f"{self.context_length}")
        bad_stop = [t for t in sp.stop_token_ids or [] if not 0 <= t < self.vocab_size]
        if bad_stop:
            raise ValueError(f"stop_token_ids {bad_stop[:8]} outside the vocabulary")
        stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
        sampling = SamplingParams(
            max_new_tokens=sp.max_new_tokens, temperature=sp.temperature, top_p=sp.top_p,
            top_k=sp.top_k, min_p=sp.min_p, stop=stop, stop_token_ids=list(sp.stop_token_ids or []),
            ignore_eos=sp.ignore_eos, seed=sp.seed)
        return GenerateReq(
            rid=body.rid or uuid.uuid4().hex, input_ids=list(ids), sampling=sampling,
            return_logprob=body.return_logprob, return_routed_experts=body.return_routed_experts,
            routed_dp_rank=self.pick_dp_rank(body, dp_header), stream=body.stream)
