"""parallelize_policy: FSDP2 for the reference model, which itself knows nothing of it.

Groups (innermost first, every one a ``fully_shard`` call):
- fp32 groups (param_dtype fp32): each RMSNorm, each MoE router, each layer's sinks, and the
  final ``[norm, lm_head]`` when lm_head_fp32 is set;
- one compute-dtype group per decoder layer (attention and MLP weights);
- the root (embeddings, lm_head when it is not fp32).
Master weights are fp32 everywhere (a group needs one original dtype); the policy casts to the
compute dtype for the forward and reduces gradients in fp32. Sinks are a bare parameter of the
attention module, so they move into a ``SinkHolder`` child that gets its own fp32 group; a
forward pre-hook hands the unsharded fp32 tensor back to the attention as ``attn.sinks``. They
are never in ``ignored_params`` (that would skip their gradient reduction). Frozen Engram
tables are ignored: not sharded, not reduced, never synced.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from sglang_dsv41.model import DSV41ForCausalLM, is_engram_table
from sglang_dsv41.model.layers import MoE, RMSNorm, Router

SINK_HOLDER = "sink_holder"


class SinkHolder(nn.Module):
    """Owns an attention layer's sinks so FSDP can keep them in an fp32 group of their own."""

    def __init__(self, sinks: nn.Parameter):
        super().__init__()
        self.sinks = sinks

    def forward(self) -> torch.Tensor:
        return self.sinks


def _give_sinks(attn: nn.Module, args) -> None:
    attn.__dict__["sinks"] = getattr(attn, SINK_HOLDER)()


def _take_sinks(attn: nn.Module, args, output) -> None:
    attn.__dict__.pop("sinks", None)


def move_sinks_to_holders(model: nn.Module) -> int:
    """Replace every ``attn.sinks`` parameter by ``attn.sink_holder.sinks``; returns the count."""
    count = 0
    for layer in model.model.layers:
        attn = layer.self_attn
        sinks = attn._parameters.get("sinks")
        if sinks is None:
            continue
        del attn._parameters["sinks"]
        attn.add_module(SINK_HOLDER, SinkHolder(sinks))
        attn.register_forward_pre_hook(_give_sinks)
        attn.register_forward_hook(_take_sinks)
        count += 1
    return count


def _touch_every_expert(moe: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    # FSDP2 reduce-scatters the gradients of the parameters that have one; an expert that got no
    # token on one rank but some on another would make the ranks' collectives disagree. A zero
    # term gives every expert a (zero) gradient on every rank.
    touch = sum(p.sum() for p in moe.experts.parameters() if p.requires_grad)
    return output + 0.0 * touch if torch.is_tensor(touch) else output


def server_param_name(name: str) -> str:
    """Trainer parameter name -> the checkpoint/server name."""
    return name.replace(f".{SINK_HOLDER}.sinks", ".sinks")


def is_sink_param(name: str) -> bool:
    return name.endswith("sinks")


def compute_dtype_for(device: torch.device, requested: str = "auto") -> torch.dtype:
    if requested == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[requested]


def parallelize_policy(model: DSV41ForCausalLM, mesh: DeviceMesh, *,
                       compute_dtype: torch.dtype, lm_head_fp32: bool = True,
                       reshard_after_forward: bool = True) -> DSV41ForCausalLM:
    """Shard ``model`` (fp32 master weights, any device) in place over the 1-D ``mesh``."""
    for name, p in model.named_parameters():
        if p.requires_grad and p.dtype != torch.float32:
            raise ValueError(f"parameter {name} is {p.dtype}: build the trainer's model in fp32 "
                             "(master weights); the compute dtype comes from the FSDP policy")
    move_sinks_to_holders(model)
    for layer in model.model.layers:
        if isinstance(layer.mlp, MoE):
            layer.mlp.register_forward_hook(_touch_every_expert)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                cast_forward_inputs=False)
    low = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32,
                               cast_forward_inputs=False)
    engram = {p for n, p in model.named_parameters() if is_engram_table(n)}
    kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    for layer in model.model.layers:
        for mod in layer.modules():
            if isinstance(mod, (RMSNorm, Router)) and mod is not model.model.norm:
                fully_shard(mod, mp_policy=fp32, **kw)
            elif isinstance(mod, SinkHolder):
                # Called in a pre-hook, used through the attention forward and backward: keep it
                # unsharded until its post-backward (the root's final callback) reshards it.
                fully_shard(mod, mp_policy=fp32, mesh=mesh, reshard_after_forward=False)
        fully_shard(layer, mp_policy=low, ignored_params=engram & set(layer.parameters()), **kw)
    if lm_head_fp32:
        fully_shard([model.model.norm, model.lm_head], mp_policy=fp32, **kw)
    else:
        fully_shard(model.model.norm, mp_policy=fp32, **kw)
    fully_shard(model, mp_policy=low, ignored_params=engram, **kw)
    return model
