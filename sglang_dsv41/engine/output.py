"""Turns a request's GenerateOut chunks into SGLang's /generate response body.

Stop conditions are decided in one place, the leader's StopChecker (sampling.py); here the text
is only trimmed at the stop string it reported (unless no_stop_trim), as SGLang does. The
output ids keep the tokens that completed the stop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..tokenizer import IncrementalDecoder
from ..wire import encode_array
from .logprobs import LogprobExtras
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
        self.output_extras = LogprobExtras()
        self.input_logprobs: list[float] | None = None   # set by the chunk that carries them
        self.input_extras = LogprobExtras()
        self._token_text: dict[int, str] = {}
        self.text = ""
        self._text_stream = IncrementalDecoder(self._decode)
        self.finished = False
        self.finish_reason: dict[str, Any] | None = None
        self.last: GenerateOut | None = None

    def add(self, chunk: GenerateOut) -> None:
        self.last = chunk
        self.output_ids.extend(chunk.token_ids)
        if chunk.logprobs is not None:
            self.logprobs.extend(chunk.logprobs)
        if chunk.output_extras is not None:
            self.output_extras.extend(chunk.output_extras)
        if chunk.input_logprobs is not None:
            self.input_logprobs = list(chunk.input_logprobs)
            if chunk.input_extras is not None:
                self.input_extras = chunk.input_extras
        if chunk.finished:
            self.finished, self.finish_reason = True, chunk.finish_reason
            if self.options.prefill_only:
                self.output_ids, self.logprobs = [], []
                self.output_extras.clear()
                self.finish_reason = {"type": "length", "length": 0}
                self.text = ""
        # Cumulative text built from increments: decoding every id again per chunk would make a
        # streamed answer quadratic in its length.
        self.text += self._text_stream.step(self.output_ids, final=self.finished)
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
            self._add_logprobs(meta)
        if self.req.return_routed_experts and last is not None and self.finished:
            self._add_routed_experts(meta)
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}

    def _add_logprobs(self, meta: dict[str, Any]) -> None:
        """SGLang's logprob keys: [logprob, token id, text or None] per token; the top-N and
        token-id lists hold such entries per position, None where SGLang has none (always the
        logprob_start_len position; any position whose token-id list is empty)."""
        req = self.req
        start = req.logprob_start_len
        scored = start >= 0 and self.input_logprobs is not None
        input_ids = req.input_ids[start:] if scored else []
        meta["input_token_logprobs"] = [
            self._entry(lp, t) for lp, t in zip([None, *(self.input_logprobs or [])], input_ids)]
        meta["output_token_logprobs"] = [
            self._entry(lp, t) for lp, t in zip(self.logprobs, self.output_ids)]
        meta["output_token_logprobs_length"] = len(self.output_ids)
        if req.top_logprobs_num > 0:
            meta["input_top_logprobs"] = [None, *self._rows(
                self.input_extras.top_values, self.input_extras.top_ids)][:len(input_ids)]
            meta["output_top_logprobs"] = self._rows(self.output_extras.top_values,
                                                     self.output_extras.top_ids)
        if req.token_ids_logprob is not None:
            ids = req.token_ids_logprob
            meta["input_token_ids_logprobs"] = [None, *self._rows(
                self.input_extras.ids_values, [ids] * len(self.input_extras))][:len(input_ids)]
            meta["output_token_ids_logprobs"] = self._rows(
                self.output_extras.ids_values, [ids] * len(self.output_extras))

    def _rows(self, values: list[list[float]], ids: list[list[int]]) -> list[Any]:
        return [[self._entry(v, t) for v, t in zip(vs, ts)] if vs else None
                for vs, ts in zip(values, ids)]

    def _entry(self, logprob: float | None, token: int) -> list[Any]:
        if not self.options.text_in_logprobs:
            return [logprob, token, None]
        # SGLang decodes each id alone, special tokens included (batch_decode's default).
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode(
                [token], skip_special_tokens=False)
        return [logprob, token, text]

    def _add_routed_experts(self, meta: dict[str, Any]) -> None:
        last = self.last
        if last.routed_experts is None:
            meta["routed_experts"] = None
            return
        # One row per token that went through the model from routed_experts_start_len on (a
        # stop string may have cut some).
        rows = (meta["prompt_tokens"] + meta["completion_tokens"] - 1
                - self.req.routed_experts_start_len)
        meta["routed_experts"], meta["routed_experts_shape"] = encode_array(
            np.asarray(_to_numpy(last.routed_experts))[:rows], "int32")
        if last.routed_weights is not None:
            meta["routed_expert_weights"], _ = encode_array(
                np.asarray(_to_numpy(last.routed_weights))[:rows], "float32")


def _to_numpy(x: Any) -> Any:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else x
