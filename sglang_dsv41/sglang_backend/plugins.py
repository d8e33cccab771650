"""The plugins: what each fixes, the SGLang 0.5.23 targets it hooks, and how SGLang loads it.

Each plugin is one entry point of SGLang's group ``sglang.srt.plugins`` (pyproject.toml), so
SGLang's own ``load_plugins()`` runs it in the main process, every scheduler, the DP controller
and the detokenizer; it registers HookRegistry hooks on its targets after checking each target's
parameters in the live module. A plugin is switched off by leaving it out of SGLANG_PLUGINS
(SGLang's allow-list) or naming it in SGLANG_DSV41_DISABLED_PLUGINS (--dsv41-disable-plugins).
"""

from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass

from .env import ENV

logger = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"
ENTRY_POINT_PREFIX = "dsv41_"
HOOK_TYPES = ("before", "after", "around", "replace", "check")


@dataclass(frozen=True)
class Target:
    module: str                 # "sglang.srt.model_loader.loader"
    qualname: str               # "DummyModelLoader.load_model"
    params: tuple[str, ...]     # every parameter name in order, as the 0.5.23 source has them
    hook_type: str              # HookRegistry's type; "check": only verified (the hook reads it)
    hook: str = ""              # "module:function" of our hook, relative to this package

    def __post_init__(self) -> None:
        if self.hook_type not in HOOK_TYPES or (self.hook_type != "check") != bool(self.hook):
            raise ValueError(f"target {self.path}: bad hook {self.hook_type!r} {self.hook!r}")

    @property
    def path(self) -> str:
        return f"{self.module}.{self.qualname}"


@dataclass(frozen=True)
class Plugin:
    name: str
    fixes: str
    targets: tuple[Target, ...]
    opt_in: str = ""  # the flag that turns the hook's effect on, when it is off by default
    # Hooks an HTTP process runs: SGLang's tokenizer worker processes need them too (http_workers)
    http_side: bool = False

    @property
    def entry_point(self) -> str:
        return ENTRY_POINT_PREFIX + self.name


LOADER, WEIGHT_UTILS = "sglang.srt.model_loader.loader", "sglang.srt.model_loader.weight_utils"
ENGRAM, SERVER_ARGS = "sglang.srt.layers.engram", "sglang.srt.server_args"
HTTP, SCHEDULER = "sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler"
DP_ATTN = "sglang.srt.managers.scheduler_components.dp_attn"
RUNNER_WEIGHTS = "sglang.srt.model_executor.model_runner_components.weight_updater"
DP_CONTROLLER = "sglang.srt.managers.data_parallel_controller"

PLUGINS = (
    Plugin("engram_dummy_load",
           "--load-format dummy still loads each rank's Engram rows and tid2eid from the "
           "checkpoint (no fp16 upcast of the tables) and runs finish_load",
           (Target(LOADER, "DummyModelLoader.load_model", ("self", "model_config",
                   "device_config"), "around", "engram_hooks:around_dummy_load_model"),
            Target(WEIGHT_UTILS, "initialize_dummy_weights", ("model", "low", "high", "seed"),
                   "around", "engram_hooks:around_initialize_dummy_weights"),
            Target(ENGRAM, "EngramEmbedding._load_rows", ("self", "param", "loaded_weight"),
                   "check"),
            Target(ENGRAM, "EngramEmbedding.finish_load", ("self", "label"), "check"))),
    Plugin("engram_layout",
           "Engram host layout by node count (per_rank over several nodes, shared on one); "
           "shared over several nodes refused before launch",
           (Target(SERVER_ARGS, "ServerArgs.check_server_args", ("self",), "after",
                   "guards:after_check_server_args_engram"),
            Target(ENGRAM, "EngramEmbedding._init_host_table",
                   ("self", "num_embeddings", "dim", "layer_id"), "check"))),
    Plugin("layout_guards",
           "attention TP > o_groups and pp > 1 with R3 refused before launch, with the reason",
           (Target(SERVER_ARGS, "ServerArgs.check_server_args", ("self",), "after",
                   "guards:after_check_server_args"),)),
    Plugin("generate_dp_rank_header",
           "/generate honours X-Data-Parallel-Rank; conflicting or out-of-range pins get 400",
           (Target(HTTP, "serve_generate_request", ("obj", "request"), "around",
                   "request_hooks:around_serve_generate_request"),
            Target(HTTP, "generate_request", ("obj", "request"), "check")),
           http_side=True),
    Plugin("stall_watchdog",
           "batch run and MLP sync under a stall watchdog; /health and /health_generate answer "
           "503 naming the rank and collective",
           (Target(SCHEDULER, "Scheduler.run_batch", ("self", "batch", "pp_proxy_tensors"),
                   "around", "watchdog_hooks:around_run_batch"),
            Target(DP_ATTN, "MLPSyncBatchInfo.all_gather",
                   ("self", "device", "group", "use_all_reduce"), "around",
                   "watchdog_hooks:around_mlp_sync_all_gather"),
            Target(HTTP, "set_global_state", ("global_state",), "after",
                   "watchdog_hooks:after_set_global_state"),
            Target(HTTP, "health_generate", ("request",), "check")),
           http_side=True),
    Plugin("hash_r3_rows",
           "R3 rows of hash-routed layers filled from tid2eid (0.5.23 returns zeros)",
           (Target("sglang.srt.layers.moe.hash_topk", "HashTopK.forward",
                   ("self", "hidden_states", "router_logits", "input_ids",
                    "num_token_non_padded", "expert_location_dispatch_info"), "after",
                   "r3_hooks:after_hash_topk_forward"),
            Target("sglang.srt.layers.moe.mega_gate", "run_mega_gate",
                   ("moe", "hidden_states", "input_ids", "buf", "forward_batch"), "after",
                   "r3_hooks:after_run_mega_gate"),
            Target("sglang.srt.state_capturer.routed_experts", "RoutedExpertsCapturer.capture",
                   ("self", "layer_id", "topk_indices"), "check"))),
    Plugin("engram_update_guard",
           "weight updates naming an Engram table refused with 400 unless allowed",
           (Target(RUNNER_WEIGHTS, "WeightUpdater.load_weights_from_distributed",
                   ("self", "named_tensors"), "around",
                   "engram_hooks:around_load_weights_from_distributed"),
            Target(RUNNER_WEIGHTS, "WeightUpdater.update_weights_from_tensor",
                   ("self", "named_tensors", "load_format"), "around",
                   "engram_hooks:around_update_weights_from_tensor"),
            Target(RUNNER_WEIGHTS, "WeightUpdater.update_weights_from_ipc",
                   ("self", "recv_req"), "around",
                   "engram_hooks:around_update_weights_from_ipc"))),
    Plugin("routing_key_dispatch",
           "session-sticky DP dispatch keyed by routing_key, for users without a router",
           (Target(DP_CONTROLLER, "DataParallelController.maybe_external_dp_rank_routing",
                   ("self", "req"), "around", "request_hooks:around_external_dp_rank_routing"),),
           opt_in="--dsv41-dp-dispatch routing_key"),
)
PLUGINS_BY_NAME = {p.name: p for p in PLUGINS}
INSTALLED: list[str] = []


class PluginTargetError(RuntimeError):
    """A target is missing or changed; the message names every one."""


def check_plugin_names(names) -> None:
    unknown = sorted(set(names) - set(PLUGINS_BY_NAME))
    if unknown:
        raise ValueError(f"unknown plugin(s) {unknown}; known plugins: {sorted(PLUGINS_BY_NAME)}")


def live_params(fn) -> tuple[str, ...]:
    names = []
    for p in inspect.signature(fn, follow_wrapped=False).parameters.values():
        names.append({p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name)
    return tuple(names)


def check_live_target(target: Target) -> str | None:
    """None when the imported target has the expected parameters, else what is wrong."""
    try:
        obj = importlib.import_module(target.module)
        for part in target.qualname.split("."):
            obj = inspect.getattr_static(obj, part)
    except (ImportError, AttributeError) as e:
        return f"{target.path} is missing: {e}"
    fn = getattr(obj, "__func__", obj)  # staticmethod / classmethod
    fn = inspect.unwrap(fn)  # already hooked in this process: check SGLang's function
    got = live_params(fn)
    return None if got == target.params else (f"{target.path}: parameters changed: expected "
                                              f"{target.params}, found {got}")


def _hook(spec: str):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


def install(name: str) -> bool:
    """Register the plugin's hooks with SGLang's HookRegistry (SGLang's load_plugins applies
    them); False when switched off. Raises PluginTargetError naming every changed target."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    check_plugin_names(ENV.DISABLED_PLUGINS.get())
    if name in ENV.DISABLED_PLUGINS.get():
        logger.info("sglang-dsv41 plugin %s: off (%s)", name, ENV.DISABLED_PLUGINS.name)
        return False
    plugin = PLUGINS_BY_NAME[name]
    problems = [p for p in map(check_live_target, plugin.targets) if p]
    if problems:
        raise PluginTargetError(f"sglang-dsv41 plugin {name} not installed, SGLang "
                                f"{SGLANG_VERSION} targets changed: " + "; ".join(problems))
    for t in plugin.targets:
        if t.hook_type != "check":
            HookRegistry.register(t.path, _hook(t.hook), HookType[t.hook_type.upper()])
    INSTALLED.append(name)
    return True
