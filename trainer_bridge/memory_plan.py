"""A training step's device memory from two short probes, and the activation checkpointing that
fits a micro-batch of a given length (model.activation_checkpointing = auto).

A step's peak is its static state (whatever is allocated when the plan is made: master weights,
buffers, compute copies, a reference policy; plus the two Adam moments, allocated at the first
optimizer step, and the fp32 gradients a step's earlier micro-batches hold for the later ones),
what each decoder layer keeps from its forward for the backward, and the rest: what the norm
and head keep and the backward's rise above all that (gradients, temporaries). A layer's kept
bytes are a fixed part plus a part linear in the micro-batch's tokens (no [T, T] tensor
anywhere: the attention is sparse, the selection chunked), fitted through two probes
(probe_length and its half) for any length. The rest is not: the head works in logprob chunks
and the backward one layer at a time, and fits through probes of 2k/4k and 4k/8k carried it to
10-18 GiB at 64k tokens of the `small` preset where a 32k/64k fit gives 2.5 (run AH), so it is
the larger of the two probes' own. The allocator's counters measure it all: CUDA only.

Every layer is probed plain and checkpointed (parallelize.checkpoint_layer, applied again in
place); `MemoryPlan.fitting` then checkpoints the fewest layers that keep the planned peak under
a limit, one at a time where it lowers the peak most, so a length that does not fit plain gets
the recompute only where it is needed (bench/results/train_h200.txt, run AH).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sglang_dsv41.model.dsv4.token_logprobs import logprob_chunk_rows

from .parallelize import checkpoint_layer, layer_checkpointing

GiB = float(1 << 30)
# The policies a plan probes and chooses between: selective keeps an unknown share in between
# and is not chosen automatically.
PLAIN, RECOMPUTED = "none", "layer"
# model.memory_fraction's default: the rest of the device for the caching allocator's
# fragmentation, the CUDA context, NCCL, and the plan's own error (run AH: the measured peaks
# 0.5-1.5% over the planned ones at 64k-128k, growing with the length; those runs took 0.93).
MEMORY_FRACTION = 0.90


@dataclass(frozen=True)
class Linear:
    """Bytes as fixed + per_token * tokens."""

    fixed: float
    per_token: float

    def at(self, tokens: int) -> float:
        return self.fixed + self.per_token * tokens

    @classmethod
    def through(cls, t1: int, b1: float, t2: int, b2: float) -> "Linear":
        per_token = (b2 - b1) / (t2 - t1)
        return cls(b1 - per_token * t1, per_token)


@dataclass(frozen=True)
class MemoryPlan:
    static: float                     # bytes at any length
    kept: dict[str, list[Linear]]     # PLAIN / RECOMPUTED -> per decoder layer
    rest: float                       # norm + head kept and the backward's rise (module doc)
    probe_tokens: tuple[int, int]

    @property
    def num_layers(self) -> int:
        return len(self.kept[PLAIN])

    def peak(self, tokens: int, policies: Sequence[str]) -> float:
        """Planned peak bytes of a micro-batch of ``tokens`` with ``policies`` (one per decoder
        layer): the static state, the rest, and the most the layers hold at once:
        what all of them keep after the forward or, in the backward of a checkpointed
        layer i (the layers after it done and freed), what the layers before it keep plus its
        recomputed activations, as large as what it keeps plain."""
        kept = [self.kept[p][i].at(tokens) for i, p in enumerate(policies)]
        held, below = sum(kept), 0.0
        for i, p in enumerate(policies):
            if p != PLAIN:
                held = max(held, below + self.kept[PLAIN][i].at(tokens))
            below += kept[i]
        return self.static + held + self.rest

    def fitting(self, tokens: int, limit: float) -> tuple[str, ...] | None:
        """The fewest layers checkpointed for a peak of at most ``limit`` bytes at ``tokens``,
        each added where it lowers the peak most; None when every layer checkpointed is still
        over."""
        policies = [PLAIN] * self.num_layers
        while self.peak(tokens, policies) > limit:
            plain = [i for i, p in enumerate(policies) if p == PLAIN]
            if not plain:
                return None
            policies[min(plain, key=lambda i: self.peak(
                tokens, policies[:i] + [RECOMPUTED] + policies[i + 1:]))] = RECOMPUTED
        return tuple(policies)

    def describe(self, tokens: int, policies: Sequence[str], kinds: Sequence[str] = ()) -> str:
        kinds = list(kinds) or [f"L{i}" for i in range(self.num_layers)]
        layers = ", ".join(
            f"{k} {self.kept[p][i].at(tokens) / GiB:.2f}" + ("" if p == PLAIN else " (ckpt)")
            for i, (k, p) in enumerate(zip(kinds, policies)))
        return (f"memory plan @ {tokens} tokens (fitted from {self.probe_tokens[0]} and "
                f"{self.probe_tokens[1]}): static {self.static / GiB:.2f} GiB; kept after the "
                f"forward, GiB: {layers}; norm+head and the backward's rise {self.rest / GiB:.2f}"
                f"; planned peak "
                f"{self.peak(tokens, policies) / GiB:.2f} GiB")


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def probe(policy, batch: Callable[[int], object], tokens: int, zero_grad: Callable[[], None],
          before_backward: Callable[[], None] | None = None) -> tuple[list[int], int]:
    """One forward and backward of ``batch(tokens)`` (a MicroBatch) on ``policy`` -> (bytes each
    decoder layer, then the norm and head, leave allocated after the forward; the backward's
    rise above that). CUDA only: the allocator's counters, read in a hook after each layer and
    at the backward's peak."""
    device = policy.device
    marks: list[int] = []
    hooks = [layer.register_forward_hook(
        lambda *_: marks.append(torch.cuda.memory_allocated(device)))
        for layer in policy.model.layers]
    mb = batch(tokens)
    free(device)
    try:
        before = torch.cuda.memory_allocated(device)
        out = policy.forward(mb, replay=False)
        points = [before, *marks, torch.cuda.memory_allocated(device)]
    finally:
        for h in hooks:
            h.remove()
    torch.cuda.reset_peak_memory_stats(device)
    if before_backward is not None:
        before_backward()
    try:  # a whole iteration, so FSDP's backward state completes
        out.logprobs.sum().backward()
        rise = torch.cuda.max_memory_allocated(device) - points[-1]
    finally:
        out.release()
    zero_grad()
    del out
    free(device)
    return [b - a for a, b in zip(points, points[1:])], rise


def measure(policy, batch: Callable[[int], object], probe_tokens: int, extra_static: float,
            zero_grad: Callable[[], None], before_backward: Callable[[], None] | None = None
            ) -> MemoryPlan:
    """Probes ``policy`` at probe_tokens // 2 and probe_tokens, plain and with every layer
    checkpointed, then gives each layer back its policy. ``extra_static``: bytes the step will
    hold that are not allocated yet (the Adam moments, unsharded accumulation buffers)."""
    if policy.device.type != "cuda":
        raise ValueError("a memory plan reads the CUDA allocator's counters: CUDA only")
    free(policy.device)
    static = torch.cuda.memory_allocated(policy.device) + extra_static
    lengths = (max(2, probe_tokens // 2), max(4, probe_tokens))
    kept: dict[str, list[Linear]] = {}
    rest = 0.0
    before = [layer_checkpointing(layer) for layer in policy.model.layers]
    try:
        for mode in (PLAIN, RECOMPUTED):
            apply(policy, [mode] * len(policy.model.layers))
            (a, ra), (b, rb) = (probe(policy, batch, t, zero_grad, before_backward)
                                for t in lengths)
            kept[mode] = [Linear.through(lengths[0], x, lengths[1], y)
                          for x, y in zip(a[:-1], b[:-1])]
            if mode == PLAIN:
                rest = max(a[-1] + ra, b[-1] + rb)
    finally:
        apply(policy, before)
    return MemoryPlan(static, kept, rest, lengths)


def apply(policy, policies: Sequence[str]) -> None:
    for layer, mode in zip(policy.model.layers, policies):
        checkpoint_layer(layer, mode)


# The probes' length (and half of it), at least: short enough to run under any plan, long
# enough for the part linear in tokens to dominate what they measure.
PROBE_TOKENS = 4096


def probe_length(tokens: int, vocab_size: int) -> int:
    """The longer probe for micro-batches of ``tokens``: PROBE_TOKENS, or two of the head's
    logprob chunks when that is more, at most ``tokens``. Both probes then hold a whole chunk:
    below one, the head's fp32 logits grow with the tokens (a 2k/4k fit carried that growth to
    64k: 8 GiB too much for the small preset's 32k vocabulary, run AH), and the plan's rest is
    the probes' own (MemoryPlan.rest), which must not miss a chunk's bytes."""
    return min(tokens, max(PROBE_TOKENS, 2 * logprob_chunk_rows(vocab_size)))


class MemoryPlanError(ValueError):
    """No activation checkpointing fits: the plan and the ways out in the message, the plan in
    ``plan``."""

    def __init__(self, message: str, plan: MemoryPlan):
        super().__init__(message)
        self.plan = plan


def unallocated_static(policy, optimizer_offloaded: bool, accumulates: bool) -> float:
    """Bytes a step holds that are not allocated before its first optimizer step: the two fp32
    Adam moments of this rank's trained parameters (none on the device when the optimizer is
    offloaded) and, when ``accumulates`` (a step of several micro-batches), the fp32 gradients
    the earlier micro-batches leave for the later ones to add into: the whole model's when they
    accumulate unsharded (Policy.accumulate_unsharded), this rank's shards otherwise (the
    compute copies' masters on one rank: 5.45 GiB for the `small` preset, which the trainer's
    two-micro-batch steps held over the probes' plan, bench/results/train_h200.txt, run AI):
    the probes run a step's last backward, which finds none held."""
    trained = [p for p in policy.model.parameters() if p.requires_grad]
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in trained)
    if not accumulates:
        held = 0
    elif policy.accumulate_unsharded:
        held = 4 * sum(p.numel() for p in trained)
    else:
        held = local
    return (0 if optimizer_offloaded else 2 * local) + held


def probe_batch(policy) -> Callable[[int], object]:
    """tokens -> one random sequence of that many tokens as a micro-batch for ``policy``."""
    from .batch import random_batch

    return lambda t: random_batch(policy.config.vocab_size, policy.routed_layers, [t])


def device_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).total_memory


def fitting_or_refused(plan: MemoryPlan, tokens: int, fraction: float, total: float,
                       kinds: Sequence[str] = ()) -> tuple[tuple[str, ...], float]:
    """-> (plan.fitting's policies within ``fraction`` of a device of ``total`` bytes, that
    limit in bytes); MemoryPlanError, with the plan and the ways out, when none fits."""
    limit = fraction * total
    policies = plan.fitting(tokens, limit)
    if policies is None:
        every = (RECOMPUTED,) * plan.num_layers
        raise MemoryPlanError(
            f"a micro-batch of {tokens} tokens does not fit {limit / GiB:.2f} GiB "
            f"(model.memory_fraction {fraction} of the device) even with every layer "
            f"checkpointed: {plan.describe(tokens, every, kinds)}. Lower loss.token_budget, "
            "shard over more ranks, or offload the optimizer (optim.optimizer_offload)", plan)
    return policies, limit


def plan_checkpointing(policy, tokens: int, fraction: float, extra_static: float,
                       zero_grad: Callable[[], None],
                       before_backward: Callable[[], None] | None = None
                       ) -> tuple[tuple[str, ...], MemoryPlan]:
    """model.activation_checkpointing = auto: measures ``policy`` (probe_length), gives each
    layer its policy from fitting_or_refused for micro-batches of ``tokens``, and returns (the
    policies, the plan). Every rank takes rank 0's plan (the same choice everywhere: FSDP's
    collectives must match)."""
    from .dist import broadcast_object

    plan = broadcast_object(measure(
        policy, probe_batch(policy), probe_length(tokens, policy.config.vocab_size),
        extra_static, zero_grad, before_backward))
    policies, _ = fitting_or_refused(plan, tokens, fraction, device_bytes(policy.device),
                                     layer_kinds(policy))
    apply(policy, policies)
    return policies, plan


def layer_kinds(policy) -> list[str]:
    """Decoder layers named by index and compression ratio, as the plans print them."""
    cfg = policy.config
    return [f"L{i} r{cfg.compress_ratio(i)}" for i in range(cfg.num_hidden_layers)]
