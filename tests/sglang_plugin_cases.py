"""Cases that install our plugins into the real SGLang 0.5.23 on CPU, one fresh process each
(HookRegistry patches cannot be undone). Run as ``python tests/sglang_plugin_cases.py CASE ...``
by test_sglang_plugins.py; a case prints ``OK <json>`` on success and raises otherwise."""

from __future__ import annotations

import asyncio
import faulthandler
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sglang_cpu import (import_sglang, install_torchvision_shim,  # noqa: E402
                        write_tiny_model)

install_torchvision_shim()  # before anything imports torchvision (through transformers)
# A case that runs past its time gets SIGUSR1 before it is killed: every thread's stack goes to
# stderr, which the test prints (where a hung case waits, not only its last log line).
faulthandler.register(signal.SIGUSR1, all_threads=True)
import torch  # noqa: E402


def load_plugins(allow: str | None = None):
    if allow is not None:
        os.environ["SGLANG_PLUGINS"] = allow
    plugins = import_sglang("sglang.srt.plugins")
    plugins._plugins_loaded = False
    plugins.load_plugins()
    from sglang_dsv41.sglang_backend.plugins import INSTALLED

    return list(INSTALLED)


def done(**facts) -> None:
    print("OK " + json.dumps(facts), flush=True)


# ---- entry points ------------------------------------------------------------------------------
def entry_points(installed: list[str]) -> dict:
    loader = import_sglang("sglang.srt.model_loader.loader")
    weight_utils = import_sglang("sglang.srt.model_loader.weight_utils")
    wrapped = {
        "DummyModelLoader.load_model": hasattr(loader.DummyModelLoader.load_model, "__wrapped__"),
        # HookRegistry re-binds the loader's `from weight_utils import initialize_dummy_weights`
        "loader.initialize_dummy_weights": loader.initialize_dummy_weights
        is weight_utils.initialize_dummy_weights
        and hasattr(loader.initialize_dummy_weights, "__wrapped__"),
        "serve_generate_request": hasattr(import_sglang(
            "sglang.srt.entrypoints.http_server").serve_generate_request, "__wrapped__"),
        "WeightUpdater.update_weights_from_tensor": hasattr(import_sglang(
            "sglang.srt.model_executor.model_runner_components.weight_updater").WeightUpdater
            .update_weights_from_tensor, "__wrapped__"),
    }
    return dict(installed=installed, wrapped=wrapped)


def switches() -> dict:
    """SGLang's allow-list, then our own switch. HookRegistry.reset leaves the patches: only
    which plugins register is compared. Runs last."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry.reset()
    INSTALLED = sys.modules["sglang_dsv41.sglang_backend.plugins"].INSTALLED
    INSTALLED.clear()
    allow_list = load_plugins("dsv41_stall_watchdog,dsv41_layout_guards")
    INSTALLED.clear()
    os.environ["SGLANG_DSV41_DISABLED_PLUGINS"] = "layout_guards"
    disabled = load_plugins("dsv41_stall_watchdog,dsv41_layout_guards")
    return dict(allow_list=allow_list, disabled=disabled)


# ---- watchdog over a 2-rank gloo group ----------------------------------------------------------
def case_mlp_sync(rank: str, port: str, delay: str) -> None:
    rank = int(rank)
    load_plugins("dsv41_stall_watchdog")
    ps = import_sglang("sglang.srt.distributed.parallel_state")
    rc = import_sglang("sglang.srt.runtime_context")
    dp_attn = import_sglang("sglang.srt.managers.scheduler_components.dp_attn")
    rc.get_parallel().override_permanently(
        tp_size=2, tp_rank=rank, pp_size=1, attn_dp_size=2, moe_ep_size=1, attn_cp_size=1,
        moe_dp_size=1, attn_dcp_size=1, shared_experts_tp_size=2)
    ps.init_distributed_environment(world_size=2, rank=rank, local_rank=rank, backend="gloo",
                                    distributed_init_method=f"tcp://127.0.0.1:{port}")
    ps.initialize_model_parallel(backend="gloo")
    group = rc.get_parallel().tp_group.cpu_group
    counts = []
    for step, tokens in enumerate((3 * rank, 0)):  # step 0: rank 0 idle; step 1: all idle
        if rank == 1 and step == 0:
            time.sleep(float(delay))  # the wedged rank: rank 0 waits for it in the gather
        info = dp_attn.MLPSyncBatchInfo(
            num_dp_ranks=2, tp_size=1, cp_size=1, num_tokens=tokens, num_tokens_for_logprob=0,
            can_run_decode_cuda_graph=False, can_run_draft_cuda_graph=False,
            can_run_prefill_cuda_graph=False, is_extend_in_batch=False, local_can_run_tbo=False,
            local_forward_mode=0)
        info.all_gather("cpu", group)
        counts.append(info.global_num_tokens)
    from sglang_dsv41.sglang_backend.watchdog_hooks import GUARD

    torch.distributed.barrier(group)
    done(rank=rank, counts=counts, steps=dict(GUARD.steps),
         report_left=os.path.exists(os.path.join(os.environ["SGLANG_DSV41_RUN_DIR"],
                                                 f"stall-rank{rank}.json")))


# ---- HTTP: /generate pins, sticky dispatch, /health with a stall report, Engram updates ------
def http(work_dir: str, run_dir: str) -> dict:
    from sglang_plugin_generate import request_path_case

    os.environ["SGLANG_DSV41_RUN_DIR"] = run_dir  # read by the health middleware per request
    return request_path_case(work_dir, run_dir)


# ---- R3 rows of hash layers -------------------------------------------------------------------
def r3(work_dir: str) -> dict:
    """SGLang's HashTopK.forward (its torch path: SGLANG_OPT_USE_FUSED_HASH_TOPK=0, the fused
    one is a CUDA JIT kernel) in a scheduler's published context with R3 on."""
    sa = import_sglang("sglang.srt.server_args")
    rc = import_sglang("sglang.srt.runtime_context")
    hash_topk = import_sglang("sglang.srt.layers.moe.hash_topk")
    moe_utils = import_sglang("sglang.srt.layers.moe.utils")
    routed = import_sglang("sglang.srt.state_capturer.routed_experts")
    base = import_sglang("sglang.srt.state_capturer.base")
    weight_utils = import_sglang("sglang.srt.model_loader.weight_utils")
    os.environ["SGLANG_OPT_USE_FUSED_HASH_TOPK"] = "0"
    args = sa.prepare_server_args([
        "--model-path", write_tiny_model(os.path.join(work_dir, "r3_model")), "--device", "cpu",
        "--enable-return-routed-experts"])
    args.resolve_once()
    rc.publish(args, role="scheduler", ranks=rc.SpawnRanks(world_rank=0))
    # SGLang's capturer with its device buffer only: its host half pins memory through CUDA
    capturer = routed.RoutedExpertsCapturer.__new__(routed.RoutedExpertsCapturer)
    capturer.num_layers, capturer.topk_size, capturer.num_fused_shared_experts = 4, 3, 0
    capturer.device_cache = base.BaseDeviceCache(16, 4, 3, "cpu", name="routed_experts")
    routed.set_global_experts_capturer(capturer)
    shared = moe_utils.SharedExpertsConfig(fusion_disabled=True, num_fused_shared_experts=0,
                                           use_waterfill=False)
    layers = {}
    with rc.get_model().override(shared_experts=shared):  # as SGLang's loader builds a model
        for name, draft in (("target", False), ("draft", True)):
            layers[name] = hash_topk.HashTopK(3, 16, vocab_size=50, layer_id=1, is_draft=draft)
    tid2eid = torch.randint(0, 16, (50, 3), dtype=torch.int32)
    for layer in layers.values():  # the checkpoint's table, through SGLang's loader path
        weight_utils.default_weight_loader(layer.tid2eid, tid2eid)
    ids = torch.tensor([5, 9, 0, 49, 7])
    before = capturer.device_cache.buffer[:5, 1].clone()
    out = layers["target"](torch.zeros(5, 8), torch.randn(5, 16), ids)
    rows = capturer.device_cache.buffer[:5, 1]
    facts = dict(installed=hasattr(hash_topk.HashTopK.forward, "__wrapped__"),
                 rows_equal=torch.equal(rows, tid2eid[ids]),
                 rows_are_routed=torch.equal(rows, out.topk_ids.to(rows.dtype)),
                 were_zero=bool((before == 0).all()))
    capturer.device_cache.buffer.zero_()
    layers["draft"](torch.zeros(5, 8), torch.randn(5, 16), ids)
    facts["draft_untouched"] = bool((capturer.device_cache.buffer == 0).all())
    return facts


# ---- launch_server --backend sglang refusals ----------------------------------------------------
def launch(model_dir: str) -> dict:
    from sglang_dsv41.launch_server import main

    base = ["--backend", "sglang", "--model-path", model_dir,
            "--dsv41-run-dir", os.path.join(model_dir, "run")]
    codes = {}
    for label, extra in (("tp16", ["--tp-size", "16"]),
                         ("shared_2_nodes", ["--tp-size", "16", "--attn-dp-size", "2",
                                             "--nnodes", "2", "--dsv41-engram-layout", "shared"]),
                         ("pp_r3", ["--pp-size", "2", "--enable-return-routed-experts"])):
        for name in ("SGLANG_DSV41_ENGRAM_LAYOUT", "SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT"):
            os.environ.pop(name, None)  # one launch per process: no earlier choice
        # the tables in host memory (SGLang's switch): where a shared layout matters
        os.environ["SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE"] = "1"
        codes[label] = main(base + extra)
    del os.environ["SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE"]
    return dict(codes=codes, children=len(__import__("psutil").Process().children()))


def plain_sglang(work_dir: str) -> dict:
    """``python -m sglang.launch_server`` with our package installed: SGLang resolves the
    arguments (resolve_once) and calls ServerArgs.check_server_args in its main process before
    it spawns a scheduler (entrypoints/engine.py _launch_subprocesses); SGLang's own validation
    runs first (``--device cpu``: nothing else here needs a GPU), then our AFTER hooks."""
    sa = import_sglang("sglang.srt.server_args")
    model_dir = write_tiny_model(os.path.join(work_dir, "plain_sglang_model"))  # o_groups 2
    out = {"hooked": hasattr(sa.ServerArgs.check_server_args, "__wrapped__")}
    for label, argv in (("tp16", ["--tp-size", "16"]),
                        ("two_nodes", ["--tp-size", "16", "--attn-dp-size", "8", "--nnodes", "2"]),
                        ("sglang_refuses", ["--tp-size", "3", "--nnodes", "2"]),
                        ("workers2", ["--tp-size", "2", "--tokenizer-worker-num", "2"]),
                        ("workers2_own_app", ["--tp-size", "2", "--tokenizer-worker-num", "2"])):
        app_path = os.environ.get("SGLANG_HTTP_SERVER_APP_PATH")
        if label == "workers2_own_app":
            os.environ["SGLANG_HTTP_SERVER_APP_PATH"] = "my_server:app"
        for name in ("SGLANG_DSV41_ENGRAM_LAYOUT", "SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT"):
            os.environ.pop(name, None)  # one server per process: no earlier choice
        args = sa.prepare_server_args(["--model-path", model_dir, "--device", "cpu", *argv])
        try:
            args.resolve_once()
            args.check_server_args()
            out[label] = "accepted"
        except (ValueError, AssertionError) as e:
            out[label] = f"{type(e).__name__}: {e}"
        if label == "two_nodes":
            out["host_layout"] = os.environ.get("SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT")
        out[label + "_app_path"] = app_path  # as our plugins' load left it
        if app_path is not None:
            os.environ["SGLANG_HTTP_SERVER_APP_PATH"] = app_path
    return out


def case_http_worker() -> None:
    """A tokenizer worker process: what uvicorn does in each worker with SGLang's app path
    (the environment our plugins' main process left), nothing else."""
    from uvicorn.importer import import_from_string

    install_torchvision_shim()
    app = import_from_string(os.environ["SGLANG_HTTP_SERVER_APP_PATH"])
    http = sys.modules["sglang.srt.entrypoints.http_server"]
    from sglang_dsv41.policies.watchdog import StallReport
    from sglang_dsv41.sglang_backend.plugins import INSTALLED
    from sglang_dsv41.sglang_backend.watchdog_hooks import write_stall_report

    # As the worker runs: Starlette builds the middleware stack on the first ASGI call (the
    # lifespan), whose body then calls set_global_state; a stalled rank's /health after that
    app.middleware_stack = app.build_middleware_stack()
    http.set_global_state(http._GlobalState(tokenizer_manager=None, template_manager=None,
                                            scheduler_info={}))
    write_stall_report(os.environ["SGLANG_DSV41_RUN_DIR"],
                       StallReport(rank=5, step=2, op="mlp_sync", waited_s=9.0))
    sent = []

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/health", "headers": [],
             "query_string": b"", "root_path": "", "scheme": "http", "http_version": "1.1",
             "server": ("127.0.0.1", 30000), "client": ("127.0.0.1", 1)}
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    done(installed=sorted(INSTALLED), same_app=app is http.app,
         generate_hooked=hasattr(http.serve_generate_request, "__wrapped__"),
         health=[start["status"], json.loads(body)["error"]["stalled_ranks"]])


def dummy_load(ckpt_dir: str) -> dict:
    from sglang_plugin_dummy_load import dummy_load_case

    return dummy_load_case(ckpt_dir)


def sticky_dispatch() -> dict:
    """SGLang's own DataParallelController schedulers with --dsv41-dp-dispatch routing_key:
    a burst of new keys between two load snapshots, and a PD prefill server."""
    from collections import Counter
    from types import SimpleNamespace

    dpc = import_sglang("sglang.srt.managers.data_parallel_controller")
    sent: list[tuple[int, object]] = []
    real_send = dpc.sock_send
    dpc.sock_send = lambda sock, req: sent.append((sock, req))  # the socket: the rank

    def controller(method, n=4):
        c = dpc.DataParallelController.__new__(dpc.DataParallelController)
        c.load_balance_method, c.dp_budget = method, dpc.DPBudget(n)
        c.workers, c._active_workers, c.status = list(range(n)), list(range(n)), [True] * n
        return c

    def req(i, key, room=None):
        return SimpleNamespace(routed_dp_rank=None, routing_key=key, input_ids=[1] * 8,
                               bootstrap_room=room, rid=f"r{i}")

    os.environ["SGLANG_DSV41_DP_DISPATCH"] = "routing_key"
    try:
        c = controller(dpc.LoadBalanceMethod.TOTAL_REQUESTS)
        c.dp_budget.total_requests = [0, 2, 2, 2]  # the last load snapshot
        for i in range(64):
            c.total_requests_scheduler(req(i, f"session-{i}"))
        burst = sorted(Counter(rank for rank, _ in sent).values())
        again = []
        for i in range(8):  # second turns stay where their key went
            sent.clear()
            c.total_requests_scheduler(req(100 + i, f"session-{i}"))
            again.append(sent[0][0])
        first = [c.__dict__["_dsv41_sticky"].rank_for(f"session-{i}", [0, 1, 2, 3], None)
                 for i in range(8)]
        sent.clear()
        c = controller(dpc.LoadBalanceMethod.FOLLOW_BOOTSTRAP_ROOM)
        for i, room in enumerate((101, 202, 303, 404)):
            c.follow_bootstrap_room_scheduler(req(i, f"traj-{i}", room))
        prefill = [(rank, r.bootstrap_room % 4) for rank, r in sent]
    finally:
        dpc.sock_send = real_send
        del os.environ["SGLANG_DSV41_DP_DISPATCH"]
    return dict(burst=burst, again=again == first, prefill=prefill)


def case_in_process(ckpt_dir: str, run_dir: str, model_dir: str) -> None:
    """Every single-process case after one load_plugins() of all our plugins (one SGLang
    import for all of them: each costs seconds of CPU)."""
    import traceback

    installed = load_plugins()
    cases = [("entry_points", lambda: entry_points(installed)),
             ("dummy_load", lambda: dummy_load(ckpt_dir)),
             ("http", lambda: http(os.path.dirname(run_dir), run_dir)),
             ("r3", lambda: r3(os.path.dirname(run_dir))),
             ("plain_sglang", lambda: plain_sglang(os.path.dirname(run_dir))),
             ("launch", lambda: launch(model_dir)), ("sticky_dispatch", sticky_dispatch),
             ("switches", switches)]
    facts = {}
    for name, run in cases:
        try:
            facts[name] = run()
        except Exception:
            facts[name] = {"error": traceback.format_exc()}
    done(**facts)


if __name__ == "__main__":
    globals()["case_" + sys.argv[1]](*sys.argv[2:])
