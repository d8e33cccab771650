"""Layouts refused before anything starts, and the Engram host layout picked by node count.

Run by ``launch_server --backend sglang`` before SGLang starts, and by an AFTER hook on
``ServerArgs.check_server_args`` (server_args.py), which SGLang calls in the main process
before it spawns a scheduler, so plain ``python -m sglang.launch_server`` gets them too.
The rules are sglang_dsv41.policies'; this module only reads SGLang's arguments for them.
"""

from __future__ import annotations

import copy
import logging
import os

from ..jsonio import read_json_object
from ..policies.engram_layout import (SGLANG_LAYOUT_NAMES, choose_engram_layout,
                                      layout_from_sglang_name)
from ..policies.launch_guards import check_attention_tp, check_pp_with_r3
from .env import ENV
from .http_workers import check_http_workers
from .plugins import INSTALLED

logger = logging.getLogger(__name__)

# SGLang 0.5.23's own switches (environ.py), read by layers/engram.py in each scheduler
HOST_TABLE_ENV = "SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE"
HOST_LAYOUT_ENV = "SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT"
PEER_SHARDS_ENV = "SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS"


def _env_bool(environ, name: str) -> bool:
    """SGLang's EnvBool reading (environ.py): true, 1, yes, y."""
    return environ.get(name, "").strip().lower() in ("true", "1", "yes", "y")


def host_tables_enabled(environ) -> bool:
    """Whether SGLang puts the Engram tables in host memory (EngramEmbedding.__init__): the
    host-table switch on and the peer shards (which take precedence) off."""
    return _env_bool(environ, HOST_TABLE_ENV) and not _env_bool(environ, PEER_SHARDS_ENV)


def attention_tp_size(server_args) -> int:
    """SGLang's own arithmetic (runtime_context.parallel_widths_of) on a copy with the
    deprecated ``--dp-size N --enable-dp-attention`` spelling resolved as SGLang resolves it."""
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.arg_groups.parallel_hook import handle_deprecated_dp_attention
    from sglang.srt.runtime_context import parallel_widths_of

    view = resolving_view(server_args)
    if view.enable_dp_attention:
        server_args = copy.deepcopy(server_args)
        handle_deprecated_dp_attention(server_args)
        view = resolving_view(server_args)
    return int(parallel_widths_of(view)["attn_tp_size"])


def model_o_groups(model_path: str) -> int | None:
    """o_groups of a local DeepSeek V4/V4.1 checkpoint (multimodal releases keep it under
    text_config); None for another model or a hub id that is not on disk."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        return None
    cfg = read_json_object(path, "model config")
    for section in (cfg, cfg.get("text_config") or {}):
        if "o_groups" in section:
            return int(section["o_groups"])
    return None


def check_layout(server_args) -> None:
    """Attention TP <= o_groups, no pp with R3, several tokenizer workers only with our app;
    raises DeploymentRefused naming the cause."""
    from sglang.srt.arg_groups.overrides import resolving_view

    view = resolving_view(server_args)
    check_pp_with_r3(view.pp_size, bool(view.enable_return_routed_experts))
    check_http_workers(int(view.tokenizer_worker_num), INSTALLED)
    o_groups = model_o_groups(view.model_path)
    if o_groups is None:
        logger.warning("sglang-dsv41: no o_groups in %s/config.json; attention-TP guard skipped",
                       view.model_path)
        return
    check_attention_tp(attention_tp_size(server_args), o_groups)


def apply_engram_layout(nnodes: int, environ=None) -> str:
    """Set SGLang's host-table layout switch from the node count (an explicit
    SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT or --dsv41-engram-layout wins, and is refused when
    it is shared over several nodes while the tables live in host memory). Returns our layout
    name."""
    environ = os.environ if environ is None else environ
    requested = ENV.ENGRAM_LAYOUT.get(environ)
    explicit = environ.get(HOST_LAYOUT_ENV)
    if explicit is not None:
        mine = layout_from_sglang_name(explicit)
        if requested not in ("auto", mine):
            raise ValueError(f"{HOST_LAYOUT_ENV}={explicit} disagrees with "
                             f"{ENV.ENGRAM_LAYOUT.name}={requested}")
        requested = mine
    layout = choose_engram_layout(requested, spans_nodes=nnodes > 1,
                                  host_tables=host_tables_enabled(environ))
    environ[HOST_LAYOUT_ENV] = SGLANG_LAYOUT_NAMES[layout]
    return layout


def after_check_server_args(result, self, *args, **kwargs):
    check_layout(self)


def after_check_server_args_engram(result, self, *args, **kwargs):
    from sglang.srt.arg_groups.overrides import resolving_view

    layout = apply_engram_layout(resolving_view(self).nnodes)
    logger.info("sglang-dsv41: Engram host layout %s (%s=%s, host table %s)", layout,
                HOST_LAYOUT_ENV, os.environ[HOST_LAYOUT_ENV],
                os.environ.get(HOST_TABLE_ENV, "off"))
