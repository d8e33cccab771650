"""Turns a request's GenerateOut chunks into SGLang's /generate response body.

Stop strings are matched here too, on the whole detokenized text: the leader's StopChecker
(sampling.py) decides when generation stops, but it decodes only a tail of the output ids, so a
stop string spanning ids that decode to nothing (specials, reserved ids) can slip past it. The
text is cut before the stop string and the ids after the token that completed it.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from .messages import GenerateOut, GenerateReq


def encode_array(x: Any, dtype: str) -> tuple[str, list[int]]:
    """base64 of the little-endian bytes of ``x`` (numpy or CPU torch) and its shape."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    arr = np.ascontiguousarray(np.asarray(x), dtype=np.dtype(dtype).newbyteorder("<"))
    return base64.b64encode(arr.tobytes()).decode("ascii"), list(arr.shape)


class OutputAssembler:
    def __init__(self, req: GenerateReq, dp_rank: int, tokenizer: Any, weight_version: str,
                 model_config: Any = None):
        self.req, self.dp_rank, self.tokenizer = req, dp_rank, tokenizer
        self.weight_version = weight_version
        self.model_config = model_config
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.text = ""
        self.finished = False
        self.finish_reason: dict[str, Any] | None = None
        self.last: GenerateOut | None = None

    def add(self, chunk: GenerateOut) -> bool:
        """Append a chunk; True when a stop string the scheduler has not acted on ended the
        request here (the engine should then be told to stop generating)."""
        self.last = chunk
        self.output_ids.extend(chunk.token_ids)
        if chunk.logprobs is not None:
            self.logprobs.extend(chunk.logprobs)
        self.text = self.tokenizer.decode(self.output_ids)
        if chunk.finished:
            self.finished, self.finish_reason = True, chunk.finish_reason
        matched = self._match_stop()
        if matched is None:
            return False
        stopped_early = not self.finished
        self.finished = True
        self.finish_reason = {"type": "stop", "matched": matched}
        return stopped_early

    def _match_stop(self) -> str | None:
        hits = [(self.text.find(s), s) for s in self.req.sampling.stop if s in self.text]
        if not hits:
            return None
        cut, stop = min(hits)
        # Keep the ids up to (and including) the first token whose text completes the stop.
        for k in range(1, len(self.output_ids) + 1):
            if stop in self.tokenizer.decode(self.output_ids[:k]):
                del self.output_ids[k:]
                del self.logprobs[k:]
                break
        self.text = self.text[:cut]
        return stop

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
            meta["output_token_logprobs"] = [
                [lp, tid, None] for lp, tid in zip(self.logprobs, self.output_ids)]
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
