"""`python -m sglang_dsv41.plan`: refusals (exit 2), a fitting plan (0), a plan too big (1)."""

import json

from sglang_dsv41.plan.__main__ import main

TWO_NODES = ["--model", "v41-flash", "--nnodes", "2", "--gpus-per-node", "8", "--tp", "8",
             "--dp", "2", "--ep", "16", "--kv-bytes-per-token", "890", "--kv-gib-per-gpu", "8"]


def test_refusals_name_the_rule(capsys):
    assert main(["--nnodes", "2", "--tp", "16"]) == 2
    err = capsys.readouterr().err
    assert "o_groups=8" in err and "attention TP size 16" in err
    assert main(["--tp", "4", "--pp", "2", "--r3"]) == 2
    assert "pp_size=2) with R3" in capsys.readouterr().err
    assert main(["--nnodes", "2", "--tp", "8", "--dp", "2", "--engram-layout", "shared"]) == 2
    assert "/proc/<pid>/fd" in capsys.readouterr().err


def test_two_node_plan_fits_and_reports_r3(capsys):
    assert main(TWO_NODES) == 0
    out = capsys.readouterr().out
    per_rank = -(-((9_651_456 + 256) * 960) // 4096) * 4096
    assert "PLAN FITS" in out and f"R3 host bytes per node: {8 * per_rank:,}" in out
    assert "--tp-size 16 --dp-size 2 --ep-size 16 --enable-dp-attention" in out
    assert main(TWO_NODES + ["--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] is True and plan["r3_host_bytes_per_node"] == 8 * per_rank
    assert plan["engram_layout"] == "private"


def test_plan_too_big_refused_with_reason(capsys):
    assert main(TWO_NODES[:-4] + ["--kv-bytes-per-token", "100", "--host-gib-per-node",
                                  "256"]) == 1
    captured = capsys.readouterr()
    assert "PLAN REFUSED" in captured.out and "largest safe" in captured.err


def test_non_finite_sizes_are_illegal_input(capsys):
    """inf would overflow once turned into bytes (a raw OverflowError, exit 1 'does not fit'),
    nan would fail a comparison with a wrong reason: both exit 2, naming the flag."""
    for flag in ("--kv-gib-per-gpu", "--host-gib-per-node", "--base-gib-per-rank"):
        for value in ("inf", "nan"):
            assert main([flag, value]) == 2, (flag, value)
            err = capsys.readouterr().err
            assert f"{flag} must be a finite number" in err, err


def test_default_kv_prints_both_terms(capsys):
    assert main(TWO_NODES[:-4]) == 0
    out = capsys.readouterr().out
    assert "KV cache: 1,632.5 B/token per GPU (SGLang 0.5.23 DeepSeek-V4 pools: 1632.5 B" in out
    assert "+ 7,293,536,256 B per GPU fixed, scaling with max_running_requests" in out
    assert main(TWO_NODES[:-4] + ["--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv_bytes_per_token"] == 1632.5
    assert plan["requested_max_total_tokens"] == 8_686_336
    assert main(TWO_NODES[:-4] + ["--page-size", "16"]) == 2
    assert "multiple of 128" in capsys.readouterr().err
