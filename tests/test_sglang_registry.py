"""The patch registry against the real SGLang 0.5.10.post1 source (downloaded once, parsed with
ast, never imported), a deliberately broken copy of it, the launcher's argument handling, the
entry functions' pickling, and the GPU-cluster commands of the README's "GPU cluster" section."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import pickletools
import re
import shutil
import subprocess
import sys
import warnings
import zipfile

import pytest

from sglang_dsv41.server_args import ServerArgs
from sglang_dsv41.sglang_backend import entry, launch as launch_fn
from sglang_dsv41.sglang_backend.env import ENV
from sglang_dsv41.sglang_backend.launch import (dsv41_parser, resolve_settings, sglang_cli_flags,
                                                split_argv)
from sglang_dsv41.sglang_backend.registry import (PatchTargetError, all_patches, format_table,
                                                  source_version, verify_source)

SGLANG_VERSION = "0.5.10.post1"
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "sglang_dsv41", f"sglang-{SGLANG_VERSION}")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def sglang_src() -> str:
    """The SGLang source tree (the directory holding the ``sglang`` package)."""
    if os.path.isfile(os.path.join(CACHE, "sglang", "_version.py")):
        return CACHE
    download = CACHE + ".download"
    shutil.rmtree(download, ignore_errors=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary",
                           ":all:", f"sglang=={SGLANG_VERSION}", "-d", download],
                          capture_output=True, text=True, timeout=600)
    wheels = [f for f in os.listdir(download) if f.endswith(".whl")] if proc.returncode == 0 \
        else []
    if not wheels:
        reason = (f"!!! SGLANG SOURCE UNAVAILABLE: `pip download sglang=={SGLANG_VERSION}` "
                  f"failed, the patch targets were NOT checked: {proc.stderr[-500:]}")
        warnings.warn(reason)
        pytest.skip(reason)
    partial = CACHE + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(os.path.join(download, wheels[0])) as zf:
        zf.extractall(partial, [n for n in zf.namelist() if n.startswith("sglang/")])
    shutil.rmtree(CACHE, ignore_errors=True)
    os.rename(partial, CACHE)  # a half-extracted tree is never taken for the real one
    shutil.rmtree(download, ignore_errors=True)
    return CACHE


def _copy_targets(src: str, dst: str) -> str:
    """A copy of the files the registry reads (enough for verify_source)."""
    paths = {os.path.join("sglang", "_version.py")}
    for p in all_patches():
        for module in (p.target.module, p.target.bound_in, *(m for m, _ in p.requires)):
            if module:
                paths.add(os.path.join(*module.split(".")) + ".py")
    for rel in paths:
        os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
        shutil.copy(os.path.join(src, rel), os.path.join(dst, rel))
    return dst


def _edit(root: str, module: str, old: str, new: str) -> None:
    path = os.path.join(root, *module.split(".")) + ".py"
    text = open(path).read()
    assert old in text, f"{old!r} not in {path}"
    open(path, "w").write(text.replace(old, new))


def test_every_target_exists_in_the_real_source(sglang_src):
    assert source_version(sglang_src) == SGLANG_VERSION
    statuses = verify_source(sglang_src)
    assert {s.state for s in statuses} == {"verified"}
    assert len(statuses) == len(all_patches()) >= 15
    table = format_table(statuses)
    assert "DummyModelLoader.load_model" in table and "prepare_mlp_sync_batch_raw" in table


def test_renamed_target_stops_startup_naming_it(sglang_src, tmp_path):
    root = _copy_targets(sglang_src, str(tmp_path))
    verify_source(root)
    mixin = "sglang.srt.managers.scheduler_dp_attn_mixin"
    _edit(root, mixin, "def prepare_mlp_sync_batch_raw(", "def prepare_mlp_sync_batch_raw_v2(")
    with pytest.raises(PatchTargetError) as err:
        verify_source(root)
    msg = str(err.value)
    assert "idle_batch.guarantee" in msg and f"{mixin}.prepare_mlp_sync_batch_raw" in msg
    assert "is not defined" in msg and "--dsv41-disable-plugins" in msg
    # the plugin switched off: start-up goes on, and the table says so
    statuses = verify_source(root, disabled=["idle_batch"])
    assert {s.patch.name: s.state for s in statuses}["idle_batch.guarantee"] == "off"


def test_changed_parameters_and_version_are_refused(sglang_src, tmp_path):
    root = _copy_targets(sglang_src, str(tmp_path))
    _edit(root, "sglang.srt.model_loader.loader",
          "        *,\n        model_config: ModelConfig,\n        device_config: DeviceConfig,\n"
          "    ) -> nn.Module:\n\n        if get_bool_env_var(\"SGL_CPU_QUANTIZATION\")",
          "        *,\n        model_config: ModelConfig,\n        device: DeviceConfig,\n"
          "    ) -> nn.Module:\n\n        if get_bool_env_var(\"SGL_CPU_QUANTIZATION\")")
    _edit(root, "sglang.srt.entrypoints.engine",
          "from sglang.srt.managers.data_parallel_controller import (\n"
          "    run_data_parallel_controller_process,\n)", "")
    statuses = verify_source(root, raise_on_failure=False)
    failed = {s.patch.name: s.detail for s in statuses if s.state == "failed"}
    assert set(failed) == {"engram_dummy_load.load_model", "process_entry.dp_controller"}
    assert "parameters changed" in failed["engram_dummy_load.load_model"]
    assert "sglang.srt.entrypoints.engine" in failed["process_entry.dp_controller"]
    _edit(root, "sglang._version", f"'{SGLANG_VERSION}'", "'0.6.0'")
    with pytest.raises(PatchTargetError, match=r"SGLang 0\.6\.0 is not a supported version"):
        verify_source(root, disabled=["engram_dummy_load"])
    with pytest.raises(ValueError, match="unknown plugin"):
        verify_source(root, disabled=["no_such_plugin"])


def test_attribute_an_adapter_reads_is_checked(sglang_src, tmp_path):
    root = _copy_targets(sglang_src, str(tmp_path))
    _edit(root, "sglang.srt.managers.data_parallel_controller",
          "self.workers: List[zmq.Socket] = [None] * server_args.dp_size",
          "self.worker_sockets: List[zmq.Socket] = [None] * server_args.dp_size")
    _edit(root, "sglang.srt.layers.dp_attention", "def get_attention_tp_size()",
          "def get_attn_tp_size()")
    statuses = verify_source(root, raise_on_failure=False)
    failed = {s.patch.name: s.detail for s in statuses if s.state == "failed"}
    assert failed == {
        "dp_rank_pin.dispatch": "sglang.srt.managers.data_parallel_controller."
                                "DataParallelController.workers is no longer set",
        "prefill_padding.forward_batch": "sglang.srt.layers.dp_attention.get_attention_tp_size "
                                         "is not defined"}


def test_entry_functions_pickle_by_reference():
    for fn in (entry.run_scheduler_process, entry.run_data_parallel_controller_process):
        data = pickle.dumps(fn)
        strings = [arg for op, arg, _ in pickletools.genops(data) if isinstance(arg, str)]
        assert "sglang_dsv41.sglang_backend.entry" in strings and fn.__name__ in strings
        assert pickle.loads(data) is fn
    # the DP controller's default scheduler entry is ours too (handed to every DP group)
    import inspect

    default = inspect.signature(entry.run_data_parallel_controller_process).parameters[
        "run_scheduler_process_func"].default
    assert default is entry.run_scheduler_process
    assert callable(launch_fn) and launch_fn.__module__.endswith("sglang_backend.launch")


def _our_args(argv: list[str]) -> ServerArgs:
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    ns, _ = p.parse_known_args(argv)
    return ServerArgs.from_cli_args(ns)


def test_argv_split_and_settings(sglang_src, tmp_path):
    flags = sglang_cli_flags(sglang_src)
    assert {"--tp-size", "--dp-size", "--enable-dp-attention", "--load-format"} <= flags
    argv = ["--backend", "sglang", "--model-path", "/ckpt", "--tp-size", "8", "--dp-size", "2",
            "--enable-dp-attention", "--nnodes", "2", "--node-rank", "0", "--stall-timeout",
            "30", "--no-enable-idle-batch", "--dsv41-engram-layout=auto",
            "--dsv41-disable-plugins", "dp_rank_pin", "--mem-fraction-static", "0.8"]
    sglang_argv, ours = split_argv(argv, flags)
    assert sglang_argv == ["--model-path", "/ckpt", "--tp-size", "8", "--dp-size", "2",
                           "--enable-dp-attention", "--nnodes", "2", "--node-rank", "0",
                           "--mem-fraction-static", "0.8"]
    assert ours == ["--dsv41-engram-layout=auto", "--dsv41-disable-plugins", "dp_rank_pin"]
    s = resolve_settings(_our_args(argv), ours)
    assert (s.engram_layout, s.stall_timeout, s.disabled) == (
        "private", 30.0, ("dp_rank_pin", "idle_batch"))
    env = s.environ()
    assert ENV.DISABLED_PLUGINS.get(env) == ("dp_rank_pin", "idle_batch")
    assert ENV.ENGRAM_LAYOUT.get(env) == "private" and ENV.ENGRAM_CHECKPOINT.get(env) == "/ckpt"
    with pytest.raises(ValueError, match="cannot span --nnodes 2"):
        resolve_settings(_our_args(argv), ["--dsv41-engram-layout", "shared"])
    with pytest.raises(ValueError, match="unknown plugin"):
        resolve_settings(_our_args(argv), ["--dsv41-disable-plugins", "typo"])
    with pytest.raises(ValueError, match="process_entry cannot be switched off"):
        resolve_settings(_our_args(argv), ["--dsv41-disable-plugins", "process_entry"])
    assert split_argv(["--tp", "16", "--dp=2", "--dist-init-port", "5", "--ep", "16"], flags) == (
        ["--tp-size", "16", "--dp-size=2", "--ep", "16"], [])
    with pytest.raises(ValueError, match="unknown option --dsv41-nope"):
        split_argv(["--dsv41-nope", "1"], flags)
    with pytest.raises(ValueError, match="SGLANG_DSV41_ENGRAM_LAYOUT"):
        ENV.ENGRAM_LAYOUT.get({"SGLANG_DSV41_ENGRAM_LAYOUT": "numa"})


SHELL_VARS = {"$MODEL": "/data/model", "$NODE0": "10.0.0.1", "$MAX_TOTAL_TOKENS": "262144"}


def _gpu_cluster_section() -> str:
    text = open(os.path.join(REPO, "README.md")).read()
    return text.split("\n## GPU cluster\n", 1)[1].split("\n## ", 1)[0]


def _doc_commands() -> list[list[str]]:
    text = _gpu_cluster_section()
    blocks = re.findall(r"```(?:bash|sh|text)\n(.*?)```", text, re.S)
    commands = []
    for block in blocks:
        for cmd in block.replace("\\\n", " ").splitlines():
            if "sglang_dsv41.launch_server" in cmd:
                for var, value in SHELL_VARS.items():
                    cmd = cmd.replace(var, value)
                assert "$" not in cmd, f"unknown shell variable in {cmd}"
                commands.append(cmd.split("sglang_dsv41.launch_server", 1)[1].split())
    return commands


def test_gpu_cluster_doc_commands_use_real_flags(sglang_src):
    commands = _doc_commands()
    known = sglang_cli_flags(sglang_src) | set(dsv41_parser()._option_string_actions) | {
        "--backend"}
    for argv in commands:
        unknown = [a.split("=")[0] for a in argv if a.startswith("--") and a.split("=")[0]
                   not in known]
        assert not unknown, f"flags not in SGLang {SGLANG_VERSION} or ours: {unknown}"
    per_node = [c for c in commands if "--node-rank" in c]
    assert len(per_node) == 2 and len(commands) == 3, "one launch per node, one plugin listing"
    node0, node1 = per_node
    for argv in per_node:  # the embedded ServerArgs (launch_server's own parser) accepts them
        args = _our_args(argv)
        assert (args.attn_tp_size, args.effective_dp_size, args.ep_size) == (8, 2, 16)
        assert resolve_settings(args, split_argv(argv, known)[1]).engram_layout == "private"
    for flag, value in [("--tp-size", "16"), ("--dp-size", "2"), ("--ep-size", "16"),
                        ("--nnodes", "2"), ("--load-format", "dummy")]:
        assert node0[node0.index(flag) + 1] == value and node1[node1.index(flag) + 1] == value
    assert node0[node0.index("--node-rank") + 1] == "0"
    assert node1[node1.index("--node-rank") + 1] == "1"
    for flag in ("--enable-dp-attention", "--enable-return-routed-experts",
                 "--max-total-tokens", "--dist-init-addr"):
        assert flag in node0 and flag in node1


def test_plugins_list_prints_every_patch(sglang_src, tmp_path, capsys):
    from sglang_dsv41.sglang_backend.launch import _list_plugins

    args = _our_args(["--model-path", "/m", "--tp-size", "16", "--dp-size", "2",
                      "--enable-dp-attention", "--nnodes", "2"])
    assert _list_plugins(sglang_src, resolve_settings(args, [])) == 0
    out = capsys.readouterr().out
    for p in all_patches():
        assert p.name in out and p.target.label in out
    assert "applies in each scheduler process" in out
    root = _copy_targets(sglang_src, str(tmp_path))
    _edit(root, "sglang.srt.managers.tokenizer_manager", "    async def generate_request(",
          "    async def generate_request_renamed(")
    assert _list_plugins(root, resolve_settings(args, [])) == 1
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.startswith("dp_rank_pin.validate"))
    assert "failed" in row and "generate_request is not defined" in row


def test_gpu_cluster_doc_planner_command_gives_max_total_tokens(capsys):
    from sglang_dsv41.plan.__main__ import main as plan_main

    text = _gpu_cluster_section().replace("\\\n", " ")
    [line] = [ln for ln in text.splitlines() if "python -m sglang_dsv41.plan " in ln]
    argv = line.split("python -m sglang_dsv41.plan", 1)[1].split(">")[0].split()
    argv[argv.index("$MODEL")] = "v41-flash"
    assert plan_main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["largest_safe_max_total_tokens"] > 0
    assert "--tp-size 16 --dp-size 2 --ep-size 16 --enable-dp-attention" in plan["layout"][
        "sglang_flags"]

