"""Launcher pieces without spawning: ReadyMsg wait, death reports, model-path checks."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass

import pytest

from sglang_dsv41.engine.dp_controller import DPController
from sglang_dsv41.engine.launcher import (Engine, EngineStartError, _wait_ready,
                                          context_length_for, describe_exit, log_tail,
                                          resolve_model_dir)
from sglang_dsv41.engine.messages import ReadyMsg
from sglang_dsv41.model.dsv4 import get_preset
from sglang_dsv41.server_args import ServerArgs

pytestmark = pytest.mark.timeout(30)
GLOO_ABORT = "\n".join([
    "[dp 1 leader] INFO step 3",
    "terminate called after throwing an instance of 'gloo::EnforceNotMet'",
    "  what():  [enforce fail at ProcessGroupGloo.cpp:4093] Check failed: "
    "outputShape[0] * worldSize == inputShape[0]",
    "Fatal Python error: Aborted",
    "",
    "Current thread 0x00007f (most recent call first):",
    '  File "/x/torch/distributed/distributed_c10d.py", line 4600 in reduce_scatter_tensor',
    ""])


@dataclass
class FakeProcess:  # the launcher reads only exitcode (and is_alive/join on shutdown)
    exitcode: int | None = None


def args4() -> ServerArgs:
    return ServerArgs(tp_size=4, dp_size=2, enable_dp_attention=True, startup_timeout=0.5)


def test_wait_ready_collects_every_rank_or_names_the_failure(tmp_path):
    a, q = args4(), queue.Queue()
    for r in range(4):
        q.put(ReadyMsg(r, a.rank_to_dp(r)[0], True, info={"max_total_tokens": 64}))
    assert _wait_ready(a, [FakeProcess()] * 4, q, str(tmp_path)) == {
        r: {"max_total_tokens": 64} for r in range(4)}
    q.put(ReadyMsg(0, 0, True))
    q.put(ReadyMsg(3, 1, False, error="rank 3: ValueError: bad shard"))
    with pytest.raises(EngineStartError, match=r"rank 3 \(dp_rank 1\).*bad shard"):
        _wait_ready(a, [FakeProcess()] * 4, q, str(tmp_path))
    (tmp_path / "rank2.log").write_text(GLOO_ABORT)
    procs = [FakeProcess(), FakeProcess(), FakeProcess(-6), FakeProcess()]
    with pytest.raises(EngineStartError, match=r"rank 2 died during startup with exit code -6 "
                                               r"\(SIGABRT\).*Check failed"):
        _wait_ready(a, procs, queue.Queue(), str(tmp_path))
    with pytest.raises(EngineStartError, match=r"ranks \[0, 1, 2, 3\] sent no ReadyMsg"):
        _wait_ready(a, [FakeProcess()] * 4, queue.Queue(), str(tmp_path))


def test_log_tail_and_exit_codes(tmp_path):
    path = tmp_path / "r.log"
    path.write_text(GLOO_ABORT)
    tail = log_tail(str(path))
    assert "Check failed: outputShape[0] * worldSize == inputShape[0]" in tail
    assert "INFO step 3" not in tail
    path.write_text("just a line\nanother\n")
    assert log_tail(str(path)) == "just a line | another"
    assert log_tail(str(tmp_path / "missing.log")) == ""
    assert describe_exit(-6) == "exit code -6 (SIGABRT)" and describe_exit(1) == "exit code 1"


def test_monitor_reports_a_dead_rank_once_with_its_last_words(tmp_path):
    a = args4()
    controller = DPController([queue.Queue(), queue.Queue()], queue.Queue(), list(range(4)))
    procs = [FakeProcess() for _ in range(4)]
    engine = Engine(a, "m", get_preset("tiny"), procs, controller, {}, str(tmp_path))
    engine.start_watchers(echo_logs=False)
    try:
        (tmp_path / "rank1.log").write_text(GLOO_ABORT)
        procs[1].exitcode = -6
        deadline = time.monotonic() + 5
        while controller.healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        assert len(controller.failures) == 1
        reason = controller.failures[0]
        assert reason.startswith("dp_rank 0: scheduler rank 1 (attn_tp_rank 1) died with exit "
                                 "code -6 (SIGABRT)") and "Check failed" in reason
    finally:
        engine._stop.set()
        controller.shutdown()


def test_model_path_and_context_length_checks(tmp_path):
    with pytest.raises(ValueError, match="neither a preset"):
        resolve_model_dir(ServerArgs(model_path=str(tmp_path / "nope")))
    get_preset("tiny").save_pretrained(str(tmp_path))
    assert resolve_model_dir(ServerArgs(model_path=str(tmp_path))) == str(tmp_path)
    cfg = get_preset("tiny")
    assert context_length_for(ServerArgs(), cfg) == cfg.max_position_embeddings
    assert context_length_for(ServerArgs(context_length=100), cfg) == 100
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        context_length_for(ServerArgs(context_length=10**6), cfg)
