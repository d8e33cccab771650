"""Training-step throughput of the real model: our trainer (FSDP2 policy, or compute copies on one
GPU; mixed precision, grouped expert GEMMs, our sink-attention kernel, PPO loss, AdamW) vs
transformers' DeepseekV4ForCausalLM (eager attention; eager and grouped_mm experts), same GPU,
same run.

GPU (the real measurement): python bench/train.py --preset small --seqs 4096,16384,65536
CPU smoke check:            python bench/train.py --preset tiny --seqs 64 --steps 2

A ``--seqs`` item NxLENGTH packs N sequences into ours' one micro-batch (transformers gets them
as a [N, LENGTH] batch): the host cost of a step is shared by more tokens. ``--micro-batches
M`` runs M micro-batches of each shape per optimizer step, as the trainer's mini-batch loop
does (both sides): the AdamW step's fixed cost (fp32 state, memory-bound) is shared by M times
the tokens.

Rows: ours on the preset (V4.1: ratio-1/2 layers, Engram), ours and transformers on its V4 twin
(same sizes, the layer kinds transformers defines: ratios 1/2 become 4, no Engram). MFU counts
6 x active parameters x tokens against the device's bf16 peak; attention FLOPs (3 x forward,
4 H D per query-key pair) are reported separately. A row that runs out of memory says OOM.
The row of the most tokens prints its memory plan (fp32 master weights, gradients, Adam state,
activations); before it runs, each of ours' models prints its planned peak for one sequence of
that many tokens (an upper bound when they are packed sequences: each sees fewer compressed
entries): the static state, every layer's retained bytes plain and checkpointed, measured on
two steps (trainer_bridge/memory_plan.py's probe_length and its half) and extrapolated linearly
(O(T): the attention is sparse, the selection chunked), the norm and head's bytes and the
backward's rise above it all as those steps measured them (chunked: not extrapolated), and the
largest temporaries. ``--checkpointing auto`` checkpoints the layers that plan picks, as the
trainer's model.activation_checkpointing=auto does.

On one GPU ours runs as the trainer does there (``--one-rank``, the trainer's model.one_rank):
without FSDP, on compute-dtype copies of its fp32 weights, when those fit; ``--one-rank fsdp``
runs FSDP2 over the one rank. Under torchrun (FSDP over the ranks; ``torchrun
--nproc-per-node 2 bench/train.py --transformers none --no-twin ...``) each rank steps its own
batch of each shape, rows are per GPU and rank 0 prints.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sglang_dsv41.model.dsv4 import DSV4Config, compressor, get_preset, names  # noqa: E402
from sglang_dsv41.model.dsv4 import token_logprobs  # noqa: E402
from sglang_dsv41.model.dsv4.config import V4  # noqa: E402
from sglang_dsv41.model.dsv4.context import DSV4Context  # noqa: E402
from sglang_dsv41.model.dsv4.model import DSV4ForCausalLM, init_weights  # noqa: E402
from sglang_dsv41.model.dsv4.moe import MoE  # noqa: E402
from trainer_bridge.batch import random_batch, random_tokens  # noqa: E402
from trainer_bridge.config import LossConfig, ModelConfig, OptimConfig  # noqa: E402
from trainer_bridge.dist import close_distributed, init_distributed  # noqa: E402
from trainer_bridge.micro_batch_graphs import MicroBatchGraphs  # noqa: E402
from trainer_bridge import memory_plan as memplan  # noqa: E402
from trainer_bridge.memory_plan import free  # noqa: E402
from trainer_bridge.config import CHECKPOINTING_CHOICES  # noqa: E402
from trainer_bridge.parallelize import ONE_RANK_MODES, layer_checkpointing  # noqa: E402
from trainer_bridge.policy import ForwardState, policy_from_model, resolve_device  # noqa: E402
from trainer_bridge import adamw_triton  # noqa: E402
from trainer_bridge.schedule import build_optimizer  # noqa: E402
from trainer_bridge.trainer import clip_and_step, forward_backward  # noqa: E402

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}
GiB = 2 ** 30


def v4_twin(cfg: DSV4Config) -> DSV4Config:
    """The same sizes with only what transformers' DeepseekV4 defines: V4.1's ratio-1/2 layers
    become CSA (4), no shared kv/index sources, no Engram, V4's mHC and q head norm."""
    return replace(cfg, model_type=V4, compress_ratios=[r if r in (0, 4, 128) else 4
                                                        for r in cfg.compress_ratios],
                   kv_source_layer_ids=[], index_source_layer_ids=[],
                   candidate_source_layer_id=-1, candidate_topk_blocks=0, candidate_block_size=0,
                   engram_layer_ids=[], engram_num_embeddings=[], engram_n_heads=0,
                   engram_head_dim=0, engram_vocab_size=0, engram_compressed_vocab_size=0,
                   engram_max_ngram_size=1, q_head_norm=True, hc_pre_from_prev_sublayer=False)


def active_params(cfg: DSV4Config) -> int:
    """Matmul parameters one token passes through: everything but the embedding, the idle
    routed experts and the Engram tables (buffers, looked up, not multiplied)."""
    with torch.device("meta"):
        model = DSV4ForCausalLM(cfg)
    total = sum(p.numel() for n, p in model.named_parameters() if n != "embed.weight")
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    idle = cfg.n_routed_experts - cfg.num_experts_per_tok
    return total - cfg.num_hidden_layers * idle * per_expert


def attention_flops(cfg: DSV4Config, seq: int) -> float:
    """3 x forward attention (4 H D per query-key pair): the window, plus on compressed layers
    the selected entries (index_topk on ratio 4, every visible entry on 128, the shared top-k
    selection on 1/2)."""
    pairs = 0
    for layer in range(cfg.num_hidden_layers):
        ratio = cfg.compress_ratio(layer)
        w = min(seq, cfg.window_size)
        pairs += w * (w + 1) // 2 + (seq - w) * cfg.window_size
        if ratio:
            seen = torch.arange(1, seq + 1) // ratio
            pairs += int((seen if ratio == 128 else seen.clamp(max=cfg.index_topk)).sum())
    return 3 * 4 * cfg.num_attention_heads * cfg.head_dim * pairs


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory(device: torch.device) -> tuple[int, int]:
    if device.type != "cuda":
        return 0, 0
    return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)


def time_steps(step, args, device, profile_label: str | None, before=None
               ) -> tuple[float, int, float, float]:
    """Median seconds of ``args.steps`` steps after ``args.warmup``; peak bytes; the median CPU
    seconds per step of the calling (main) thread, and of the whole process (every thread: the
    backward's launches come from autograd's device thread). ``before``: run untimed ahead of
    each step. With a ``profile_label``, then ``args.steps`` more steps under torch.profiler (not
    timed) and one under CUDA sync debugging."""
    times, host, process = [], [], []
    for i in range(args.warmup + args.steps):
        if before is not None:
            before()
        sync(device)
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        step()
        # before the sync: its wait is not host work
        c1, p1 = time.thread_time(), time.process_time()
        sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            host.append(c1 - c0)
            process.append(p1 - p0)
    peak = memory(device)[1]
    if profile_label:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(args.steps):
                step()
            sync(device)
        print_profile(prof, profile_label, args.steps, device, args.trace_dir)
        print(host_syncs(step, device), flush=True)
        print(host_python_profile(step, device, args.trace_dir), flush=True)
    return (statistics.median_high(times), peak, statistics.median_high(host),
            statistics.median_high(process))


# Runtime calls that start work on the GPU, and those that make the host wait for it.
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def print_profile(prof, label: str, steps: int, device, trace_dir: str | None) -> None:
    """Per step: self CPU vs self device time, kernel launches, copies and host waits; then
    the top ops by self device and self CPU time (which source line launched them:
    bench/train_ops.py sources)."""
    table = prof.key_averages()
    cpu = sum(e.self_cpu_time_total for e in table) / steps / 1e3
    dev = sum(e.self_device_time_total for e in table) / steps / 1e3
    count = {e.key: e.count for e in table}
    launches = sum(count.get(k, 0) for k in LAUNCH_CALLS) / steps
    waits = sum(count.get(k, 0) for k in SYNC_CALLS) / steps
    copies = count.get("cudaMemcpyAsync", 0) / steps
    print(f"--- {label}: per step: self CPU {cpu:.1f} ms, self {device.type} {dev:.1f} ms; "
          f"{launches:.0f} kernel launches, {copies:.0f} cudaMemcpyAsync, {waits:.0f} host "
          f"waits ({', '.join(SYNC_CALLS)}) ---")
    phases = [e for e in table if e.key.startswith("trainer.")]
    if phases:
        print("phases per step: " + ", ".join(
            f"{e.key} CPU {e.cpu_time_total / steps / 1e3:.1f} ms" for e in phases))
    for key in (["self_device_time_total"] if device.type == "cuda" else []) + \
            ["self_cpu_time_total"]:
        print(f"--- {label}: top ops by {key} over {steps} steps ---")
        print(table.table(sort_by=key, row_limit=40, max_name_column_width=60))
    if trace_dir:
        os.makedirs(trace_dir, exist_ok=True)
        # letters, digits, - _ . only: "ours small ac=none @ 4096" -> ours_small_ac_none_4096
        name = "_".join(re.sub(r"[^A-Za-z0-9_.-]+", " ", label).split())
        prof.export_chrome_trace(os.path.join(trace_dir, name + ".json"))


def host_python_profile(step, device, stats_dir: str | None = None, top: int = 30) -> str:
    """One more step under cProfile: the Python functions the host spends its time in (self
    time, then cumulative), which is what a host-bound step is made of. cProfile slows each
    call alike, so read the shares, not the absolute times."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    step()
    sync(device)
    prof.disable()
    if stats_dir:  # for pstats: callers of a hot function, e.g. who casts dtypes
        os.makedirs(stats_dir, exist_ok=True)
        prof.dump_stats(os.path.join(stats_dir, "host_step.pstats"))
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out).strip_dirs()
    for key in ("tottime", "cumulative"):
        out.write(f"--- host Python profile of one step, top {top} by {key} ---\n")
        stats.sort_stats(key).print_stats(top)
    return out.getvalue()


def host_syncs(step, device) -> str:
    """One more step under torch's CUDA sync debug mode: where the host waits for the GPU
    (each place a step reads a device value), counted by source line."""
    if device.type != "cuda":
        return "host syncs: CUDA only"
    import warnings
    from collections import Counter

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    places = Counter(f"{os.path.relpath(w.filename)}:{w.lineno}" for w in caught
                     if "synchroniz" in str(w.message))
    return (f"host syncs in one step: {sum(places.values())}; by place: "
            + ", ".join(f"{k} x{n}" for k, n in places.most_common()))


@dataclass(frozen=True)
class Shape:
    """A step's batch: ``n`` sequences of ``length`` tokens (``--seqs`` item ``[Nx]LENGTH``):
    ours packs them into one micro-batch, transformers takes them as a [n, length] batch."""
    n: int
    length: int

    @classmethod
    def parse(cls, text: str) -> "Shape":
        n, _, length = text.rpartition("x")
        try:
            shape = cls(int(n or 1), int(length))
        except ValueError:
            raise SystemExit(f"--seqs item {text!r}: expected LENGTH or NxLENGTH") from None
        if shape.n < 1 or shape.length < 2:
            raise SystemExit(f"--seqs item {text!r}: at least 1 sequence of 2 tokens")
        return shape

    @property
    def tokens(self) -> int:
        return self.n * self.length

    def __str__(self) -> str:
        return str(self.length) if self.n == 1 else f"{self.n}x{self.length}"


def bench_batch(cfg: DSV4Config, routed_layers: list[int], shape: Shape, index: int = 0):
    """``shape.n`` random sequences packed into one micro-batch (batch.random_batch); ``index``
    numbers the micro-batches drawn (per rank, per micro-batch of a step), each with its own
    tokens."""
    return random_batch(cfg.vocab_size, routed_layers, [shape.length] * shape.n,
                        seed=index * shape.n)


def static_bytes(model: torch.nn.Module) -> tuple[int, int, int]:
    """(parameters, trained parameters, buffers) in bytes on this rank: fp32 master weights (an
    FSDP shard), and each of the fp32 gradients and the two Adam moments, and the frozen
    tables."""
    local = [(p.to_local() if hasattr(p, "to_local") else p, p.requires_grad)
             for p in model.parameters()]
    master = sum(t.numel() * t.element_size() for t, _ in local)
    trained = sum(t.numel() * t.element_size() for t, grad in local if grad)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return master, trained, buffers


class Ours:
    """Our trainer's policy on ``cfg``: built once, stepped at every sequence length."""

    def __init__(self, cfg: DSV4Config, info, device, attention_backend: str | None,
                 checkpointing: str, compute_dtype: str = "auto",
                 accumulate: str = "auto", one_rank: str = "auto", head_gemm: str = "auto",
                 cuda_graphs: bool = False):
        """compute_dtype, accumulate, one_rank, head_gemm, cuda_graphs: the trainer's
        model.compute_dtype (auto: bf16 on CUDA, fp32 on the CPU), accumulate_unsharded (auto |
        always | never), one_rank (auto | fsdp | copies), lm_head_gemm (auto | ieee | tf32x3 |
        tf32x3-logits)
        and cuda_graphs (micro-batch layouts captured as CUDA graphs)."""
        t0 = time.perf_counter()
        self.cfg, self.device, self.info = cfg, device, info
        torch.manual_seed(0)
        model = DSV4ForCausalLM(cfg)
        init_weights(model, seed=0)
        # the trainer's own build, on this model (its router frozen: model.freeze_router)
        self.policy = policy_from_model(
            model, ModelConfig(model_path="bench", compute_dtype=compute_dtype,
                               lm_head_gemm=head_gemm, serving_numerics=False,
                               activation_checkpointing=checkpointing,
                               accumulate_unsharded=accumulate, one_rank=one_rank),
            info.mesh, device, attention_backend=attention_backend)
        self.copies = getattr(model, "compute_copies", None)
        if cuda_graphs:
            self.policy.graphs = MicroBatchGraphs(self.policy, LossConfig(), info.world_size)
        self.optim_cfg = OptimConfig(lr=1e-5, sink_frozen_frac=0, sink_ramp_frac=0)
        self.opt, _ = build_optimizer(self.policy, self.optim_cfg, 1)
        self.allocated_after_build = memory(device)[0]
        print(f"built ours {checkpointing} in {time.perf_counter() - t0:.1f} s; "
              + ("no FSDP on one rank: compute copies of the weights "
                 f"({self.copies.nbytes / GiB:.2f} GiB)" if self.copies is not None else
                 f"FSDP2; micro-batches accumulate unsharded: "
                 f"{self.policy.accumulate_unsharded} (with more than one a step: FSDP's fp32 "
                 "unsharded gradients too, in the memory plan)"), flush=True)

    def stepper(self, shape: Shape, micro_batches: int, optimizer: bool = True,
                reference_pass: bool = False):
        """One optimizer step over ``micro_batches`` micro-batches of ``shape`` per rank, with
        the trainer's own functions (forward_backward per micro-batch, then clip_and_step:
        clipping and AdamW; without ``optimizer`` the gradients stay); with
        ``reference_pass`` each micro-batch's no-grad forward first, as the trainer's
        reference pass runs it for several optimizer steps a batch (Policy.forward: its old
        logprobs; Trainer.on_policy). The step returns the last micro-batch's loss."""
        batches = []
        for m in range(micro_batches):
            batches.append(bench_batch(self.cfg, self.policy.routed_layers, shape,
                                       self.info.rank * micro_batches + m))
        # the loss is normalised by the global token count: every rank's batches hold as many
        tokens = sum(float(mb.loss_mask.sum()) for mb in batches) * self.info.world_size

        def step():
            if reference_pass:
                with torch.no_grad(), torch.profiler.record_function("trainer.reference_pass"):
                    for mb in batches:
                        mb.old_logprobs = self.policy.forward(mb, replay=False).logprobs
            for i, mb in enumerate(batches):
                self.policy.micro_batch(i, len(batches))
                sums = forward_backward(self.policy, mb, tokens, LossConfig(),
                                        self.info.world_size, replay=False)
            if optimizer:
                with torch.profiler.record_function("trainer.optimizer"):
                    clip_and_step(self.opt, self.optim_cfg.max_grad_norm)
                    self.opt.zero_grad(set_to_none=True)
            return sums[0]
        return step

    def memory_plan(self, peak: int, micro_batches: int) -> str:
        master, trained, buffers = static_bytes(self.policy.model)
        return (f"memory plan: fp32 master weights {master / GiB:.2f} GiB, buffers (Engram "
                f"tables, tid2eid) {buffers / GiB:.2f}, {self.copies_note()}"
                f"{self.gradients_note(trained, micro_batches)}, Adam state "
                f"{2 * trained / GiB:.2f}; activations, "
                f"gradients and workspace at the peak "
                f"{(peak - self.allocated_after_build - 2 * trained) / GiB:.2f}; peak "
                f"{peak / GiB:.2f} GiB")

    def gradients_note(self, trained: int, micro_batches: int) -> str:
        """The gradients' bytes: fp32, but for the compute copies' ones that a one-micro-batch
        step leaves pending in bf16 for the Triton AdamW (compute_copies.py)."""
        held = 0
        if micro_batches == 1 and self.copies is not None and self.copies.reader() is not None:
            held = sum(self.copies.copies[i].numel() for i in self.copies.trained)
        return (f"fp32 gradients {(trained - 4 * held) / GiB:.2f}"
                + (f" (+ the copies' pending bf16 ones {2 * held / GiB:.2f})" if held else ""))

    def copies_note(self) -> str:
        return ("" if self.copies is None else
                f"compute copies {self.copies.nbytes / GiB:.2f} (no FSDP on one rank), ")

    def planned_memory(self, seq: int, probe_seq: int, checkpointing: str,
                       micro_batches: int = 1,
                       fraction: float = memplan.MEMORY_FRACTION) -> str:
        """The memory plan at ``seq`` tokens (trainer_bridge/memory_plan.py: probes at
        probe_seq // 2 and probe_seq, plain and every layer checkpointed) under the layers'
        current policies, with the static state, the fp32 gradients held between a step's
        micro-batches when it has several, and the largest temporaries. ``auto``: the
        layers then get the plan's fitting policies within ``fraction`` of the device, as the
        trainer's model.activation_checkpointing=auto gives them."""
        master, trained, buffers = static_bytes(self.policy.model)
        # the Adam moments, and the fp32 gradients a step's earlier micro-batches hold
        unallocated = memplan.unallocated_static(self.policy, False, micro_batches > 1)
        cfg = self.cfg
        # one chunk of fp32 logits, its log_softmax/exp and the bf16 gradient (token_logprobs)
        rows = min(seq, token_logprobs.logprob_chunk_rows(cfg.vocab_size))
        head_chunk = rows * cfg.vocab_size * (4 + 4 + 2)
        # One selection chunk (compressor.query_chunks' rows): on CUDA the indexer-score
        # kernel's fp32 [rows, entries] scores and the stable top-k's sorted fp32 values and
        # int64 indices; elsewhere (the torch expressions) bf16 [rows, heads, entries]
        # products, their relu and weighted copy.
        entries = max((seq // r for r in cfg.compress_ratios if r in (1, 2, 4)), default=0)
        products = min(compressor.SELECTION_CHUNK_PRODUCTS, seq * cfg.index_n_heads * entries)
        selection_chunk = (products // max(1, cfg.index_n_heads) * (4 + 4 + 8)
                           if self.device.type == "cuda" else 3 * 2 * products)
        lines = [f"memory plan @ {seq} (ac={checkpointing}): fp32 master weights "
                 f"{master / GiB:.2f} GiB, buffers {buffers / GiB:.2f}, {self.copies_note()}"
                 f"{self.gradients_note(trained, micro_batches)}, Adam state "
                 f"{2 * trained / GiB:.2f}; largest "
                 f"temporaries: head chunk {head_chunk / GiB:.2f} (vocab {cfg.vocab_size}), "
                 f"selection chunk {selection_chunk / GiB:.2f}"]
        if self.device.type != "cuda":
            lines.append("  activations: measured on CUDA only (the allocator's counter)")
            return "\n".join(lines)
        # A one-micro-batch step's backward is also its last: the compute copies' gradients
        # stay pending in bf16 for the Triton AdamW (no fp32 ones), as the step's own would.
        last = (self.copies.defer_next_backward if micro_batches == 1 and self.copies is not None
                else None)
        kinds = memplan.layer_kinds(self.policy)
        if checkpointing == "auto":  # the trainer's own planning (probes at probe_length(seq))
            try:
                chosen, plan = memplan.plan_checkpointing(
                    self.policy, seq, fraction, unallocated, self.zero_grad, last)
                lines.append(f"  auto within {fraction} of the device: "
                             f"{sum(p != 'none' for p in chosen)} of {len(chosen)} layers "
                             "checkpointed")
            except memplan.MemoryPlanError as e:  # the trainer refuses; the bench tries
                plan = e.plan
                memplan.apply(self.policy, (memplan.RECOMPUTED,) * cfg.num_hidden_layers)
                lines.append(f"  auto refused ({e}); every layer checkpointed")
        else:
            plan = memplan.measure(self.policy, memplan.probe_batch(self.policy), probe_seq,
                                   unallocated, self.zero_grad, last)
        current = [layer_checkpointing(layer) for layer in self.policy.model.layers]
        every = [memplan.RECOMPUTED] * len(kinds)
        for label, policies in (("as built", current), ("every layer checkpointed", every)):
            if all(p in plan.kept for p in policies):
                lines.append(f"  {label}: {plan.describe(seq, policies, kinds)}")
        return "\n".join(lines)

    def checkpointing(self, requested: str) -> str:
        """``requested``, or for auto the layers it checkpointed: auto:K/N."""
        if requested != "auto":
            return requested
        got = [layer_checkpointing(layer) for layer in self.policy.model.layers]
        return f"auto:{sum(p != 'none' for p in got)}/{len(got)}"

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def close(self) -> None:
        del self.policy, self.opt


class Transformers:
    """transformers' DeepseekV4ForCausalLM on the V4 twin in bf16 (its usual training setup:
    bf16 weights, AdamW, cross-entropy), eager attention, the given experts implementation."""

    def __init__(self, cfg: DSV4Config, device, experts: str):
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

        t0 = time.perf_counter()
        self.cfg, self.device = cfg, device
        hf_cfg = DeepseekV4Config(**names.to_transformers_config(cfg))
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        torch.manual_seed(0)
        with torch.device(device):
            self.model = DeepseekV4ForCausalLM._from_config(
                hf_cfg, attn_implementation="eager", experts_implementation=experts, dtype=dtype)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        print(f"built transformers {experts} in {time.perf_counter() - t0:.1f} s", flush=True)

    def stepper(self, shape: Shape, micro_batches: int, reference_pass: bool = False):
        """``reference_pass``: each micro-batch's no-grad forward first, as Ours.stepper's."""
        batches = [torch.tensor([random_tokens(self.cfg.vocab_size, shape.length, m * shape.n + i)
                                 for i in range(shape.n)], device=self.device)
                   for m in range(micro_batches)]

        def step():
            if reference_pass:
                with torch.no_grad():  # every position's logits: what logprobs need
                    for ids in batches:
                        self.model(input_ids=ids)
            for ids in batches:
                (self.model(input_ids=ids, labels=ids).loss / micro_batches).backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return step

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def close(self) -> None:
        del self.model, self.opt


def check_grouped_moe(cfg: DSV4Config, device: torch.device) -> str:
    """One layer's grouped-GEMM MoE vs its per-expert loop on this device (the GPU runs torch's
    grouped GEMM kernel, which CPU CI cannot)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(1)
    moe = MoE(cfg, cfg.num_hash_layers)  # a top-k routed layer
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, cfg.initializer_range)
    moe = moe.to(device, dtype)
    x = torch.randn(2048, cfg.hidden_size, device=device, dtype=dtype)
    ids = torch.randint(0, 256, (2048,), device=device)
    res = []
    for grouped in (True, False):
        moe.grouped = grouped
        xi = x.clone().requires_grad_(True)
        out = moe(xi, ids, DSV4Context.packed([2048], device=device, shared=ForwardState()))
        out.float().square().sum().backward()
        res.append((out.detach().float(), xi.grad.float(), moe.experts.w13.grad.float().clone()))
        moe.zero_grad()

    def rel(a, b):
        return float((a - b).norm() / b.norm())
    return ("grouped vs loop MoE on {}: rel. error out {:.1e}, dx {:.1e}, dW {:.1e}".format(
        device.type, *(rel(a, b) for a, b in zip(*res))))


def check_fused_hc_weights(cfg: DSV4Config, device: torch.device) -> str:
    """The fused mHC weights kernels vs the torch expression on this device (4096 tokens):
    values and the gradients of mix, base and scale."""
    if device.type != "cuda":
        return "fused vs torch mHC weights: CUDA only (CPU CI runs them interpreted)"
    from sglang_dsv41.model.dsv4 import mhc
    from sglang_dsv41.model.dsv4.hc_weights_triton import hc_weights_fused

    hc, gen = cfg.hc_mult, torch.Generator(device=device).manual_seed(2)
    n = (2 + hc) * hc
    inputs = [torch.randn(4096, n, generator=gen, device=device),
              torch.randn(n, generator=gen, device=device) * 0.5,
              torch.rand(3, generator=gen, device=device) + 0.5]
    grads = [torch.randn(4096, hc, generator=gen, device=device),
             torch.randn(4096, hc, generator=gen, device=device),
             torch.randn(4096, hc, hc, generator=gen, device=device)]
    res = []
    for fn in (hc_weights_fused, mhc._hc_weights):
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        outs = fn(*leaves, hc, cfg.hc_sinkhorn_iters, cfg.hc_eps)
        sum((o * g).sum() for o, g in zip(outs, grads)).backward()
        res.append([torch.cat([o.detach().flatten() for o in outs])] + [t.grad for t in leaves])
    errs = [float((a - b).norm() / b.norm()) for a, b in zip(*res)]
    return ("fused vs torch mHC weights on cuda: rel. error out {:.1e}, d mix {:.1e}, d base "
            "{:.1e}, d scale {:.1e}".format(*errs))


def parse_tiles(text: str, flag: str) -> tuple[int, int]:
    """"ELEMENTSxWARPS" (the Triton AdamW kernel's tiles) -> (elements, warps); a malformed
    value exits with the flag's name."""
    parts = text.split("x")
    if len(parts) != 2 or not all(t.isdigit() and int(t) > 0 for t in parts):
        raise SystemExit(f"{flag} {text}: ELEMENTSxWARPS, e.g. 2048x8")
    return int(parts[0]), int(parts[1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--seqs", default="4096,16384,65536",
                   help="comma list of step shapes: LENGTH (one sequence) or NxLENGTH (N "
                   "sequences packed in one micro-batch; transformers gets them as a batch)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--micro-batches", type=int, default=1,
                   help="micro-batches of each --seqs shape per optimizer step (the trainer's "
                   "mini-batch: the AdamW step's fixed cost is shared by their tokens)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--accumulate", default="auto", choices=("auto", "always", "never"),
                   help="ours: the trainer's model.accumulate_unsharded (micro-batches but the "
                   "last add into unsharded gradients; auto: when they fit)")
    p.add_argument("--one-rank", default="auto", choices=ONE_RANK_MODES,
                   help="ours on one GPU: the trainer's model.one_rank (FSDP2, or no FSDP and "
                        "compute-dtype copies of the weights; auto: copies when they fit)")
    p.add_argument("--lm-head-gemm", default="auto", choices=("auto", *token_logprobs.FP32_GEMMS),
                   help="ours: the trainer's model.lm_head_gemm (the fp32 head's GEMMs)")
    p.add_argument("--adamw-tiles", default=None, metavar="ELEMENTSxWARPS",
                   help="ours: the Triton AdamW kernel's tiles for this run (adamw_triton."
                   "DEFAULT_TILES; bench/train_ops.py adamw --tiles times candidates)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="ours: the trainer's model.cuda_graphs (each micro-batch layout a CUDA "
                   "graph from its second micro-batch on: warm-up steps capture)")
    p.add_argument("--reference-pass", action="store_true",
                   help="each micro-batch's no-grad forward first, in ours and transformers "
                   "(the trainer's reference pass: old logprobs, run when loss.mini_batches > 1); "
                   "MFU still counts 6 x active x tokens, not the pass's forward")
    p.add_argument("--attention", default=None, help="triton | reference (default: triton on "
                   "CUDA, the torch reference on CPU)")
    p.add_argument("--checkpointing", default="none",
                   help="ours: comma list of none | layer | selective | auto (the trainer's: "
                   "the fewest layers checkpointed that fit the longest --seqs within "
                   "--memory-fraction, by the memory plan), each its own model and rows; with "
                   "layer among them every other policy's rows get their speed-up over layer's "
                   "at the same length. A length that runs out of memory is retried with "
                   "selective, then layer (one process; under torchrun it fails)")
    p.add_argument("--memory-fraction", type=float, default=memplan.MEMORY_FRACTION,
                   help="--checkpointing auto: the share of the device the planned peak may "
                   "take (the trainer's model.memory_fraction)")
    p.add_argument("--transformers", default="eager,grouped_mm",
                   help="comma list of transformers experts implementations, or none")
    p.add_argument("--no-twin", action="store_true", help="skip ours on the V4 twin")
    p.add_argument("--profile-seq", default="",
                   help="print the top ops (torch.profiler) of ours on the preset at this "
                   "--seqs item")
    p.add_argument("--trace-dir", default=None,
                   help="with --profile-seq: also write the profile's Chrome trace and the "
                   "host Python profile (host_step.pstats) here")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="device bf16 peak for MFU (default: known GPUs; none on CPU)")
    args = p.parse_args(argv)
    if args.micro_batches < 1:
        raise SystemExit(f"--micro-batches {args.micro_batches}: at least 1")
    if not 0.0 < args.memory_fraction <= 1.0:
        raise SystemExit(f"--memory-fraction {args.memory_fraction}: in (0, 1]")
    checkpointing = list(dict.fromkeys(args.checkpointing.split(",")))
    for policy in checkpointing:
        if policy not in CHECKPOINTING_CHOICES:
            raise SystemExit(f"--checkpointing {policy!r}: one of "
                             f"{', '.join(CHECKPOINTING_CHOICES)}")
    if args.adamw_tiles:
        adamw_triton.DEFAULT_TILES = parse_tiles(args.adamw_tiles, "--adamw-tiles")
    cfg = get_preset(args.preset)
    seqs = [Shape.parse(s) for s in args.seqs.split(",")]
    longest = max(s.length for s in seqs)
    if longest > cfg.max_position_embeddings:
        raise SystemExit(f"--seqs {longest} exceeds the preset's context")
    profile_shape = Shape.parse(args.profile_seq) if args.profile_seq else None
    if profile_shape is not None and profile_shape not in seqs:
        raise SystemExit(f"--profile-seq {args.profile_seq} is not one of --seqs {args.seqs}")
    biggest = max(seqs, key=lambda s: s.tokens)
    device = resolve_device("auto")
    if args.attention is None:
        args.attention = "triton" if device.type == "cuda" else "reference"
    peak = args.peak_tflops
    if peak is None and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    info = init_distributed(device)
    if info.world_size > 1:
        # FSDP over the ranks, each with its own batch of the shape: only ours runs (the
        # transformers baseline is one process on one GPU), and only rank 0 prints.
        if args.transformers != "none" or not args.no_twin:
            raise SystemExit("under torchrun with more than one rank: pass --transformers none "
                             "--no-twin (ours on the preset only)")
        if not info.is_primary:
            sys.stdout = open(os.devnull, "w")
    twin = v4_twin(cfg)
    print(check_grouped_moe(cfg, device), flush=True)
    print(check_fused_hc_weights(cfg, device), flush=True)
    rows: list[tuple] = []
    plans: list[str] = []

    def measure(runner, label, seq, profile):
        try:
            step_s, peak_b, host_s, cpu_s = time_steps(
                runner.stepper(seq, args.micro_batches, reference_pass=args.reference_pass),
                args, device,
                f"{label} @ {seq}" if profile else None)
        except torch.OutOfMemoryError:
            if info.world_size > 1:
                raise  # the other ranks may not have run out: a retry would hang them
            runner.zero_grad()
            free(device)
            return "OOM"
        if isinstance(runner, Ours) and seq == biggest:
            plans.append(f"{label} @ {seq}: " + runner.memory_plan(peak_b, args.micro_batches))
        free(device)
        return step_s, peak_b, host_s, cpu_s

    def run_ours(label, c, profile, first):
        # One model per checkpointing policy, kept for the longer lengths; a length that
        # runs out of memory moves on to the next policy.
        policies = list(dict.fromkeys([first, "selective", "layer"]))
        runner, ac = None, 0
        for seq in seqs:
            while True:
                if runner is None:
                    runner = Ours(c, info, device, args.attention, policies[ac],
                                  accumulate=args.accumulate, one_rank=args.one_rank,
                                  head_gemm=args.lm_head_gemm,
                                  cuda_graphs=args.cuda_graphs)
                    try:
                        probe = memplan.probe_length(biggest.tokens, c.vocab_size)
                        plan = (runner.planned_memory(biggest.tokens, probe, policies[ac],
                                                      args.micro_batches, args.memory_fraction)
                                if probe >= 4 else "memory plan: its two probes "
                                "(memory_plan.probe_length) need a length of at least 4")
                    except torch.OutOfMemoryError:
                        if info.world_size > 1:
                            raise  # as in measure: the ranks must stay on one path
                        plan = f"memory plan: the {probe}-token probe ran out of memory"
                        free(device)
                    print(f"{label}: {plan}", flush=True)
                    plans.append(f"{label}: {plan}")
                name = (f"{label} ac={runner.checkpointing(policies[ac])}"
                        + (" graphs" if args.cuda_graphs else "")
                        + (" +ref" if args.reference_pass else ""))
                r = measure(runner, name, seq, profile and seq == profile_shape)
                rows.append((name, c, seq, r))
                print_row(rows[-1], peak, args.micro_batches, flush=True)
                if runner.policy.graphs is not None:
                    print(f"{name} @ {seq}: {runner.policy.graphs.summary()}", flush=True)
                if r != "OOM" or ac + 1 == len(policies):
                    break
                runner.close()
                runner, ac = None, ac + 1
                free(device)
        runner.close()
        del runner
        free(device)

    try:
        for i, policy in enumerate(checkpointing):
            run_ours(f"ours {args.preset}", cfg, i == 0, policy)
        for experts in [e for e in args.transformers.split(",") if e != "none"]:
            label = (f"transformers {args.preset}-v4 experts={experts}"
                     + (" +ref" if args.reference_pass else ""))
            try:
                runner = Transformers(twin, device, experts)
            except torch.OutOfMemoryError:
                rows += [(label, twin, seq, "OOM") for seq in seqs]
                continue
            for seq in seqs:
                rows.append((label, twin, seq, measure(runner, label, seq, False)))
                print_row(rows[-1], peak, args.micro_batches, flush=True)
            runner.close()
            del runner
            free(device)
        if not args.no_twin:
            run_ours(f"ours {args.preset}-v4", twin, False, checkpointing[0])
    finally:
        close_distributed()
    print(f"\n{args.preset}: {active_params(cfg) / 1e6:.1f}M active params "
          f"({args.preset}-v4: {active_params(twin) / 1e6:.1f}M), {device.type} x "
          f"{info.world_size}, {args.micro_batches} micro-batch(es) of the seq shape per step, "
          f"median of {args.steps} steps after {args.warmup} warm-up; seq, "
          f"tokens/s, attn TFLOP and peak GiB are per GPU (each rank steps its own batch of the "
          f"shape); MFU = 6 x active x tokens / step / {peak} TFLOP/s; attn TFLOP = attention "
          f"FLOPs per step (not in MFU); host ms = the main thread's CPU time per step (median): "
          f"the host work a host-bound step waits for, without the time the host's scheduler "
          f"or hypervisor takes away from it; cpu ms = the same for all the process's threads "
          f"(autograd's device thread launches the backward)")
    print(f"{'run':<48} {'seq':>9} {'step ms':>9} {'tokens/s':>9} {'MFU':>6} "
          f"{'attn TFLOP':>10} {'peak GiB':>8} {'host ms':>8} {'cpu ms':>8}")
    for row in rows:
        print_row(row, peak, args.micro_batches)
    for seq in seqs:
        best_hf = max((r[3] for r in rows if r[2] == seq and r[0].startswith("transformers")
                       and r[3] != "OOM"), default=None, key=lambda r: -r[0])
        mine = [r for r in rows if r[2] == seq and r[0].startswith("ours") and r[3] != "OOM"]
        if best_hf and mine:
            for r in mine:
                print(f"speed-up at {seq}: {r[0]} / best transformers = "
                      f"{best_hf[0] / r[3][0]:.2f}x")
        # each policy against layer checkpointing of the same model at the same length
        for r in mine:
            layer = next((x for x in mine if x[1] is r[1] and " ac=layer" in x[0]), None)
            if layer is not None and r[0] != layer[0]:
                print(f"speed-up at {seq}: {r[0]} / {layer[0]} = "
                      f"{layer[3][0] / r[3][0]:.2f}x")
    for plan in plans:
        print(plan)
    return 0


def print_row(row, peak, micro_batches: int, flush=False) -> None:
    label, c, seq, r = row
    if r == "OOM":
        print(f"{label:<48} {str(seq):>9} {'OOM':>9}", flush=flush)
        return
    step_s, peak_b, host_s, cpu_s = r
    tokens = seq.tokens * micro_batches
    mfu = (f"{100 * 6 * active_params(c) * tokens / step_s / 1e12 / peak:.1f}%" if peak
           else "n/a")
    print(f"{label:<48} {str(seq):>9} {1e3 * step_s:9.1f} {tokens / step_s:9.0f} {mfu:>6} "
          f"{micro_batches * seq.n * attention_flops(c, seq.length) / 1e12:10.2f} "
          f"{peak_b / GiB:8.2f} {1e3 * host_s:8.1f} {1e3 * cpu_s:8.1f}",
          flush=flush)


if __name__ == "__main__":
    sys.exit(main())
