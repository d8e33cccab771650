"""Stage objects of a scheduler step: Req (leader-side request state) and ForwardPlan (what every
rank of a DP group runs this step; built by the leader, broadcast to its attention-TP peers)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..policies.dp_attention import plan_prefill_padding
from .kv_cache import DUMMY_PAGE, DUMMY_SLOT, slots_of
from .logprobs import LogprobExtras
from .messages import SamplingParams


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    return_routed_experts: bool = False
    stream: bool = False
    routed_experts_start_len: int = 0
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)    # page table; one reference held on each
    num_computed: int = 0        # leading tokens of all_ids whose K/V sit in the pool
    cached_tokens: int = 0       # tokens served by the prefix cache at (first) admission
    admitted: bool = False
    in_prefill: bool = False     # admitted, next token not sampled yet (extend batches)
    epoch: int = 0               # prefix-cache epoch its K/V belong to (a flush bumps it)
    cache_handle: Any = None     # locked prefix-cache node (set by the leader at admission)
    # (src, dst) slots of a prefix-cache page matched part-way, copied into this request's own
    # page by its first forward (ForwardPlan.copy_src/copy_dst)
    pending_copy: tuple[list[int], list[int]] | None = None
    generator: torch.Generator | None = None
    finish_reason: dict[str, Any] | None = None
    num_sent: int = 0            # output tokens already streamed
    logprob_start_len: int = -1  # >= 0: collect input_logprobs of prompt tokens from there
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    input_logprobs: list[float] = field(default_factory=list)
    input_extras: LogprobExtras = field(default_factory=LogprobExtras)
    input_sent: bool = False     # the prompt's logprobs went out (in the first chunk after it)
    output_extras: LogprobExtras = field(default_factory=LogprobExtras)

    @property
    def first_scored(self) -> int:
        """The first prompt position whose logprob is returned: as SGLang, the one after
        logprob_start_len (whose own entry is None)."""
        return self.logprob_start_len + 1

    @property
    def wants_extras(self) -> bool:
        return self.return_logprob and (self.top_logprobs_num > 0
                                        or self.token_ids_logprob is not None)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_pending(self) -> int:
        """Tokens to run through the model before the next token can be sampled."""
        return len(self.prompt_ids) + len(self.output_ids) - self.num_computed


@dataclass
class ForwardPlan:
    """One DP group's forward. Rows [0, num_tokens) are real, the rest padding (dummy slot)."""
    mode: str                       # "extend" (prefill chunks) | "decode" | "idle"
    input_ids: torch.Tensor         # int64 [T_pad]
    positions: torch.Tensor         # int64 [T_pad]
    slots: torch.Tensor             # int64 [T_pad] where this forward's cache rows are written
    num_tokens: int
    seq_lens: list[int] = field(default_factory=list)     # tokens per sequence after this forward
    extend_lens: list[int] = field(default_factory=list)  # new tokens per sequence
    # every sequence's slots of positions [0, seq_len), concatenated: the window's latents and
    # the compressors' rows of the whole history are read from these
    context_slots: torch.Tensor | None = None
    # int64 [B, engram_max_ngram_size - 1]: the tokens before each sequence's first new one
    engram_history: torch.Tensor | None = None
    logit_rows: list[int] = field(default_factory=list)   # rows whose next token is sampled
    # per request: the prompt tokens scored by its rows in logit_rows (prompt logprobs), which
    # sit just before its sampled row
    score_targets: list[list[int]] = field(default_factory=list)
    record_routing: bool = False
    # cache rows copied src -> dst before this forward: a prefix matched part-way into a cached
    # page continues in a copy of that page's rows (the shared page is never written)
    copy_src: torch.Tensor | None = None
    copy_dst: torch.Tensor | None = None
    # int32 [B, max_pages], only when every sequence adds exactly one token (a decode forward):
    # the pages holding positions [0, seq_len) of each, rows padded with the dummy page; the
    # paged decode reads each query's window through it
    decode_page_table: torch.Tensor | None = None

    @property
    def padded_tokens(self) -> int:
        """Rows this DP group contributes to the forward's collectives (0 when idle)."""
        return 0 if self.mode == "idle" else int(self.input_ids.shape[0])


def idle_plan() -> ForwardPlan:
    """A DP group without tokens that joins the world's MoE collectives. It runs one placeholder
    row (the model's modules need T >= 1) at the dummy slot, trimmed from every output; its
    group still counts 0 tokens in every collective."""
    one = torch.zeros(1, dtype=torch.long)
    return ForwardPlan("idle", one, one, torch.full((1,), DUMMY_SLOT, dtype=torch.long), 0,
                       context_slots=torch.zeros(0, dtype=torch.long))


def build_plan(mode: str, reqs: list[Req], chunk_lens: list[int], page_size: int,
               attn_tp_size: int, padding: bool, history_len: int, record_routing: bool
               ) -> ForwardPlan:
    """The forward of chunk_lens[i] tokens of reqs[i] (their next uncomputed tokens). The page
    tables must already cover them. history_len: Engram's look-back (max n-gram size - 1)."""
    ids, pos, slots, context_slots, history = [], [], [], [], []
    seq_lens, logit_rows, score_targets = [], [], []
    for req, n in zip(reqs, chunk_lens):
        all_ids, start = req.all_ids, req.num_computed
        ids += all_ids[start:start + n]
        pos += range(start, start + n)
        slots += slots_of(req.pages, start, start + n, page_size)
        context_slots += slots_of(req.pages, 0, start + n, page_size)
        before = all_ids[max(0, start - history_len):start]
        history.append([0] * (history_len - len(before)) + before)
        seq_lens.append(start + n)
        targets = []
        if req.logprob_start_len >= 0:
            first = req.first_scored + len(req.input_logprobs)  # not yet scored (retraction)
            for i in range(max(start, first - 1), min(start + n, len(req.prompt_ids) - 1)):
                logit_rows.append(len(ids) - n + (i - start))
                targets.append(all_ids[i + 1])
        score_targets.append(targets)
        if start + n == len(all_ids):
            logit_rows.append(len(ids) - 1)
    num_tokens = len(ids)
    pad = plan_prefill_padding(num_tokens, attn_tp_size, padding).num_pad
    # Padding rows: a dummy token at the reserved slot, trimmed from every output.
    ids += [0] * pad
    pos += [0] * pad
    slots += [DUMMY_SLOT] * pad
    page_table = None
    if reqs and all(n == 1 for n in chunk_lens):
        used = [-(-s // page_size) for s in seq_lens]
        width = max(used)
        page_table = torch.tensor([req.pages[:u] + [DUMMY_PAGE] * (width - u)
                                   for req, u in zip(reqs, used)], dtype=torch.int32)
    return ForwardPlan(mode, torch.tensor(ids, dtype=torch.long),
                       torch.tensor(pos, dtype=torch.long), torch.tensor(slots, dtype=torch.long),
                       num_tokens, seq_lens=seq_lens, extend_lens=list(chunk_lens),
                       context_slots=torch.tensor(context_slots, dtype=torch.long),
                       engram_history=torch.tensor(history, dtype=torch.long).reshape(len(reqs),
                                                                             history_len),
                       logit_rows=logit_rows, record_routing=record_routing,
                       score_targets=score_targets, decode_page_table=page_table)
