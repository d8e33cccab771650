"""A parsed /generate body checked against what the server serves (vocabulary, context length,
--max-new-tokens-limit, dp_size) and expanded into one engine GenerateReq per prompt and sample.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from ..policies.dp_rank_pin import resolve_dp_rank_pin
from .api_models import TOP_K_ALL, GenerateRequest, SamplingParamsIn, as_list
from .logprobs import check_logprob_request
from .messages import GenerateReq, SamplingParams

MAX_BATCH = 256              # ours: prompts (and samples) per batched request


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against: the served model and the server's flags."""

    vocab_size: int
    context_length: int
    max_new_tokens_limit: int
    dp_size: int

    def pick_dp_rank(self, body: GenerateRequest, header: str | None) -> int | None:
        """The one DP-rank pin rule (policies/dp_rank_pin), shared with the SGLang plugin."""
        return resolve_dp_rank_pin(body.routed_dp_rank, body.data_parallel_rank, header,
                                   self.dp_size)

    def check_prompt(self, ids: list[int], sp: SamplingParamsIn) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:8]} outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.context_length:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context length is "
                             f"{self.context_length} (at least one token must be generated)")
        if sp.max_new_tokens is None:  # up to the context length (the leader's limit)
            pass
        elif sp.max_new_tokens > self.max_new_tokens_limit:
            raise ValueError(f"max_new_tokens={sp.max_new_tokens} exceeds "
                             f"--max-new-tokens-limit {self.max_new_tokens_limit}")
        elif len(ids) + sp.max_new_tokens > self.context_length:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens "
                             f"({sp.max_new_tokens}) exceeds the context length "
                             f"{self.context_length}")
        bad_stop = [t for t in sp.stop_token_ids or [] if not 0 <= t < self.vocab_size]
        if bad_stop:
            raise ValueError(f"stop_token_ids {bad_stop[:8]} outside the vocabulary")
        bad_bias = [k for k in sp.logit_bias if not 0 <= int(k) < self.vocab_size]
        if bad_bias:
            raise ValueError(f"logit_bias keys {bad_bias[:8]} outside [0, {self.vocab_size})")

    def logprob_fields(self, body: GenerateRequest, i: int, n: int, prompt_len: int
                       ) -> dict[str, Any]:
        """GenerateReq's logprob fields for prompt i of n. As SGLang, they mean nothing without
        return_logprob, and logprob_start_len -1 (or the prompt length) scores no prompt token."""
        if not body.per_prompt("return_logprob", i, n):
            return {}
        start = body.per_prompt("logprob_start_len", i, n)
        if not -1 <= start <= prompt_len:
            raise ValueError(f"logprob_start_len must be -1 or in [0, {prompt_len}] (the prompt "
                             f"length), got {start}")
        top = body.per_prompt("top_logprobs_num", i, n)
        token_ids = body.token_ids_logprob_for(i, n)
        check_logprob_request(top, token_ids, self.vocab_size)
        return {"return_logprob": True, "logprob_start_len": start, "top_logprobs_num": top,
                "token_ids_logprob": token_ids}

    def to_engine_sampling(self, sp: SamplingParamsIn, sample_index: int = 0) -> SamplingParams:
        """The engine's SamplingParams. max_new_tokens 0 (prefill only, as sglang.lang's
        cache_prefix and select send it) runs one step whose token the HTTP layer drops; None
        (null) is --max-new-tokens-limit, which the leader caps at the context length."""
        seed = sp.effective_seed
        greedy = sp.is_greedy
        return SamplingParams(
            max_new_tokens=(self.max_new_tokens_limit if sp.max_new_tokens is None
                            else max(1, sp.max_new_tokens)),
            temperature=0.0 if greedy else sp.temperature,
            top_p=sp.top_p, top_k=-1 if sp.top_k >= TOP_K_ALL else sp.top_k, min_p=sp.min_p,
            stop=as_list(sp.stop), stop_token_ids=list(sp.stop_token_ids or []),
            ignore_eos=sp.ignore_eos,
            seed=None if seed is None else seed + sample_index,
            min_new_tokens=sp.min_new_tokens, frequency_penalty=sp.frequency_penalty,
            presence_penalty=sp.presence_penalty, repetition_penalty=sp.repetition_penalty,
            stop_regex=as_list(sp.stop_regex),
            logit_bias={int(k): float(v) for k, v in sp.logit_bias.items()})

    def to_generate_reqs(self, body: GenerateRequest, encode, dp_header: str | None = None
                         ) -> list[tuple[GenerateReq, SamplingParamsIn]]:
        """One GenerateReq per (prompt, sample), prompt-major; ``encode`` tokenizes text."""
        prompts = body.prompts()
        if not prompts or len(prompts) > MAX_BATCH:
            raise ValueError(f"a batch must have 1 to {MAX_BATCH} prompts, got {len(prompts)}")
        if body.stream and body.is_batch:
            raise ValueError("stream is not supported with a batch of prompts")
        dp_rank = self.pick_dp_rank(body, dp_header)
        out = []
        for i, prompt in enumerate(prompts):
            sp = body.per_prompt("sampling_params", i, len(prompts))
            ids = encode(prompt) if isinstance(prompt, str) else list(prompt)
            self.check_prompt(ids, sp)
            rid = body.per_prompt("rid", i, len(prompts))
            if rid is not None and body.is_batch and isinstance(body.rid, str):
                rid = f"{rid}_{i}"  # SGLang's io_struct._normalize_rid for one rid on a batch
            if body.stream and sp.n > 1:
                raise ValueError("stream is not supported with n > 1")
            logprobs = self.logprob_fields(body, i, len(prompts), len(ids))
            if body.return_routed_experts and body.routed_experts_start_len > len(ids):
                raise ValueError(f"routed_experts_start_len must be in [0, {len(ids)}] (the "
                                 f"prompt length), got {body.routed_experts_start_len}")
            for j in range(sp.n):
                req_id = rid or uuid.uuid4().hex
                out.append((GenerateReq(
                    rid=req_id if sp.n == 1 else f"{req_id}-{j}", input_ids=ids,
                    sampling=self.to_engine_sampling(sp, j),
                    return_routed_experts=body.return_routed_experts,
                    routed_experts_start_len=(body.routed_experts_start_len
                                              if body.return_routed_experts else 0),
                    routed_dp_rank=dp_rank, stream=body.stream, **logprobs), sp))
        if len(out) > MAX_BATCH:
            raise ValueError(f"{len(out)} samples in one request; the limit is {MAX_BATCH}")
        rids = [req.rid for req, _ in out]
        if len(set(rids)) != len(rids):
            repeated = sorted({r for r in rids if rids.count(r) > 1})
            raise ValueError(f"request ids must be unique within a request; repeated: "
                             f"{repeated[:8]}")
        return out
