"""``launch_server --backend sglang``: SGLang 0.5.23's own arguments plus ours (--dsv41-*).
Every plugin target is verified against the installed SGLang source, the layout guards run,
then SGLang's own ``load_plugins`` installs our plugins through their entry points and SGLang's
own ``run_server`` starts the server (as ``python -m sglang.launch_server`` does)."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
import tempfile

from . import guards
from .env import DISPATCH_METHODS, ENV
from .plugins import INSTALLED, PLUGINS, PluginTargetError, check_plugin_names
from .source_check import format_table, require_verified, verify_source

logger = logging.getLogger(__name__)
DSV41_PREFIXES = ("--dsv41-", "--no-dsv41-")


def dsv41_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch_server --backend sglang", add_help=False)
    p.add_argument("--dsv41-plugins", choices=("list",), default=None,
                   help="'list': print every plugin, its targets and whether they verified")
    p.add_argument("--dsv41-disable-plugins", default="", help="comma-separated plugin names")
    p.add_argument("--dsv41-stall-timeout", type=float, default=None,
                   help="seconds a batch run or MLP sync may block; <= 0: off")
    p.add_argument("--dsv41-engram-layout", choices=("auto", "shared", "private"), default=None)
    p.add_argument("--dsv41-engram-checkpoint", default=None,
                   help="checkpoint with the Engram tables for --load-format dummy "
                        "(default: --model-path)")
    p.add_argument("--dsv41-run-dir", default=None, help="directory for stall reports")
    p.add_argument("--dsv41-allow-engram-update", action="store_true",
                   help="accept weight updates that name an Engram table")
    p.add_argument("--dsv41-dp-dispatch", choices=DISPATCH_METHODS, default="sglang",
                   help="routing_key: requests with a routing_key stick to one DP rank")
    return p


def split_argv(argv: list[str], sglang_parser: argparse.ArgumentParser
               ) -> tuple[list[str], list[str]]:
    """-> (SGLang's argv, our --dsv41-* argv). Flags only our embedded engine knows
    (--backend, --stall-timeout, ...) were read already and are dropped, our short aliases
    (--tp) take SGLang's spelling (--tp-size), and flags SGLang knows go to SGLang unchanged."""
    from ..launch_server import build_parser

    ours = dsv41_parser()._option_string_actions
    embedded = build_parser()._option_string_actions
    theirs = sglang_parser._option_string_actions
    sglang_argv, dsv41_argv, i = [], [], 0
    while i < len(argv):
        tok = argv[i]
        name = tok.split("=", 1)[0] if tok.startswith("--") else ""
        if name.startswith(DSV41_PREFIXES):
            if name not in ours:
                raise ValueError(f"unknown option {name}; ours are "
                                 f"{sorted(o for o in ours if o.startswith('--dsv41'))}")
            action, sink = ours[name], dsv41_argv
        elif name in embedded and name not in theirs:
            action = embedded[name]
            canonical = [o for o in action.option_strings if o in theirs]
            if canonical:  # our short alias (--tp) of an SGLang flag (--tp-size)
                sglang_argv.append(canonical[0] + tok[len(name):])
                i += 1
                continue
            sink = []  # only the embedded engine reads it: dropped
        else:
            sglang_argv.append(tok)
            i += 1
            continue
        chunk = argv[i:i + 2] if action.nargs != 0 and "=" not in tok else [tok]
        sink.extend(chunk)
        i += len(chunk)
    return sglang_argv, dsv41_argv


def sglang_source_root() -> str:
    """The directory holding the installed ``sglang`` package (found without importing it)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("--backend sglang needs SGLang: pip install 'sglang-dsv41[sglang]' "
                           "(SGLang 0.5.23), or run --backend embedded")
    return os.path.dirname(list(spec.submodule_search_locations)[0])


def set_plugin_environment(ns: argparse.Namespace, server_args, disabled: set[str]) -> str:
    """Our settings for SGLang's processes (they inherit the environment); returns the run dir."""
    run_dir = ns.dsv41_run_dir or tempfile.mkdtemp(prefix="sglang-dsv41-")
    os.makedirs(run_dir, exist_ok=True)
    stall = server_args.stall_timeout if ns.dsv41_stall_timeout is None else ns.dsv41_stall_timeout
    ENV.DISABLED_PLUGINS.set(tuple(sorted(disabled)))
    ENV.STALL_TIMEOUT.set(stall)
    ENV.RUN_DIR.set(run_dir)
    ENV.ENGRAM_CHECKPOINT.set(ns.dsv41_engram_checkpoint or "")
    ENV.ENGRAM_LAYOUT.set(ns.dsv41_engram_layout or server_args.engram_layout)
    ENV.ALLOW_ENGRAM_UPDATE.set(ns.dsv41_allow_engram_update)
    ENV.DP_DISPATCH.set(ns.dsv41_dp_dispatch)
    allow = os.environ.get("SGLANG_PLUGINS")
    if allow:  # SGLang's allow-list is set: keep ours on it
        ours = [p.entry_point for p in PLUGINS if p.name not in disabled]
        os.environ["SGLANG_PLUGINS"] = ",".join(dict.fromkeys(allow.split(",") + ours))
    os.environ.setdefault("SGLANG_HEALTH_CHECK_TIMEOUT",
                          str(max(1, round(server_args.health_check_timeout))))
    return run_dir


def launch(server_args, argv: list[str]) -> int:
    """Start SGLang with the plugins (blocks while the server runs); returns an exit code."""
    from ..torchvision_shim import install_torchvision_shim

    # SGLang's import reaches torchvision; where its operators cannot load (a CPU machine with
    # SGLang's CUDA pin) the import dies on "torchvision::nms", which says nothing useful.
    install_torchvision_shim()
    root = sglang_source_root()
    ns, _ = dsv41_parser().parse_known_args(argv)
    disabled = {n.strip() for n in ns.dsv41_disable_plugins.split(",") if n.strip()}
    check_plugin_names(disabled)
    version, statuses = verify_source(root, disabled)
    if ns.dsv41_plugins == "list":
        print(format_table(version, statuses))
        return 1 if any(s.state == "failed" for s in statuses) else 0
    require_verified(statuses)  # raises, naming every missing or changed target
    run_dir = set_plugin_environment(ns, server_args, disabled)

    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    load_plugins()  # SGLang's own loader runs our entry points here, as in every child
    missing = sorted({p.name for p in PLUGINS} - disabled - set(INSTALLED))
    if missing:
        raise PluginTargetError(f"SGLang's load_plugins did not install {missing}: is "
                                f"sglang-dsv41 installed (pip install -e .) and on SGLANG_PLUGINS?")
    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    sglang_argv, _ = split_argv(list(argv), parser)
    sglang_args = prepare_server_args(sglang_argv)
    guards.check_layout(sglang_args)  # before any process starts: the cause, not a crash
    from sglang.srt.arg_groups.overrides import resolving_view

    layout = guards.apply_engram_layout(resolving_view(sglang_args).nnodes)
    print(f"sglang-dsv41: plugins {INSTALLED} on SGLang {version}; Engram layout {layout}; "
          f"stall reports in {run_dir}", file=sys.stderr)
    import torch

    if getattr(sglang_args, "device", None) in (None, "cuda") and not torch.cuda.is_available():
        raise RuntimeError("SGLang 0.5.23 serves DeepSeek V4/V4.1 on CUDA GPUs and none is "
                           "visible here: use --backend embedded on this machine")
    from sglang.launch_server import run_server
    from sglang.srt.utils import kill_process_tree

    try:
        run_server(sglang_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0
