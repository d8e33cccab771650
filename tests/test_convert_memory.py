"""The converter in child processes: peak memory stays bounded by the source shard size, and a
conversion killed midway leaves no DST (its staging directory is cleaned on the next run)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from sglang_dsv41.convert import SHARD_DELAY_ENV, convert
from sglang_dsv41.loader.checkpoint import load_model
from sglang_dsv41.loader.shards import INDEX_FILE
from sglang_dsv41.model import DSV41Config, get_preset
from sglang_dsv41.tools.make_checkpoint import make_checkpoint

pytestmark = pytest.mark.timeout(180)

# Tiny in depth but wide, so that each of the 4 release shards holds 15-21 MB (bf16 embeddings
# and FP8 experts); wide embeddings are the cheapest bytes to initialize.
WIDE = dict(vocab_size=16384, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, head_dim=64, o_groups=4, o_lora_rank=128,
            intermediate_size=1024, moe_intermediate_size=384, n_routed_experts=16,
            num_experts_per_tok=2, first_k_dense_replace=1, engram_layers=[1],
            engram_num_rows=8192, engram_dim=64, global_attn_layers=[1, 3])


# Both children run this: the same imports, then the converter's main() when given arguments.
# The peak is the child's own VmHWM: ru_maxrss from wait4 would include the RSS the child
# inherited from this (large) pytest process at fork time.
CHILD = """
import sys, torch, torch._dynamo
from sglang_dsv41 import convert
rc = convert.main(sys.argv[1:]) if len(sys.argv) > 1 else 0
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print("PEAK_KB", hwm.split()[1])
sys.exit(rc)
"""


def _peak_rss(args: list[str], timeout: float = 120) -> int:
    """Run CHILD with ``args`` and return its peak RSS in bytes."""
    proc = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stdout.split("PEAK_KB")[1].split()[0]) * 1024


def test_peak_rss_is_bounded_by_the_source_shard(tmp_path):
    src, dst = str(tmp_path / "release"), str(tmp_path / "dst")
    make_checkpoint(src, DSV41Config(**WIDE), "release", seed=0, num_shards=4)
    shards = [os.path.join(src, f) for f in os.listdir(src) if f.endswith(".safetensors")]
    largest = max(os.path.getsize(f) for f in shards)
    assert len(shards) == 4 and largest > 16 * 2**20  # shards must dominate the measurement
    # Baseline: the same child without the conversion. torch._dynamo is imported by both
    # because building the model on the meta device (the converter's name/shape check) imports
    # it lazily: a fixed ~150 MB of code, independent of the checkpoint.
    base = _peak_rss([])
    peak = _peak_rss([src, dst, "--quiet"])
    extra = peak - base
    print(f"\nlargest source shard {largest / 2**20:.1f} MiB, baseline peak RSS "
          f"{base / 2**20:.1f} MiB, converter peak RSS {peak / 2**20:.1f} MiB, extra "
          f"{extra / 2**20:.1f} MiB")
    assert extra <= 2 * largest
    total = json.load(open(os.path.join(dst, INDEX_FILE)))["metadata"]["total_size"]
    assert total > 4 * largest  # the bf16 output is far larger than what was ever resident


def test_killed_conversion_leaves_no_dst(tmp_path):
    src, dst = str(tmp_path / "release"), str(tmp_path / "dst")
    make_checkpoint(src, get_preset("tiny"), "release", seed=1, num_shards=4)
    env = dict(os.environ, **{SHARD_DELAY_ENV: "60"})
    proc = subprocess.Popen([sys.executable, "-m", "sglang_dsv41.convert", src, dst, "--quiet",
                             "--max-shard-size", "300KB"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, staging = time.monotonic() + 60, None
        while staging is None and time.monotonic() < deadline:
            for entry in os.listdir(tmp_path):
                d = os.path.join(tmp_path, entry)
                if entry.startswith(f".dst.tmp-{proc.pid}-") and any(
                        f.startswith("model-00001-of-") for f in os.listdir(d)):
                    staging = d
            assert proc.poll() is None, "the converter finished before it could be killed"
            time.sleep(0.05)
        assert staging is not None, "no output shard appeared"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not os.path.exists(dst)
    assert os.path.isdir(staging)  # the half-written output exists only under its hidden name
    assert not os.path.exists(os.path.join(staging, INDEX_FILE))
    convert(src, dst, progress=False)  # the next run removes the dead process's staging dir
    assert not os.path.exists(staging)
    assert [e for e in os.listdir(tmp_path) if e.startswith(".")] == []
    load_model(dst)
