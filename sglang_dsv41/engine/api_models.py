"""FastAPI body models of the HTTP API: SGLang 0.5.23's /generate schema field for field
(``sglang/api/v1/api_types.py``) and the admin bodies.

As SGLang: unknown top-level keys of a request are ignored, unknown ``sampling_params`` keys are
refused, a null field means its default. Every value is range-checked here (SGLang's
``SamplingParams.verify`` rules plus finiteness), so a request either becomes engine messages or
a 400 that names the field; the scheduler only checks what needs its state (KV capacity).
Checks that need the served model (vocab, context length, dp_size) are in request_limits.py.
"""

from __future__ import annotations

from typing import Any, ClassVar, Union

import regex
from pydantic import (BaseModel, ConfigDict, Field, StrictInt, field_validator,
                      model_validator)


# SGLang's defaults (sampling_params.py): top_k "off" is 1 << 30; temperatures below the eps
# mean greedy. Limits SGLang does not have but an engine needs to stay alive are marked.
TOP_K_ALL = 1 << 30
SAMPLING_EPS = 1e-6
MAX_STOP_COUNT = 64          # SGLang's MAX_STOP_COUNT
MAX_STOP_LEN = 256           # ours: stop strings are matched on every step
MAX_N = 64                   # ours: parallel samples per prompt
MAX_LOGIT_BIAS = 100.0       # OpenAI's range for a logit bias


def _valid_text(s: str, what: str) -> str:
    """Lone surrogates pass json.loads but cannot be encoded: refuse them here (else a 500)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode (lone surrogate at {e.start})") from e
    return s


def as_list(v: Any) -> list:
    return [] if v is None else (list(v) if isinstance(v, list) else [v])


class ApiSchema(BaseModel):
    # Null means "the default" for every field, as in SGLang's generated decoders.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=False)

    # Fields whose null SGLang keeps as None, meaning something of its own (not the default).
    NULL_KEPT: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items()
                    if not (v is None and k in cls.model_fields and k not in cls.NULL_KEPT
                            and cls.model_fields[k].default is not None)}
        return data


class SamplingParamsIn(ApiSchema):
    """``sampling_params`` of /generate: every field of SGLang 0.5.23's SamplingParams."""
    # null: no limit of its own (SGLang's scheduler: up to the context length and
    # --max-new-tokens-limit); absent: 128
    NULL_KEPT: ClassVar[frozenset[str]] = frozenset({"max_new_tokens"})
    max_new_tokens: int | None = Field(128, ge=0)
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    stop_regex: Union[str, list[str], None] = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = TOP_K_ALL
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    min_new_tokens: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=MAX_N)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int | None = Field(None, ge=1)
    logit_bias: dict[str, float] = Field(default_factory=dict)
    sampling_seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    custom_params: Any = None
    beam_width: int | None = Field(None, ge=1)
    watermark: dict[str, Any] | None = None
    choice: list[str] = Field(default_factory=list)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # ours, older name of sampling_seed

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == -1:
            return TOP_K_ALL
        if v < 1:
            raise ValueError("top_k must be -1 (disable) or at least 1")
        return v

    @field_validator("stop", "stop_regex")
    @classmethod
    def _stops(cls, v: Any) -> Any:
        words = as_list(v)
        if len(words) > MAX_STOP_COUNT:
            raise ValueError(f"at most {MAX_STOP_COUNT} stop strings are allowed")
        for w in words:
            if not w or len(w) > MAX_STOP_LEN:
                raise ValueError(f"stop strings must have 1 to {MAX_STOP_LEN} characters")
            _valid_text(w, "a stop string")
        return v

    @field_validator("stop_regex")
    @classmethod
    def _compiles(cls, v: Any) -> Any:
        for pattern in as_list(v):
            try:
                regex.compile(pattern)  # the engine the leader matches with (engine/sampling)
            except regex.error as e:
                raise ValueError(f"stop_regex {pattern!r} does not compile: {e}") from e
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float]) -> dict[str, float]:
        for key, bias in v.items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, "
                                 f"{MAX_LOGIT_BIAS:g}], got {bias}")
        return v

    @model_validator(mode="after")
    def _supported(self) -> "SamplingParamsIn":
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens "
                             f"({self.max_new_tokens})], got {self.min_new_tokens}")
        # An empty grammar is "unset" in SGLang too; a real one we cannot honour is refused.
        grammars = [k for k in ("json_schema", "regex", "ebnf", "structural_tag")
                    if getattr(self, k)]
        if grammars:
            raise ValueError(f"constrained decoding ({', '.join(grammars)}) is not supported by "
                             "the embedded backend")
        if self.beam_width not in (None, 1):
            raise ValueError("beam search (beam_width > 1) is not supported")
        if self.watermark and self.watermark.get("enabled"):
            raise ValueError("watermarking is not supported")
        if self.choice:
            raise ValueError("sampling_params.choice is not supported; use sglang.lang select")
        if self.seed is not None and self.sampling_seed is not None and \
                self.seed != self.sampling_seed:
            raise ValueError("seed and sampling_seed disagree")
        return self

    @property
    def effective_seed(self) -> int | None:
        return self.sampling_seed if self.sampling_seed is not None else self.seed

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1


class SessionParams(ApiSchema):
    id: str = Field(min_length=1, max_length=256)
    rid: str | None = None
    offset: int | None = None
    replace: bool | None = None
    drop_previous_output: bool | None = None


# Strict: pydantic would read true/false and 1.0 as token ids, "1" or true as a DP rank
_Ids = list[StrictInt]
_Bool = Union[bool, list[bool]]
_Int = Union[int, list[int]]


class GenerateRequest(ApiSchema):
    """The /generate body. Fields that would change the result but mean nothing for a text-only
    model on this backend (images, LoRA, hidden states, custom logit processors) are refused
    when set; routing hints for other deployments (bootstrap_*, priority, ...) are ignored."""
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    rid: Union[str, list[str], None] = None
    text: Union[str, list[str], None] = None
    input_ids: Union[_Ids, list[_Ids], None] = None
    stream: bool = False
    sampling_params: Union[SamplingParamsIn, list[SamplingParamsIn]] = Field(
        default_factory=SamplingParamsIn)
    return_logprob: _Bool = False
    logprob_start_len: _Int = -1
    top_logprobs_num: _Int = 0
    token_ids_logprob: Union[_Ids, list[_Ids], None] = None
    return_text_in_logprobs: bool = False
    return_hidden_states: _Bool = False
    routed_dp_rank: StrictInt | None = None
    # SGLang's older name; sglang-router --dp-aware sets it
    data_parallel_rank: StrictInt | None = None
    routing_key: str | None = Field(None, max_length=1024)
    session_params: SessionParams | None = None
    return_routed_experts: bool = False
    routed_experts_start_len: int = Field(0, ge=0)
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    lora_path: Any = None
    custom_logit_processor: Any = None
    extra_key: Any = None

    @field_validator("text")
    @classmethod
    def _text(cls, v: Any) -> Any:
        for t in as_list(v):
            _valid_text(t, "text")
        return v

    @field_validator("rid")
    @classmethod
    def _rid(cls, v: Any) -> Any:
        for r in as_list(v):
            if not 0 < len(r) <= 256:
                raise ValueError("rid must have 1 to 256 characters")
            _valid_text(r, "rid")
        return v

    @model_validator(mode="after")
    def _supported(self) -> "GenerateRequest":
        refused = [k for k in ("image_data", "video_data", "audio_data", "lora_path",
                               "custom_logit_processor") if getattr(self, k) not in (None, [])]
        if refused:
            raise ValueError(f"{', '.join(refused)}: not supported by this text-only backend")
        if any(as_list(self.return_hidden_states)):
            raise ValueError("return_hidden_states is not supported")
        if self.text is not None and self.input_ids is not None:
            raise ValueError("give either text or input_ids, not both")
        if self.text is None and self.input_ids is None:
            raise ValueError("one of text or input_ids is required")
        return self

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    def prompts(self) -> list[Any]:
        """One entry per prompt: a str (text) or a list of ids."""
        if self.text is not None:
            return list(self.text) if isinstance(self.text, list) else [self.text]
        return list(self.input_ids) if self.is_batch else [self.input_ids]

    def per_prompt(self, name: str, i: int, n: int) -> Any:
        """Field ``name`` for prompt i of n: a scalar applies to all, a list must have n."""
        v = getattr(self, name)
        if isinstance(v, list):
            if len(v) != n:
                raise ValueError(f"{name} has {len(v)} entries for {n} prompts")
            return v[i]
        return v

    def token_ids_logprob_for(self, i: int, n: int) -> list[int] | None:
        """As SGLang: null or [] asks none; a flat list applies to every prompt; a batch may
        give one list per prompt (an inner [] then asks none at that prompt's positions)."""
        v = self.token_ids_logprob
        if not v:
            return None
        if not isinstance(v[0], list):
            return list(v)
        if not self.is_batch:
            raise ValueError("token_ids_logprob must be a flat list of token ids for one prompt")
        if len(v) != n:
            raise ValueError(f"token_ids_logprob has {len(v)} lists for {n} prompts")
        return list(v[i])


class OpenSessionRequest(ApiSchema):
    capacity_of_str_len: int = Field(1 << 16, ge=1)
    session_id: str | None = Field(None, min_length=1, max_length=256)


class CloseSessionRequest(ApiSchema):
    session_id: str = Field(min_length=1, max_length=256)
