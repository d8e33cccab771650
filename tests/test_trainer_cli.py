"""python -m trainer_bridge.train refuses bad runs before any server or model: each case is one
`error: ...` line and exit 2 (no traceback), and leaves the run directory as it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from trainer_bridge import train
from trainer_bridge.config import config_snapshot, load_config


@pytest.fixture
def rollouts(tmp_path) -> str:
    """Enough of an offline rollouts file for the checks (8 samples a step)."""
    path = tmp_path / "roll.jsonl"
    path.write_text(json.dumps({"step": 0, "samples": [{}] * 8}) + "\n")
    return str(path)


def run(capsys, out_dir, rollouts, *extra):
    rc = train.main(["--preset", "tiny", "rollout.source=offline",
                     f"rollout.offline_path={rollouts}", f"out_dir={out_dir}", "plots=false",
                     "tensorboard=false", *extra])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return rc, captured.out, captured.err


def fake_checkpoint(out_dir, step, world_size=1, overrides=()):
    d = out_dir / "checkpoints" / f"step-{step:06d}"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"")
    cfg = config_snapshot(load_config("tiny", None, ["rollout.source=offline",
                                                      "rollout.offline_path=x", *overrides]))
    torch.save({"step": step, "world_size": world_size, "config": cfg}, d / "trainer_state.pt")
    (out_dir / "checkpoints" / "latest").write_text(d.name + "\n")
    return d


def test_resume_without_checkpoint_or_rollouts_creates_nothing(tmp_path, capsys, rollouts):
    out = tmp_path / "run"
    rc, _, err = run(capsys, out, rollouts, "--resume")
    assert rc == 2 and err.startswith("error: --resume: no complete checkpoint")
    rc, _, err = run(capsys, out, tmp_path / "missing.jsonl")
    assert rc == 2 and "does not exist" in err
    rc, _, err = run(capsys, out, rollouts, "loss.mini_batches=9")
    assert rc == 2 and "loss.mini_batches=9" in err
    assert not out.exists()


def test_every_rank_gets_a_sample_in_every_mini_batch():
    """One rule for both rollout sources, counting the ranks: 4 engine samples a step give 2
    ranks 2 each, too few for 4 mini-batches (two of them would step without a gradient)."""
    server = ["rollout.source=server", "rollout.server_urls=[http://127.0.0.1:9]",
              "rollout.prompts_per_step=2", "rollout.group_size=2"]
    train.preflight(load_config("tiny", None, [*server, "loss.mini_batches=2"]), 1, 2)
    with pytest.raises(ValueError, match=r"loss.mini_batches=4 x 2 rank\(s\) .* = 4"):
        train.preflight(load_config("tiny", None, [*server, "loss.mini_batches=4"]), 1, 2)


def test_mini_batches_split_a_ranks_share_evenly():
    from trainer_bridge.batch import split_evenly

    # a rank's 5 samples in 4 mini-batches: none empty (a ceil-sized cut gave 2, 2, 1, 0)
    assert split_evenly([0, 2, 4, 6, 8], 4) == [[0], [2], [4], [6, 8]]
    assert split_evenly(list(range(8)), 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_a_previous_run_is_refused_without_resume(tmp_path, capsys, rollouts):
    out = tmp_path / "run"
    fake_checkpoint(out, 2)
    before = sorted(os.listdir(out / "checkpoints"))
    rc, _, err = run(capsys, out, rollouts, "steps=4")
    assert rc == 2 and str(out) in err and "--resume" in err and "another out_dir" in err
    assert sorted(os.listdir(out / "checkpoints")) == before
    metrics_only = tmp_path / "m"
    metrics_only.mkdir()
    (metrics_only / "metrics.jsonl").write_text('{"step": 0}\n')
    rc, _, err = run(capsys, metrics_only, rollouts)
    assert rc == 2 and "metrics.jsonl" in err


def test_a_second_trainer_on_the_same_directory_is_refused(tmp_path, capsys, rollouts):
    out = tmp_path / "run"
    out.mkdir()
    train.lock_run_dir(str(out))           # the first trainer
    try:
        rc, _, err = run(capsys, out, rollouts)
        assert rc == 2 and f"is used by another trainer (pid {os.getpid()})" in err
    finally:
        train.release_lock()
    fake_checkpoint(out, 2)                 # lock released: only the previous run now refuses
    rc, _, err = run(capsys, out, rollouts)
    assert rc == 2 and "holds a previous run" in err


def test_an_unwritable_output_directory_is_refused(tmp_path, capsys, rollouts):
    (tmp_path / "file").write_text("")
    rc, _, err = run(capsys, tmp_path / "file" / "run", rollouts)
    assert rc == 2 and "is not writable" in err and "Not a directory" in err


def test_resume_checks_world_size_config_and_steps_first(tmp_path, capsys, rollouts):
    out = tmp_path / "run"
    fake_checkpoint(out, 4)
    rc, stdout, _ = run(capsys, out, rollouts, "--resume", "steps=4")
    assert rc == 0 and "nothing to train" in stdout and "step 4" in stdout
    rc, _, err = run(capsys, out, rollouts, "--resume", "steps=6", "optim.lr=0.1")
    assert rc == 2 and "optim.lr: 0.005 -> 0.1" in err
    two = tmp_path / "two"
    fake_checkpoint(two, 2, world_size=2)
    rc, _, err = run(capsys, two, rollouts, "--resume", "steps=6")
    assert rc == 2 and "saved by 2 rank(s), this run has 1" in err


def test_a_corrupt_latest_checkpoint_names_the_file_and_the_way_back(tmp_path, capsys, rollouts):
    out = tmp_path / "run"
    older = fake_checkpoint(out, 2)
    newer = fake_checkpoint(out, 4)
    (newer / "trainer_state.pt").write_bytes(b"PK\x03\x04 cut")
    rc, _, err = run(capsys, out, rollouts, "--resume", "steps=6")
    assert rc == 2 and str(newer / "trainer_state.pt") in err
    assert f"--resume-from {older}" in err
    rc, stdout, _ = run(capsys, out, rollouts, "--resume-from", str(older), "steps=2")
    assert rc == 0 and "nothing to train" in stdout and "step-000002" in stdout


def test_saves_killed_midway_are_removed_by_the_next_run(tmp_path, rollouts):
    """A killed save leaves its uniquely named staged directory; the next run removes it
    before it starts (its writer no longer runs), and puts back a step a save killed between
    its two renames had moved aside."""
    out = tmp_path / "run"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    killed = out / "checkpoints" / f".step-000006.tmp-{dead}-k1ll3d"
    killed.mkdir(parents=True)
    (killed / "__0_0.distcp").write_bytes(b"half")
    cfg = load_config("tiny", None, ["rollout.source=offline", f"rollout.offline_path={rollouts}",
                                     f"out_dir={out}"])
    try:
        train.preflight(cfg, 0, 1)
    finally:
        train.release_lock()
    assert not killed.exists() and os.listdir(out / "checkpoints") == []
    # a save killed between its two renames (no atomic exchange): the step is put back
    from trainer_bridge.checkpoint import remove_abandoned_saves

    moved_aside = out / "checkpoints" / f".step-000004.old-{dead}-k1ll3d"
    moved_aside.mkdir()
    (moved_aside / "trainer_state.pt").write_bytes(b"complete")
    assert remove_abandoned_saves(str(out / "checkpoints")) == []
    assert os.listdir(out / "checkpoints") == ["step-000004"]
    assert (out / "checkpoints" / "step-000004" / "trainer_state.pt").read_bytes() == b"complete"
