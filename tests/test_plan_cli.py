"""`python -m sglang_dsv41.plan` in subprocesses: refusals, a fitting plan, a plan too big."""

import json
import subprocess
import sys

import pytest

from sglang_dsv41.plan.__main__ import main

TWO_NODES = ["--model", "v41-flash", "--nnodes", "2", "--gpus-per-node", "8", "--tp", "8",
             "--dp", "2", "--ep", "16", "--kv-gib-per-gpu", "20"]
CASES = {
    "tp16": ["--model", "v41-flash", "--nnodes", "2", "--tp", "16"],
    "pp2_r3": ["--model", "v41-flash", "--tp", "4", "--pp", "2", "--r3"],
    "fits_json": TWO_NODES + ["--json"],
    "too_big": TWO_NODES + ["--kv-bytes-per-token", "960", "--host-gib-per-node", "256"],
}


@pytest.fixture(scope="module")
def runs():
    # Started together: each run spends most of its time importing torch.
    procs = {name: subprocess.Popen([sys.executable, "-m", "sglang_dsv41.plan", *args],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, args in CASES.items()}
    out = {}
    try:
        for name, p in procs.items():
            stdout, stderr = p.communicate(timeout=60)
            out[name] = (p.returncode, stdout, stderr)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def test_tp16_refused_naming_o_groups(runs):
    rc, _, err = runs["tp16"]
    assert rc == 2 and "o_groups=8" in err and "tp=16" in err


def test_pp2_with_r3_refused(runs):
    rc, _, err = runs["pp2_r3"]
    assert rc == 2 and "pp=2" in err and "R3" in err


def test_two_node_plan_fits_and_reports_r3(runs, capsys):
    assert main(TWO_NODES) == 0
    out = capsys.readouterr().out
    assert "PLAN FITS" in out
    # 8 processes x (262144 + 16) tokens x 960 B, each pinned as 256 MiB
    assert f"R3 host bytes per node: {8 << 28:,}" in out
    assert "--tp-size 16 --dp-size 2 --ep-size 16 --enable-dp-attention" in out
    rc, out, _ = runs["fits_json"]
    plan = json.loads(out)
    assert rc == 0 and plan["fits"] is True
    assert plan["r3_host_bytes_per_node"] == 8 << 28
    assert plan["budget"]["r3_buffers"] == 8 * (262144 + 16) * 960
    assert plan["largest_safe_max_total_tokens"] == 262144


def test_plan_too_big_refused_with_reason(runs):
    rc, out, err = runs["too_big"]
    assert rc == 1 and "PLAN REFUSED" in out
    assert "plan refused" in err and "largest safe" in err and "256.0 GiB is available" in err
