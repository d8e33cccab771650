"""The DP-group leader's scheduling state: queues, KV pages, the prefix cache, sampling, outputs.

Continuous batching as SGLang by default: a step is either an extend batch (chunks of prompts,
at most --chunked-prefill-size tokens, in-progress chunked requests first, then waiting requests
FIFO) or, when nothing is to be prefilled, a decode batch of every running request. A decode
that finds no free page evicts the prefix cache, then retracts the newest request (its computed
pages go to the prefix cache, so its recompute is mostly a cache hit).
"""

from __future__ import annotations

import logging
import random
from collections import deque
from typing import TYPE_CHECKING

import torch

from ..policies.r3_buffer import r3_buffer_bytes
from ..tokenizer import load_model_tokenizer
from .batch import ForwardPlan, Req, build_plan
from .kv_cache import OutOfPages, PageAllocator, RoutedExpertsBuffer, slots_of
from .logprobs import check_logprob_request, score_rows
from .messages import GenerateOut, GenerateReq
from .prefix_cache import create_prefix_cache
from .sampling import (StopChecker, make_generator, model_logprobs, return_original_logprob,
                       sample_token, validate_sampling)

if TYPE_CHECKING:
    from .model_runner import EngineForwardContext, ModelRunner

logger = logging.getLogger(__name__)


class LeaderScheduler:
    def __init__(self, runner: "ModelRunner", out_queue, prefix_cache: str = "radix"):
        self.runner, self.args, self.out_queue = runner, runner.args, out_queue
        self.cfg, self.dp_rank, self.ps = runner.cfg, runner.info.dp_rank, runner.page_size
        self.allocator = PageAllocator(runner.num_pages, self.ps)
        self.cache = create_prefix_cache(prefix_cache, self.allocator)
        self.cache_epoch = 0   # bumped by a flush: older requests' K/V must not be cached
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        # Stop strings match the text the HTTP side decodes: the same tokenizer, loaded the
        # same way.
        tokenizer = load_model_tokenizer(runner.model_dir, self.cfg)
        self.stop_checker = StopChecker(self.cfg.eos_token_id, tokenizer.decode)
        # what min_new_tokens holds back besides a request's stop_token_ids (SGLang's
        # BatchedMinNewTokensPenalizer: the EOS ids, whatever ignore_eos says)
        self.eos_ids = () if self.cfg.eos_token_id is None else (self.cfg.eos_token_id,)
        self.original_logprobs = return_original_logprob()  # SGLang's env switch, read once
        self.seeds = random.Random(self.args.random_seed * 1000 + self.dp_rank)
        self.prefix_hit_tokens = self.prompt_tokens = 0
        self.r3 = None
        if self.args.enable_return_routed_experts:
            self.r3 = RoutedExpertsBuffer(runner.num_pages * self.ps, self.cfg.num_hidden_layers,
                                          self.cfg.num_experts_per_tok)
            _check_r3_size(self.r3, self.cfg, runner.max_total_tokens, self.ps)

    # ---- intake -----------------------------------------------------------------------------
    def add_request(self, msg: GenerateReq) -> None:
        try:
            self._validate(msg)
        except ValueError as e:
            self._send(GenerateOut(msg.rid, [], finished=True, finish_reason={"type": "abort"},
                                   prompt_tokens=len(msg.input_ids), dp_rank=self.dp_rank,
                                   error=str(e)))
            return
        seed = msg.sampling.seed if msg.sampling.seed is not None else self.seeds.getrandbits(62)
        req = Req(msg.rid, list(msg.input_ids), msg.sampling, msg.return_logprob,
                  msg.return_routed_experts, msg.stream, generator=make_generator(seed),
                  logprob_start_len=msg.logprob_start_len if msg.return_logprob else -1,
                  top_logprobs_num=msg.top_logprobs_num if msg.return_logprob else 0,
                  token_ids_logprob=msg.token_ids_logprob if msg.return_logprob else None,
                  routed_experts_start_len=msg.routed_experts_start_len)
        self.waiting.append(req)

    def _validate(self, msg: GenerateReq) -> None:
        n, v = len(msg.input_ids), self.cfg.vocab_size
        if n == 0:
            raise ValueError("the prompt is empty")
        if any(not isinstance(t, int) or not 0 <= t < v for t in msg.input_ids):
            raise ValueError(f"input_ids must be token ids in [0, {v})")
        if n >= self.runner.context_length:
            raise ValueError(f"the prompt has {n} tokens; the context length is "
                             f"{self.runner.context_length}")
        if n + 1 > self.runner.max_total_tokens:
            raise ValueError(f"the prompt has {n} tokens; the KV cache holds "
                             f"{self.runner.max_total_tokens}")
        if msg.return_routed_experts and self.r3 is None:
            raise ValueError("return_routed_experts needs --enable-return-routed-experts")
        if any(r.rid == msg.rid for r in [*self.waiting, *self.running]):
            raise ValueError(f"request id {msg.rid!r} is already in use")
        if not 0 <= msg.routed_experts_start_len <= n:  # SGLang aborts such a request
            raise ValueError(f"routed_experts_start_len must be in [0, {n}] (the prompt "
                             f"length), got {msg.routed_experts_start_len}")
        if not -1 <= msg.logprob_start_len <= n:
            raise ValueError(f"logprob_start_len must be in [-1, {n}] (the prompt length), got "
                             f"{msg.logprob_start_len}")
        check_logprob_request(msg.top_logprobs_num, msg.token_ids_logprob, v)
        validate_sampling(msg.sampling, v)

    def abort(self, rid: str) -> None:
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                req.finish_reason = {"type": "abort"}
                self._send(self._output(req))
        for req in list(self.running):
            if req.rid == rid:
                req.finish_reason = {"type": "abort"}
                self._finish(req)

    def abort_all(self) -> None:
        for req in [*self.waiting, *self.running]:
            self.abort(req.rid)

    def flush_cache(self) -> bool:
        self.cache.reset()
        self.cache_epoch += 1
        return True

    # ---- pages ------------------------------------------------------------------------------
    def _reserve(self, n: int) -> list[int] | None:
        if n > self.allocator.num_free:
            self.cache.evict(n - self.allocator.num_free)
        try:
            return self.allocator.alloc(n)
        except OutOfPages:
            return None

    def _grow(self, req: Req, num_tokens: int) -> bool:
        """Makes req's page table cover num_tokens tokens."""
        need = -(-num_tokens // self.ps) - len(req.pages)
        if need <= 0:
            return True
        pages = self._reserve(need)
        if pages is None:
            return False
        req.pages += pages
        return True

    def _admit(self, req: Req) -> None:
        # Keep one token out of the match: its logits give the next token; with prompt
        # logprobs, also every position whose logits score a requested prompt token.
        keep = len(req.all_ids) - 1
        if req.logprob_start_len >= 0:
            keep = min(keep, req.first_scored - 1)
        match = self.cache.match_prefix(req.all_ids[:keep])
        self.cache.lock(match.handle)
        self.allocator.incref(match.pages)
        req.pages, req.num_computed, req.cache_handle = list(match.pages), match.num_tokens, \
            match.handle
        req.epoch = self.cache_epoch
        if match.copy_tokens:
            # The match goes on part-way into a cached page: copy those rows into a page of
            # the request's own (its first forward does) rather than recompute them. The
            # source rows stay intact until then: rows are only written by forwards.
            own = self._reserve(1)
            if own is not None:
                k, ps = match.copy_tokens, self.ps
                req.pending_copy = ([match.copy_page * ps + i for i in range(k)],
                                    [own[0] * ps + i for i in range(k)])
                req.pages.append(own[0])
                req.num_computed += k

    def _on_admitted(self, req: Req) -> None:
        if not req.admitted:
            req.cached_tokens = req.num_computed
            self.prefix_hit_tokens += req.num_computed
            self.prompt_tokens += len(req.prompt_ids)
        req.admitted, req.in_prefill = True, True
        self.running.append(req)

    def _release(self, req: Req) -> None:
        """Gives the request's computed whole pages to the prefix cache and drops its pages."""
        computed = req.num_computed
        if req.pending_copy is not None:  # released before its copy ran: that page is not
            req.pending_copy = None       # filled
            computed -= computed % self.ps
        if computed and getattr(req, "epoch", 0) == self.cache_epoch:
            # Whole pages and the partial last one (copy-on-write matches read it).
            self.cache.insert(req.all_ids[:computed], req.pages[:-(-computed // self.ps)])
        self.allocator.decref(req.pages)
        self.cache.unlock(req.cache_handle)
        req.pages, req.cache_handle = [], None

    def _retract(self, req: Req) -> None:
        self._release(req)
        self.running.remove(req)
        req.num_computed = 0
        self.waiting.appendleft(req)
        logger.info("retracted request %s (KV cache full)", req.rid)

    # ---- scheduling -------------------------------------------------------------------------
    def schedule(self) -> tuple[ForwardPlan | None, list[Req], list[int]]:
        reqs, chunks = self._schedule_extend()
        mode = "extend"
        if not reqs:
            reqs, mode = self._schedule_decode(), "decode"
            chunks = [1] * len(reqs)
        if not reqs:
            return None, [], []
        a = self.runner.info.attn_tp_size
        # Record every batch: a later request may hit these tokens in the prefix cache.
        record = self.r3 is not None
        plan = build_plan(mode, reqs, chunks, self.ps, a, self.args.enable_prefill_padding,
                          max(self.cfg.engram_max_ngram_size - 1, 0), record)
        copies = [r.pending_copy for r in reqs if r.pending_copy is not None]
        if copies:
            plan.copy_src = torch.tensor([s for src, _ in copies for s in src], dtype=torch.long)
            plan.copy_dst = torch.tensor([d for _, dst in copies for d in dst], dtype=torch.long)
            if self.r3 is not None:
                self.r3.copy_rows(plan.copy_src, plan.copy_dst)
            for r in reqs:
                r.pending_copy = None
        return plan, reqs, chunks

    def _schedule_extend(self) -> tuple[list[Req], list[int]]:
        budget = self.args.chunked_prefill_size
        reqs, chunks = [], []
        for req in self.running:
            if req.in_prefill and budget > 0:
                n = min(req.num_pending, budget)
                if not self._grow(req, req.num_computed + n):
                    break
                reqs.append(req)
                chunks.append(n)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.args.max_running_requests:
            req = self.waiting[0]
            self._admit(req)
            n = min(req.num_pending, budget)
            if not self._grow(req, req.num_computed + n):
                self._release(req)
                req.num_computed = 0
                if not self.running:   # validation makes this unreachable; never hang on it
                    self.waiting.popleft()
                    self._send(GenerateOut(req.rid, [], finished=True, dp_rank=self.dp_rank,
                                           finish_reason={"type": "abort"},
                                           error="the request does not fit the KV cache"))
                    continue
                break
            self.waiting.popleft()
            self._on_admitted(req)
            reqs.append(req)
            chunks.append(n)
            budget -= n
        if not reqs and self.running and all(r.in_prefill for r in self.running) and \
                len(self.running) > 1:
            # Chunked prefills hold every page and none can grow: make room for the oldest.
            self._retract(self.running[-1])
        return reqs, chunks

    def _schedule_decode(self) -> list[Req]:
        while True:
            batch = [r for r in self.running if not r.in_prefill]
            if all(self._grow(r, r.num_computed + 1) for r in batch):
                return batch
            if len(self.running) <= 1:
                req = self.running[0]
                req.finish_reason = {"type": "abort", "message": "the KV cache is full"}
                self._finish(req)
                continue
            self._retract(self.running[-1])

    # ---- results ----------------------------------------------------------------------------
    def process_results(self, plan: ForwardPlan, reqs: list[Req], chunks: list[int],
                        hidden: torch.Tensor, ctx: "EngineForwardContext") -> None:
        if plan.record_routing:
            rows = slice(ctx.dp_offset, ctx.dp_offset + plan.padded_tokens)
            self.r3.write(plan.slots, ctx.routed, rows)
        logits = self.runner.compute_logits(hidden, plan.logit_rows) if plan.logit_rows else None
        # logits rows, per request in order: the rows scoring its prompt tokens (prompt
        # logprobs), then its sampled row once nothing is pending.
        row, scored, sampled = 0, [], []
        for req, n, targets in zip(reqs, chunks, plan.score_targets):
            if targets:
                scored.append((req, row, targets))
                row += len(targets)
            req.num_computed += n
            if not req.num_pending:
                sampled.append((req, row))
                row += 1
        if scored:
            self._score_prompts(logits, scored)
        if sampled:
            self._sample(logits[[r for _, r in sampled]], [req for req, _ in sampled])

    def _score_prompts(self, logits: torch.Tensor,
                       scored: list[tuple[Req, int, list[int]]]) -> None:
        """Prompt logprobs of the step's scoring rows, in one pass on the logits' device."""
        rows = [at + i for _, at, targets in scored for i in range(len(targets))]
        spans = [(req, len(targets)) for req, _, targets in scored]
        logprobs, extras = score_rows(
            model_logprobs(logits[rows]), [t for _, _, targets in scored for t in targets],
            [req.top_logprobs_num for req, n in spans for _ in range(n)],
            [req.token_ids_logprob for req, n in spans for _ in range(n)])
        at = 0
        for req, n in spans:
            req.input_logprobs += logprobs[at:at + n]
            if req.wants_extras:
                req.input_extras.extend(extras.window(at, at + n))
            at += n

    def _sample(self, logits: torch.Tensor, reqs: list[Req]) -> None:
        """One host copy of the sampled rows, each request's token, then one log_softmax pass
        over the rows of the requests that return logprobs."""
        rows = logits.float().cpu()
        tokens, scored, scored_tokens, scored_logits = [], [], [], []
        for i, req in enumerate(reqs):
            token, lp_logits = sample_token(rows[i], req.sampling, req.generator, req.output_ids,
                                            stop_ids=self.eos_ids,
                                            logprob_logits=req.return_logprob,
                                            original=self.original_logprobs)
            tokens.append(token)
            if lp_logits is not None:
                scored.append(req)
                scored_tokens.append(token)
                scored_logits.append(lp_logits)
        if scored:
            logprobs, extras = score_rows(model_logprobs(torch.stack(scored_logits)),
                                          scored_tokens,
                                          [req.top_logprobs_num for req in scored],
                                          [req.token_ids_logprob for req in scored])
            for at, req in enumerate(scored):
                req.output_logprobs.append(logprobs[at])
                if req.wants_extras:
                    req.output_extras.extend(extras.window(at, at + 1))
        for req, token in zip(reqs, tokens):
            req.in_prefill = False
            req.output_ids.append(token)
            limit = min(req.sampling.max_new_tokens,
                        self.runner.context_length - len(req.prompt_ids))
            req.finish_reason = self.stop_checker.check(req.output_ids, req.sampling, limit)
            if req.finish_reason is not None:
                self._finish(req)
            elif req.stream:
                self._send(self._output(req))

    def _finish(self, req: Req) -> None:
        out = self._output(req)
        if self.r3 is not None and req.return_routed_experts:
            # the rows of the tokens the model ran: fewer than the prompt for an abort in the
            # middle of a chunked prefill (a disconnect, a weight update's abort_all)
            n = min(len(req.all_ids) - 1, req.num_computed)
            start = min(req.routed_experts_start_len, n)
            ids, weights = self.r3.read(slots_of(req.pages, start, n, self.ps))
            out.routed_experts, out.routed_weights = ids.numpy(), weights.numpy()
        self._release(req)
        self.running.remove(req)
        self._send(out)

    def _output(self, req: Req) -> GenerateOut:
        new = req.output_ids[req.num_sent:]
        logprobs = req.output_logprobs[req.num_sent:] if req.return_logprob else None
        out = GenerateOut(req.rid, new, logprobs, req.finish_reason is not None,
                          req.finish_reason, len(req.prompt_ids), len(req.output_ids),
                          req.cached_tokens, self.dp_rank)
        if req.wants_extras:
            out.output_extras = req.output_extras.window(req.num_sent)
        req.num_sent = len(req.output_ids)
        # The prompt's logprobs are complete once a token was sampled after it.
        if req.logprob_start_len >= 0 and req.output_ids and not req.input_sent:
            out.input_logprobs = list(req.input_logprobs)
            out.input_extras = req.input_extras if req.wants_extras else None
            req.input_sent = True
        return out

    def _send(self, out: GenerateOut) -> None:
        self.out_queue.put(out)

    # ---- stats ------------------------------------------------------------------------------
    @property
    def kv_used_tokens(self) -> int:
        return (self.allocator.num_usable - self.allocator.num_free) * self.ps

    def check_integrity(self) -> None:
        """Only when no request runs: every page is then free or the prefix cache's alone."""
        self.cache.check_integrity()
        self.allocator.check()
        used = self.allocator.num_usable - self.allocator.num_free
        if not self.running and used != self.cache.num_cached_pages:
            raise AssertionError(f"{used} pages in use with no request running, "
                                 f"{self.cache.num_cached_pages} held by the prefix cache")


def _check_r3_size(r3: RoutedExpertsBuffer, cfg, max_total_tokens: int, page_size: int) -> None:
    """The buffer must be what SGLang allocates and the deployment planner budgets for."""
    planned = r3_buffer_bytes(cfg, max_total_tokens, page_size)
    if planned != r3.nbytes:
        raise RuntimeError(f"R3 buffer has {r3.nbytes} bytes, SGLang's rule gives {planned}")
    logger.info("R3 host buffer: %.2f MiB of expert ids (+ as much for weights)", r3.nbytes / 2**20)
