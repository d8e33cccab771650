"""bench/serve.py's decode-time table runs against a real server on CPU (tiny preset)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(240)
def test_bench_serve_decode_table_on_cpu():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "serve.py"),
                          "--decode-only", "--decode-contexts", "48,96", "--decode-tokens", "2"],
                         env=env, capture_output=True, text=True, timeout=230, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    table = lines[next(i for i, line in enumerate(lines) if line.startswith(" context")) + 1:]
    rows = {int(line.split()[0]): float(line.split()[1]) for line in table if line.strip()}
    # a difference of two timings: finite, its sign left to the machine's noise at 2 tokens
    assert set(rows) == {48, 96} and all(map(math.isfinite, rows.values())), out.stdout[-1500:]
    assert "throughput" not in out.stdout  # --decode-only skips the layouts


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, message", [
    (["--decode-contexts", "64,abc"], "a comma list of token counts"),
    (["--decode-contexts", "0"], "each >= 1"),
    (["--decode-tokens", "0"], "--decode-tokens 0: at least 1"),
])
def test_bench_serve_refuses_bad_flags_before_starting_a_server(args, message):
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "serve.py"), *args],
                         env=env, capture_output=True, text=True, timeout=50, cwd=ROOT)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]
