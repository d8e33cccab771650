"""ServerArgs: validation, derived layout, and the frozen CLI (as torchtitan's
test_no_new_cli_options): adding, renaming or dropping a flag must be a deliberate edit here."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from sglang_dsv41.launch_server import build_parser, parse_server_args, resolve_backend
from sglang_dsv41.server_args import ServerArgs

FROZEN_CLI = sorted("""
--model-path --backend --host --port --api-key --tp-size --tp --dp-size --dp --ep-size --ep
--enable-dp-attention --no-enable-dp-attention --nnodes --node-rank --load-format --dtype
--device --disable-cuda-graph --no-disable-cuda-graph --max-total-tokens --page-size
--chunked-prefill-size --max-running-requests --context-length --max-new-tokens-limit
--enable-return-routed-experts --no-enable-return-routed-experts --random-seed
--load-balance-method --dist-init-port --log-level
--enable-prefill-padding --no-enable-prefill-padding --enable-idle-batch --no-enable-idle-batch
--stall-timeout --engram-layout --allow-engram-update --no-allow-engram-update
--checkpoint-cache-dir --health-check-timeout --startup-timeout --max-request-bytes
--shutdown-grace
""".split())


def test_no_new_cli_options():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    flags = sorted(s for a in parser._actions for s in a.option_strings if s != "-h"
                   and s != "--help")
    assert flags == FROZEN_CLI, (sorted(set(flags) - set(FROZEN_CLI)),
                                 sorted(set(FROZEN_CLI) - set(flags)))


def test_cli_round_trip_defaults_and_plugin_flags():
    a, unknown = parse_server_args([])
    assert a == ServerArgs() and unknown == []  # argparse defaults are read from the dataclass
    a, _ = parse_server_args(["--model-path", "tiny", "--tp", "4", "--dp", "2",
                           "--enable-dp-attention", "--no-enable-prefill-padding",
                           "--no-enable-idle-batch", "--stall-timeout", "3.5",
                           "--engram-layout", "private", "--load-balance-method",
                           "shortest_queue", "--api-key", "k", "--context-length", "100"])
    assert (a.tp_size, a.dp_size, a.attn_tp_size, a.effective_dp_size) == (4, 2, 2, 2)
    assert not a.enable_prefill_padding and not a.enable_idle_batch
    assert a.stall_timeout == 3.5 and a.resolved_engram_layout == "private"
    assert a.load_balance_method == "shortest_queue" and a.api_key == "k"
    assert [a.rank_to_dp(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [a.dp_leader(d) for d in range(2)] == [0, 2]
    assert ServerArgs(nnodes=2, node_rank=1).resolved_engram_layout == "private"
    assert ServerArgs(tp_size=4).attn_tp_size == 4


@pytest.mark.parametrize("kwargs, needle", [
    ({"dp_size": 2, "tp_size": 2}, "--enable-dp-attention"),
    ({"dp_size": 3, "tp_size": 4, "enable_dp_attention": True}, "multiple of --dp-size"),
    ({"tp_size": 0}, "--tp-size"),
    ({"port": 0}, "--port"),
    ({"backend": "vllm"}, "--backend"),
    ({"load_format": "pt"}, "--load-format"),
    ({"engram_layout": "x"}, "--engram-layout"),
    ({"load_balance_method": "random"}, "--load-balance-method"),
    ({"max_total_tokens": 8}, "--max-total-tokens"),
    ({"context_length": 0}, "--context-length"),
    ({"max_new_tokens_limit": 0}, "--max-new-tokens-limit"),
    ({"api_key": ""}, "--api-key"),
    ({"host": ""}, "--host"),
    ({"model_path": ""}, "--model-path"),
    ({"health_check_timeout": 0}, "--health-check-timeout"),
    ({"max_request_bytes": 0}, "--max-request-bytes"),
    ({"shutdown_grace": -1.0}, "--shutdown-grace"),
    ({"nnodes": 2, "node_rank": 2}, "--node-rank"),
    ({"log_level": "loud"}, "--log-level"),
])
def test_validation_names_the_flag(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ServerArgs(**kwargs)


def test_cli_errors_exit_2_with_reason(capsys):
    with pytest.raises(SystemExit) as e:
        parse_server_args(["--dp-size", "2", "--tp-size", "2"])
    assert e.value.code == 2 and "--enable-dp-attention" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--backend", "nope"])


def test_backend_choice_and_missing_sglang_backend_exits_nonzero():
    assert resolve_backend("embedded") == "embedded"
    try:
        import sglang  # noqa: F401
        has_sglang = True
    except Exception:
        has_sglang = False
    if not has_sglang:
        assert resolve_backend("auto") == "embedded"
        proc = subprocess.run([sys.executable, "-m", "sglang_dsv41.launch_server",
                               "--backend", "sglang", "--port", "1"],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1 and "--backend sglang" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
    # SGLang's own flags pass through to --backend sglang, but not into the embedded engine.
    _, unknown = parse_server_args(["--mem-fraction-static", "0.8"], allow_unknown=True)
    assert unknown == ["--mem-fraction-static", "0.8"]
    proc = subprocess.run([sys.executable, "-m", "sglang_dsv41.launch_server", "--backend",
                           "embedded", "--mem-fraction-static", "0.8"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--mem-fraction-static" in proc.stderr


def test_sglang_backend_leaves_sglangs_flags_to_sglang(monkeypatch):
    """Flags both parsers know (--dp-size, --load-format, --dtype, ...) mean SGLang's thing
    under --backend sglang: the embedded engine's choices and checks refused valid SGLang
    0.5.23 launches (--dp-size 2 without DP attention: replicas there)."""
    from sglang_dsv41 import launch_server

    seen = {}
    monkeypatch.setattr(launch_server, "run_sglang",
                        lambda args, argv: seen.update(args=args, argv=argv) or 0)
    argv = ["--backend", "sglang", "--model-path", "m", "--tp-size", "2", "--dp-size", "2",
            "--load-format", "safetensors", "--dtype", "half", "--stall-timeout", "7",
            "--load-balance-method", "total_requests"]
    assert launch_server.main(argv) == 0
    assert seen["argv"] == argv and seen["args"].stall_timeout == 7
    assert seen["args"].backend == "sglang"


def test_two_servers_cannot_bind_one_port_and_the_store_needs_its_own():
    """bind_socket listens at once: a second server on the port fails there, in a second (with
    SO_REUSEADDR a second bind of a port nobody listened on yet succeeded, and the second
    server loaded its whole engine before uvicorn failed)."""
    from sglang_dsv41.engine.launcher import EngineStartError, host_rendezvous_store
    from sglang_dsv41.launch_server import bind_socket
    from sglang_dsv41.ports import free_port

    port = free_port()
    first = bind_socket("127.0.0.1", port)
    try:
        with pytest.raises(OSError, match=f"cannot bind 127.0.0.1:{port}"):
            bind_socket("127.0.0.1", port)
        with pytest.raises(EngineStartError, match=f"--dist-init-port {port}"):
            host_rendezvous_store(port)
    finally:
        first.close()
    with pytest.raises(ValueError, match="need two ports"):
        ServerArgs(port=port, dist_init_port=port)


def test_checkpoints_the_engine_cannot_serve_are_refused_before_spawning(tmp_path):
    """A release checkpoint's config nests the model under text_config: read flat, every size
    took V4.1-Flash's default and a full-size model was built on random weights, silently; an
    attention TP that does not divide o_groups failed only inside the ranks."""
    import json

    from sglang_dsv41.engine.launcher import launch_engine
    from sglang_dsv41.tools.make_checkpoint import main as make_checkpoint

    release = tmp_path / "release"
    assert make_checkpoint([str(release), "--preset", "tiny", "--layout", "release"]) == 0
    with pytest.raises(ValueError, match="is a release checkpoint .*sglang_dsv41.convert"):
        launch_engine(ServerArgs(model_path=str(release), device="cpu"))
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    with pytest.raises(ValueError, match="lacks .*hidden_size"):
        launch_engine(ServerArgs(model_path=str(flat), device="cpu"))
    with pytest.raises(ValueError, match="attention TP size 4 exceeds o_groups"):
        launch_engine(ServerArgs(model_path="tiny", device="cpu", tp_size=4))
