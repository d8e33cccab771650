"""Test harness for the engine core: spawns the scheduler ranks directly (no launcher), talks to
their queues, and always kills what it started."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import uuid
from dataclasses import replace

from sglang_dsv41.engine.messages import (ControlOut, ControlReq, GenerateOut, GenerateReq,
                                          RankStats, ReadyMsg, SamplingParams, ShutdownReq)
from sglang_dsv41.engine.scheduler import run_scheduler_process
from sglang_dsv41.server_args import ServerArgs
from sglang_dsv41.ports import free_port


def _rank_main(stderr_path, *args) -> None:
    if stderr_path:
        fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 2)
    from sglang_cpu import install_torchvision_shim

    install_torchvision_shim()   # a rank loading a transformers checkpoint imports transformers
    run_scheduler_process(*args)


# The tiny preset: every V4.1 layer kind (CSA with a top-4 indexer, HCA, ratio-1/2 sources with
# candidate blocks), Engram. The indexers break score ties by the lowest entry, so a prefix
# forward and a whole-sequence forward select the same entries.
ENGINE_TEST_PRESET = "tiny"
ENGINE_TEST_OVERRIDES: dict = {}
V4_TEST_PRESET = "tiny-v4"   # what transformers defines
V4_TEST_OVERRIDES: dict = {}


def engine_test_model(preset: str = ENGINE_TEST_PRESET, overrides: dict | None = None):
    """(config, model) of the engine tests' reference: the preset, overrides, init seed 0."""
    import torch

    from sglang_dsv41.model.dsv4 import get_preset
    from sglang_dsv41.model.dsv4.model import DSV4ForCausalLM, init_weights

    cfg = replace(get_preset(preset), **(ENGINE_TEST_OVERRIDES if overrides is None
                                         else overrides))
    model = DSV4ForCausalLM(cfg)
    init_weights(model, seed=0)
    return cfg, model.eval().requires_grad_(False).to(torch.float32)


def write_flat_checkpoint(path: str, cfg, model) -> str:
    """Our bf16 layout (flat SGLang names, flat config.json), kept fp32 for exact tests."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    cfg.save_pretrained(path)
    save_file({n: t.clone() for n, t in model.state_dict().items()},  # experts: views
              os.path.join(path, "model.safetensors"))
    return path


def reference_greedy(model, prompt: list[int], n: int, serving_numerics: bool = True
                     ) -> list[int]:
    """Whole-sequence recompute per token (no cache), with the server's numerics (ServerArgs
    serving_numerics defaults on)."""
    import torch

    from sglang_dsv41.model.dsv4.context import DSV4Context

    seq = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor(seq), DSV4Context.packed(
            [len(seq)], serving_numerics=serving_numerics))
        seq.append(int(logits[-1].argmax()))
    return seq[len(prompt):]


def reference_logprobs(model, seqs: list[list[int]], record_routing: bool = False,
                       serving_numerics: bool = True, temperature: float = 1.0):
    """[per sequence: logprob of token t+1 at row t under log_softmax(logits / temperature)]
    and the context (routing when asked)."""
    import torch

    from sglang_dsv41.model.dsv4.context import DSV4Context

    ctx = DSV4Context.packed([len(s) for s in seqs], record_routing=record_routing,
                             serving_numerics=serving_numerics)
    logits = model(torch.tensor([t for s in seqs for t in s]), ctx).float()
    logp = torch.log_softmax(logits / temperature, -1)
    out, at = [], 0
    for s in seqs:
        rows = logp[at:at + len(s) - 1]
        out.append(rows.gather(1, torch.tensor(s[1:])[:, None]).squeeze(1))
        at += len(s)
    return out, ctx


def tiny_args(**kw) -> ServerArgs:
    base = dict(model_path="tiny", device="cpu", page_size=4, max_total_tokens=2048,
                chunked_prefill_size=64, stall_timeout=30.0, log_level="warning")
    base.update(kw)
    return ServerArgs(**base)


class RankCluster:
    def __init__(self, args: ServerArgs, model_dir: str | None = None,
                 stderr_dir: str | None = None):
        model_dir = model_dir or args.model_path
        self.args = args
        ctx = mp.get_context("spawn")
        dp = args.effective_dp_size
        self.req_queues = [ctx.Queue() for _ in range(dp)]
        self.out_queue, self.ready_queue = ctx.Queue(), ctx.Queue()
        port = free_port()
        self.stderr_paths = [os.path.join(stderr_dir, f"rank{r}.err") if stderr_dir else None
                             for r in range(args.tp_size)]
        self.procs = []
        for r in range(args.tp_size):
            dp_rank, attn_rank = args.rank_to_dp(r)
            rq = self.req_queues[dp_rank] if attn_rank == 0 else None
            p = ctx.Process(target=_rank_main, daemon=True, name=f"rank{r}",
                            args=(self.stderr_paths[r], args, r, model_dir, port, rq,
                                  self.out_queue, self.ready_queue))
            p.start()
            self.procs.append(p)
        self.outs: dict[str, list[GenerateOut]] = {}
        self.stats: list[RankStats] = []
        self.control_outs: list[ControlOut] = []

    def wait_ready(self, timeout: float = 60.0) -> list[ReadyMsg]:
        msgs, deadline = [], time.monotonic() + timeout
        while len(msgs) < self.args.tp_size:
            msgs.append(self.ready_queue.get(timeout=max(0.1, deadline - time.monotonic())))
        return msgs

    def submit(self, req: GenerateReq, dp_rank: int = 0) -> None:
        self.req_queues[dp_rank].put(req)

    def _drain_one(self, timeout: float) -> None:
        msg = self.out_queue.get(timeout=timeout)
        if isinstance(msg, GenerateOut):
            self.outs.setdefault(msg.rid, []).append(msg)
        elif isinstance(msg, RankStats):
            self.stats.append(msg)
        elif isinstance(msg, ControlOut):
            self.control_outs.append(msg)

    def wait_finished(self, rids: list[str], timeout: float = 60.0) -> dict[str, GenerateOut]:
        deadline = time.monotonic() + timeout
        while not all(self.outs.get(r) and self.outs[r][-1].finished for r in rids):
            self._drain_one(max(0.05, deadline - time.monotonic()))
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests {rids} not finished")
        return {r: merge_chunks(self.outs[r]) for r in rids}

    def generate(self, prompts: list[list[int]], dp_ranks: list[int] | None = None,
                 timeout: float = 60.0, **req_kw) -> list[GenerateOut]:
        sampling = req_kw.pop("sampling", SamplingParams(max_new_tokens=8, temperature=0.0))
        rids = []
        for i, p in enumerate(prompts):
            rid = f"r{uuid.uuid4().hex[:8]}"
            self.submit(GenerateReq(rid, p, replace(sampling), **req_kw),
                        dp_ranks[i] if dp_ranks else 0)
            rids.append(rid)
        outs = self.wait_finished(rids, timeout)
        return [outs[r] for r in rids]

    def control(self, op: str, timeout: float = 30.0, **args) -> list[ControlOut]:
        req_id = uuid.uuid4().hex
        for q in self.req_queues:
            q.put(ControlReq(req_id, op, args))
        deadline = time.monotonic() + timeout
        while sum(c.req_id == req_id for c in self.control_outs) < self.args.tp_size:
            self._drain_one(max(0.05, deadline - time.monotonic()))
        return sorted([c for c in self.control_outs if c.req_id == req_id], key=lambda c: c.rank)

    def wait_stall(self, timeout: float, contains: str = "") -> RankStats:
        """The first stall report whose message contains ``contains``."""
        deadline = time.monotonic() + timeout
        while True:
            for s in self.stats:
                if not s.healthy and contains in (s.stall or ""):
                    return s
            self._drain_one(max(0.05, deadline - time.monotonic()))

    def shutdown(self, timeout: float = 30.0) -> list[int | None]:
        for q in self.req_queues:
            q.put(ShutdownReq())
        for p in self.procs:
            p.join(timeout)
        return [p.exitcode for p in self.procs]

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)

    def __enter__(self) -> "RankCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


def merge_chunks(chunks: list[GenerateOut]) -> GenerateOut:
    """Streamed chunks -> one output (non-streamed requests already have one chunk)."""
    last = chunks[-1]
    ids = [t for c in chunks for t in c.token_ids]
    lps = [x for c in chunks for x in (c.logprobs or [])] if last.logprobs is not None else None
    return replace(last, token_ids=ids, logprobs=lps)


def drain_queue(q, timeout: float = 0.0):
    out = []
    try:
        while True:
            out.append(q.get(timeout=timeout))
    except queue.Empty:
        return out
