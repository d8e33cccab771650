"""Planner formulas and layout rules against hand-computed cases."""

import pytest

from sglang_dsv41.model.config import get_preset
from sglang_dsv41.plan import (PlanError, PlanInput, engram_host_bytes, engram_table_bytes,
                               kv_bytes_per_token, kv_tokens_for_budget, largest_tokens_within,
                               make_plan, optimizer_host_bytes, pinned_alloc_bytes,
                               r3_buffer_bytes, r3_bytes_per_token, validate_parallel_layout,
                               validate_sglang_layout)

GIB, MIB = 1 << 30, 1 << 20
FLASH, TINY = get_preset("v41-flash"), get_preset("tiny")


def test_r3_bytes():
    assert r3_bytes_per_token(FLASH) == 960  # 40 layers x top-6 x 4 B
    assert r3_bytes_per_token(TINY) == 32  # 4 x 2 x 4
    assert r3_buffer_bytes(FLASH, 1000, 16) == 1016 * 960
    with pytest.raises(ValueError):
        r3_buffer_bytes(FLASH, -1, 16)


def test_kv_bytes_and_tokens():
    assert kv_bytes_per_token(TINY) == 4 * 2 * 4 * 16 * 2  # layers x K,V x heads x dim x bf16
    assert kv_bytes_per_token(TINY, attn_tp_size=2) == 512  # 2 KV heads per rank
    assert kv_bytes_per_token(TINY, attn_tp_size=8) == 256  # fewer heads than ranks: 1, replicated
    assert kv_bytes_per_token(FLASH) == 40 * 2 * 1 * 512 * 2 == 81920
    assert kv_tokens_for_budget(20 * GIB, 81920, 16) == 262144
    assert kv_tokens_for_budget(1000, 10, 16) == 96  # 100 tokens, down to whole pages


def test_pinned_rounding():
    assert pinned_alloc_bytes(11 * GIB) == 16 * GIB
    assert pinned_alloc_bytes(11 * GIB, capped=True) == 11 * GIB
    assert pinned_alloc_bytes(100 * MIB, capped=True) == 128 * MIB  # at or below the cap: rounded
    assert pinned_alloc_bytes(129 * MIB, capped=True, cap_mb=128) == 129 * MIB
    assert pinned_alloc_bytes(8 * GIB) == 8 * GIB
    assert pinned_alloc_bytes(0) == 0 and pinned_alloc_bytes(3) == 4
    with pytest.raises(ValueError):
        pinned_alloc_bytes(-1)


def test_engram_bytes():
    # 384M rows x 256 fp8 values + one fp32 scale per 128 values, two tables (~189 GiB)
    per_table = 384_000_000 * 256 + 384_000_000 * 256 // 128 * 4
    assert per_table == 101_376_000_000
    assert engram_table_bytes(FLASH) == 2 * per_table
    assert 188 * GIB < engram_table_bytes(FLASH) < 189 * GIB
    assert engram_table_bytes(FLASH, "bf16") == 2 * 384_000_000 * 256 * 2
    assert engram_host_bytes(FLASH, "shared", 2, 8) == 2 * per_table
    assert engram_host_bytes(FLASH, "private", 2, 8) == per_table  # 8 of 16 row shards
    assert engram_table_bytes(TINY) == 4096 * 32 + 4096 * 32 // 128 * 4
    with pytest.raises(ValueError):
        engram_host_bytes(FLASH, "numa", 1, 8)


def test_optimizer_bytes():
    assert optimizer_host_bytes(1000, "full") == 18000  # 4 + 4 + 8 + 2 per param
    assert optimizer_host_bytes(1000, "chunked") == 12000
    assert optimizer_host_bytes(1000, "none") == 0
    with pytest.raises(ValueError):
        optimizer_host_bytes(1000, "adamw")


def test_largest_tokens_hand_cases():
    # 1 GiB budget, rounded: the buffer must fit in 2^30 -> 2^30 // 960 - 16 = 1118465 -> page 16
    assert largest_tokens_within(GIB, 960, 16) == 1118464
    # 1.5 GiB budget, capped and exact: 1610612736 // 960 - 16 = 1677705 -> 1677696
    assert largest_tokens_within(3 * GIB // 2, 960, 16, capped=True) == 1677696
    assert largest_tokens_within(3 * GIB // 2, 960, 16, capped=True, max_tokens=1000) == 992
    assert largest_tokens_within(100, 960, 16) == -1


@pytest.mark.parametrize("capped", [False, True])
def test_largest_tokens_matches_a_scan(capped):
    # Sizes straddle a 1 MiB cap, where the cost is not monotone in the token count.
    bpt, page = 100_000, 2
    for budget in range(0, 4 * MIB, 37_000):
        scan = [t for t in range(0, 60, page)
                if pinned_alloc_bytes((t + page) * bpt, capped, 1) <= budget]
        expect = max(scan) if scan else -1
        assert largest_tokens_within(budget, bpt, page, capped, 1) == expect, budget


def test_layout_rules():
    with pytest.raises(PlanError, match="o_groups=8"):
        validate_parallel_layout(FLASH, 16, 1, None, 1, True, 2, 8)
    with pytest.raises(PlanError, match="pp=2 with R3"):
        validate_parallel_layout(FLASH, 4, 1, None, 2, True, 1, 8)
    assert validate_parallel_layout(FLASH, 4, 1, None, 2, False, 1, 8).world_size == 8
    lay = validate_parallel_layout(FLASH, 8, 2, 16, 1, True, 2, 8)
    assert (lay.world_size, lay.sglang_tp_size) == (16, 16)
    assert "--tp-size 16 --dp-size 2 --ep-size 16 --enable-dp-attention" in lay.sglang_flags()
    with pytest.raises(PlanError, match="num_attention_heads=8"):
        validate_parallel_layout(TINY, 3, 1, 3, 1, True, 1, 3)
    with pytest.raises(PlanError, match="must be equal"):
        validate_parallel_layout(FLASH, 8, 1, None, 1, True, 2, 8)
    with pytest.raises(PlanError, match="n_routed_experts=256"):
        validate_parallel_layout(FLASH, 8, 2, 3, 1, True, 2, 8)
    with pytest.raises(PlanError, match="ranks of a pipeline stage"):
        validate_parallel_layout(FLASH, 8, 2, 32, 1, True, 2, 8)
    assert validate_sglang_layout(FLASH, 16, 2, 16, 1, True, 2, 8).tp == 8
    with pytest.raises(PlanError, match="multiple of dp_size"):
        validate_sglang_layout(FLASH, 15, 2, None, 1, True, 2, 8)


def test_two_node_plan_budget():
    res = make_plan(PlanInput(model="v41-flash", nnodes=2, tp=8, dp=2, ep=16,
                              kv_gib_per_gpu=20))
    assert res.requested_max_total_tokens == 262144  # 20 GiB / 81920 B
    assert res.budget.r3_buffers == 8 * (262144 + 16) * 960
    assert res.r3_pinned_bytes_per_rank == 1 << 28  # 240 MiB rounds up to 256 MiB
    assert res.to_dict()["r3_host_bytes_per_node"] == 8 << 28
    assert res.budget.engram == 101_376_000_000 and res.engram_layout == "private"
    assert res.fits and res.largest_safe_max_total_tokens == 262144
    # With the compressed-KV figure R3 reaches SPEC's 160 GiB per node (256 GiB if uncapped).
    capped = make_plan(PlanInput(model="v41-flash", nnodes=2, tp=8, dp=2, ep=16,
                                 kv_bytes_per_token=960, pinned_cap=True))
    assert capped.budget.r3_buffers == 8 * (22369616 + 16) * 960
    assert 159 * GIB < capped.budget.r3_buffers < 161 * GIB
    assert capped.budget.pinned_rounding == 0


def test_optimizer_plan_and_refusals():
    n = get_preset("small-1b").num_parameters()
    res = make_plan(PlanInput(model="small-1b", optimizer="full", kv_gib_per_gpu=1))
    assert res.budget.optimizer == 18 * n
    shard = 2 * -(-n // 8)  # the bf16 pinned copy of one rank's shard
    r3 = (res.requested_max_total_tokens + 16) * 16 * 2 * 4
    rounding = 8 * ((1 << (shard - 1).bit_length()) - shard + (1 << (r3 - 1).bit_length()) - r3)
    assert res.budget.pinned_rounding == rounding
    small = make_plan(PlanInput(model="v41-flash", engram_layout="shared", host_gib_per_node=150))
    assert not small.fits and small.largest_safe_max_total_tokens is None
    assert "nothing fits" in small.reason
    tight = make_plan(PlanInput(model="v41-flash", nnodes=2, tp=8, dp=2, kv_bytes_per_token=960,
                                host_gib_per_node=256, pinned_cap=True))
    assert not tight.fits and "largest safe" in tight.reason
    safe = tight.largest_safe_max_total_tokens
    per_rank = (256 * GIB - tight.budget.engram - tight.budget.base) // 8
    assert safe % 16 == 0 and (safe + 16) * 960 <= per_rank < (safe + 32) * 960
    with pytest.raises(ValueError, match="--optimizer"):
        PlanInput(optimizer="sgd")


def test_plan_from_checkpoint_dir(tmp_path):
    TINY.save_pretrained(str(tmp_path))
    res = make_plan(PlanInput(model=str(tmp_path), gpus_per_node=4, tp=4, kv_gib_per_gpu=0.001))
    assert res.kv_bytes_per_token == 4 * 2 * 1 * 16 * 2  # one of 4 KV heads per rank
    assert res.requested_max_total_tokens == (GIB // 1000) // 256 // 16 * 16
    assert res.layout.ep == 4 and res.fits
    with pytest.raises(PlanError, match="cannot load model config"):
        make_plan(PlanInput(model=str(tmp_path / "missing")))
