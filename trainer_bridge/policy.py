"""The trainable policy and the frozen reference: loading, sharding, packed logprob forwards."""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from sglang_dsv41.loader.serving import load_serving_model
from sglang_dsv41.model.dsv4.context import DSV4Context, host_to_device
from sglang_dsv41.model.dsv4.model import DSV4ForCausalLM
from sglang_dsv41.model.dsv4.token_logprobs import check_targets

from .batch import MicroBatch
from .compute_copies import ComputeCopies
from .config import ModelConfig
from .parallelize import accumulates_unsharded, compute_dtype_for, parallelize_policy


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("model.device=cuda but CUDA is not available")
        # torchrun's LOCAL_RANK: the process group may not exist yet (NCCL wants the device first)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))
                              % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def load_policy_model(model_path: str) -> DSV4ForCausalLM:
    """The weights the server serves for ``model_path`` (a preset or a checkpoint directory),
    in fp32 on the CPU: the trainer's master weights."""
    return load_serving_model(model_path, torch.float32, "cpu").train()


def lm_head_gemm_for(device: torch.device, lm_head_gemm: str) -> str:
    """model.lm_head_gemm resolved: auto is tf32x3-logits on CUDA (fp32-accurate logp, TF32
    gradients), ieee elsewhere (no TF32 on a CPU: there the split would triple the logits' work
    for nothing)."""
    if lm_head_gemm != "auto":
        return lm_head_gemm
    return "tf32x3-logits" if device.type == "cuda" else "ieee"


def build_policy(cfg: ModelConfig, mesh: DeviceMesh, device: torch.device, *,
                 trainable: bool = True, optimizer_offload: str = "none",
                 temperature: float = 1.0) -> "Policy":
    """Loads the checkpoint the server serves (fp32 master weights) and makes it the policy
    (policy_from_model)."""
    return policy_from_model(load_policy_model(cfg.model_path), cfg, mesh, device,
                             trainable=trainable, optimizer_offload=optimizer_offload,
                             temperature=temperature)


def policy_from_model(model: DSV4ForCausalLM, cfg: ModelConfig, mesh: DeviceMesh,
                      device: torch.device, *, trainable: bool = True,
                      optimizer_offload: str = "none", temperature: float = 1.0,
                      attention_backend: str | None = None) -> "Policy":
    """A built model (fp32 master weights) as the trainer's policy: the router gate frozen when
    cfg.freeze_router (its correction bias and the frozen tables are buffers, never trained),
    on ``device``, the head's GEMMs as cfg.lm_head_gemm, sharded (parallelize_policy).
    build_policy and the benchmarks (models built from a config, not loaded) both use it."""
    for name, p in model.named_parameters():
        if not trainable or (cfg.freeze_router and name.endswith("ffn.gate.weight")):
            p.requires_grad_(False)
    model.to(device)
    model.head.fp32_gemm = lm_head_gemm_for(device, cfg.lm_head_gemm)
    compute_dtype = compute_dtype_for(device, cfg.compute_dtype)
    # auto: built plain, its layers checkpointed after the start-up plan (memory_plan.py)
    checkpointing = cfg.activation_checkpointing
    parallelize_policy(model, mesh, compute_dtype=compute_dtype, lm_head_fp32=cfg.lm_head_fp32,
                       optimizer_offload=optimizer_offload,
                       activation_checkpointing=checkpointing if trainable
                       and checkpointing != "auto" else "none", one_rank=cfg.one_rank)
    if not trainable:
        model.eval()
    accumulate = trainable and accumulates_unsharded(model, mesh, compute_dtype,
                                                     cfg.accumulate_unsharded, optimizer_offload)
    return Policy(model, cfg.model_path, device, attention_backend=attention_backend,
                  serving_numerics=cfg.serving_numerics, temperature=temperature,
                  accumulate_unsharded=accumulate)


class ForwardState(MutableMapping):
    """``DSV4Context.shared`` for a sharded forward: a mapping FSDP2 does not look into. Its
    hooks rebuild every dict and dataclass among a module's inputs that holds a tensor requiring
    grad (torch 2.13 ``replace_grad_tensors``), so a plain dict would give each decoder layer its
    own copy, and V4.1's ratio-1/2 layers would not see their kv/index source's entries."""

    def __init__(self) -> None:
        self._items: dict[Any, Any] = {}

    def __getitem__(self, key: Any) -> Any:
        return self._items[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._items[key] = value

    def __delitem__(self, key: Any) -> None:
        del self._items[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class ForwardOut:
    logprobs: torch.Tensor            # fp32 [N], aligned with MicroBatch.targets
    routed: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (ids, weights) [T, k]
    # The forward's shared entries (V4.1 source layers'), kept for checkpointed recomputes.
    state: ForwardState | None = None
    copies: ComputeCopies | None = None  # the model's compute copies, on one rank

    def release(self) -> None:
        """Drops the forward's shared entries; call it once the backward is done or has failed.
        Under activation checkpointing those entries and the recompute's saved inputs hold each
        other through autograd nodes, a cycle Python's collector cannot see: a forward whose
        backward never completed (an out-of-memory step) would otherwise keep the whole
        activation graph alive for good. A model on compute copies gets its masters back."""
        if self.state is not None:
            self.state.clear()
        if self.copies is not None:
            self.copies.abandon()


class Policy:
    def __init__(self, model: DSV4ForCausalLM, model_path: str, device: torch.device, *,
                 attention_backend: str | None = None, serving_numerics: bool = False,
                 temperature: float = 1.0, accumulate_unsharded: bool = False):
        self.model, self.model_path, self.device = model, model_path, device
        self.accumulate_unsharded = accumulate_unsharded
        self.attention_backend, self.serving_numerics = attention_backend, serving_numerics
        # The rollouts' sampling temperature: the server returns logprobs of logits / T
        # (SGLang's default), so the trainer's are of the same distribution; greedy: 1.
        self.temperature = temperature if temperature > 0 else 1.0
        self.config = model.cfg
        # model.cuda_graphs: the trainer's MicroBatchGraphs, which forward_backward and a
        # forward without autograd (the reference pass) then use
        self.graphs = None

    def micro_batch(self, index: int, count: int) -> None:
        """Call before micro-batch ``index`` of an optimizer step's ``count`` (the same count on
        every rank: build_mini_batches pads): with accumulate_unsharded only the last reduces
        the gradients over the ranks and reshards; the others add into FSDP's unsharded fp32
        gradients and keep the parameters gathered for the next forward (no reduce, no
        re-gather: a host-bound step's FSDP hooks held the host 27 ms a backward and 18 ms a
        forward on an H200, bench/results/train_h200.txt). With compute copies and their
        reader (the Triton AdamW) the last leaves its gradients pending for the step to read
        (compute_copies.py)."""
        last = index == count - 1
        if self.accumulate_unsharded:
            self.model.set_requires_gradient_sync(last)
            self.model.set_reshard_after_backward(last)
        copies = getattr(self.model, "compute_copies", None)
        if last and copies is not None:
            copies.defer_next_backward()

    @property
    def routed_layers(self) -> list[int]:
        """Every V4 layer is MoE: hash-routed (tid2eid) or top-k routed."""
        return list(range(self.config.num_hidden_layers))

    @property
    def replayed_layers(self) -> list[int]:
        """R3 replays the top-k layers; hash layers route from tid2eid (checked, not replayed)."""
        return [i for i in self.routed_layers if not self.config.is_hash_layer(i)]

    def forward(self, mb: MicroBatch, *, replay: bool, record_routing: bool = False
                ) -> ForwardOut:
        if self.graphs is not None and not torch.is_grad_enabled():
            logp, routed = self.graphs.forward(mb, replay, record_routing)
            return ForwardOut(logp, routed)
        dev = self.device
        routing = None
        if replay and mb.routing is not None:
            routing = {k: (host_to_device(mb.routing[k][0], dev),
                           host_to_device(mb.routing[k][1], dev)) for k in self.replayed_layers}
        state = ForwardState()
        ctx = DSV4Context.packed(mb.seq_lens, device=dev, routing_replay=routing,
                                 record_routing=record_routing,
                                 attention_backend=self.attention_backend,
                                 serving_numerics=self.serving_numerics, shared=state)
        check_targets(mb.targets, self.config.vocab_size)  # on the host: no GPU read-back
        # Called as a module so every FSDP group unshards; the head is fp32 (lm_head_fp32).
        # The model returns the targets' log-probabilities computed in chunks of rows: the
        # [T, vocab] fp32 logits of a long sequence never exist at once.
        logp = self.model(host_to_device(mb.input_ids, dev), ctx,
                          hidden_index=host_to_device(mb.hidden_index, dev),
                          targets=host_to_device(mb.targets, dev), temperature=self.temperature)
        return ForwardOut(logp, ctx.routed, state, getattr(self.model, "compute_copies", None))

    def trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
