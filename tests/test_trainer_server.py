"""The trainer bridge against the real embedded server (tp=2, dp=2, DP attention, R3).

- the Quickstart command learns: mean reward of the last 5 of 16 steps >= first 5 + 0.3;
  with the same weights on both sides (a sync after every step, CPU fp32) the train-inference
  mismatch stays <= 1e-5 and the trainer's own router picks the server's experts everywhere;
- --dry-run passes, and fails with the reason when the server serves other weights;
- a multi-turn episode stays on its DP rank (its second turn hits the prefix cache), with
  two model turns, the server's routing for every position, and matching logprobs;
- the distributed (process-group) weight-sync transport round-trips too.
"""

from __future__ import annotations

import base64
import json
import os
import re
import sys

import httpx
import numpy as np
import pytest
import torch
from jobs import run_job
from safetensors.torch import save

from sglang_dsv41.ports import free_port
from sglang_dsv41.server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SERVER_ARGS = ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention",
               "--enable-return-routed-experts"]


def run(cmd: list[str], timeout: float) -> tuple[int, str]:
    return run_job(cmd, timeout, dict(os.environ, OMP_NUM_THREADS="1"))


def metrics(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_quickstart_learns_with_matching_logprobs(tmp_path):
    out_dir = str(tmp_path / "quickstart")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "-m", "trainer_bridge.train", "--preset", "tiny",
           "--launch-server", f"out_dir={out_dir}"]
    rc, out = run(cmd, timeout=540)
    assert rc == 0, out[-4000:]
    rows = metrics(out_dir)
    assert [r["step"] for r in rows] == list(range(16))
    rewards = [r["reward_mean"] for r in rows]
    first, last = float(np.mean(rewards[:5])), float(np.mean(rewards[-5:]))
    assert last >= first + 0.3, f"reward did not improve: {rewards}"
    worst = max(r["mismatch_abs_logp"] for r in rows)
    assert worst <= 1e-5, f"train-inference mismatch {worst}"
    assert all(r["routing_agreement_min_layer"] == 1.0 for r in rows)  # every routed layer
    assert all(r["weight_sync_s"] > 0 for r in rows)
    for png in ("reward.png", "mismatch.png", "memory.png"):
        assert os.path.getsize(os.path.join(out_dir, png)) > 0
    with open(os.path.join(out_dir, "server.log")) as f:
        port = re.search(r"127\.0\.0\.1:(\d+)", f.read()).group(1)
    with pytest.raises(httpx.TransportError):  # --launch-server stopped it
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("server") / "server.log")
    proc = ServerProcess(["--model-path", "tiny", *SERVER_ARGS], log_path=log, startup_timeout=240)
    yield proc
    proc.stop()


def train_cmd(preset: str, url: str, out_dir: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trainer_bridge.train", "--preset", preset,
            f"rollout.server_urls=[{url}]", f"out_dir={out_dir}", "plots=false",
            "tensorboard=false", *extra]


def test_dry_run_passes_then_catches_stale_server_weights(server, tmp_path):
    rc, out = run(train_cmd("tiny", server.url, str(tmp_path / "ok"), "--dry-run"), 240)
    assert rc == 0 and "dry run: OK" in out, out[-3000:]
    from trainer_bridge.policy import load_policy_model

    head = load_policy_model("tiny").head.weight.detach()
    noisy = head + 0.5 * torch.randn(head.shape, generator=torch.Generator().manual_seed(0))
    body = {"serialized_named_tensors": base64.b64encode(save({"head.weight": noisy})).decode(),
            "flush_cache": True, "weight_version": "perturbed"}
    assert httpx.post(server.url + "/update_weights_from_tensor", json=body,
                      timeout=60).status_code == 200
    rc, out = run(train_cmd("tiny", server.url, str(tmp_path / "bad"), "--dry-run",
                            "weight_sync=false"), 240)
    assert rc == 1 and "train-inference mismatch" in out and "dry run: FAILED" in out, out[-3000:]


def test_multiturn_episodes_stay_on_their_dp_rank(server, tmp_path):
    record = str(tmp_path / "rollouts.jsonl")
    out_dir = str(tmp_path / "multiturn")
    rc, out = run(train_cmd("tiny-multiturn", server.url, out_dir, "steps=1",
                            "rollout.prompts_per_step=2", f"rollout.offline_path={record}"), 240)
    assert rc == 0, out[-3000:]
    (row,) = metrics(out_dir)
    assert row["prefix_cache_hit_ratio"] > 0.2 and row["mismatch_abs_logp"] <= 1e-5
    from trainer_bridge.batch import Sample

    with open(record) as f:
        samples = [Sample.from_json(s) for s in json.loads(f.readline())["samples"]]
    assert len(samples) == 16
    for s in samples:
        mask = "".join(map(str, s.loss_mask))
        assert len([run for run in mask.split("0") if run]) == 2, "expected two model turns"
        assert s.route[0] == server.url and s.route[1] in (0, 1)
        # The second request re-sent the whole prefix; it hit the cache only on the same rank.
        assert s.cached_tokens > 0
        assert s.routed_experts.shape[0] == len(s.tokens) - 1


@pytest.mark.parametrize("one_rank,mini_batches", [("fsdp", 2), ("copies", 1)])
def test_tensor_weight_sync_round_trip(server, tmp_path, one_rank, mini_batches):
    """The HTTP tensor transport (the Quickstart uses the process-group one): after each sync
    the server's logprobs match the trainer's (the dry run's round-trip and mismatch checks),
    Engram checksum unchanged; on one rank with FSDP2 and without (model.one_rank=copies). The
    second on-policy (loss.mini_batches=1: no forward before the update; the mismatch and the
    server's routing checked on the training forward's own logprobs and routing)."""
    out_dir = str(tmp_path / "tensor")
    rc, out = run(train_cmd("tiny", server.url, out_dir, "--dry-run",
                            "weight_sync_transport=tensor", f"model.one_rank={one_rank}",
                            f"loss.mini_batches={mini_batches}"), 240)
    assert rc == 0 and "dry run: OK" in out, out[-3000:]
    rows = metrics(os.path.join(out_dir, "dry_run"))  # a dry run's rows (train.preflight)
    assert rows and all(r["mismatch_abs_logp"] <= 1e-5 and r["weight_sync_s"] > 0 for r in rows)
    assert all(r["weight_resyncs"] == 0 for r in rows)
    assert all(r["routing_agreement_min_layer"] == 1.0 and r["train_tokens"] > 0 for r in rows)


def resync_worker(out_dir: str, queue) -> None:
    """One rank, its own tp=1 server (restarted on the same port): a push refused half-way,
    a restart between two steps, then a restart the re-push does not fix."""
    import traceback

    import sglang_dsv41.server_process as sp
    import trainer_bridge.weight_sync as ws
    from trainer_bridge.config import load_config
    from trainer_bridge.trainer import Trainer, WeightVersionError

    torch.set_num_threads(1)
    port = free_port()
    sp.free_port = lambda: port  # a restarted server comes back on the same URL
    args = ["--model-path", "tiny", "--enable-return-routed-experts"]
    server, res = sp.ServerProcess(args, startup_timeout=240), {}
    try:
        cfg = load_config("tiny", None, [
            f"rollout.server_urls=[{server.url}]", f"out_dir={out_dir}", "plots=false",
            "tensorboard=false", "steps=3", "weight_sync_transport=tensor",
            "rollout.prompts_per_step=1", "rollout.group_size=2", "loss.mini_batches=1"])
        tr = Trainer(cfg)

        def version():
            return httpx.get(server.url + "/get_weight_version").json()["weight_version"]

        tr.sync_weights("step-0")
        # A push whose last float tensor the server refuses (scale check): earlier buckets
        # were applied, so the engine must not claim the new version.
        tr.syncer.bucket_bytes = 1 << 16
        real = ws.pushed_tensors

        def refused_last(state):
            named = real(state)
            i = max(j for j, (_, t) in enumerate(named) if t.is_floating_point())
            named[i] = (named[i][0], named[i][1] * 1e7)
            return named

        ws.pushed_tensors = refused_last
        try:
            tr.sync_weights("step-1")
            res["half"] = "pushed"
        except ws.WeightSyncError as e:
            res["half"] = str(e)
        ws.pushed_tensors = real
        res["after_half"] = version()
        m = tr.train_step(0)  # its rollouts came from the half-pushed engine: re-push, again
        res["resyncs0"], res["after0"] = m["weight_resyncs"], version()
        server.stop()
        server = sp.ServerProcess(args, startup_timeout=240)  # back on its base weights
        res["restarted"] = version()
        m = tr.train_step(1)
        res["resyncs1"], res["after1"] = m["weight_resyncs"], version()
        server.stop()
        server = sp.ServerProcess(args, startup_timeout=240)
        tr.syncer._push = lambda *a: {}  # a re-push that does not reach the engine
        try:
            tr.train_step(2)
            res["stuck"] = "trained"
        except WeightVersionError as e:
            res["stuck"] = str(e)
        tr.close(failed=False)
    except Exception:
        res["error"] = traceback.format_exc()
    finally:
        server.stop()
    queue.put(res)


def test_rollouts_from_other_weights_are_not_trained_on(tmp_path):
    """A push refused half-way leaves the engine labelled '<version>.partial', never the new
    version; rollouts from it, or from an engine restarted on its base weights ('default'),
    are dropped, the weights pushed again and the step collected again (weight_resyncs 1);
    when the re-push does not help, the step fails naming the engine and both versions."""
    from trainer_bridge.dist import run_spawned

    (res,) = run_spawned(resync_worker, [(str(tmp_path / "run"),)], timeout=540)
    assert "error" not in res, res["error"]
    assert res["half"] != "pushed" and res["after_half"] == "step-1.partial", res
    assert res["resyncs0"] == 1 and res["after0"] == "step-1", res
    assert res["restarted"] == "default"
    assert res["resyncs1"] == 1 and res["after1"] == "step-2", res
    assert "serves weight_version 'default', expected 'step-2'" in res["stuck"], res
    assert "not trained on" in res["stuck"]
