"""Every plugin target verified in the SGLang 0.5.23 source (``ast``, nothing imported), and the
shared policies the plugins and the embedded engine both call."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

from sglang_dsv41.policies import (DeploymentRefused, DPRankPinError, EngramLayoutError,
                                   check_attention_tp, check_pp_with_r3, choose_engram_layout,
                                   resolve_dp_rank_pin)
from sglang_dsv41.policies.sticky_dispatch import StickyDispatch
from sglang_dsv41.sglang_backend.plugins import PLUGINS, PluginTargetError
from sglang_dsv41.sglang_backend.source_check import (module_path, require_verified,
                                                      verify_source)

SGLANG_ROOT = os.path.dirname(importlib.util.find_spec("sglang").submodule_search_locations[0])
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def copy_targets(dst) -> str:
    """The files the check reads (every target module, sglang/_version.py, the package's
    __init__ so find_spec finds the copy), copied from the installed SGLang."""
    modules = {t.module for p in PLUGINS for t in p.targets} | {"sglang._version", "sglang"}
    for module in modules:
        src = module_path(SGLANG_ROOT, module)
        if not os.path.isfile(src):
            src = module_path(SGLANG_ROOT, module + ".__init__")
            dst_file = module_path(str(dst), module + ".__init__")
        else:
            dst_file = module_path(str(dst), module)
        os.makedirs(os.path.dirname(dst_file), exist_ok=True)
        shutil.copy(src, dst_file)
    return str(dst)


def list_plugins(pythonpath: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, ROOT])
    return subprocess.run([sys.executable, "-m", "sglang_dsv41.launch_server", "--backend",
                           "sglang", "--model-path", "unused", "--dsv41-plugins", "list"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)


def test_plugins_list_against_sglang_0_5_23_source_exits_0_naming_every_plugin():
    r = list_plugins()
    assert r.returncode == 0, r.stderr
    for p in PLUGINS:
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith(p.name + " "))
        assert p.entry_point in line and "0.5.23" in line and "verified" in line, line
        for t in p.targets:
            assert t.path in r.stdout
    version, statuses = verify_source(SGLANG_ROOT)
    assert version == "0.5.23" and {s.state for s in statuses} == {"verified"}


def test_a_renamed_target_is_refused_naming_it(tmp_path):
    root = copy_targets(tmp_path)
    path = module_path(root, "sglang.srt.managers.scheduler_components.dp_attn")
    text = open(path).read()
    assert text.count("    def all_gather(") == 1
    open(path, "w").write(text.replace("    def all_gather(", "    def all_gather_v2("))
    version, statuses = verify_source(root)
    failed = {s.plugin.name: s.problems for s in statuses if s.state == "failed"}
    assert list(failed) == ["stall_watchdog"]
    target = "sglang.srt.managers.scheduler_components.dp_attn.MLPSyncBatchInfo.all_gather"
    with pytest.raises(PluginTargetError, match="plugin stall_watchdog: " + target.replace(
            ".", r"\.") + " is not defined"):
        require_verified(statuses)
    r = list_plugins(pythonpath=root)  # the CLI finds the copy first on its path
    assert r.returncode == 1 and "failed" in r.stdout and target in r.stdout
    # switched off, the rest starts
    _, statuses = verify_source(root, disabled=["stall_watchdog"])
    require_verified(statuses)


def test_a_changed_signature_and_another_version_are_refused(tmp_path):
    root = copy_targets(tmp_path)
    path = module_path(root, "sglang.srt.entrypoints.http_server")
    text = open(path).read()
    open(path, "w").write(text.replace("async def serve_generate_request(obj: GenerateReqInput, "
                                       "request: Request)",
                                       "async def serve_generate_request(obj, request, extra)"))
    _, statuses = verify_source(root)
    failed = {s.plugin.name: " ".join(s.problems) for s in statuses if s.state == "failed"}
    assert list(failed) == ["generate_dp_rank_header"] and "parameters changed" in str(failed)
    open(module_path(root, "sglang._version"), "w").write('__version__ = "0.5.10.post1"\n')
    _, statuses = verify_source(root)
    assert {s.state for s in statuses} == {"failed"}
    assert "SGLang 0.5.10.post1 is not the supported 0.5.23" in statuses[0].problems[0]


# ---- the shared policies -------------------------------------------------------------------------
def test_dp_rank_pin_one_rule():
    assert resolve_dp_rank_pin(None, None, None, 4) is None
    assert resolve_dp_rank_pin(None, None, " ", 4) is None  # an empty header is absent
    assert resolve_dp_rank_pin(None, None, "3", 4) == 3
    assert resolve_dp_rank_pin(2, None, "2", 4) == 2 and resolve_dp_rank_pin(None, 1, None, 4) == 1
    for args, message in (((0, None, "1", 4), "conflicting"), ((0, 1, None, 4), "conflicting"),
                          ((None, None, "4", 4), r"valid ranks are \[0, 4\)"),
                          ((-1, None, None, 4), "out of range"),
                          ((None, None, "1.5", 4), "must be an integer"),
                          ((True, None, None, 4), "must be an integer")):
        with pytest.raises(DPRankPinError, match=message):
            resolve_dp_rank_pin(*args)


def test_engram_layout_by_node_count():
    assert choose_engram_layout("auto", spans_nodes=False) == "shared"
    assert choose_engram_layout("auto", spans_nodes=True) == "private"
    assert choose_engram_layout("private", spans_nodes=False) == "private"
    with pytest.raises(EngramLayoutError, match="ranks on other nodes cannot open it"):
        choose_engram_layout("shared", spans_nodes=True)
    with pytest.raises(EngramLayoutError, match="must be one of"):
        choose_engram_layout("per_node", spans_nodes=False)
    # tables on the device (SGLang's host-table switch off): the layout is never used
    assert choose_engram_layout("shared", spans_nodes=True, host_tables=False) == "shared"


def test_sglang_engram_layout_refuses_shared_over_nodes_only_with_host_tables():
    from sglang_dsv41.sglang_backend.guards import apply_engram_layout

    env = {"SGLANG_DSV41_ENGRAM_LAYOUT": "shared"}
    assert apply_engram_layout(2, env) == "shared"  # host table off: SGLang's default
    for switches in ({"SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE": "1"},
                     {"SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE": "true",
                      "SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS": "0"}):
        with pytest.raises(EngramLayoutError, match="other nodes"):
            apply_engram_layout(2, {**env, **switches})
    # peer shards take precedence over the host table (EngramEmbedding): nothing in host memory
    assert apply_engram_layout(2, {**env, "SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE": "1",
                                   "SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS": "yes"}) == "shared"
    env = {"SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE": "1"}
    assert apply_engram_layout(2, env) == "private"
    assert env["SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT"] == "per_rank"


def test_launch_guards():
    check_attention_tp(8, 8)
    check_attention_tp(4, 8)
    with pytest.raises(DeploymentRefused, match="exceeds o_groups=8"):
        check_attention_tp(16, 8)
    with pytest.raises(DeploymentRefused, match="must divide"):
        check_attention_tp(3, 8)
    check_pp_with_r3(2, False)
    check_pp_with_r3(1, True)
    with pytest.raises(DeploymentRefused, match="pp_size=2"):
        check_pp_with_r3(2, True)


def test_sticky_dispatch_keeps_keys_and_places_new_ones_by_load():
    s = StickyDispatch(max_keys=3)
    assert s.rank_for("a", [0, 1, 2], loads=[5, 0, 9]) == 1
    assert s.rank_for("a", [0, 1, 2], loads=[0, 99, 0]) == 1  # sticky despite the load
    assert s.rank_for("b", [0, 1, 2], loads=[0, 0, 0]) == 0  # fewest pinned keys, then lowest
    assert s.rank_for("c", [0, 1, 2]) == 2
    assert s.rank_for("a", [0, 2]) == 0  # rank 1 left: placed again, on the least pinned
    s.rank_for("d", [0, 1, 2])
    assert s.pinned("b") is None  # the least recently used key was forgotten
    with pytest.raises(RuntimeError, match="no active DP rank"):
        s.rank_for("e", [])


def test_readme_gpu_cluster_flags_exist_in_sglang_0_5_23_and_ours():
    import argparse
    import re

    from sglang_cpu import import_sglang
    from sglang_dsv41.sglang_backend.launcher import dsv41_parser

    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme[readme.index("## GPU cluster"):readme.index("\n## ", readme.index(
        "## GPU cluster") + 1)]
    launch_blocks = [b for b in re.findall(r"```(?:bash|text)\n(.*?)```", section, re.S)
                     if "launch_server" in b]
    flags = {f for b in launch_blocks for f in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", b)}
    parser = argparse.ArgumentParser()
    import_sglang("sglang.srt.server_args").ServerArgs.add_cli_args(parser)
    sglang_flags = set(parser._option_string_actions) | {"--backend"}  # ours, for the launcher
    ours = set(dsv41_parser()._option_string_actions)
    assert "--attn-dp-size" in flags and "--dsv41-plugins" in flags
    assert {f for f in flags if not f.startswith("--dsv41-")} - sglang_flags == set()
    assert {f for f in flags if f.startswith("--dsv41-")} - ours == set()
    table = set(re.findall(r"\| `(--dsv41-[a-z-]+)", section))
    assert table == {o for o in ours if o.startswith("--dsv41-")}


def test_split_argv_sends_sglang_its_flags_and_keeps_ours():
    import argparse

    from sglang_cpu import import_sglang
    from sglang_dsv41.sglang_backend.launcher import split_argv

    parser = argparse.ArgumentParser()
    import_sglang("sglang.srt.server_args").ServerArgs.add_cli_args(parser)
    argv = ["--backend", "sglang", "--model-path", "/m", "--tp", "16", "--attn-dp-size=2",
            "--stall-timeout", "9", "--dsv41-engram-layout", "private", "--mem-fraction-static",
            "0.8", "--dsv41-allow-engram-update", "--port", "30000"]
    sglang_argv, ours = split_argv(argv, parser)
    assert sglang_argv == ["--model-path", "/m", "--tp-size", "16", "--attn-dp-size=2",
                           "--mem-fraction-static", "0.8", "--port", "30000"]
    assert ours == ["--dsv41-engram-layout", "private", "--dsv41-allow-engram-update"]
    with pytest.raises(ValueError, match="unknown option --dsv41-nope"):
        split_argv(["--dsv41-nope", "1"], parser)
