"""Our SGLang 0.5.23 plugins running inside the real SGLang modules on CPU.

Each case installs the plugins through SGLang's own ``load_plugins()`` (entry-point group
``sglang.srt.plugins``) in a fresh process: HookRegistry patches cannot be undone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save_file

from sglang_dsv41.ports import free_port
from sglang_dsv41.sglang_backend.http_workers import PLUGIN_APP

HERE = os.path.dirname(os.path.abspath(__file__))
ALL_PLUGINS = ["engram_dummy_load", "engram_layout", "layout_guards", "generate_dp_rank_header",
               "stall_watchdog", "hash_r3_rows", "engram_update_guard", "routing_key_dispatch"]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SGLANG_DSV41_", "SGLANG_PLUGINS"))}
    env.update(extra)
    return env


def start_case(*args, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.join(HERE, "sglang_plugin_cases.py"),
                             *map(str, args)], env=_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish_case(proc: subprocess.Popen, timeout: float = 150) -> tuple[dict, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # the case dumps its threads' stacks (faulthandler)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        else:
            proc.kill()
        raise AssertionError(f"case timed out after {timeout} s; its stderr, ending with every "
                             f"thread's stack:\n{err[-12000:]}")
    lines = [ln for ln in out.splitlines() if ln.startswith("OK ")]
    assert proc.returncode == 0 and lines, f"case failed ({proc.returncode}):\n{err[-4000:]}"
    return json.loads(lines[-1][3:]), err


def run_case(*args, timeout: float = 150, **env) -> tuple[dict, str]:
    return finish_case(start_case(*args, **env), timeout)


@pytest.fixture(scope="module")
def in_process(tmp_path_factory):
    """Every single-process case in one fresh process (see sglang_plugin_cases.case_in_process);
    -> (facts per case, the process's stderr, the checkpoint's tensors)."""
    tmp = tmp_path_factory.mktemp("sglang_plugins")
    tensors = write_checkpoint(tmp / "ckpt", seed=int.from_bytes(os.urandom(4), "little"))
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v41",
        "text_config": {"o_groups": 8}}))
    facts, err = run_case("in_process", tmp / "ckpt", tmp / "run", model, timeout=240)
    return facts, err, tensors


def case_facts(in_process, name: str) -> dict:
    facts = in_process[0][name]
    assert "error" not in facts, facts.get("error")
    return facts


def test_sglang_loads_every_plugin_through_its_entry_point(in_process):
    facts = {**case_facts(in_process, "entry_points"), **case_facts(in_process, "switches")}
    assert sorted(facts["installed"]) == sorted(ALL_PLUGINS)
    assert facts["wrapped"] == {"DummyModelLoader.load_model": True,
                                "loader.initialize_dummy_weights": True,
                                "serve_generate_request": True,
                                "WeightUpdater.update_weights_from_tensor": True}
    assert sorted(facts["allow_list"]) == ["layout_guards", "stall_watchdog"]  # SGLANG_PLUGINS
    assert facts["disabled"] == ["stall_watchdog"]  # SGLANG_DSV41_DISABLED_PLUGINS


LAYERS = [{"id": 0, "rows": 100, "bounds": [0, 30, 60, 100]},   # 3 hash columns: row split
          {"id": 1, "rows": 90, "bounds": [0, 20, 45, 70, 90]}]  # 4 columns: 2 per rank
DIM, VOCAB, TOPK = 64, 50, 2


def write_checkpoint(path, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in LAYERS:
        n, prefix = layer["rows"], f"layers.{layer['id']}"
        tensors[f"{prefix}.engram.embed.weight"] = torch.randint(
            0, 255, (n, DIM), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
        tensors[f"{prefix}.engram.embed.scale"] = torch.randint(
            100, 140, (n, DIM // 32), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
        tensors[f"{prefix}.ffn.gate.tid2eid"] = torch.randint(
            0, 16, (VOCAB, TOPK), dtype=torch.int32, generator=g)
        tensors[f"{prefix}.attn.wkv.weight"] = torch.ones(4, 4)  # not frozen: never read
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model-00001.safetensors"))
    json.dump({"layers": LAYERS, "dim": DIM, "vocab": VOCAB, "topk": TOPK},
              open(os.path.join(path, "layout.json"), "w"))
    os.makedirs(os.path.join(path, "no_tables"))
    save_file({"layers.0.attn.wkv.weight": torch.ones(4, 4)},
              os.path.join(path, "no_tables", "model-00001.safetensors"))
    return tensors


def test_dummy_load_fills_real_engram_modules_with_each_ranks_rows(in_process):
    """SGLang's DummyModelLoader.load_model end to end; the case compares each EngramEmbedding's
    bytes with its rows of the checkpoint file and each HashTopK's tid2eid with the file's."""
    facts = case_facts(in_process, "dummy_load")
    rows = {"0": [[0, 50], [0, 45]], "1": [[50, 50], [45, 45]]}  # EngramEmbedding's own split
    for rank in ("0", "1"):
        assert facts[rank]["rows"] == rows[rank]
        # only this rank's rows are read from the file: host peak one shard, not one table
        assert sorted(facts[rank]["reads"]) == sorted(
            [[f"layers.{layer['id']}.engram.embed.{part}", lo, lo + n]
             for layer, (lo, n) in zip(LAYERS, rows[rank]) for part in ("scale", "weight")])
        assert facts[rank]["finished"] == ["model.layers.0.engram.embed",
                                           "model.layers.1.engram.embed"]
        # SGLang's dummy fill ran on the dense weights and left the tables alone
        assert facts[rank]["dummy_fill_ran"] is True
        assert facts[rank]["tables_kept_by_fill"] is True
        # tid2eid is SGLang's HashTopK parameter, loaded through its weight-loader path
        assert facts[rank]["tid2eid_in"] == ["HashTopK"]
        assert facts[rank]["tid2eid_equal"] == [True, True]
    assert facts["stray_shard_ignored"] is True  # the index decides which shards are read
    assert "lacks 6 frozen tensor(s)" in facts["missing"]
    assert "model.layers.0.engram.embed" in facts["missing"]
    assert "model.layers.0.mlp.topk.tid2eid" in facts["missing"]


def test_watchdog_names_the_waiting_rank_over_a_gloo_group(tmp_path):
    port, run_dir = free_port(), tmp_path / "run"
    env = dict(SGLANG_DSV41_STALL_TIMEOUT="0.5", SGLANG_DSV41_RUN_DIR=str(run_dir))
    procs = [start_case("mlp_sync", r, port, 3.0, **env) for r in (0, 1)]
    report, deadline = None, 120
    t0 = time.monotonic()
    while report is None and time.monotonic() - t0 < deadline and procs[0].poll() is None:
        path = run_dir / "stall-rank0.json"
        if path.exists():
            report = json.loads(path.read_text())
        time.sleep(0.1)
    results = [finish_case(p)[0] for p in procs]
    assert report is not None, "rank 0 waited 3 s in the MLP sync without a stall report"
    assert report["rank"] == 0 and report["op"] == "mlp_sync" and report["step"] == 1
    assert "rank 0 stuck in collective 'mlp_sync'" in report["message"]
    for r in results:
        # SGLang's own gather, through our hook: rank 0 idle in step 0, all idle in step 1
        assert r["counts"] == [[0, 3], [0, 0]] and r["steps"] == {"mlp_sync": 2}
        assert r["report_left"] is False  # the gather finished: the rank is healthy again
    assert not (run_dir / "stall-rank1.json").exists()  # the late rank never waited


def test_generate_pins_through_sglangs_request_path(in_process):
    """SGLang's HTTP app, TokenizerManager, DataParallelController and DetokenizerManager; what
    reached the (stand-in) GPU scheduler is the real TokenizedGenerateReqInput."""
    facts = case_facts(in_process, "http")
    assert facts["scheduler_errors"] == []
    prompt = [3, 4, 5]  # "hello world again" through the WordLevel tokenizer, echoed back
    # (DP worker socket, routed_dp_rank, routing_key, input_ids) at the scheduler
    assert facts["header"]["reached"] == [[1, 1, None, prompt]]
    assert facts["body_agrees"]["reached"] == [[1, 1, None, prompt]]
    assert facts["alias_agrees"]["reached"] == [[1, 1, None, prompt]]  # data_parallel_rank
    for label in ("header", "body_agrees", "alias_agrees"):
        assert facts[label]["status"] == 200 and facts[label]["dp_rank"] == 1
        assert facts[label]["text"] == "hello world again"
    for label in ("none", "empty_header"):  # no pin: SGLang's round robin decides
        assert facts[label]["status"] == 200
        assert [r[1] for r in facts[label]["reached"]] == [None]
    for label, message in (("conflict", "conflicting DP ranks"),
                           ("alias_conflict", "conflicting DP ranks"),
                           ("out_of_range", "valid ranks are [0, 2)"),
                           ("not_int", "must be an integer")):
        assert facts[label]["status"] == 400 and message in facts[label]["error"], facts[label]
        assert facts[label]["reached"] == []  # refused before the scheduler


def test_routing_key_sticks_to_one_dp_rank_in_sglangs_dp_controller(in_process):
    facts = case_facts(in_process, "http")
    worker_of = {}
    for worker, routed, key in facts["sticky"]:
        assert worker == routed  # the controller sent it to the rank it was pinned to
        assert worker_of.setdefault(key, worker) == worker, (key, facts["sticky"])
    assert sorted(worker_of.values()) == [0, 0, 1, 1]  # 4 new keys spread over 2 ranks
    assert facts["sticky_pinned"][0][:2] == [1, 1]  # an explicit pin beats the key's rank


def test_health_answers_503_naming_the_stalled_rank(in_process):
    facts = case_facts(in_process, "http")
    status, body = facts["health"]
    assert status == 503 and body["error"]["stalled_ranks"] == [{"rank": 3, "dp_replica": None}]
    assert "rank 3 stuck in collective 'mlp_sync' at step 7" in body["error"]["message"]
    assert facts["health_generate"] == 503


def test_weight_updates_naming_an_engram_table_get_400(in_process):
    facts = case_facts(in_process, "http")
    # from distributed: the scheduler is reached (it receives the broadcast, so the sender is
    # not left in a collective), SGLang's model-runner WeightUpdater refuses before loading any
    status, message, reached = facts["engram_distributed"]
    assert status == 400 and "frozen Engram table" in message, facts["engram_distributed"]
    assert reached == ["UpdateWeightsFromDistributedReqInput"]
    assert facts["engram_distributed_nothing_loaded"] is True
    assert facts["dense_distributed"][0] == 200 and facts["dense_distributed_loaded"] is True
    # from tensor: refused by SGLang's model-runner WeightUpdater, before any tensor is loaded
    for label in ("engram_tensor", "engram_bucket"):  # (name, tensor) pairs; flattened bucket
        status, message = facts[label]
        assert status == 400 and "frozen Engram table" in message, facts[label]
    assert facts["engram_table_untouched"] is True
    assert facts["dense_tensor"][0] == 200 and facts["dense_loaded"] is True
    # from IPC: the bucket naming the table refused before the model loads it, the earlier
    # bucket loaded (the message says so); the model's own loader back in place afterwards
    ok, message = facts["engram_ipc"]
    assert not ok and "frozen Engram table" in message and "buckets before" in message
    assert facts["engram_ipc_loaded"] == [5.0, 0.0]
    assert facts["dense_ipc"][0] is True and facts["dense_ipc_loaded"] == 6.0, facts["dense_ipc"]
    assert facts["loader_restored"] is True


def test_r3_rows_of_hash_layers_come_from_tid2eid(in_process):
    facts = case_facts(in_process, "r3")
    # the rows SGLang's HashTopK.forward routed to, captured by our AFTER hook
    assert facts == {"installed": True, "rows_equal": True, "rows_are_routed": True,
                     "were_zero": True, "draft_untouched": True}


def test_launch_refuses_bad_layouts_before_starting_anything(in_process):
    facts, err = case_facts(in_process, "launch"), in_process[1]
    assert facts["codes"] == {"tp16": 1, "shared_2_nodes": 1, "pp_r3": 1}
    assert facts["children"] == 0
    assert "attention TP size 16 exceeds o_groups=8" in err and "--attn-dp-size 2" in err
    assert "Engram layout 'shared'" in err and "per_rank" in err
    assert "pipeline parallelism (pp_size=2) with R3" in err


def test_plain_sglang_launch_server_gets_the_guards_through_check_server_args(in_process):
    facts = case_facts(in_process, "plain_sglang")
    assert facts["hooked"] is True
    assert facts["tp16"].startswith("DeploymentRefused: attention TP size 16 exceeds o_groups=2")
    assert facts["two_nodes"] == "accepted"  # attention TP 2 = o_groups, per_rank layout
    assert facts["host_layout"] == "per_rank"  # SGLang's own switch, picked by node count
    # SGLang's own validation ran (not stubbed): its refusal comes before our hooks
    assert facts["sglang_refuses"].startswith("AssertionError: tp_size must be divisible")
    # --tokenizer-worker-num 2: the worker processes import our app (plugins loaded) ...
    assert facts["workers2"] == "accepted"
    assert facts["workers2_app_path"] == PLUGIN_APP
    # ... and a deployment's own app path with several workers is refused before launch
    assert facts["workers2_own_app"].startswith(
        "DeploymentRefused: --tokenizer-worker-num 2 with "
        "SGLANG_HTTP_SERVER_APP_PATH=my_server:app")


def test_routing_key_dispatch_counts_its_placements_and_leaves_pd_prefill_alone(in_process):
    """A burst of 64 new keys between two load snapshots (last: [0, 2, 2, 2]) spreads as
    SGLang's own dispatch would (every key went to rank 0 and stayed pinned there), second turns
    keep their rank; a PD prefill server keeps bootstrap_room % dp (its KV transfer failed)."""
    facts = case_facts(in_process, "sticky_dispatch")
    assert facts["burst"] == [15, 16, 16, 17], facts
    assert facts["again"] is True
    assert all(rank == want for rank, want in facts["prefill"]), facts["prefill"]


def test_tokenizer_worker_processes_load_the_plugins(tmp_path):
    """SGLang imports the app path in each tokenizer worker process without load_plugins();
    ours loads them (and it is SGLang's own app object)."""
    facts, _ = run_case("http_worker", SGLANG_HTTP_SERVER_APP_PATH=PLUGIN_APP,
                        SGLANG_DSV41_RUN_DIR=str(tmp_path))
    # its /health names a stalled rank too: the middleware is in before the worker serves
    # (added from set_global_state, in the lifespan, Starlette refused it)
    assert facts == {"installed": sorted(ALL_PLUGINS), "same_app": True,
                     "generate_hooked": True,
                     "health": [503, [{"rank": 5, "dp_replica": None}]]}


def test_a_stall_report_made_as_its_step_ends_is_not_left_behind(tmp_path, monkeypatch):
    """The watchdog's check and the report's write are two moments; a step that ends between
    them withdrew nothing, and its report, written after, kept /health 503 for good."""
    from sglang_dsv41.sglang_backend import watchdog_hooks as wh

    monkeypatch.setenv("SGLANG_DSV41_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("SGLANG_DSV41_STALL_TIMEOUT", "0.2")
    write, writing = wh.write_stall_report, []

    def slow_write(*args, **kwargs):  # the step ends while the report is being made
        writing.append(True)
        time.sleep(0.4)
        return write(*args, **kwargs)

    monkeypatch.setattr(wh, "write_stall_report", slow_write)
    guard = wh.RankGuard()
    with guard.guard("run_batch"):
        deadline = time.monotonic() + 10
        while not writing:
            assert time.monotonic() < deadline, "no stall report was made"
            time.sleep(0.01)
    with guard.guard("run_batch"):  # a later, healthy step
        pass
    assert wh.read_stall_reports(str(tmp_path)) == [] and wh.stall_response(str(tmp_path)) is None
    guard.watchdog.close()


def test_stall_reports_of_dp_replicas_are_kept_apart(tmp_path):
    """SGLang's DP replicas (--dp-size without DP attention) each number their ranks from 0:
    replica 1's rank 0 neither overwrites nor withdraws replica 0's report."""
    from sglang_dsv41.policies.watchdog import StallReport
    from sglang_dsv41.sglang_backend import watchdog_hooks as wh

    for replica in (0, 1):
        wh.write_stall_report(str(tmp_path), StallReport(0, 4, "mlp_sync", 3.0), replica)
    _, body = wh.stall_response(str(tmp_path))  # both: told apart by their replicas
    assert body["error"]["stalled_ranks"] == [{"rank": 0, "dp_replica": 0},
                                              {"rank": 0, "dp_replica": 1}]
    wh.clear_stall_report(str(tmp_path), 0, 1)  # replica 1's rank 0 recovered
    status, body = wh.stall_response(str(tmp_path))
    assert status == 503 and body["error"]["message"].startswith(
        "unhealthy: DP replica 0: rank 0 stuck in collective 'mlp_sync' at step 4"), body
    assert body["error"]["stalled_ranks"] == [{"rank": 0, "dp_replica": 0}]


def test_a_new_server_clears_an_earlier_servers_stall_reports(tmp_path, monkeypatch):
    """--dsv41-run-dir given again: the server's first process (no SERVER_PID inherited)
    clears the reports an earlier server left (its /health answered 503 for a rank of the old
    server for good); its children, which inherit SERVER_PID, clear nothing."""
    from sglang_dsv41.policies.watchdog import StallReport
    from sglang_dsv41.sglang_backend import entry
    from sglang_dsv41.sglang_backend import watchdog_hooks as wh

    wh.write_stall_report(str(tmp_path), StallReport(3, 812, "mlp_sync", 75.0))
    monkeypatch.setattr(entry, "_install", lambda name: None)  # no SGLang hooks here
    monkeypatch.setenv("SGLANG_DSV41_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("SGLANG_DSV41_SERVER_PID", "1")  # a child of a running server
    entry.stall_watchdog()
    assert wh.stall_response(str(tmp_path)) is not None
    monkeypatch.delenv("SGLANG_DSV41_SERVER_PID")  # a new server's first process
    entry.stall_watchdog()
    assert wh.stall_response(str(tmp_path)) is None


def test_health_names_a_stall_under_a_fastapi_root_path(tmp_path):
    """SGLang's --fastapi-root-path: uvicorn puts the root path in front of the request path,
    and the stall-aware /health answered 200 with a stall report there."""
    import asyncio

    from sglang_dsv41.policies.watchdog import StallReport
    from sglang_dsv41.sglang_backend.watchdog_hooks import StallAwareHealth, write_stall_report

    write_stall_report(str(tmp_path), StallReport(2, 9, "mlp_sync", 70.0))

    async def routes(scope, receive, send):  # SGLang's app answering /health itself: 200
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    def status(root: str, path: str) -> int:
        sent = []

        async def receive():
            return {"type": "http.request", "body": b""}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "GET", "path": root + path, "root_path": root,
                 "headers": [], "query_string": b""}
        asyncio.run(StallAwareHealth(routes, str(tmp_path))(scope, receive, send))
        return sent[0]["status"]

    assert status("", "/health") == status("/sglang", "/health") == 503
    assert status("/sglang", "/generate") == 200
