"""Parallel-layout rules for DSV4.1-class deployments.

Convention (the planner's and SPEC part 2's): ``tp`` is the attention tensor-parallel size of one
DP-attention replica, ``dp`` the number of replicas and ``pp`` the pipeline depth, so the GPUs
used are tp x dp x pp = nnodes x gpus_per_node. The MoE layers span every rank of a pipeline
stage, split ``ep`` ways over experts. SGLang spells the same layout with a world-sized tp:
``--tp-size tp*dp --dp-size dp --enable-dp-attention --ep-size ep`` (attn_tp_size =
tp_size // dp_size); ``validate_sglang_layout`` accepts that spelling, and there the rule
tp_size % dp_size == 0 applies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..model.dsv4.config import DSV4Config
from ..policies.launch_guards import DeploymentRefused, check_attention_tp, check_pp_with_r3


class PlanError(ValueError):
    """A deployment plan that is illegal or cannot fit; the message says why."""


@dataclass(frozen=True)
class ParallelLayout:
    tp: int  # attention TP per DP replica (SGLang's attn_tp_size)
    dp: int
    ep: int
    pp: int
    nnodes: int
    gpus_per_node: int
    warnings: tuple[str, ...] = field(default=())

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def sglang_tp_size(self) -> int:
        return self.tp * self.dp

    def sglang_flags(self) -> str:
        flags = f"--tp-size {self.sglang_tp_size} --dp-size {self.dp} --ep-size {self.ep}"
        if self.dp > 1:
            flags += " --enable-dp-attention"
        if self.pp > 1:
            flags += f" --pp-size {self.pp}"
        if self.nnodes > 1:
            flags += f" --nnodes {self.nnodes}"
        return flags


def validate_parallel_layout(cfg: DSV4Config, tp: int, dp: int, ep: int | None, pp: int,
                             r3: bool, nnodes: int, gpus_per_node: int) -> ParallelLayout:
    """Check a layout against the model and the machines; raise PlanError naming the rule broken.

    ``ep=None`` spreads the experts over every rank of a pipeline stage (tp x dp).
    """
    for name, value in (("tp", tp), ("dp", dp), ("pp", pp), ("nnodes", nnodes),
                        ("gpus_per_node", gpus_per_node)):
        if not isinstance(value, int) or value < 1:
            raise PlanError(f"{name} must be an integer >= 1, got {value!r}")
    if ep is None:
        ep = tp * dp
    if not isinstance(ep, int) or ep < 1:
        raise PlanError(f"ep must be an integer >= 1, got {ep!r}")
    try:  # the same rules the launchers apply (sglang_dsv41.policies.launch_guards)
        check_pp_with_r3(pp, r3)
        check_attention_tp(tp, cfg.o_groups)
    except DeploymentRefused as e:
        raise PlanError(str(e)) from None
    if cfg.num_attention_heads % tp:
        raise PlanError(f"attention tp={tp} must divide num_attention_heads="
                        f"{cfg.num_attention_heads}")
    gpus = nnodes * gpus_per_node
    if tp * dp * pp != gpus:
        raise PlanError(
            f"tp x dp x pp = {tp} x {dp} x {pp} = {tp * dp * pp} ranks, but nnodes x "
            f"gpus_per_node = {nnodes} x {gpus_per_node} = {gpus} GPUs; they must be equal "
            "(tp is attention TP per DP replica)")
    if cfg.n_routed_experts % ep:
        raise PlanError(f"ep={ep} must divide n_routed_experts={cfg.n_routed_experts}")
    if (tp * dp) % ep:
        raise PlanError(f"ep={ep} must divide the {tp * dp} ranks of a pipeline stage (tp x dp)")
    if pp > cfg.num_hidden_layers:
        raise PlanError(f"pp={pp} exceeds num_hidden_layers={cfg.num_hidden_layers}")
    warnings = []
    if tp > gpus_per_node:
        warnings.append(f"attention tp={tp} spans nodes (gpus_per_node={gpus_per_node}): its "
                        "collectives cross the inter-node network on every layer")
    elif gpus_per_node % tp:
        warnings.append(f"attention tp={tp} does not divide gpus_per_node={gpus_per_node}: "
                        "some attention groups span two nodes")
    return ParallelLayout(tp, dp, ep, pp, nnodes, gpus_per_node, tuple(warnings))


def attn_tp_from_sglang(tp_size: int, dp_size: int) -> int:
    """SGLang's world-sized tp_size -> attention TP per replica, as
    compute_dp_attention_world_info."""
    if not isinstance(tp_size, int) or not isinstance(dp_size, int) or tp_size < 1 or dp_size < 1:
        raise PlanError(f"tp_size and dp_size must be integers >= 1, got {tp_size}, {dp_size}")
    if tp_size % dp_size:
        raise PlanError(f"tp_size={tp_size} must be a multiple of dp_size={dp_size} "
                        "(attn_tp_size = tp_size / dp_size)")
    return tp_size // dp_size


def validate_sglang_layout(cfg: DSV4Config, tp_size: int, dp_size: int, ep_size: int | None,
                           pp_size: int, r3: bool, nnodes: int, gpus_per_node: int,
                           enable_dp_attention: bool = True) -> ParallelLayout:
    """The same rules for SGLang's spelling, where tp_size counts every rank of a stage."""
    if dp_size > 1 and not enable_dp_attention:
        raise PlanError("dp_size > 1 without DP attention (full model replicas) is not planned "
                        "here: plan one replica")
    return validate_parallel_layout(cfg, attn_tp_from_sglang(tp_size, dp_size), dp_size, ep_size,
                                    pp_size, r3, nnodes, gpus_per_node)
