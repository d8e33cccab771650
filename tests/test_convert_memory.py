"""The converter's peak RSS on the real release layout stays within 2x the largest source shard
(over a baseline process that imported the same modules), while it writes several times that."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from sglang_dsv41.loader.shards import INDEX_FILE
from sglang_dsv41.model.dsv4 import get_preset
from sglang_dsv41.tools.make_checkpoint import make_checkpoint

pytestmark = pytest.mark.timeout(300)

# Every V4.1 layer kind of tiny, wider: FP4 experts, FP8 dense weights and two Engram tables of
# ~400k rows make 10-22 MB release shards. The row counts are the sums of each layer's primes
# from engram_vocab_size (EngramLayout.from_config refuses any other value when the model is
# built).
WIDE = dict(hidden_size=512, moe_intermediate_size=512, engram_vocab_size=100_000,
            engram_num_embeddings=[400114, 400338])

# Both children run this: the same imports, then the converter's main() when given arguments.
# The peak is the child's own VmHWM: ru_maxrss from wait4 would include the RSS the child
# inherited from this (large) pytest process at fork time.
CHILD = """
import sys, torch
from sglang_dsv41 import convert
rc = convert.main(sys.argv[1:]) if len(sys.argv) > 1 else 0
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print("PEAK_KB", hwm.split()[1])
sys.exit(rc)
"""


def _peak_rss(args: list[str], timeout: float = 240) -> int:
    proc = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stdout.split("PEAK_KB")[1].split()[0]) * 1024


def test_peak_rss_is_bounded_by_the_largest_source_shard(tmp_path):
    src, dst = str(tmp_path / "release"), str(tmp_path / "dst")
    make_checkpoint(src, replace(get_preset("tiny"), **WIDE), "release", seed=0, num_shards=4)
    shards = [os.path.join(src, f) for f in os.listdir(src) if f.endswith(".safetensors")]
    largest = max(os.path.getsize(f) for f in shards)
    assert len(shards) == 4 and largest > 16 * 2**20  # shards must dominate the measurement
    base = _peak_rss([])
    peak = _peak_rss([src, dst, "--quiet"])
    extra = peak - base
    print(f"\nlargest source shard {largest / 2**20:.1f} MiB, baseline peak RSS "
          f"{base / 2**20:.1f} MiB, converter peak RSS {peak / 2**20:.1f} MiB, extra "
          f"{extra / 2**20:.1f} MiB")
    assert extra <= 2 * largest
    index = json.load(open(os.path.join(dst, INDEX_FILE)))
    assert index["metadata"]["total_size"] > 3 * largest  # far more than was ever resident
    assert any(".engram.embed." in n for n in index["weight_map"])
