"""CUDA graphs of a micro-batch's forward, loss and backward, one graph per micro-batch layout.

Why: on one H200 a 4k-token step of the ``small`` preset launches ~3,600 kernels, most under
25 us of GPU time each, and the threads that launch them are busy ~94% of the step
(bench/results/train_h200.txt, run W): the host, not the GPU, sets the step time. A replayed
graph launches all of a micro-batch's kernels at once.

What one graph holds: the policy's forward on static device inputs, the PPO loss, the
gradients of the loss with respect to the tensors the forward computed with
(``torch.autograd.grad``: the compute copies', and the parameters kept fp32), and one
``_foreach_add_`` of those gradients into the masters' fp32 gradients: persistent buffers
outside the graph's memory pool, attached to the parameters before every run (a
``zero_grad(set_to_none=True)`` in between gets them back zeroed). A step's first micro-batch
(every .grad None) copies instead of adding: no zeroing pass and no read of the buffers, as the
plain path's first backward makes its gradients; its layout then has a graph of its own. The
result is what the plain path (trainer.forward_backward) leaves, to the bit
(tests/test_trainer_micro_batch_graphs.py). The reference pass's no-grad forwards (old and
reference logprobs, the routing it checks: Policy.forward without autograd) run as graphs of
their own layouts the same way.

A layout is what a graph bakes in: the sequence lengths, the replayed layers, whether reference
logprobs take part, whether old ones do (on-policy: the forward's own), the kind of run (first
or later micro-batch of a step, no-grad forward with or without the routing recorded).
Everything else of a micro-batch (tokens, targets, logprobs, advantages, mask, replayed routing,
and the loss's normaliser, which changes every step) is copied into the layout's static inputs
before each run. A layout's first micro-batch runs eagerly (the same function, on the same
inputs: it also warms Triton and cuBLAS up); its second is captured, then replayed, as is every
later one. Training that repeats layouts (fixed-length packing, benchmarks, lengths bucketed by
the data pipeline) gains; a layout seen once costs nothing extra. A capture that fails (an
operation a graph cannot hold) is logged and that layout runs eagerly from then on.

Limits: one rank without FSDP (model.one_rank copies, or an fp32 model): FSDP's hooks gather
and reduce from host-side state that a replay would skip. On a CPU the same function runs
eagerly every time (what the CPU tests check).
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.utils._pytree import tree_leaves, tree_map

from sglang_dsv41.model.dsv4.context import DSV4Context, keeping_host_inputs
from sglang_dsv41.model.dsv4.token_logprobs import check_targets

from .batch import MicroBatch
from .compute_copies import holdable
from .config import LossConfig
from .loss import loss_scale, ppo_loss

log = logging.getLogger("trainer_bridge")


@dataclass
class Layout:
    """A layout's static inputs (device tensors a graph reads), its context and its graph."""

    key: tuple
    ctx: DSV4Context
    inputs: dict[str, torch.Tensor]
    routing: dict[int, tuple[torch.Tensor, torch.Tensor]] | None
    scale: torch.Tensor                       # fp32 0-d: loss_scale(global_tokens, world size)
    runs: int = 0
    graph: torch.cuda.CUDAGraph | None = None
    out: Any = None                           # the graph's static outputs
    eager_only: bool = False                  # its capture failed
    grad_params: list[torch.nn.Parameter] = field(default_factory=list)
    # (master, gradient) a deferred kind's run leaves pending (_add_grads)
    pending: list[tuple[torch.nn.Parameter, torch.Tensor]] = field(default_factory=list)
    # pinned host tensors the graph copies from at each replay (context.keeping_host_inputs)
    host_inputs: list[torch.Tensor] = field(default_factory=list)


class MicroBatchGraphs:
    """Runs forward_backward's work for micro-batches, capturing one CUDA graph per layout.
    ``max_layouts``: layouts kept (least recently used dropped); their graphs share one memory
    pool, which holds about one micro-batch's activations."""

    def __init__(self, policy, loss_cfg: LossConfig, world_size: int, max_layouts: int = 8):
        model = policy.model
        if world_size != 1 or any(isinstance(m, FSDPModule) for m in model.modules()):
            raise ValueError("model.cuda_graphs needs one rank without FSDP (model.one_rank "
                             "copies, or an fp32 model on one rank): FSDP's hooks gather and "
                             "reduce from host state that a graph's replay would skip")
        if max_layouts < 1:
            raise ValueError(f"max_layouts must be >= 1, got {max_layouts}")
        self.policy, self.loss_cfg, self.world_size = policy, loss_cfg, world_size
        self.max_layouts = max_layouts
        self.copies = getattr(model, "compute_copies", None)
        self.params = [p for _, p in policy.trainable_parameters()]  # none: forwards only
        in_forward = self.copies.in_forward if self.copies is not None else (lambda p: p)
        self.leaves = [in_forward(p) for p in self.params]
        self.capture = policy.device.type == "cuda"
        self.layouts: OrderedDict[tuple, Layout] = OrderedDict()
        self.grad_buffers: dict[int, torch.Tensor] = {}  # id(param) -> its persistent gradient
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.stream = torch.cuda.Stream(policy.device) if self.capture else None
        self.counts = {"eager": 0, "captured": 0, "replayed": 0, "capture_failed": 0}

    # ---- the public call --------------------------------------------------------------------
    def forward_backward(self, mb: MicroBatch, global_tokens: float, loss_cfg: LossConfig,
                         replay: bool) -> torch.Tensor:
        """trainer.forward_backward's contract: the micro-batch's gradients added into the
        parameters' .grad -> float64 [5] device sums (STEP_SUMS)."""
        if loss_cfg != self.loss_cfg:
            raise ValueError("MicroBatchGraphs was built for another LossConfig: a graph "
                             "bakes the loss's constants in")
        if not self.params:
            raise ValueError("forward_backward: the policy has no trained parameters")
        self._settle()
        # The step's first micro-batch (every .grad None, as zero_grad(set_to_none=True)
        # leaves them) copies its gradients into the buffers: no zeroing pass, no read of them.
        # The step's last, for the copies' reader, leaves theirs pending (compute_copies.py).
        fresh = all(p.grad is None for p in self.params)
        deferred = self.copies is not None and self.copies.take_defer()
        kind = ("fresh" if fresh else "accumulate") + (" deferred" if deferred else "")
        layout = self._layout(mb, replay, kind)
        self._load(layout, mb, global_tokens)
        self._attach_grads(layout.grad_params, zero=not fresh)
        return self._run(layout)

    def forward(self, mb: MicroBatch, replay: bool, record_routing: bool
                ) -> tuple[torch.Tensor, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
        """Policy.forward without autograd (the trainer's reference pass: old and reference
        logprobs, the routing it checks) -> (fp32 logprobs [N], layer -> (ids, weights) when
        ``record_routing``), as graphs of their own layouts."""
        self._settle()
        layout = self._layout(mb, replay, "routing" if record_routing else "forward")
        self._load(layout, mb, None)
        return self._run(layout)

    def summary(self) -> str:
        return ("micro-batch graphs: " + ", ".join(f"{k} {v}" for k, v in self.counts.items())
                + f"; layouts kept {len(self.layouts)}")

    # ---- layouts and their inputs -----------------------------------------------------------
    def _layout(self, mb: MicroBatch, replay: bool, kind: str) -> Layout:
        """``kind``: fresh (forward and backward, the gradients copied into the buffers: the
        step's first micro-batch), accumulate (added), either + " deferred" (the compute
        copies' gradients left pending), forward (no autograd), routing (forward, the routing
        recorded): a graph each where a layout is met several ways."""
        replayed = tuple(self.policy.replayed_layers) if replay and mb.routing is not None else ()
        training = kind.split()[0] in ("fresh", "accumulate")
        key = (tuple(mb.seq_lens), replayed, training and mb.ref_logprobs is not None,
               training and mb.old_logprobs is None, kind)
        layout = self.layouts.get(key)
        if layout is not None:
            self.layouts.move_to_end(key)
            return layout
        dev = self.policy.device
        ctx = DSV4Context.packed(mb.seq_lens, device=dev,
                                 attention_backend=self.policy.attention_backend,
                                 serving_numerics=self.policy.serving_numerics,
                                 record_routing=kind == "routing")
        names = ["input_ids", "hidden_index", "targets"]
        if training:
            names += [] if key[3] else ["old_logprobs"]  # on-policy: the forward's own
            names += ["rollout_logprobs", "advantages", "loss_mask"]
            names += ["ref_logprobs"] if key[2] else []
        inputs = {n: torch.empty_like(getattr(mb, n), device=dev) for n in names}
        routing = None
        if replayed:
            routing = {k: tuple(torch.empty_like(t, device=dev) for t in mb.routing[k])
                       for k in replayed}
        ctx.routing_replay = routing
        layout = Layout(key, ctx, inputs, routing,
                        torch.zeros((), dtype=torch.float32, device=dev))
        self.layouts[key] = layout
        while len(self.layouts) > self.max_layouts:
            self.layouts.popitem(last=False)
        return layout

    def _load(self, layout: Layout, mb: MicroBatch, global_tokens: float | None) -> None:
        """The micro-batch into the layout's static inputs: queued copies from pinned memory
        (no host wait), checked on the host first as Policy.forward checks them; the loss's
        normaliser (training kinds); the compute copies refreshed after an optimizer step (a
        replay runs no pre-hook)."""
        check_targets(mb.targets, self.policy.config.vocab_size)
        for name, dst in layout.inputs.items():
            src = getattr(mb, name)
            if src.shape != dst.shape:
                raise ValueError(f"micro-batch {name} has shape {tuple(src.shape)}, its layout "
                                 f"{tuple(dst.shape)}")
            _queued_copy(dst, src)
        for k, (ids, weights) in (layout.routing or {}).items():
            _queued_copy(ids, mb.routing[k][0])
            _queued_copy(weights, mb.routing[k][1])
        if global_tokens is not None:
            layout.scale.fill_(loss_scale(global_tokens, self.world_size))
        if self.copies is not None:
            self.copies.refresh()

    # ---- gradients ----------------------------------------------------------------------------
    def _attach_grads(self, params: list[torch.nn.Parameter], zero: bool) -> None:
        """Puts each parameter's persistent gradient buffer back as its .grad (where a graph
        writes): zeroed where .grad was None when ``zero`` (a graph that adds), holding
        .grad's values where it was another tensor."""
        to_zero = []
        for p in params:
            buf = self.grad_buffers[id(p)]
            if p.grad is None:
                if zero:
                    to_zero.append(buf)
            elif p.grad is not buf:
                buf.copy_(p.grad)
            p.grad = buf
        if to_zero:
            torch._foreach_zero_(to_zero)

    def _add_grads(self, layout: Layout, grads) -> None:
        pairs = [(p, g) for p, g in zip(self.params, grads) if g is not None]
        fresh = layout.key[-1].startswith("fresh")
        defers = layout.key[-1].endswith("deferred")

        def holds(p, g):  # a compute copy's gradient the AdamW kernel can read where it is
            return defers and self.copies.copy_of(p) is not None and holdable(g)
        held = [(p, g) for p, g in pairs if holds(p, g)]
        written = [(p, g) for p, g in pairs if not holds(p, g)]
        if layout.runs == 1 or not layout.grad_params:  # eager: learn which get gradients
            # _attach_grads zeroes or fills a new buffer as it needs; a held gradient's fp32
            # buffer is made by settle if ever needed (a one-micro-batch step needs none)
            for p, _ in written:
                if id(p) not in self.grad_buffers:
                    self.grad_buffers[id(p)] = torch.empty_like(
                        p, memory_format=torch.contiguous_format)
            layout.grad_params = [p for p, _ in written]
            self._attach_grads(layout.grad_params, zero=not fresh)
        # fp32 (+)= compute dtype: exact as the plain path's first copy and later adds
        # (ComputeCopies._backward_end; FSDP's reduce output likewise)
        write = torch._foreach_copy_ if fresh else torch._foreach_add_
        if written:
            write([p.grad for p, _ in written], [g for _, g in written])
        layout.pending = held  # a graph's: its static outputs, valid until the next run

    def _settle(self) -> None:
        """The pending gradients into the persistent buffers before anything runs: a held
        gradient of a graph lives in the pool the next run writes."""
        if self.copies is not None:
            self.copies.settle(self.grad_buffers)

    # ---- the work -----------------------------------------------------------------------------
    def _run(self, layout: Layout):
        """Eager at a layout's first run, captured at its second, replayed from then on ->
        copies of the body's outputs: a graph's are static, and an eager run's may be a static
        input (a replayed routing the forward records as it is)."""
        layout.runs += 1
        if layout.graph is None and layout.runs >= 2 and self.capture and not layout.eager_only:
            self._capture(layout)
        if layout.graph is not None:
            layout.graph.replay()
            self.counts["replayed"] += 1
            out = layout.out
        else:
            self.counts["eager"] += 1
            out = self._run_eager(layout)
        for p, g in layout.pending:
            self.copies.add_pending(p, g)
        return tree_map(torch.clone, out)

    def _body(self, layout: Layout):
        return (self._train_body if layout.key[-1].split()[0] in ("fresh", "accumulate")
                else self._forward_body)(layout)

    @contextlib.contextmanager
    def _released(self, layout: Layout):
        """Around a body's forward (and gradients), as ForwardOut.release after it: the shared
        entries and the recorded routing cleared, the masters back in the modules."""
        try:
            yield
        finally:
            layout.ctx.shared.clear()
            layout.ctx.routed.clear()
            if self.copies is not None:
                self.copies.abandon()

    def _logprobs(self, layout: Layout) -> torch.Tensor:
        x, policy = layout.inputs, self.policy
        return policy.model(x["input_ids"], layout.ctx, hidden_index=x["hidden_index"],
                            targets=x["targets"], temperature=policy.temperature)

    def _forward_body(self, layout: Layout):
        """A no-grad forward -> (logprobs, the routing it recorded)."""
        with self._released(layout), torch.no_grad():
            return self._logprobs(layout), dict(layout.ctx.routed)

    def _train_body(self, layout: Layout) -> torch.Tensor:
        """forward, loss, gradients, their copy or add into the buffers."""
        x = layout.inputs
        with self._released(layout):
            terms = ppo_loss(self._logprobs(layout), x.get("old_logprobs"), x["rollout_logprobs"],
                             x["advantages"], x["loss_mask"], self.loss_cfg, scale=layout.scale,
                             ref_logp=x.get("ref_logprobs"))
            grads = torch.autograd.grad(terms.loss, self.leaves, allow_unused=True)
        self._add_grads(layout, grads)
        return terms.sums()

    def _run_eager(self, layout: Layout):
        if self.stream is None:
            return self._body(layout)
        # On the side stream the captures use (PyTorch's advice: warm up where you capture).
        current = torch.cuda.current_stream(self.policy.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            out = self._body(layout)
        current.wait_stream(self.stream)
        for t in tree_leaves(out) + [g for _, g in layout.pending]:
            t.record_stream(current)  # _run copies them, the optimizer reads the held ones
        return out

    def _capture(self, layout: Layout) -> None:
        graph = torch.cuda.CUDAGraph()
        try:
            with keeping_host_inputs(layout.host_inputs), \
                    torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                out = self._body(layout)
        except Exception as e:  # noqa: BLE001 - any capture failure: run this layout eagerly
            layout.eager_only = True
            layout.host_inputs.clear()
            self.counts["capture_failed"] += 1
            log.warning("CUDA graph capture of a micro-batch layout (%d sequences, %d tokens) "
                        "failed; it runs eagerly: %s", len(layout.key[0]), sum(layout.key[0]),
                        e)
            return
        layout.graph, layout.out = graph, out
        self.counts["captured"] += 1


def _queued_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """A host tensor into a device one without a host wait (context.host_to_device's reason),
    into ``dst`` itself: a graph reads its inputs where it was captured."""
    if dst.is_cuda and not src.is_cuda:
        src = src.pin_memory()
    dst.copy_(src, non_blocking=dst.is_cuda)
