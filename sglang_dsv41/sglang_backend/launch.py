"""``launch_server --backend sglang``: SGLang's own arguments plus ours (--dsv41-*), patches
verified against the installed SGLang source before anything starts, then SGLang's
launch_server with our scheduler entry function."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import os
import sys
import tempfile
from dataclasses import dataclass

from .env import ENV
from .registry import (PatchStatus, all_patches, apply_patches, check_plugin_names,
                       format_table, verify_source)
from .state import stall_report_files

DSV41_PREFIXES = ("--dsv41-", "--no-dsv41-")


def dsv41_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch_server --backend sglang", add_help=False)
    p.add_argument("--dsv41-plugins", choices=("list",), default=None,
                   help="'list': print every patch and whether it applies, then exit")
    p.add_argument("--dsv41-disable-plugins", default="",
                   help="comma-separated plugins to switch off")
    p.add_argument("--dsv41-stall-timeout", type=float, default=None,
                   help="seconds a collective may block before the rank is reported; <= 0: off")
    p.add_argument("--dsv41-engram-layout", choices=("auto", "shared", "private"), default=None)
    p.add_argument("--dsv41-engram-dummy-load", action=argparse.BooleanOptionalAction,
                   default=True, help="with --load-format dummy, still load the Engram tables")
    p.add_argument("--dsv41-engram-checkpoint", default=None,
                   help="checkpoint holding the Engram tables (default: --model-path)")
    p.add_argument("--dsv41-run-dir", default=None,
                   help="directory for stall reports (default: a fresh temporary directory)")
    return p


def _own_actions() -> dict[str, argparse.Action]:
    from ..server_args import ServerArgs

    p = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(p)
    return dict(p._option_string_actions)


def sglang_cli_flags(src_root: str) -> set[str]:
    """Every option string SGLang's ServerArgs.add_cli_args declares, read from its source."""
    path = os.path.join(src_root, "sglang", "srt", "server_args.py")
    flags = set()
    for node in ast.walk(ast.parse(open(path).read(), filename=path)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            flags.update(a.value for a in node.args
                         if isinstance(a, ast.Constant) and isinstance(a.value, str)
                         and a.value.startswith("-"))
    return flags


def split_argv(argv: list[str], sglang_flags: set[str]) -> tuple[list[str], list[str]]:
    """-> (SGLang's argv, our --dsv41-* argv). Flags of our embedded ServerArgs that SGLang does
    not know (--backend, --stall-timeout, ...) were read by launch_server already: dropped;
    our short aliases (--tp, --dp) become SGLang's spelling."""
    ours = dict(dsv41_parser()._option_string_actions)
    own = _own_actions()
    sglang_argv, dsv41_argv = [], []
    i = 0
    while i < len(argv):
        tok = argv[i]
        name = tok.split("=", 1)[0] if tok.startswith("--") else ""
        if name.startswith(DSV41_PREFIXES):
            if name not in ours:
                raise ValueError(f"unknown option {name}; ours are "
                                 f"{sorted(o for o in ours if o.startswith('--dsv41'))}")
            action, sink = ours[name], dsv41_argv
        elif name in own and name not in sglang_flags:
            action = own[name]
            canonical = [o for o in action.option_strings if o in sglang_flags]
            if canonical:  # our short alias (--tp) of an SGLang flag (--tp-size)
                sglang_argv.append(canonical[0] + tok[len(name):])
                i += 1
                continue
            sink = []  # the embedded engine's own flag: dropped
        else:
            sglang_argv.append(tok)
            i += 1
            continue
        chunk = argv[i:i + 2] if action.nargs != 0 and "=" not in tok else [tok]
        sink.extend(chunk)
        i += len(chunk)
    return sglang_argv, dsv41_argv


@dataclass(frozen=True)
class BackendSettings:
    list_plugins: bool
    disabled: tuple[str, ...]
    stall_timeout: float
    engram_layout: str             # resolved: shared or private
    engram_dummy_load: bool
    engram_checkpoint: str
    run_dir: str

    def environ(self) -> dict[str, str]:
        return dict([ENV.DISABLED_PLUGINS.to_env(self.disabled),
                     ENV.STALL_TIMEOUT.to_env(self.stall_timeout),
                     ENV.RUN_DIR.to_env(self.run_dir),
                     ENV.ENGRAM_DUMMY_LOAD.to_env(self.engram_dummy_load),
                     ENV.ENGRAM_CHECKPOINT.to_env(self.engram_checkpoint),
                     ENV.ENGRAM_LAYOUT.to_env(self.engram_layout)])


def resolve_settings(server_args, dsv41_argv: list[str]) -> BackendSettings:
    """Our flags over the embedded ServerArgs' plugin fields (same meaning, other spelling)."""
    ns = dsv41_parser().parse_args(dsv41_argv)
    disabled = {n.strip() for n in ns.dsv41_disable_plugins.split(",") if n.strip()}
    if not server_args.enable_prefill_padding:
        disabled.add("prefill_padding")
    if not server_args.enable_idle_batch:
        disabled.add("idle_batch")
    if "process_entry" in disabled:
        raise ValueError("plugin process_entry cannot be switched off: without it no patch "
                         "reaches SGLang's scheduler processes")
    check_plugin_names(all_patches(), disabled)
    layout = ns.dsv41_engram_layout or server_args.engram_layout
    resolved = dataclasses.replace(server_args, engram_layout=layout).resolved_engram_layout
    if resolved == "shared" and server_args.nnodes > 1:
        raise ValueError("Engram layout 'shared' keeps one table per node in shared memory and "
                         f"cannot span --nnodes {server_args.nnodes}; use private (or auto)")
    stall = ns.dsv41_stall_timeout
    return BackendSettings(
        list_plugins=ns.dsv41_plugins == "list", disabled=tuple(sorted(disabled)),
        stall_timeout=server_args.stall_timeout if stall is None else stall,
        engram_layout=resolved, engram_dummy_load=ns.dsv41_engram_dummy_load,
        engram_checkpoint=ns.dsv41_engram_checkpoint or server_args.model_path,
        run_dir=ns.dsv41_run_dir or "")


def sglang_source_root() -> str:
    """The directory holding the installed ``sglang`` package (found without importing it)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("--backend sglang needs SGLang: pip install 'sglang==0.5.10.post1' "
                           "(or run --backend embedded)")
    return os.path.dirname(list(spec.submodule_search_locations)[0])


def _list_plugins(root: str, settings: BackendSettings) -> int:
    statuses = verify_source(root, disabled=settings.disabled, raise_on_failure=False)
    if not any(s.state == "failed" for s in statuses):
        try:  # the main-process patches can be applied here; the others apply in each child
            applied = {s.patch.name: s for s in apply_patches("main", settings.disabled)}
            statuses = [applied.get(s.patch.name, s) for s in statuses]
        except (ImportError, OSError, RuntimeError) as e:  # e.g. no CUDA driver for sgl_kernel
            print(f"(SGLang not importable here, targets checked in its source only: {e})")
    where = {"main": "applies in the HTTP process at start", "scheduler":
             "applies in each scheduler process", "dp_controller": "applies in the DP controller"}
    statuses = [PatchStatus(s.patch, s.state, where[s.patch.role]) if s.state == "verified"
                else s for s in statuses]
    print(format_table(statuses))
    return 1 if any(s.state == "failed" for s in statuses) else 0


def check_http_workers(tokenizer_worker_num: int, disabled: tuple[str, ...]) -> None:
    """More than one tokenizer worker makes uvicorn spawn HTTP processes that import SGLang's
    http_server afresh, without the main-process patches: refuse rather than lose them."""
    lost = sorted({p.plugin for p in all_patches() if p.role == "main"
                   and p.plugin != "process_entry" and p.plugin not in disabled})
    if tokenizer_worker_num > 1 and lost:
        raise ValueError(f"--tokenizer-worker-num {tokenizer_worker_num} starts HTTP worker "
                         f"processes without the main-process patches of {lost}; use 1, or "
                         f"switch them off with --dsv41-disable-plugins {','.join(lost)}")


def launch(server_args, argv: list[str]) -> int:
    """Start SGLang with the plugins (blocks while the server runs); returns an exit code."""
    root = sglang_source_root()
    sglang_argv, dsv41_argv = split_argv(list(argv), sglang_cli_flags(root))
    settings = resolve_settings(server_args, dsv41_argv)
    if settings.list_plugins:
        return _list_plugins(root, settings)
    verify_source(root, disabled=settings.disabled)  # raises, naming every bad target
    run_dir = settings.run_dir or tempfile.mkdtemp(prefix="sglang-dsv41-")
    os.makedirs(run_dir, exist_ok=True)
    for stale in stall_report_files(run_dir):
        os.remove(stale)
    os.environ.update(dataclasses.replace(settings, run_dir=run_dir).environ())
    # SGLang's own knob (read as an int when its http_server module is imported)
    os.environ.setdefault("SGLANG_HEALTH_CHECK_TIMEOUT",
                          str(max(1, round(server_args.health_check_timeout))))

    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.server_args import prepare_server_args

    from .entry import run_scheduler_process

    sglang_args = prepare_server_args(sglang_argv)
    check_http_workers(getattr(sglang_args, "tokenizer_worker_num", 1), settings.disabled)
    apply_patches("main", settings.disabled)
    print(f"sglang-dsv41: plugins on, disabled: {list(settings.disabled) or 'none'}; "
          f"stall reports in {run_dir}", file=sys.stderr)
    launch_server(sglang_args, run_scheduler_process_func=run_scheduler_process)
    return 0
