"""TrainConfig: every knob of the trainer bridge, nested by component, plus the recipes.

Recipes are functions returning a config (``tiny()`` is the debug flavour every test uses). A
YAML file and ``section.field=value`` overrides are merged on top as OmegaConf structured
configs (types checked, unknown keys refused), then ``__post_init__`` validates the values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from sglang_dsv41.model.dsv4.token_logprobs import FP32_GEMMS

from .envs import check_env
from .local_shards import ADAMW_KERNELS
from .memory_plan import MEMORY_FRACTION
from .optimizer_offload import OFFLOAD_MODES
from .parallelize import ACTIVATION_CHECKPOINTING, ONE_RANK_MODES

# model.activation_checkpointing: a policy for every layer, or auto (memory_plan.py)
CHECKPOINTING_CHOICES = (*ACTIVATION_CHECKPOINTING, "auto")


@dataclass(kw_only=True)
class ModelConfig:
    model_path: str = "tiny"            # preset name or checkpoint dir (the server uses the same)
    checkpoint_cache_dir: str | None = None
    device: str = "auto"                # auto: cuda when available, else cpu
    # bf16 compute with fp32 master weights on GPU, fp32 everywhere on CPU.
    compute_dtype: str = "auto"
    lm_head_fp32: bool = True
    # How an fp32 head's log-probability GEMMs run: ieee (plain fp32: no tensor cores on a GPU),
    # tf32x3 (three TF32 products of split operands: on an H200 1.6x faster, logp 1.2e-6 off
    # float64 where fp32 is 4.2e-7; token_logprobs.py) or tf32x3-logits (the logits as tf32x3,
    # the two gradient GEMMs one TF32 product each: 3.1x, the same logp, gradients 5.6e-4 off
    # float64, finer than their bf16 rounding next); auto: tf32x3-logits on CUDA, ieee on the
    # CPU (which has no TF32).
    lm_head_gemm: str = "auto"
    r3: bool = True                     # replay the server's routing (ids and weights)
    freeze_router: bool = True          # RL on V4-class MoE keeps the router gate frozen
    # Also route with the trainer's own router and report the agreement with the server's
    # routing (one extra no-grad forward per micro-batch).
    check_routing: bool = False
    # Compute what SGLang computes where it differs from plain math (V4.1's FP4-rounded indexer
    # queries/keys and compressed KV; straight-through in the backward).
    serving_numerics: bool = True
    # dtype the engines serve (weights are cast to it before a sync); auto: ask /get_model_info,
    # float32 when the engine does not say
    served_dtype: str = "auto"
    # Recompute activations in the backward: none, layer (each decoder layer keeps only its
    # inputs), selective (each layer keeps its matmul outputs, recomputes the rest) or auto
    # (CUDA: the fewest layers checkpointed for a micro-batch of loss.token_budget tokens to fit
    # memory_fraction of the device, by a plan measured at start-up: memory_plan.py; none on a
    # CPU). A sample longer than the budget gets a micro-batch of its own: set the budget to the
    # longest sample the run will see.
    activation_checkpointing: str = "none"
    # auto checkpointing: the share of the device's memory the planned peak may take.
    memory_fraction: float = MEMORY_FRACTION
    # Micro-batches of one optimizer step add into unsharded fp32 gradients and keep the
    # parameters gathered; only the last reduces and reshards (FSDP's no-sync accumulation).
    # auto: when the model's unsharded parameters and fp32 gradients fit (parallelize.py);
    # always | never (not on/off: YAML, and so a command-line override, reads those as bools).
    accumulate_unsharded: str = "auto"
    # One rank (world size 1): fsdp (FSDP2 as on many ranks) or copies (no FSDP: the fp32
    # master weights and a compute-dtype copy of each, refreshed after each optimizer step;
    # trainer_bridge/compute_copies.py); auto: copies on CUDA when they fit in 10% of the
    # device and the optimizer is not offloaded.
    one_rank: str = "auto"
    # Each micro-batch layout (its sequence lengths) as a CUDA graph of forward, loss and
    # backward, captured on the layout's second micro-batch and replayed from then on: for a
    # step bound by kernel launches (micro_batch_graphs.py). One rank without FSDP only.
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        _choice("model.device", self.device, ("auto", "cpu", "cuda"))
        _choice("model.accumulate_unsharded", self.accumulate_unsharded,
                ("auto", "always", "never"))
        _choice("model.one_rank", self.one_rank, ONE_RANK_MODES)
        _choice("model.activation_checkpointing", self.activation_checkpointing,
                CHECKPOINTING_CHOICES)
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"model.memory_fraction must lie in (0, 1], got "
                             f"{self.memory_fraction}")
        _choice("model.compute_dtype", self.compute_dtype, ("auto", "float32", "bfloat16"))
        _choice("model.lm_head_gemm", self.lm_head_gemm, ("auto", *FP32_GEMMS))
        _choice("model.served_dtype", self.served_dtype, ("auto", "float32", "bfloat16",
                                                           "float16"))


@dataclass(kw_only=True)
class RolloutConfig:
    source: str = "server"              # server | offline (replay rollouts recorded to a file)
    server_urls: list[str] = field(default_factory=lambda: ["http://127.0.0.1:30000"])
    api_key: str | None = None
    offline_path: str | None = None     # source=offline: read; source=server: also record here
    env: str = "byte_target"
    env_args: dict[str, Any] = field(default_factory=dict)
    prompts_per_step: int = 8
    group_size: int = 8                 # GRPO: samples per prompt
    max_new_tokens: int = 16
    temperature: float = 1.0
    concurrency: int = 32

    def __post_init__(self) -> None:
        _choice("rollout.source", self.source, ("server", "offline"))
        _positive("rollout", self, "prompts_per_step", "group_size", "max_new_tokens",
                  "concurrency")
        if self.source == "offline" and not self.offline_path:
            raise ValueError("rollout.source=offline needs rollout.offline_path")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"rollout.temperature must be > 0 and finite, got "
                             f"{self.temperature!r}")
        if self.source == "server":
            try:
                check_env(self.env, dict(self.env_args))
            except ValueError as e:
                raise ValueError(f"rollout.env={self.env!r}, rollout.env_args="
                                 f"{dict(self.env_args)}: {e}") from None


@dataclass(kw_only=True)
class LossConfig:
    advantage: str = "grpo"             # grpo: per-group baseline; ppo: batch-whitened (no critic)
    normalize_std: bool = True          # divide advantages by the group/batch reward std
    clip_eps: float = 0.2
    clip_eps_high: float = 0.28
    dual_clip_c: float = 3.0
    kl_coef: float = 0.0                # k3 KL to the frozen reference policy
    tis_cap: float = 2.0                # truncated importance sampling against rollout logprobs
    token_budget: int = 4096            # tokens per micro-batch (per rank)
    mini_batches: int = 1               # optimizer steps per train step (PPO minibatches)

    def __post_init__(self) -> None:
        _choice("loss.advantage", self.advantage, ("grpo", "ppo"))
        _positive("loss", self, "token_budget", "mini_batches", "dual_clip_c", "tis_cap")
        if self.dual_clip_c <= 1.0:
            raise ValueError("loss.dual_clip_c must be > 1")
        _finite_at_least("loss", self, "clip_eps", 0.0, strict=True)
        _finite_at_least("loss", self, "clip_eps_high", self.clip_eps)
        _finite_at_least("loss", self, "kl_coef", 0.0)


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = 1e-5
    sink_lr: float | None = None        # None: same as lr
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    sink_frozen_frac: float = 0.1       # sinks frozen for this fraction of the steps,
    sink_ramp_frac: float = 0.4         # then their LR ramps linearly over this fraction
    # none: Adam state on the device; fsdp: FSDP2 CPUOffloadPolicy (shards, grads and state on
    # the host); chunked: state on the host, streamed through one pinned buffer of
    # offload_chunk_mb (trainer_bridge/optimizer_offload.py)
    optimizer_offload: str = "none"
    offload_chunk_mb: float = 64.0
    # torch: torch's AdamW (fused on CUDA); triton: one Triton kernel per group that also writes
    # the compute-dtype copies of one rank without FSDP (trainer_bridge/adamw_triton.py); auto:
    # triton where there are such copies on CUDA, else torch
    adamw_kernel: str = "auto"

    def __post_init__(self) -> None:
        _choice("optim.optimizer_offload", self.optimizer_offload, OFFLOAD_MODES)
        _choice("optim.adamw_kernel", self.adamw_kernel, ADAMW_KERNELS)
        _positive("optim", self, "offload_chunk_mb")
        if not (0 <= self.sink_frozen_frac and 0 <= self.sink_ramp_frac
                and self.sink_frozen_frac + self.sink_ramp_frac <= 1):
            raise ValueError("optim.sink_frozen_frac and sink_ramp_frac must be >= 0 and sum <= 1")
        _finite_at_least("optim", self, "lr", 0.0, strict=True)
        if self.sink_lr is not None:
            _finite_at_least("optim", self, "sink_lr", 0.0)
        _finite_at_least("optim", self, "weight_decay", 0.0)
        # clipping is always on; a huge value (or .inf) never clips
        if not self.max_grad_norm > 0:
            raise ValueError(f"optim.max_grad_norm must be > 0 (.inf: no clipping), got "
                             f"{self.max_grad_norm!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optim.betas must be two values in [0, 1), got "
                             f"{list(self.betas)!r}")


@dataclass(kw_only=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    steps: int = 20
    seed: int = 0
    out_dir: str = "runs/tiny"
    checkpoint_every: int = 0           # 0: only at the end
    resume: bool = False
    # --resume-from: this checkpoint directory (out_dir/checkpoints/step-N) instead of the
    # latest; implies resume
    resume_from: str | None = None
    weight_sync: bool = True
    weight_sync_transport: str = "tensor"     # tensor | distributed
    dry_run: bool = False
    plots: bool = True
    tensorboard: bool = True
    # --launch-server: start the embedded server with these launch_server flags
    launch_server: bool = False
    server_args: list[str] = field(default_factory=lambda: [
        "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention",
        "--enable-return-routed-experts"])

    def __post_init__(self) -> None:
        _positive("train", self, "steps")
        _choice("weight_sync_transport", self.weight_sync_transport, ("tensor", "distributed"))
        if self.checkpoint_every < 0:
            raise ValueError("checkpoint_every must be >= 0")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.resume_from:
            self.resume = True
        r = self.rollout
        if r.source == "server":
            if not r.server_urls and not self.launch_server:
                raise ValueError("rollout.server_urls is empty: give at least one engine URL, "
                                 "or --launch-server")
        if self.model.one_rank == "copies" and self.optim.optimizer_offload != "none":
            raise ValueError(f"model.one_rank=copies keeps every weight on the device: not with "
                             f"optim.optimizer_offload={self.optim.optimizer_offload} (use "
                             f"model.one_rank=fsdp or auto)")


def tiny() -> TrainConfig:
    """The Quickstart: the tiny model learns the byte-target task in a few dozen steps."""
    return TrainConfig(
        model=ModelConfig(model_path="tiny", check_routing=True),
        rollout=RolloutConfig(env="byte_target", prompts_per_step=4, group_size=8,
                              max_new_tokens=12),
        loss=LossConfig(kl_coef=0.001, mini_batches=2, token_budget=1024),
        # 5e-3: every run climbs smoothly (last five steps 0.80 on average, six of six); at
        # 1e-2 the rollouts' run-to-run differences grew into gradient spikes and, about once
        # in 40 runs, a collapse of the reward after step 9.
        optim=OptimConfig(lr=5e-3, sink_lr=5e-3, max_grad_norm=1.0),
        # Weights go to the server over a collective group, as RL clusters push them (SGLang's
        # update_weights_from_distributed), not as serialized tensors over HTTP.
        steps=16, out_dir="runs/tiny", weight_sync_transport="distributed")


def tiny_multiturn() -> TrainConfig:
    cfg = tiny()
    cfg.rollout.env, cfg.out_dir = "tool_call", "runs/tiny-multiturn"
    return cfg


RECIPES = {"tiny": tiny, "tiny-multiturn": tiny_multiturn}


def get_recipe(name: str) -> TrainConfig:
    if name not in RECIPES:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(RECIPES)}")
    return RECIPES[name]()


def load_config(preset: str | None, config_file: str | None, overrides: list[str]) -> TrainConfig:
    """The recipe, then the YAML file, then ``section.key=value`` overrides (YAML values)."""
    base = OmegaConf.structured(get_recipe(preset or "tiny"))
    layers = []
    try:
        if config_file:
            try:
                layer = OmegaConf.load(config_file)
            except yaml.YAMLError as e:
                raise ValueError(f"--config {config_file}: not valid YAML: "
                                 f"{' '.join(str(e).split())}") from None
            if not isinstance(layer, DictConfig):
                raise ValueError(f"--config {config_file}: the top level must be a mapping of "
                                 f"section: {{key: value}}, not a {type(layer).__name__}")
            layers.append(layer)
        for text in overrides:
            if "=" not in text:
                raise ValueError(f"override {text!r} is not key=value")
        layers.append(OmegaConf.from_dotlist(overrides))
        return OmegaConf.to_object(OmegaConf.merge(base, *layers))
    except ConfigKeyError as e:
        raise ValueError(f"unknown config key {e.full_key!r}") from None
    except OmegaConfBaseException as e:
        raise ValueError(f"config: {str(e).splitlines()[0]} (key {e.full_key!r})") from None


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}: choose from {choices}")


def _finite_at_least(section: str, obj: Any, name: str, low: float, strict: bool = False
                     ) -> None:
    v = getattr(obj, name)
    if not (math.isfinite(v) and (v > low if strict else v >= low)):
        raise ValueError(f"{section}.{name} must be finite and {'>' if strict else '>='} {low}, "
                         f"got {v!r}")


def _positive(section: str, obj: Any, *names: str) -> None:
    for n in names:
        if not getattr(obj, n) > 0:
            raise ValueError(f"{section}.{n} must be positive, got {getattr(obj, n)!r}")


# Keys a resume may change: where the run is and what it writes, not what it trains. ``steps``
# may grow (the LR schedule's sink warm-up is measured in steps: the resumed run says so).
RESUME_MAY_CHANGE = frozenset({
    "out_dir", "resume", "resume_from", "dry_run", "plots", "tensorboard", "checkpoint_every",
    "launch_server", "server_args", "steps", "rollout.server_urls", "rollout.api_key",
    "rollout.concurrency", "rollout.offline_path", "model.checkpoint_cache_dir"})


def config_snapshot(cfg: TrainConfig) -> dict[str, Any]:
    """The config as flat ``section.key`` -> plain value (what a checkpoint records)."""
    def flat(d: dict, prefix: str) -> dict[str, Any]:
        out = {}
        for k, v in d.items():
            if isinstance(v, dict) and k != "env_args":
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    return flat(OmegaConf.to_container(OmegaConf.structured(cfg)), "")


def config_differences(saved: dict[str, Any], cfg: TrainConfig) -> list[str]:
    """``key: saved -> now`` for each key that differs and a resume may not change. Only keys
    both configs have are compared: a key added to (or dropped from) the code since the save
    has no recorded value to keep, and would otherwise refuse every older checkpoint."""
    now = config_snapshot(cfg)
    return [f"{k}: {saved[k]!r} -> {now[k]!r}" for k in sorted(set(saved) & set(now))
            if k not in RESUME_MAY_CHANGE and saved[k] != now[k]]
