"""The trainable policy and the frozen reference: loading, sharding, packed logprob forwards."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from sglang_dsv41.loader.checkpoint import ensure_checkpoint, load_model
from sglang_dsv41.model import DSV41ForCausalLM, ForwardContext

from .batch import MicroBatch
from .config import ModelConfig
from .parallelize import compute_dtype_for, parallelize_policy


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


def build_policy(cfg: ModelConfig, mesh: DeviceMesh, device: torch.device, *,
                 trainable: bool = True) -> "Policy":
    """Loads the checkpoint the server serves (fp32 master weights) and shards it. The routing
    bias is always frozen (the model builds it so); the router gate when cfg.freeze_router."""
    path = ensure_checkpoint(cfg.model_path, cfg.checkpoint_cache_dir)
    model = load_model(path, dtype=torch.float32, device="cpu")
    for name, p in model.named_parameters():
        if not trainable or (cfg.freeze_router and name.endswith("mlp.gate.weight")):
            p.requires_grad_(False)
    model.to(device)
    compute_dtype = compute_dtype_for(device, cfg.compute_dtype)
    parallelize_policy(model, mesh, compute_dtype=compute_dtype, lm_head_fp32=cfg.lm_head_fp32)
    if not trainable:
        model.eval()
    return Policy(model, path, device, torch.float32 if cfg.lm_head_fp32 else compute_dtype)


@dataclass
class ForwardOut:
    logprobs: torch.Tensor            # fp32 [N], aligned with MicroBatch.targets
    routed: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (ids, weights) [T, k]


class Policy:
    def __init__(self, model: DSV41ForCausalLM, checkpoint_dir: str, device: torch.device,
                 head_dtype: torch.dtype, attention_backend: str | None = None):
        self.model, self.checkpoint_dir, self.device = model, checkpoint_dir, device
        self.head_dtype, self.attention_backend = head_dtype, attention_backend
        self.config = model.config

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.config.num_hidden_layers) if self.config.is_moe_layer(i)]

    def forward(self, mb: MicroBatch, *, replay: bool, record_routing: bool = False
                ) -> ForwardOut:
        dev = self.device
        routing = None
        if replay and mb.routing is not None:
            routing = {k: (i.to(dev), w.to(dev)) for k, (i, w) in mb.routing.items()}
        ctx = ForwardContext.packed(mb.seq_lens, device=dev, routing_replay=routing,
                                    record_routing=record_routing,
                                    attention_backend=self.attention_backend)
        hidden = self.model(mb.input_ids.to(dev), ctx)
        rows = hidden.index_select(0, mb.hidden_index.to(dev))
        # Call lm_head as a module (not compute_logits) so its FSDP group unshards for it.
        logits = self.model.lm_head(rows.to(self.head_dtype)).float()
        logp = logits.log_softmax(-1).gather(1, mb.targets.to(dev)[:, None]).squeeze(1)
        return ForwardOut(logp, ctx.routed)

    def trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
