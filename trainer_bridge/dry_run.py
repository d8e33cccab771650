"""--dry-run: three steps, then checks that make a long job worth starting. Each failed check is
one line of the reason; any failure exits non-zero."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .batch import Sample, pack
from .dist import all_reduce_scalar, on_primary
from .parallelize import is_fp32_param
from .rollout import decode_routing
from .trainer import Trainer

DRY_RUN_STEPS = 3


@dataclass
class DryRunLimits:
    max_mismatch_abs_logp: float = 0.05       # bf16 GPU stacks sit at 0.01-0.02
    max_roundtrip_abs_logp: float = 1e-3      # after a sync, fp32 CPU is ~1e-6
    max_growth_bytes_per_step: float = 64 << 20
    # Hash layers route from tid2eid on both sides: anything below 1 is a wrong table or layer
    # map. Top-k layers count too when model.check_routing is on.
    min_routing_agreement: float = 1.0


def run_dry_run(trainer: Trainer, limits: DryRunLimits | None = None) -> list[str]:
    """Returns the failures (empty: all good)."""
    limits = limits or DryRunLimits()
    failures: list[str] = []
    rows = []
    trainer.sync_weights("dry-run-start")
    for step in range(DRY_RUN_STEPS):
        rows.append(trainer.telemetry.log(step, trainer.train_step(step)))
    key = "mem_allocated_bytes" if trainer.device.type == "cuda" else "host_rss_bytes"
    growth = rows[-1][key] - rows[1][key]  # step 0 pays for lazy initialisation
    if growth > limits.max_growth_bytes_per_step:
        failures.append(f"memory grew by {growth / 2**20:.1f} MiB ({key}) between steps 1 and 2")
    for i, r in enumerate(rows):
        if not math.isfinite(r["loss"]):
            failures.append(f"step {i}: loss is {r['loss']}")
        if not r["mismatch_abs_logp"] <= limits.max_mismatch_abs_logp:
            failures.append(f"step {i}: train-inference mismatch mean |dlogp| "
                            f"{r['mismatch_abs_logp']:.3g} > {limits.max_mismatch_abs_logp}")
        worst = r.get("routing_agreement_min_layer")
        if worst is not None and not worst >= limits.min_routing_agreement:
            failures.append(f"step {i}: routing agreement with the server {worst:.4f} on the "
                            f"worst layer < {limits.min_routing_agreement}")
    sinks = trainer.sink_grads()
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in sinks.values()))
    if not sinks or not math.isfinite(norm) or norm == 0.0:
        failures.append(f"sink gradients are missing, zero or not finite (norm {norm})")
    spread = all_reduce_scalar(norm, "max") - all_reduce_scalar(norm, "min")
    if spread != 0.0:
        failures.append(f"sink gradient norms differ across FSDP ranks by {spread:.3g}")
    bad = [n for n, p in trainer.policy.trainable_parameters()
           if is_fp32_param(n) and p.dtype != torch.float32]
    if bad:
        failures.append(f"sinks / mHC parameters are not fp32: {bad}")
    if trainer.syncer is not None:
        err = roundtrip_error(trainer)
        if not err <= limits.max_roundtrip_abs_logp:
            failures.append(f"after a weight sync the server's logprobs differ from the "
                            f"trainer's by max |dlogp| {err:.3g} > "
                            f"{limits.max_roundtrip_abs_logp}")
    return failures


def roundtrip_error(trainer: Trainer) -> float:
    """Sync, let the server sample a fixed prompt, and compare its logprobs with the trainer's
    for the same tokens (collective: every rank runs the forward)."""
    trainer.syncer.sync(trainer.policy.model, "dry-run", trainer.dist.is_primary)
    def probe() -> Sample:
        prompt = [trainer.policy.config.bos_token_id] + list(b"dry run probe: ")
        resp = trainer.router.generate("dry-run-probe", {
            "input_ids": prompt, "return_logprob": True,
            "return_routed_experts": trainer.cfg.model.r3,
            "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 0}})
        trainer.router.end_session("dry-run-probe")
        out, meta = resp["output_ids"], resp["meta_info"]
        lps = [float(x[0]) for x in meta["output_token_logprobs"]]
        return Sample(prompt + out, [0] * len(prompt) + [1] * len(out),
                      [0.0] * len(prompt) + lps, 0.0, 0,
                      routed_experts=decode_routing(meta, "routed_experts", np.int32),
                      routed_weights=decode_routing(meta, "routed_expert_weights", np.float32))

    sample = on_primary(probe)
    mb = pack([sample], trainer.policy.routed_layers, trainer.cfg.model.r3,
              trainer.policy.config.num_experts_per_tok)
    with torch.no_grad():
        logp = trainer.policy.forward(mb, replay=trainer.cfg.model.r3).logprobs.cpu()
    return float(((logp - mb.rollout_logprobs).abs() * mb.loss_mask).max())
