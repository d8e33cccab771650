"""Turns a request's GenerateOut chunks into SGLang's /generate response body.

Stop conditions are decided in one place, the leader's StopChecker (sampling.py); here the text
is only trimmed at the stop string it reported (unless no_stop_trim), as SGLang does. The
output ids keep the tokens that completed the stop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..wire import encode_array
from .messages import GenerateOut, GenerateReq


@dataclass(frozen=True)
class OutputOptions:
    """What the request asked of its output (SamplingParams and request fields)."""
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    text_in_logprobs: bool = False
    prefill_only: bool = False     # max_new_tokens 0: report the prompt, drop the one token


class OutputAssembler:
    def __init__(self, req: GenerateReq, dp_rank: int, tokenizer: Any, weight_version: str,
                 model_config: Any = None, options: OutputOptions = OutputOptions()):
        self.req, self.dp_rank, self.tokenizer = req, dp_rank, tokenizer
        self.weight_version = weight_version
        self.model_config = model_config
        self.options = options
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.text = ""
        self.finished = False
        self.finish_reason: dict[str, Any] | None = None
        self.last: GenerateOut | None = None

    def add(self, chunk: GenerateOut) -> None:
        self.last = chunk
        self.output_ids.extend(chunk.token_ids)
        if chunk.logprobs is not None:
            self.logprobs.extend(chunk.logprobs)
        if chunk.finished:
            self.finished, self.finish_reason = True, chunk.finish_reason
            if self.options.prefill_only:
                self.output_ids, self.logprobs = [], []
                self.finish_reason = {"type": "length", "length": 0}
        self.text = self._decode(self.output_ids)
        matched = (self.finish_reason or {}).get("matched")
        if self.finished and isinstance(matched, str) and not self.options.no_stop_trim:
            cut = self.text.rfind(matched)
            if cut >= 0:
                self.text = self.text[:cut]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.options.skip_special_tokens)

    def response(self) -> dict[str, Any]:
        last = self.last
        meta: dict[str, Any] = {
            "id": self.req.rid,
            "prompt_tokens": last.prompt_tokens if last else len(self.req.input_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": last.cached_tokens if last else 0,
            "finish_reason": self.finish_reason if self.finished else None,
            "dp_rank": last.dp_rank if last else self.dp_rank,
            "weight_version": self.weight_version,
        }
        if self.req.return_logprob:
            text_of = (lambda t: self._decode([t])) if self.options.text_in_logprobs else \
                (lambda t: None)
            meta["output_token_logprobs"] = [
                [lp, tid, text_of(tid)] for lp, tid in zip(self.logprobs, self.output_ids)]
            if self.req.logprob_start_len >= 0 and last is not None and \
                    last.input_logprobs is not None:
                start, prompt = self.req.logprob_start_len, self.req.input_ids
                lps = [None] * (start == 0) + list(last.input_logprobs)
                meta["input_token_logprobs"] = [
                    [lp, tid, text_of(tid)] for lp, tid in zip(lps, prompt[start:])]
        if self.req.return_routed_experts and last is not None and self.finished:
            self._add_routed_experts(meta)
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}

    def _add_routed_experts(self, meta: dict[str, Any]) -> None:
        last = self.last
        if last.routed_experts is None:
            meta["routed_experts"] = None
            return
        # One row per token that went through the model (a stop string may have cut some).
        rows = meta["prompt_tokens"] + meta["completion_tokens"] - 1
        meta["routed_experts"], meta["routed_experts_shape"] = encode_array(
            np.asarray(_to_numpy(last.routed_experts))[:rows], "int32")
        if last.routed_weights is not None:
            meta["routed_expert_weights"], _ = encode_array(
                np.asarray(_to_numpy(last.routed_weights))[:rows], "float32")


def _to_numpy(x: Any) -> Any:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else x
