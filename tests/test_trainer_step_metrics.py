"""A step's logged metrics mean the same whatever loss.mini_batches cuts the batch into (one
process, gloo, offline rollouts, a learning rate too small to move the weights)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.timeout(180)


def metrics_worker(tmp: str, queue) -> None:
    import torch

    from trainer_bridge.batch import Sample
    from trainer_bridge.config import load_config
    from trainer_bridge.dist import close_distributed
    from trainer_bridge.trainer import Trainer

    try:
        torch.set_num_threads(1)
        g = torch.Generator().manual_seed(0)
        batch = []
        for i in range(8):
            n = 10 + i
            toks = torch.randint(1, 256, (n,), generator=g).tolist()
            batch.append(Sample(toks, [0] * 4 + [1] * (n - 4), [0.0] * 4 + [-3.0] * (n - 4),
                                float(i % 3), i // 4))
        out = {}
        # the same 8 samples as one mini-batch, and twice over as two identical ones
        for name, samples, minis in (("one", batch, 1), ("two", batch + batch, 2)):
            with open(f"{tmp}/{name}.jsonl", "w") as f:
                f.write(json.dumps({"step": 0, "samples": [s.to_json() for s in samples]}))
            cfg = load_config("tiny", None, [
                "model.device=cpu", "model.r3=false", "model.check_routing=false",
                "loss.kl_coef=0", f"loss.mini_batches={minis}", "rollout.source=offline",
                f"rollout.offline_path={tmp}/{name}.jsonl", "optim.lr=1e-30",
                "optim.sink_lr=1e-30", "plots=false", "tensorboard=false",
                f"out_dir={tmp}/{name}", "steps=1"])
            trainer = Trainer(cfg)
            out[name] = trainer.train_step(0)
            trainer.telemetry.close(plots=False)
        close_distributed()
        queue.put(out)
    except Exception:
        import traceback

        queue.put({"error": traceback.format_exc()})


def test_the_loss_metric_is_a_mean_over_the_steps_mini_batches(tmp_path):
    from trainer_bridge.dist import run_spawned

    [res] = run_spawned(metrics_worker, [(str(tmp_path),)], timeout=150)
    assert "error" not in res, res["error"]
    one, two = res["one"], res["two"]
    for key in ("loss", "pg_mean", "tis_mean", "clip_frac"):
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-9), key  # loss was 2x
