"""Planner formulas against hand computations from SGLang 0.5.23's own allocations, and the
Engram table sizes against SGLang's EngramLayout / shard_range run on CPU."""

import pytest

from sglang_dsv41.model.dsv4 import get_preset
from sglang_dsv41.plan import (PlanError, PlanInput, engram_host_bytes, engram_table_bytes,
                               make_plan, mmap_bytes, pinned_alloc_bytes, r3_buffer_bytes,
                               r3_bytes_per_token, r3_host_bytes, r3_largest_tokens,
                               validate_parallel_layout)
from sglang_dsv41.plan.memory import GIB, engram_shard_rows
from sglang_dsv41.plan.shapes import count_parameters, text_tensor_specs
from tests.sglang_cpu import import_sglang

FLASH = get_preset("v41-flash")


def test_r3_host_bytes_as_sglang_allocates():
    # state_capturer/routed_experts.py:72-73: [tokens, num_hidden_layers, num_experts_per_tok]
    # int32 -> 40 x 6 x 4 = 960 B per token.
    assert r3_bytes_per_token(FLASH) == 960
    # kv_index_translator.py:268: max_token_pool_size + page_size rows.
    assert r3_buffer_bytes(FLASH, 1_000_000, 64) == 1_000_064 * 960
    # mmap_allocator.py:191: ceil(n / 4096) x 4096, no power of two: 960,061,440 B is already a
    # whole number of 4 KiB pages; 1001 + 16 tokens is not.
    assert r3_host_bytes(FLASH, 1_000_000, 64) == 960_061_440
    assert r3_host_bytes(FLASH, 1001, 16) == -(-(1017 * 960) // 4096) * 4096 == 978_944
    assert r3_host_bytes(FLASH, 1001, 16, "2MB") == 2 << 20
    # 11 GiB of R3 is 11 GiB in SGLang; only torch's pinned allocator would make it 16.
    assert mmap_bytes(11 * GIB) == 11 * GIB and pinned_alloc_bytes(11 * GIB) == 16 * GIB
    with pytest.raises(ValueError, match="max_total_tokens"):
        r3_buffer_bytes(FLASH, -1, 16)


def test_r3_largest_tokens_is_exact_inverse():
    for budget in (GIB, 3 * GIB // 2 + 12345, 10**6):
        t = r3_largest_tokens(budget, 960, 16)
        assert t % 16 == 0 and mmap_bytes((t + 16) * 960) <= budget
        assert mmap_bytes((t + 32) * 960) > budget
    assert r3_largest_tokens(4096, 960, 16) == -1
    assert r3_largest_tokens(GIB, 960, 16, max_tokens=1000) == 992


def test_flash_engram_tables_are_sglangs_primes():
    engram = import_sglang("sglang.srt.layers.engram")
    layout = engram.EngramLayout.from_config(FLASH)
    # Each table's rows are the sum of its 24 primes (engram.py:207-215, 970).
    assert [layout.column_bounds(i)[-1] for i in range(2)] == FLASH.engram_num_embeddings
    # 264 B per row (256 fp8 + 8 e8m0): 2 x ~384M rows = ~189 GiB.
    assert engram_table_bytes(FLASH) == (384006168 + 384016682) * 264 == 202_758_032_400
    assert 188 * GIB < engram_table_bytes(FLASH) < 189 * GIB


@pytest.mark.parametrize("tp_size", [16, 8, 5])
def test_engram_per_rank_rows_match_sglang_shard_range(tp_size):
    engram = import_sglang("sglang.srt.layers.engram")
    layout = engram.EngramLayout.from_config(FLASH)
    bounds = [layout.column_bounds(i) for i in range(2)]
    for r in range(tp_size):
        want = sum(engram.shard_range(n, bounds[t], r, tp_size)[1]
                   - engram.shard_range(n, bounds[t], r, tp_size)[0]
                   for t, n in enumerate(FLASH.engram_num_embeddings))
        assert engram_host_bytes(FLASH, "private", tp_size, range(r, r + 1), bounds) == \
            want * 264
    if 24 % tp_size:  # uneven column count: the equal split needs no bounds
        lo, hi = engram.shard_range(384006168, bounds[0], 3, tp_size)
        assert engram_shard_rows(384006168, 24, 3, tp_size) == (lo, hi)


def test_engram_host_bytes_shared_per_node_private_per_rank():
    total = engram_table_bytes(FLASH)
    assert engram_host_bytes(FLASH, "shared", 16, range(0, 8)) == total
    # 16 ranks, 24 columns: the equal-row split; one node holds half of each table's rows.
    half = (384006168 * 8 // 16 + 384016682 * 8 // 16) * 264
    assert engram_host_bytes(FLASH, "private", 16, range(0, 8)) == half
    with pytest.raises(ValueError, match="engram layout"):
        engram_host_bytes(FLASH, "numa", 16, range(8))


def test_flash_parameter_count():
    # Text backbone without Engram tables: the published 552B backbone minus the vision tower
    # (0.485B): the public inventory gives 551,880,835,184; we count 16,512 (3e-8) fewer,
    # unexplained (a small tensor the inventory files under the backbone). Exact count pinned.
    n = count_parameters(FLASH)
    assert n == 551_880_818_672 and abs(n - 551_880_835_184) < 1e-7 * n
    specs = text_tensor_specs(FLASH)
    assert specs["layers.0.ffn.experts.0.w1.weight"][0] == [2304, 5120]
    assert specs["layers.2.attn.wq_b.weight"][0] == [32768, 1280]
    assert specs["layers.1.engram.wkv.weight"][0] == [25600, 6144]
    assert "layers.3.attn.compressor.wkv.weight" not in specs  # reuses layer 2's compressor
    assert "layers.20.attn.compressor.wgate.weight" not in specs  # ratio 1: no gate


def test_layout_refusals_name_the_rule():
    with pytest.raises(PlanError, match="o_groups=8"):
        validate_parallel_layout(FLASH, 16, 1, None, 1, True, 2, 8)
    with pytest.raises(PlanError, match=r"pp_size=2\) with R3"):
        validate_parallel_layout(FLASH, 4, 1, None, 2, True, 1, 8)
    with pytest.raises(PlanError, match="shared"):
        make_plan(PlanInput(nnodes=2, tp=8, dp=2, engram_layout="shared"))
    with pytest.raises(PlanError, match="n_routed_experts=384"):
        validate_parallel_layout(FLASH, 8, 2, 5, 1, True, 2, 8)


def test_two_node_plan_budget_by_hand():
    res = make_plan(PlanInput(model="v41-flash", nnodes=2, tp=8, dp=2, ep=16,
                              kv_bytes_per_token=890, kv_gib_per_gpu=8))
    tokens = 8 * GIB // 890 // 16 * 16
    assert res.requested_max_total_tokens == tokens == 9_651_600
    per_rank = -(-((tokens + 16) * 960) // 4096) * 4096
    assert res.r3_pinned_bytes_per_rank == per_rank
    assert res.budget.r3_buffers == 8 * per_rank and res.budget.pinned_rounding == 0
    assert res.engram_layout == "private"
    assert res.budget.engram == (384006168 // 2 + 384016682 // 2) * 264
    assert res.fits and res.largest_safe_max_total_tokens == tokens
    tight = make_plan(PlanInput(model="v41-flash", nnodes=2, tp=8, dp=2, ep=16,
                                kv_bytes_per_token=100, host_gib_per_node=256))
    assert not tight.fits and "largest safe" in tight.reason
    safe = tight.largest_safe_max_total_tokens
    budget = (256 * GIB - tight.budget.engram - tight.budget.base) // 8
    assert mmap_bytes((safe + 16) * 960) <= budget < mmap_bytes((safe + 32) * 960)


def test_default_kv_size_is_the_formula_it_prints():
    """One K=V latent head per layer (K and V are one tensor, stored once), replicated over
    attention TP: layers x kv_heads x head_dim x dtype bytes, the same at every TP size, and
    the printed formula says exactly that (no factor 2, no per-rank split)."""
    for tp in (8, 4):
        res = make_plan(PlanInput(model="v41-flash", nnodes=2, tp=tp, dp=16 // tp, ep=16))
        want = FLASH.num_hidden_layers * FLASH.num_key_value_heads * FLASH.head_dim * 2
        assert res.kv_bytes_per_token == want == 40 * 1 * 512 * 2
        assert "layers x kv_heads x head_dim x 2 B" in res.kv_bytes_per_token_source
        assert "2 x" not in res.kv_bytes_per_token_source
        assert "per_rank" not in res.kv_bytes_per_token_source
