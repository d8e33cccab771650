"""bench/train.py runs on CPU with a tiny override and prints its comparison table."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(180)
def test_bench_train_runs_on_cpu():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)  # the interpreted kernel takes minutes; GPUs measure it
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "train.py"), "--preset",
                          "tiny", "--seq", "64", "--steps", "2", "--warmup", "1"],
                         env=env, capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "triton: skipped" in out.stdout
    row = next(line for line in out.stdout.splitlines() if line.startswith("reference"))
    step_ms, tokens_per_s = map(float, row.split()[1:3])
    assert step_ms > 0 and tokens_per_s > 0
