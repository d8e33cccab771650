"""parallelize_policy: FSDP2 for DSV4ForCausalLM, which itself knows nothing of it.

Groups (torchtitan's order: every decoder layer, then ``[norm, head, hc_head_*]``, root last):
- fp32 groups (param_dtype fp32) for what must be computed in fp32: one group for every
  layer's mHC parameters (``hc_attn_*``, ``hc_ffn_*``) and attention sinks
  (``attn.attn_sink``), gathered once a step and kept so until the backward has ended; per
  layer the MoE router (``ffn.gate.weight``; its fp32 correction bias is a buffer) when it is
  trained; a frozen router (RL's default) is no group at all: FSDP ignores it, every rank holds
  it whole in fp32;
- one compute-dtype group per decoder layer for everything else (attention, compressors,
  indexer, the routed experts' two stacks ``ffn.experts.w13``/``w2``, Engram's wkv/q/k);
- ``[norm, head, hc_head_*]`` in fp32 when lm_head_fp32 (RL needs an fp32 head), else the
  compute dtype; the root (the embedding) last.
Master weights are fp32 everywhere (a group needs one original dtype); the policy casts to the
compute dtype for the forward and reduces gradients in fp32. On one rank the model may skip
FSDP and train through compute-dtype copies instead (``model.one_rank``, compute_copies.py),
with the same module tree and names. The sinks and mHC parameters are bare parameters of the
attention, the layer and the model, so they move into an ``Fp32Params`` child
(``<owner>.fp32_params.<name>``) of that fp32 group; a forward pre-hook hands the
unsharded fp32 tensors back to the owner under their own names. They are never in
``ignored_params`` (that would skip their gradient reduction). Frozen tables (Engram's
``engram.embed.*`` and ``ffn.gate.tid2eid``) are buffers: never sharded, never in the
optimizer, never sent (weight_sync) and never checkpointed (checkpoint.py).
The sharded model's state dict keeps the expert stacks under their own names (DCP checkpoints
hold them stacked); weight_sync shows them per expert (names.per_expert_state) once gathered.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from sglang_dsv41.loader.weight_sync_group import parse_dtype
from sglang_dsv41.model.dsv4.model import DSV4ForCausalLM

from . import fsdp_copy_in
from .compute_copies import apply_compute_copies
from .optimizer_offload import offload_policy_for

FP32_HOLDER = "fp32_params"
ACTIVATION_CHECKPOINTING = ("none", "layer", "selective")
_PLAIN_FORWARD = "_dsv41_plain_forward"  # a checkpointed layer's own forward
_CHECKPOINTING = "_dsv41_checkpointing"  # the policy checkpoint_layer last gave a layer
# One rank: FSDP2 (fsdp), or no FSDP and compute-dtype copies of the weights (copies,
# compute_copies.py); auto: copies when they fit (keep_unsharded) and nothing is offloaded.
ONE_RANK_MODES = ("auto", "fsdp", "copies")
# Kept unsharded between forward and backward while the compute-dtype copy of every parameter
# takes at most this fraction of the device's memory (one re-gather per layer saved).
KEEP_UNSHARDED_MEMORY_FRAC = 0.1


def is_sink_param(name: str) -> bool:
    return name.endswith("attn_sink")


def is_fp32_param(name: str) -> bool:
    """Sinks and mHC parameters: kept and computed in fp32 whatever the compute dtype."""
    leaf = name.rsplit(".", 1)[-1]
    return is_sink_param(name) or leaf.startswith("hc_")


def server_param_name(name: str) -> str:
    """Trainer name -> SGLang 0.5.23's flat checkpoint name (the model's own state_dict name)."""
    return name.replace(f"{FP32_HOLDER}.", "")


class Fp32Params(nn.Module):
    """Owns some bare parameters of its parent so FSDP can keep them in an fp32 group (on
    compute copies, one rank without FSDP, it keeps their names the same); calling it (in the
    parent's pre-hook) unshards them and returns {name: unsharded parameter}."""

    def forward(self) -> dict[str, torch.Tensor]:
        return dict(self._parameters)


def _give_params(owner: nn.Module, args) -> None:
    """Hand the holder's unsharded parameters to ``owner`` under their own names. In a forward
    every holder is called through FSDP, once: the first call unshards the one group that all
    holders share (reshard_after_forward=False keeps it so until the root's post-backward
    callback), the others find it unsharded, and the group sees each of its modules run as
    FSDP expects of a grouped ``fully_shard``. A recompute in the backward (activation
    checkpointing) takes the unsharded tensors directly: calling FSDP there made the holder
    the forward root again, and torch 2.11's root pre-forward on CUDA indexes the moved
    arguments of this no-argument call (IndexError "args_tuple[0]"); under selective
    checkpointing the extra call is also an op sequence the forward did not have."""
    holder = getattr(owner, FP32_HOLDER)
    owner.__dict__.update(holder._parameters if _in_backward() else holder())


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _take_params(owner: nn.Module, args, output) -> None:
    for name in getattr(owner, FP32_HOLDER)._parameters:
        owner.__dict__.pop(name, None)


def move_fp32_params(owner: nn.Module) -> Fp32Params | None:
    """Move the owner's direct sink/mHC parameters into ``owner.fp32_params``."""
    names = [n for n in owner._parameters if is_fp32_param(n)]
    if not names:
        return None
    holder = Fp32Params()
    for n in names:
        holder.register_parameter(n, owner._parameters.pop(n))
    owner.add_module(FP32_HOLDER, holder)
    # FSDP prepends its own pre-hook, so the root's lazy init runs before this one.
    owner.register_forward_pre_hook(_give_params)
    owner.register_forward_hook(_take_params)
    return holder


def _in_own_group(name: str) -> bool:
    return not (name.startswith(f"{FP32_HOLDER}.") or f".{FP32_HOLDER}." in name
                or name.startswith("ffn.gate."))


def _maybe_unused(layer: nn.Module, name: str) -> bool:
    # The grouped MoE multiplies a stack of every expert's weights: all of them get a gradient.
    return not (name.startswith("ffn.experts.") and layer.ffn.grouped)


def _touch_every_parameter(layer: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    # FSDP2 reduce-scatters the gradients of the parameters that have one; an expert (or a
    # compressor) that got no token on one rank but some on another would make the ranks'
    # collectives disagree. A zero term gives every parameter of the layer's own group a
    # gradient on every rank (this hook runs before FSDP reshards that group; the fp32 child
    # groups are used on every rank anyway). One launch per parameter: only for those that may
    # lack a gradient.
    touch = [p.sum() for n, p in layer.named_parameters()
             if p.requires_grad and _in_own_group(n) and _maybe_unused(layer, n)]
    if not touch:
        return output
    streams, *rest = output if isinstance(output, tuple) else (output,)  # (streams, mHC pre)
    streams = streams + 0.0 * torch.stack(touch).sum().to(streams.dtype)
    return (streams, *rest) if isinstance(output, tuple) else streams


# Selective checkpointing saves what is costly to recompute (matmuls, grouped expert GEMMs) and
# recomputes the rest (norms, mHC mixing, activations, permutations) in the backward.
_SAVED_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
              torch.ops.aten._grouped_mm.default}


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return (CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS
            else CheckpointPolicy.PREFER_RECOMPUTE)


# FSDP2's hooks of the groups nested in a layer (the router's, the fp32 holders') open profiler
# ranges in the forward and again in the recompute, not always as many times (prefetch may have
# unsharded a group before the forward reached it). Selective checkpointing numbers every op it
# sees and refuses a recompute whose sequence differs; the ranges hold no tensors, so the two
# modes let them through unnumbered.
_PROFILER_OPS = {torch.ops.profiler._record_function_enter_new.default,
                 torch.ops.profiler._record_function_exit._RecordFunction}
_UNNUMBERED_PROFILER_MODES: dict[type, type] = {}


def _unnumbered_profiler_ops(mode_cls: type) -> type:
    if mode_cls not in _UNNUMBERED_PROFILER_MODES:
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in _PROFILER_OPS:
                return func(*args, **(kwargs or {}))
            return super(cls, self).__torch_dispatch__(func, types, args, kwargs)

        cls = type(mode_cls.__name__, (mode_cls,), {"__torch_dispatch__": __torch_dispatch__})
        _UNNUMBERED_PROFILER_MODES[mode_cls] = cls
    return _UNNUMBERED_PROFILER_MODES[mode_cls]


def _selective_context():
    modes = create_selective_checkpoint_contexts(_save_matmuls)
    for mode in modes:
        mode.__class__ = _unnumbered_profiler_ops(type(mode))
    return modes


def checkpoint_layer(layer: nn.Module, policy: str) -> None:
    """Recompute ``layer``'s forward in its backward (``layer``: keep only its inputs;
    ``selective``: keep the matmul outputs too; ``none``: its plain forward). The module and
    its parameter names are unchanged (no wrapper module: checkpoints and weight sync see the
    same names). Called again, before or after FSDP wraps the layer (whose hooks run around
    whatever ``forward`` is then), it replaces the earlier policy: memory_plan.py probes a
    built model under two policies and then gives each layer its own."""
    if policy not in ACTIVATION_CHECKPOINTING:
        raise ValueError(f"activation checkpointing {policy!r}: choose from "
                         f"{ACTIVATION_CHECKPOINTING}")
    inner = layer.__dict__.pop(_PLAIN_FORWARD, None) or layer.forward
    layer.__dict__.pop("forward", None)
    layer.__dict__[_CHECKPOINTING] = policy
    if policy == "none":
        return
    layer.__dict__[_PLAIN_FORWARD] = inner
    kw = {"context_fn": _selective_context} if policy == "selective" else {}

    def run(*args, **kwargs):
        # The recompute runs outside the layer's module call: its fp32 holder's pre-hook has
        # not handed the mHC parameters back (the attention's runs, it is a module call).
        if hasattr(layer, FP32_HOLDER) and _in_backward():
            _give_params(layer, args)
        return inner(*args, **kwargs)

    def forward(*args, **kwargs):
        return checkpoint(run, *args, use_reentrant=False, **kw, **kwargs)

    layer.forward = forward


def layer_checkpointing(layer: nn.Module) -> str:
    """The policy checkpoint_layer last gave ``layer`` (none if never)."""
    return layer.__dict__.get(_CHECKPOINTING, "none")


def fits_unsharded(model: nn.Module, mesh: DeviceMesh, bytes_per_param: int) -> bool:
    """True when ``bytes_per_param`` for every parameter of the whole (unsharded) model takes
    at most KEEP_UNSHARDED_MEMORY_FRAC of the mesh's CUDA device (never on other devices)."""
    if mesh.device_type != "cuda":
        return False
    need = sum(p.numel() for p in model.parameters()) * bytes_per_param
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return need <= KEEP_UNSHARDED_MEMORY_FRAC * total


def keep_unsharded(model: nn.Module, mesh: DeviceMesh, compute_dtype: torch.dtype) -> bool:
    """reshard_after_forward by memory: keep the gathered compute-dtype parameters between the
    forward and the backward when all of them fit (fits_unsharded)."""
    return fits_unsharded(model, mesh, compute_dtype.itemsize)


def accumulates_unsharded(model: nn.Module, mesh: DeviceMesh, compute_dtype: torch.dtype,
                          requested: str = "auto", optimizer_offload: str = "none") -> bool:
    """Whether an optimizer step's micro-batches accumulate unsharded (Policy.micro_batch):
    never for a model without FSDP (compute copies: its micro-batches add into the masters'
    fp32 gradients anyway); ``always``/``never``, or by memory: the gathered compute-dtype
    parameters and FSDP's fp32 accumulated gradients (its reduce dtype) of the whole model fit
    (fits_unsharded), and the optimizer is not offloaded (asked for where the device's memory
    is short)."""
    if not isinstance(model, FSDPModule):
        return False
    if requested != "auto":
        return requested == "always"
    return optimizer_offload == "none" and fits_unsharded(model, mesh,
                                                          compute_dtype.itemsize + 4)


def uses_compute_copies(model: nn.Module, mesh: DeviceMesh, compute_dtype: torch.dtype,
                        one_rank: str = "auto", optimizer_offload: str = "none") -> bool:
    """Whether ``model`` on ``mesh`` trains without FSDP, on compute-dtype copies of its fp32
    weights (compute_copies.py): only on one rank; ``copies`` or ``fsdp``, or by memory (auto:
    the copies of every parameter fit, keep_unsharded, and the optimizer is not offloaded,
    which needs FSDP's offload policy)."""
    if one_rank not in ONE_RANK_MODES:
        raise ValueError(f"one_rank {one_rank!r}: choose from {ONE_RANK_MODES}")
    if mesh.size() > 1 or one_rank == "fsdp":
        return False
    if optimizer_offload != "none":
        if one_rank == "copies":
            raise ValueError(f"one_rank=copies keeps every weight on the device: not with "
                             f"optimizer offload {optimizer_offload!r} (use one_rank=fsdp)")
        return False
    return one_rank == "copies" or keep_unsharded(model, mesh, compute_dtype)


def keeps_fp32(name: str, lm_head_fp32: bool) -> bool:
    """Parameters computed in fp32 whatever the compute dtype: sinks, mHC, the router, and the
    final norm and head when lm_head_fp32 (FSDP's fp32 groups below)."""
    return is_fp32_param(name) or name.endswith("ffn.gate.weight") or (
        lm_head_fp32 and name.split(".", 1)[0] in ("norm", "head"))


def compute_dtype_for(device: torch.device, requested: str = "auto") -> torch.dtype:
    if requested == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return parse_dtype(requested)


def parallelize_policy(model: DSV4ForCausalLM, mesh: DeviceMesh, *,
                       compute_dtype: torch.dtype, lm_head_fp32: bool = True,
                       reshard_after_forward: bool | None = None,
                       optimizer_offload: str = "none",
                       activation_checkpointing: str = "none",
                       one_rank: str = "auto") -> DSV4ForCausalLM:
    """Shard ``model`` (fp32 master weights, any device) in place over the 1-D ``mesh``;
    ``optimizer_offload="fsdp"`` gives every group FSDP2's CPUOffloadPolicy (shards and
    gradients on the host), the other modes keep them on the mesh's device.
    ``reshard_after_forward`` None: by memory (keep_unsharded). Each decoder layer prefetches
    the next one's all-gather in the forward and the previous one's in the backward. On one
    rank ``one_rank`` may choose compute-dtype copies instead of FSDP (uses_compute_copies)."""
    for name, p in model.named_parameters():
        if p.requires_grad and p.dtype != torch.float32:
            raise ValueError(f"parameter {name} is {p.dtype}: build the trainer's model in fp32 "
                             "(master weights); the compute dtype comes from the FSDP policy")
    # The same module tree and state-dict names in both modes, so a DCP checkpoint of either
    # resumes in the other (one GPU on copies, several on FSDP): the expert stacks keep their
    # own names (weight_sync splits them once gathered), and the sink/mHC parameters live in
    # fp32 holders (Fp32Params), which FSDP groups and the copies use as they are.
    for layer in model.layers:
        layer.ffn.experts.per_expert_state_dict = False
    holders = [h for layer in model.layers for owner in (layer, layer.attn)
               if (h := move_fp32_params(owner)) is not None]
    hc_head = move_fp32_params(model)  # V4's hc_head_*; V4.1 has none (mhc_combine)
    if uses_compute_copies(model, mesh, compute_dtype, one_rank, optimizer_offload):
        for layer in model.layers:
            checkpoint_layer(layer, activation_checkpointing)
        apply_compute_copies(model, compute_dtype, lambda n: keeps_fp32(n, lm_head_fp32))
        return model
    if reshard_after_forward is None:
        reshard_after_forward = not keep_unsharded(model, mesh, compute_dtype)
    fsdp_copy_in.install(mesh.device_type)  # the gradients' copy-in by torch.cat (its docstring)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                cast_forward_inputs=False)
    # The router's input arrives in the compute dtype: its logits are computed in fp32.
    router = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                  cast_forward_inputs=True)
    low = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32,
                               cast_forward_inputs=False)
    offload = offload_policy_for(optimizer_offload, torch.device(mesh.device_type))
    kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, offload_policy=offload)
    # Called in a pre-hook, used through the owner's forward and backward: a holder stays
    # unsharded until its post-backward (the root's final callback) reshards it.
    held = dict(mesh=mesh, reshard_after_forward=False, offload_policy=offload)
    # Every layer's fp32 holders form one group: one all-gather and one reduce-scatter a step
    # for all of them, not two of each per layer (FSDP's host work per group, under cProfile
    # on an H200's host: 1.8 ms a reduce, 0.8 ms a pre-forward; bench/results/train_h200.txt,
    # runs O and Q).
    if holders:
        fully_shard(holders, mp_policy=fp32, **held)
    for layer in model.layers:
        gate = layer.ffn.gate
        # A frozen router (model.freeze_router, RL's default) stays out of FSDP: replicated in
        # fp32 on every rank (it gets no gradient to reduce), no group to gather every step;
        # the gate casts its input to the weight's dtype itself.
        frozen_router = {gate.weight} if not gate.weight.requires_grad else None
        if frozen_router is None:
            fully_shard(gate, mp_policy=router, **kw)
        if mesh.size() > 1:  # one rank: no collective to keep in step
            layer.register_forward_hook(_touch_every_parameter)
        checkpoint_layer(layer, activation_checkpointing)
        fully_shard(layer, mp_policy=low, ignored_params=frozen_router, **kw)
    extra = [hc_head] if hc_head is not None else []
    if lm_head_fp32:
        fully_shard([model.norm, model.head, *extra], mp_policy=fp32, **held)
    else:
        if extra:
            fully_shard(hc_head, mp_policy=fp32, **held)
        fully_shard([model.norm, model.head], mp_policy=low, **held)
    fully_shard(model, mp_policy=low, **kw)
    layers = list(model.layers)
    for prev, nxt in zip(layers, layers[1:]):
        prev.set_modules_to_forward_prefetch([nxt])
        nxt.set_modules_to_backward_prefetch([prev])
    return model


def reshard_gathered(model: torch.nn.Module) -> None:
    """Reshards every FSDP group a forward left gathered. A forward under no_grad has no
    backward to reshard the groups kept gathered between forward and backward
    (reshard_after_forward False: the fp32 holders and the head; on CUDA every layer when the
    model fits); left so past an optimizer step, the next forward skips their all-gather and
    computes with the weights from before the step."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
