"""Trainer: rollouts -> advantages -> PPO mini-batches on FSDP2 -> weight sync -> telemetry."""

from __future__ import annotations

import functools
import logging
import os
import random
import time
from typing import Any, Callable

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from sglang_dsv41.model.dsv4.context import host_to_device
from sglang_dsv41.router import RouterError
from sglang_dsv41.tokenizer import ByteTokenizer

from .batch import MicroBatch, Sample, pack, split_by_token_budget, split_evenly
from .checkpoint import load_checkpoint, save_checkpoint
from .config import TrainConfig, config_snapshot
from .dist import (all_reduce_scalar, all_reduce_tensor, close_distributed, init_distributed,
                   on_primary)
from .envs import make_env
from .local_shards import LocalShardAdamW, clip_grad_norm, global_norm
from .loss import compute_advantages, loss_scale, ppo_loss
from .memory_plan import layer_kinds, plan_checkpointing, unallocated_static
from .micro_batch_graphs import MicroBatchGraphs
from .optimizer_offload import offload_optimizer
from .parallelize import is_sink_param, reshard_gathered
from .policy import Policy, build_policy, resolve_device
from .rollout import (OfflineRolloutSource, RolloutSource, ServerRolloutSource,
                      WeightVersionMismatch, check_routing_present)
from .schedule import build_optimizer
from .telemetry import Telemetry, memory_metrics, rollout_metrics
from .weight_sync import WeightSyncer

log = logging.getLogger("trainer_bridge")
# forward_backward's vector (LossTerms.sums)
STEP_SUMS = ("loss", "pg", "kl", "clip", "tis", "mismatch_abs", "mismatch_k3")
# How often one step re-pushes the weights after rollouts came from other weights (a restarted
# or half-pushed engine) before it fails.
MAX_WEIGHT_RESYNCS = 1


class WeightVersionError(RuntimeError):
    """The engines kept serving other weights than the trainer pushed (every rank raises)."""


class Trainer:
    def __init__(self, cfg: TrainConfig, server_url: str | None = None):
        self.cfg = cfg
        self.device = resolve_device(cfg.model.device)
        if self.device.type == "cpu":
            torch.set_num_threads(max(1, torch.get_num_threads() // int(
                os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))))
        self.dist = init_distributed(self.device)
        self._seed(cfg.seed + self.dist.rank)
        offload = cfg.optim.optimizer_offload
        temperature = cfg.rollout.temperature  # logprobs of the distribution rollouts sample
        self.policy = build_policy(cfg.model, self.dist.mesh, self.device,
                                   optimizer_offload=offload, temperature=temperature)
        self.ref_policy: Policy | None = None
        if cfg.loss.kl_coef > 0:
            self.ref_policy = build_policy(cfg.model, self.dist.mesh, self.device, trainable=False,
                                           temperature=temperature)
        if cfg.model.cuda_graphs:
            for policy in filter(None, (self.policy, self.ref_policy)):
                policy.graphs = MicroBatchGraphs(policy, cfg.loss, self.dist.world_size)
        self.optimizer, self.scheduler = offload_optimizer(
            *build_optimizer(self.policy, cfg.optim, cfg.steps), offload,
            cfg.optim.offload_chunk_mb)
        self.checkpointing = self.plan_checkpointing()
        self.step = 0
        self.weight_resyncs = 0
        self.router = self.rollouts = None
        self.syncer: WeightSyncer | None = None
        # Rank 0 talks to the engines; a bad URL must fail every rank, not strand them.
        on_primary(lambda: self.build_rollout_source(server_url) and None)
        if cfg.weight_sync and cfg.rollout.source == "server":
            self.syncer = WeightSyncer(self.router, api_key=cfg.rollout.api_key,
                                       served_dtype=cfg.model.served_dtype,
                                       transport=cfg.weight_sync_transport)
        # The dry run's check steps go to a directory of their own, never into the run's rows.
        self.telemetry = Telemetry(os.path.join(cfg.out_dir, "dry_run") if cfg.dry_run
                                   else cfg.out_dir, self.dist.is_primary, cfg.tensorboard,
                                   fresh=cfg.dry_run)
        if cfg.resume:
            self.load_latest()

    # ---- setup ----------------------------------------------------------------------------
    def build_rollout_source(self, server_url: str | None) -> RolloutSource:
        rc = self.cfg.rollout
        if rc.source == "offline":
            self.rollouts = OfflineRolloutSource(rc.offline_path)
            return self.rollouts
        from sglang_dsv41.router import StickyRouter

        self.router = StickyRouter([server_url] if server_url else rc.server_urls,
                                   api_key=rc.api_key)
        env = make_env(rc.env, byte_tokenizer(self.policy.config), rc.env_args)
        self.rollouts = ServerRolloutSource(self.router, env, rc, self.cfg.model.r3,
                                            rc.offline_path, seed=self.cfg.seed)
        return self.rollouts

    def plan_checkpointing(self) -> tuple[str, ...] | None:
        """model.activation_checkpointing = auto: each layer's policy by the start-up memory
        plan for micro-batches of loss.token_budget tokens (memory_plan.py); None otherwise."""
        m = self.cfg.model
        if m.activation_checkpointing != "auto":
            return None
        if self.device.type != "cuda":
            log.info("model.activation_checkpointing=auto on %s: no allocator counters to plan "
                     "by, every layer keeps its activations", self.device.type)
            return None
        budget = self.cfg.loss.token_budget
        policies, plan = plan_checkpointing(
            self.policy, budget, m.memory_fraction,
            unallocated_static(self.policy, self.cfg.optim.optimizer_offload != "none",
                               self.may_accumulate()),
            lambda: self.optimizer.zero_grad(set_to_none=True),
            lambda: self.policy.micro_batch(0, 1))  # the probes' backward: a step's last
        if self.dist.is_primary:
            log.info("activation checkpointing (auto): %d of %d layers; %s",
                     sum(p != "none" for p in policies), len(policies),
                     plan.describe(budget, policies, layer_kinds(self.policy)))
        return policies

    def may_accumulate(self) -> bool:
        """Whether a mini-batch may take several micro-batches on this rank (their gradients
        add up): unless the engines' rollouts give each rank at most one sample a mini-batch,
        the lengths decide, and they are not known before the step."""
        rc = self.cfg.rollout
        samples = rc.prompts_per_step * rc.group_size
        return rc.source != "server" or samples > self.dist.world_size * self.cfg.loss.mini_batches

    @staticmethod
    def _seed(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    # ---- one step -------------------------------------------------------------------------
    def collect_rollouts(self, step: int) -> list[Sample]:
        """The step's rollouts (collected on rank 0, handed to every rank). Every response must
        come from the weights pushed last (its meta_info.weight_version): otherwise none of
        the step's rollouts is trained on, the weights are pushed again (to the dead engines
        that answer too: a restarted one) and the step collected again, at most
        MAX_WEIGHT_RESYNCS times, then WeightVersionError names the engine and both
        versions. ``self.weight_resyncs``: this step's re-pushes (metric weight_resyncs)."""
        self.weight_resyncs = 0
        while True:
            samples, mismatch = on_primary(self._collect_checked, step)
            if mismatch is None:
                break
            if self.syncer is None or self.weight_resyncs >= MAX_WEIGHT_RESYNCS:
                why = ("weight_sync is off" if self.syncer is None else
                       f"still after {self.weight_resyncs} re-push(es) of the weights")
                raise WeightVersionError(f"step {step}: {mismatch} ({why}); the step's "
                                         "rollouts were not trained on")
            version = self.syncer.version or f"step-{step}"
            if self.dist.is_primary:
                log.warning("step %d: %s; its rollouts are dropped, the weights pushed again "
                            "as %s and the step collected again", step, mismatch, version)
            self.sync_weights(version)
            self.weight_resyncs += 1
        compute_advantages(samples, self.cfg.loss)
        return samples

    def _collect_checked(self, step: int) -> tuple[list[Sample] | None, str | None]:
        """Rank 0: (samples, None), or (None, why) when they came from other weights than the
        last push's; the R3 routing of every sample checked (check_routing_present)."""
        src = self.rollouts
        if isinstance(src, ServerRolloutSource):
            if self.syncer is not None and self.syncer.version is not None:
                src.expected_version = self.syncer.version
            try:
                samples = src.collect(step)
            except WeightVersionMismatch as e:
                return None, str(e)
            except RouterError as e:
                # The router may have taken a restarted engine out for its version (with one
                # engine: none left); a version mismatch is what a re-push fixes.
                mismatch = self._served_version_mismatch(src.expected_version)
                if mismatch is None:
                    raise
                return None, f"{mismatch} ({type(e).__name__}: {e})"
        else:
            samples = src.collect(step)
        if self.cfg.model.r3:
            check_routing_present(samples, self.policy.routed_layers,
                                  self.policy.config.num_experts_per_tok)
        return samples, None

    def _served_version_mismatch(self, expected: str | None) -> str | None:
        if expected is None or self.syncer is None:
            return None
        for url, served in self.syncer.served_versions().items():
            if served != expected:
                return f"engine {url} serves weight_version {served!r}, expected {expected!r}"
        return None

    def build_mini_batches(self, samples: list[Sample]) -> list[list[MicroBatch]]:
        """This rank's share, cut into mini-batches and token-budget micro-batches; every rank
        gets the same number of micro-batches per mini-batch (empty ones are dummies)."""
        mine = samples[self.dist.rank::self.dist.world_size]
        n_mini = self.cfg.loss.mini_batches
        out = []
        # none empty while the rank has n_mini samples (train.preflight): an empty mini-batch
        # would be an optimizer step without a gradient
        for chunk in split_evenly(mine, n_mini):
            groups = split_by_token_budget(chunk, self.cfg.loss.token_budget)
            count = int(all_reduce_scalar(len(groups), "max"))
            groups += [[]] * (count - len(groups))
            top_k = self.policy.config.num_experts_per_tok
            out.append([pack(g, self.policy.routed_layers, self.cfg.model.r3, top_k)
                        for g in groups])
        return out

    def on_policy(self) -> bool:
        """One optimizer step a batch (loss.mini_batches 1): the old policy is the one being
        trained, so the training forward's own logprobs are the old ones (ppo_loss with
        old_logp None) and no forward before the update recomputes them (a third of a 64k step
        of the `small` preset on one H200, bench/results/train_h200.txt, run AI)."""
        return self.cfg.loss.mini_batches == 1

    def needs_reference_forward(self, mb: MicroBatch) -> bool:
        """Whether the policy runs a no-grad forward of ``mb`` before the update: for the old
        logprobs of several optimizer steps a batch, or for the server's routing to check when
        the micro-batch graphs (which return neither logprobs nor routing) train it."""
        return not self.on_policy() or (mb.routing is not None and self.policy.graphs is not None)

    @torch.no_grad()
    def reference_pass(self, mini_batches: list[list[MicroBatch]], agree: torch.Tensor) -> float:
        """Before the update: the policy's old logprobs where needs_reference_forward (with the
        server's routing checked into ``agree``) and the reference policy's logprobs; -> the
        loss tokens over the ranks."""
        tokens = 0.0
        for mb in (m for mini in mini_batches for m in mini):
            if self.needs_reference_forward(mb):
                out = self.policy.forward(mb, replay=self.cfg.model.r3, record_routing=True)
                mb.old_logprobs = out.logprobs.cpu()
                self.check_routing(mb, out.routed, agree)
            if self.ref_policy is not None:
                mb.ref_logprobs = self.ref_policy.forward(mb, replay=self.cfg.model.r3
                                                          ).logprobs.cpu()
            tokens += float(mb.loss_mask.sum())
        return all_reduce_scalar(tokens)

    def check_routing(self, mb: MicroBatch, routed: dict, agree: torch.Tensor) -> None:
        """The policy's routing of ``mb`` (``routed``: a forward's recording, before the update)
        against the server's, added into ``agree`` ([layers, 2], on the device: no host sync).
        Hash layers are never replayed: their tid2eid routing is checked every step; the top-k
        layers' own router only on request (one more forward)."""
        if mb.routing is None:
            return
        if not self.cfg.model.r3:
            own = routed
        elif self.cfg.model.check_routing:
            with torch.no_grad():
                own = self.policy.forward(mb, replay=False, record_routing=True).routed
            # on-policy steps run this after the backward, before the optimizer step
            reshard_gathered(self.policy.model)
        else:  # a replayed layer records what it replayed: compare the hash layers
            replayed = set(self.policy.replayed_layers)
            own = {k: v for k, v in routed.items() if k not in replayed}
        agree += routing_agreement(own, mb, self.policy.routed_layers, agree.device)

    def train_step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)  # metrics' mem_peak_bytes: this step's
        samples = self.collect_rollouts(step)
        t_rollout = time.perf_counter() - t0
        mini_batches = self.build_mini_batches(samples)
        # (rows routed as the server did, rows compared) per routed layer, on the device
        agree = torch.zeros(len(self.policy.routed_layers), 2, dtype=torch.float64,
                            device=self.device)
        tokens = max(self.reference_pass(mini_batches, agree), 1.0)
        sums = torch.zeros(len(STEP_SUMS), dtype=torch.float64, device=self.device)
        norms = torch.zeros(2, device=self.device)  # the last mini-batch's grad and sink norms
        lr, sink_lr = self.scheduler.get_last_lr()  # the LRs this step uses
        for mini in mini_batches:
            self.optimizer.zero_grad(set_to_none=True)
            global_tokens = max(all_reduce_scalar(sum(mb.num_loss_tokens for mb in mini)), 1.0)
            for i, mb in enumerate(mini):
                self.policy.micro_batch(i, len(mini))
                # on-policy: the training forward's routing is the one before the update
                check = (None if mb.routing is None or self.needs_reference_forward(mb)
                         else functools.partial(self.check_routing, mb, agree=agree))
                sums += forward_backward(self.policy, mb, global_tokens, self.cfg.loss,
                                         self.dist.world_size, replay=self.cfg.model.r3,
                                         routing_check=check)
            sink_norm = self.sink_grad_norm()
            grad_norm = clip_and_step(self.optimizer, self.cfg.optim.max_grad_norm)
            norms = torch.stack([grad_norm.float().to(norms.device), sink_norm.to(norms.device)])
        self.scheduler.step()
        # The step's one read of device metrics: one all-reduce, one copy to the host.
        totals = all_reduce_tensor(torch.cat([sums, agree.flatten()])).cpu()
        loss, pg, kl, clip, tis, mismatch_abs, mismatch_k3 = totals[:len(STEP_SUMS)].tolist()
        grad_norm, sink_norm = norms.tolist()
        # each mini-batch's loss is its token mean (on every rank): their mean over the step
        metrics = {"loss": loss / (self.dist.world_size * len(mini_batches)),
                   "pg_mean": pg / tokens,
                   "kl_mean": kl / tokens, "clip_frac": clip / tokens, "tis_mean": tis / tokens,
                   "mismatch_abs_logp": mismatch_abs / tokens, "mismatch_k3": mismatch_k3 / tokens,
                   "train_tokens": tokens}
        metrics.update(routing_metrics(totals[len(STEP_SUMS):].view_as(agree)))
        metrics.update(rollout_metrics(samples), grad_norm=grad_norm, sink_grad_norm=sink_norm,
                       lr=lr, sink_lr=sink_lr, rollout_s=t_rollout,
                       weight_resyncs=float(self.weight_resyncs))
        if self.syncer is not None:
            metrics["weight_sync_s"] = self.sync_weights(f"step-{step + 1}")
        metrics.update(memory_metrics(self.device), step_s=time.perf_counter() - t0)
        return metrics

    def sync_weights(self, version: str) -> float:
        """Push the current weights to every engine; returns the seconds it took."""
        if self.syncer is None:
            return 0.0
        return self.syncer.sync(self.policy.model, version, self.dist.is_primary)["weight_sync_s"]

    def sink_grad_norm(self) -> torch.Tensor:
        grads = [p.grad for g in self.optimizer.param_groups if g["name"] == "sinks"
                 for p in g["params"] if p.grad is not None]
        if not grads:
            return torch.zeros((), device=self.device)
        return global_norm(grads)

    def sink_grads(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) sink gradients, identical on every rank."""
        return {n: _full(p.grad).detach().cpu().clone()
                for n, p in self.policy.trainable_parameters()
                if is_sink_param(n) and p.grad is not None}

    # ---- loop -----------------------------------------------------------------------------
    def train(self) -> list[dict[str, float]]:
        history = []
        # The engines may serve other weights (a previous run, a resumed checkpoint).
        self.sync_weights(f"step-{self.step}")
        while self.step < self.cfg.steps:
            metrics = self.telemetry.log(self.step, self.train_step(self.step))
            history.append(metrics)
            if self.dist.is_primary:
                log.info("step %d reward %.3f loss %.4f mismatch %.2e sync %.2fs", self.step,
                         metrics["reward_mean"], metrics["loss"], metrics["mismatch_abs_logp"],
                         metrics.get("weight_sync_s", 0.0))
            self.step += 1
            every = self.cfg.checkpoint_every
            if (every and self.step % every == 0) or self.step == self.cfg.steps:
                self.save()
        return history

    def save(self) -> str:
        return save_checkpoint(os.path.join(self.cfg.out_dir, "checkpoints"), self.step,
                               self.policy.model, self.optimizer,
                               {"scheduler": self.scheduler.state_dict(),
                                "config": config_snapshot(self.cfg)}, self.dist.rank)

    def load_latest(self) -> None:
        """Loads cfg.resume_from, which train.preflight resolved (the latest complete checkpoint
        unless --resume-from) and checked against this config and world size."""
        path = self.cfg.resume_from
        if path is None:
            raise ValueError("resume: cfg.resume_from is unset; train.preflight resolves it")
        state = load_checkpoint(path, self.policy.model, self.optimizer, self.dist.rank,
                                self.dist.world_size)
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.telemetry.resume(self.step)
        log.info("resumed from %s at step %d", path, self.step)

    def close(self, failed: bool = False) -> None:
        """``failed``: no barrier with the other ranks, which may be in another collective
        (close_distributed)."""
        try:
            self.telemetry.close(plots=self.cfg.plots)
            for obj in (self.rollouts, self.syncer, self.router):
                if obj is not None:
                    obj.close()
        finally:
            close_distributed(barrier=not failed)


def byte_tokenizer(cfg) -> ByteTokenizer:
    """The byte tokenizer of a preset's DSV4Config (bos/eos from the config, default pad)."""
    return ByteTokenizer(cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)


def routing_agreement(own: dict[int, tuple[torch.Tensor, torch.Tensor]], mb: MicroBatch,
                      layers: list[int], device: torch.device | None = None) -> torch.Tensor:
    """[len(layers), 2] float64 on ``device`` (by default ``own``'s; no host sync):
    (rows where the trainer routed to the server's expert set, rows compared) per layer, over
    every position the server routed; (0, 0) for a layer the trainer did not record (a
    replayed layer without check_routing)."""
    dev = device or (next(iter(own.values()))[0].device if own else torch.device("cpu"))
    out = torch.zeros(len(layers), 2, dtype=torch.float64, device=dev)
    if mb.num_samples == 0:  # a dummy micro-batch: its routing is made up
        return out
    last = torch.cumsum(torch.tensor(mb.seq_lens), 0) - 1  # the server never routed these
    valid = torch.ones(mb.input_ids.shape[0], dtype=torch.bool)
    valid[last] = False
    rows = float(valid.sum())
    valid = host_to_device(valid, dev)
    for row, layer in enumerate(layers):
        if layer not in own:
            continue
        mine = own[layer][0].long().sort(-1).values
        theirs = host_to_device(mb.routing[layer][0], dev).long().sort(-1).values
        out[row, 0] = ((mine == theirs).all(-1) & valid).sum()
        out[row, 1] = rows
    return out


def routing_metrics(agree: torch.Tensor) -> dict[str, float]:
    """The step's routing agreement (all rows, the worst layer) from check_routing's sums over
    the ranks; none when no layer was compared."""
    checked = agree[:, 1] > 0
    if not checked.any():
        return {}
    return {"routing_agreement": float(agree[checked, 0].sum() / agree[checked, 1].sum()),
            "routing_agreement_min_layer": float((agree[checked, 0] / agree[checked, 1]).min())}


def forward_backward(policy: Policy, mb: MicroBatch, global_tokens: float, loss_cfg,
                     world_size: int, replay: bool,
                     routing_check: Callable[[dict], None] | None = None) -> torch.Tensor:
    """Forward, PPO loss and backward of one micro-batch -> float64 [7] on the device: the loss
    and the token sums of pg, kl, clipped, tis and the two mismatches (STEP_SUMS). Without
    mb.old_logprobs the step is on-policy (ppo_loss). ``routing_check``: the forward records
    the routing and hands it (layer -> (ids, weights)) to it after the backward. The trainer's
    step and bench/train.py both run it; its ranges name the phases in a profile. With the
    policy's micro-batch graphs (model.cuda_graphs) the same work runs as a CUDA graph of the
    micro-batch's layout (micro_batch_graphs.py), which records no routing."""
    if policy.graphs is not None:
        if world_size != policy.graphs.world_size:
            raise ValueError(f"micro-batch graphs were built for world size "
                             f"{policy.graphs.world_size}, not {world_size}")
        if routing_check is not None:
            raise ValueError("micro-batch graphs record no routing: check it in a no-grad "
                             "forward (Trainer.needs_reference_forward)")
        with torch.profiler.record_function("trainer.graphed_micro_batch"):
            return policy.graphs.forward_backward(mb, global_tokens, loss_cfg, replay)
    with torch.profiler.record_function("trainer.forward"):
        out = policy.forward(mb, replay=replay, record_routing=routing_check is not None)
    try:
        dev = out.logprobs.device
        # pinned, queued copies: a pageable one makes the host wait for the GPU's queue
        terms = ppo_loss(out.logprobs, None if mb.old_logprobs is None
                         else host_to_device(mb.old_logprobs, dev),
                         host_to_device(mb.rollout_logprobs, dev),
                         host_to_device(mb.advantages, dev), host_to_device(mb.loss_mask, dev),
                         loss_cfg, scale=loss_scale(global_tokens, world_size),
                         ref_logp=None if mb.ref_logprobs is None
                         else host_to_device(mb.ref_logprobs, dev))
        with torch.profiler.record_function("trainer.backward"):
            terms.loss.backward()
        if routing_check is not None:
            routing_check(out.routed)
    finally:  # a failed step must not keep its graph alive (ForwardOut.release)
        out.release()
    # On the device, read once per step (train_step): no host sync per micro-batch.
    return terms.sums()


def clip_and_step(optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
    """Clips the gradients of the optimizer's parameters (the trained ones) to ``max_norm`` and
    steps the optimizer -> their total norm before clipping, on the device (no host sync). Our
    AdamW folds the clipping into its fused kernel (LocalShardAdamW.clip_and_step)."""
    if isinstance(optimizer, LocalShardAdamW):
        return optimizer.clip_and_step(max_norm)
    norm = clip_grad_norm([p for g in optimizer.param_groups for p in g["params"]], max_norm)
    optimizer.step()
    return norm


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t
