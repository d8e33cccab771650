"""launch() end to end against a boundary SGLang: a generated ``sglang`` package whose modules
carry every patch target (stubs with the registry's parameters) and whose launch_server spawns
a scheduler and a DP controller the way SGLang does (start method spawn, entry functions pickled
by reference). The real SGLang cannot run without CUDA; its source is checked in
test_sglang_registry.py."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from collections import defaultdict

import pytest

from sglang_dsv41.server_args import ServerArgs
from sglang_dsv41.sglang_backend import launch
from sglang_dsv41.sglang_backend.patches import VERSIONS
from sglang_dsv41.sglang_backend.registry import MARK, all_patches

SERVER_ARGS = '''
import argparse
import dataclasses


@dataclasses.dataclass
class ServerArgs:
    model_path: str = ""
    tp_size: int = 1
    dp_size: int = 1
    enable_dp_attention: bool = False
    mem_fraction_static: float = 0.9
    tokenizer_worker_num: int = 1

    @staticmethod
    def add_cli_args(parser):
        parser.add_argument("--model-path", type=str)
        parser.add_argument("--tensor-parallel-size", "--tp-size", type=int, default=1)
        parser.add_argument("--dp-size", type=int, default=1)
        parser.add_argument("--enable-dp-attention", action="store_true")
        parser.add_argument("--mem-fraction-static", type=float, default=0.9)
        parser.add_argument("--tokenizer-worker-num", type=int, default=1)


def prepare_server_args(argv):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    return ServerArgs(ns.model_path, ns.tensor_parallel_size, ns.dp_size,
                      ns.enable_dp_attention, ns.mem_fraction_static, ns.tokenizer_worker_num)
'''

REPORT = '''
def _report(role, pipe_writer, scheduler_func=None):
    import importlib, os
    from sglang_dsv41.sglang_backend.registry import MARK, all_patches
    applied = []
    for p in all_patches():
        owner = importlib.import_module(p.target.bound_in or p.target.module)
        *outer, attr = p.target.qualname.split(".")
        for part in outer:
            owner = getattr(owner, part)
        raw = owner.__dict__[attr]
        if getattr(getattr(raw, "__func__", raw), MARK, None) == p.name:
            applied.append(p.name)
    pipe_writer.send({"role": role, "pid": os.getpid(), "applied": sorted(applied),
                      "disabled": os.environ.get("SGLANG_DSV41_DISABLED_PLUGINS"),
                      "scheduler_func": scheduler_func})
'''

BODIES = {
    "sglang.srt.managers.scheduler.run_scheduler_process":
        '_report("scheduler", pipe_writer)',
    "sglang.srt.managers.data_parallel_controller.run_data_parallel_controller_process":
        '_report("dp_controller", pipe_writer, f"{run_scheduler_process_func.__module__}."'
        'f"{run_scheduler_process_func.__qualname__}")',
    "sglang.srt.entrypoints.http_server.launch_server": '''
import json, multiprocessing as mp, os
from sglang.srt.entrypoints import engine
ctx = mp.get_context("spawn")
reader, writer = ctx.Pipe(duplex=False)
procs = [ctx.Process(target=run_scheduler_process_func,
                     args=(server_args, None, 0, 0, 0, 0, 0, 0, None, writer)),
         ctx.Process(target=engine.run_data_parallel_controller_process,
                     kwargs=dict(server_args=server_args, port_args=None, pipe_writer=writer,
                                 run_scheduler_process_func=run_scheduler_process_func))]
for p in procs:
    p.start()
try:
    reports = []
    for _ in procs:
        if not reader.poll(90):
            raise RuntimeError("a spawned child sent no report")
        reports.append(reader.recv())
finally:
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
with open(os.environ["BOUNDARY_SGLANG_REPORT"], "w") as f:
    json.dump({"reports": reports, "exitcodes": [p.exitcode for p in procs]}, f)''',
}


def _stub(name: str, params: tuple[str, ...], body: str) -> str:
    decorator = ("@classmethod\n" if params[:1] == ("cls",) else
                 "@staticmethod\n" if name == "load_weights_and_postprocess" else "")
    args = ", ".join(n if n in ("self", "cls") else f"{n}=None" for n in params)
    return decorator + f"def {name}({args}):\n" + textwrap.indent(body.strip() or "pass", "    ")


def write_boundary_sglang(root: str) -> None:
    """Stub modules for every patch target, plus the pieces launch() imports."""
    modules: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for p in all_patches():
        *outer, name = p.target.qualname.split(".")
        body = BODIES.get(p.target.label, "return None")
        modules[p.target.module][".".join(outer)].append(_stub(name, p.target.params, body))
        if p.target.bound_in:
            modules[p.target.bound_in][""].append(
                f"from {p.target.module} import {p.target.qualname}")
        for module, name in p.requires:
            if "." in name:
                cls, attr = name.split(".")
                modules[module][cls].append(f"{attr} = None")
            else:
                modules[module][""].append(_stub(name, (), "return 1"))
    modules["sglang.srt.server_args"][""].append(SERVER_ARGS)
    modules["sglang.srt.entrypoints.http_server"][""].append(
        "from fastapi import FastAPI\napp = FastAPI()")
    modules["sglang._version"][""].append(f"__version__ = version = {VERSIONS[0]!r}")
    for module, scopes in modules.items():
        path = os.path.join(root, *module.split(".")) + ".py"
        for i in range(1, len(module.split("."))):
            pkg = os.path.join(root, *module.split(".")[:i], "__init__.py")
            os.makedirs(os.path.dirname(pkg), exist_ok=True)
            open(pkg, "a").close()
        parts = [REPORT] + scopes.pop("", [])
        parts += [f"class {cls}:\n" + textwrap.indent("\n\n".join(defs), "    ")
                  for cls, defs in scopes.items()]
        with open(path, "w") as f:
            f.write("\n\n".join(parts) + "\n")


@pytest.fixture
def boundary_sglang(tmp_path, monkeypatch):
    root = str(tmp_path / "site")
    write_boundary_sglang(root)
    monkeypatch.syspath_prepend(root)
    saved_env = dict(os.environ)
    yield root
    os.environ.clear()
    os.environ.update(saved_env)
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        del sys.modules[name]  # no other test may mistake the boundary for SGLang


@pytest.mark.timeout(180)
def test_launch_spawns_patched_scheduler_and_dp_controller(boundary_sglang, tmp_path):
    report_file = str(tmp_path / "report.json")
    os.environ["BOUNDARY_SGLANG_REPORT"] = report_file
    argv = ["--backend", "sglang", "--model-path", "/m", "--tp-size", "2", "--dp-size", "2",
            "--enable-dp-attention", "--stall-timeout", "5", "--mem-fraction-static", "0.8",
            "--dsv41-disable-plugins", "engram_layout", "--dsv41-run-dir", str(tmp_path / "run")]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ours = ServerArgs.from_cli_args(parser.parse_known_args(argv)[0])
    assert launch(ours, argv) == 0

    from sglang.srt.entrypoints import engine, http_server

    assert getattr(engine.run_data_parallel_controller_process, MARK) == \
        "process_entry.dp_controller"
    assert http_server.app.state.dsv41_health_middleware
    result = json.load(open(report_file))
    assert result["exitcodes"] == [0, 0]
    by_role = {r["role"]: r for r in result["reports"]}
    assert by_role.keys() == {"scheduler", "dp_controller"}
    assert len({r["pid"] for r in result["reports"]} | {os.getpid()}) == 3
    expect = {role: sorted(p.name for p in all_patches() if p.role == role and p.make
                           and p.plugin != "engram_layout")
              for role in ("scheduler", "dp_controller")}
    assert "engram_layout.placement" not in expect["scheduler"]
    for role in ("scheduler", "dp_controller"):
        # each child applied its own patches (and the main process's binding came along)
        applied = [n for n in by_role[role]["applied"]
                   if next(p for p in all_patches() if p.name == n).role == role]
        assert applied == expect[role], role
        assert by_role[role]["disabled"] == "engram_layout"
    assert by_role["dp_controller"]["scheduler_func"] == \
        "sglang_dsv41.sglang_backend.entry.run_scheduler_process"


def test_launch_refuses_a_changed_target_before_starting(boundary_sglang, tmp_path):
    path = os.path.join(boundary_sglang, "sglang", "srt", "managers", "tokenizer_manager.py")
    text = open(path).read()
    changed = text.replace("def generate_request(self, obj=None, request=None)",
                           "def generate_request(self, obj=None)")
    assert changed != text
    open(path, "w").write(changed)
    os.environ["BOUNDARY_SGLANG_REPORT"] = str(tmp_path / "never.json")
    argv = ["--model-path", "/m"]
    ours = ServerArgs(model_path="/m")
    from sglang_dsv41.sglang_backend.registry import PatchTargetError

    with pytest.raises(PatchTargetError, match="TokenizerManager.generate_request"):
        launch(ours, argv)
    assert not os.path.exists(tmp_path / "never.json")
    # switched off, the same tree passes (the listing applies the main-process patches)
    assert launch(ours, argv + ["--dsv41-disable-plugins", "dp_rank_pin",
                                "--dsv41-plugins", "list"]) == 0
    assert launch(ours, argv + ["--dsv41-plugins", "list"]) == 1


def test_launch_refuses_http_workers_that_would_lose_patches(boundary_sglang, tmp_path):
    os.environ["BOUNDARY_SGLANG_REPORT"] = str(tmp_path / "never.json")
    argv = ["--model-path", "/m", "--tokenizer-worker-num", "2"]
    with pytest.raises(ValueError, match=r"worker-num 2 .*'dp_rank_pin', 'stall_watchdog'"):
        launch(ServerArgs(model_path="/m"), argv)
    assert not os.path.exists(tmp_path / "never.json")
