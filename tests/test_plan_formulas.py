"""Planner formulas against hand computations from SGLang 0.5.23's own allocations, and the
Engram table sizes against SGLang's EngramLayout / shard_range run on CPU."""

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from sglang_dsv41.model.dsv4 import get_preset
from sglang_dsv41.plan import (PlanError, PlanInput, engram_host_bytes, engram_table_bytes,
                               make_plan, mmap_bytes, pinned_alloc_bytes, r3_buffer_bytes,
                               r3_bytes_per_token, r3_host_bytes, r3_largest_tokens,
                               validate_parallel_layout)
from sglang_dsv41.plan.memory import (GIB, dsv4_kv_sizing, dsv4_page_bytes, engram_shard_rows,
                                     kv_bytes_per_token, resolve_dsv4_kv_layout)
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
    # SGLang's DeepSeek-V4 page is 256 tokens (model_overrides/deepseek_v4.py:51).
    tokens = 8 * GIB // 890 // 256 * 256
    assert res.requested_max_total_tokens == tokens == 9_651_456
    assert res.kv_fixed_bytes_per_gpu == 0  # a flat figure given: no request-slot pools
    per_rank = -(-((tokens + 256) * 960) // 4096) * 4096
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
    assert mmap_bytes((safe + 256) * 960) <= budget < mmap_bytes((safe + 512) * 960)


# ---- KV pools: SGLang 0.5.23's DSV4PoolConfigurator -------------------------------------------

def test_flash_kv_sizing_by_hand():
    """v41-flash on H200 (v4 layout, page 256), SGLang's defaults (max_running_requests 256,
    chunked prefill 8192, radix cache on), dp 2: hand-computed from pool_configurator.py."""
    s = dsv4_kv_sizing(FLASH, attn_tp_size=8, attn_dp_size=2)
    # v4 entry 584 B, pages padded to 576 B multiples (kv_layout.py:103): a 128-slot ratio-2 page
    # is ceil(128 x 584 / 576) x 576 = 74,880 B = 585 B/slot; 256 slots of ratio 1 the same.
    assert dsv4_page_bytes("v4", 128) == 74_880 and dsv4_page_bytes("v4", 256) == 149_760
    # Only the kv sources own compressed storage: 2, 8, 14 (ratio 2) and 20 (ratio 1); each adds
    # its entry + one fp4 indexer key (64 + 4 scale bytes) per 1/ratio token.
    assert s.per_ratio == ((1, 1, 585 + 68), (2, 3, (585 + 68) / 2))
    assert s.bytes_per_token == kv_bytes_per_token(FLASH, attn_tp_size=8, attn_dp_size=2) \
        == 1632.5
    # 25x less than the old upper bound (40 x 512 x 2 = 40,960).
    assert 40_960 / s.bytes_per_token > 25
    # V4.1 leaves swa_full_tokens_ratio unset: the SWA pool (585 B on each of the 40 layers)
    # is sized from the request cap, per DP replica 256 // 2 = 128 requests:
    # (128 + 128 + 256 + 256) x 128 + 2 x 8192 + 256, + 4 x 128 prefix tails x (128 + 256).
    assert s.swa_mode == "cap" and s.requests_per_worker == 128
    assert s.swa_cap_slots == 768 * 128 + 2 * 8192 + 256 + 512 * 384 == 311_552
    assert s.swa_bytes_per_slot == 585 * 40
    # Ratio-2 pair rings: (129 slots x 2 + 3 rows, even) x 2 x 512 fp32 x 3 source layers.
    assert s.state_fixed_bytes == 262 * 2 * 512 * 4 * 3 == 3_219_456
    assert s.fixed_bytes == 311_552 * 23_400 + 3_219_456
    # 20 GiB: the fixed pools first, then whole pages of 1632.5 B minus the reserved pages.
    tokens = s.max_total_tokens(20 * GIB)
    left = 20 * GIB - s.fixed_bytes
    assert tokens % 256 == 0 and tokens * 1632.5 + s.padding_bytes(tokens) <= left
    assert (tokens + 256) * 1632.5 + s.padding_bytes(tokens + 256) > left
    assert tokens == 8_686_336


def test_kv_sizing_settings():
    base = dsv4_kv_sizing(FLASH)
    assert base.requests_per_worker == 256 and base.layout == "v4"
    # Blackwell + V4.1 + attention tp 1: flashmla_mega, which forces the v41 layout: the SWA
    # entry 528 B in 512-B-aligned pages, the ratio-1/2 caches fp4 (288 B in 256-B pages).
    mega = dsv4_kv_sizing(FLASH, gpu="sm100", attn_tp_size=1)
    assert mega.layout == "v41" and mega.swa_bytes_per_slot == 528 * 40
    assert mega.per_ratio == ((1, 1, 288 + 68), (2, 3, (288 + 68) / 2))
    assert dsv4_kv_sizing(FLASH, gpu="sm100", attn_tp_size=8).layout == "v4"
    assert resolve_dsv4_kv_layout(FLASH, "unset", "sm100", 1) == "v41"
    # SGLANG_DSV4_KV_LAYOUT=auto set explicitly: v41 on any SM100 GPU, attention tp too
    assert resolve_dsv4_kv_layout(FLASH, "auto", "sm100", 8) == "v41"
    assert resolve_dsv4_kv_layout(FLASH, "auto", "sm90", 1) == "v4"
    # An explicit ratio puts the SWA pool back on the per-token side.
    ratio = dsv4_kv_sizing(FLASH, swa_full_tokens_ratio=0.1)
    assert ratio.swa_mode == "ratio" and ratio.swa_fixed_bytes == 0
    assert ratio.bytes_per_token == pytest.approx(1632.5 + 0.1 * 23_400)
    # No radix cache: no prefix tails in the SWA cap.
    assert dsv4_kv_sizing(FLASH, radix_cache=False).swa_cap_slots < base.swa_cap_slots
    with pytest.raises(ValueError, match="multiple of 128"):
        dsv4_kv_sizing(FLASH, page_size=16)
    with pytest.raises(ValueError, match="SM100"):
        dsv4_kv_sizing(FLASH, kv_layout="v41", gpu="sm90")


class _Spec:
    def is_dspark(self):
        return False

    def is_none(self):
        return True

    def is_eagle(self):
        return False


def _sglang_configurator(monkeypatch, cfg, *, gpu, attn_tp, dp, mrr, chunk, ratio, radix):
    """SGLang 0.5.23's own DSV4PoolConfigurator, built on CPU over a stub of the runtime
    context it reads (ServerArgs resolved as SGLang would for these settings)."""
    pc = import_sglang("sglang.srt.model_executor.pool_configurator")
    mp = import_sglang("sglang.srt.mem_cache.deepseek_v4_memory_pool")
    mega = cfg.is_v41 and gpu == "sm100" and attn_tp == 1  # deepseek_v4_hook.py:45-60
    given_ratio = ratio if ratio is not None else (None if cfg.is_v41 else 0.1)
    ns = SimpleNamespace
    exec_ = ns(kernel=ns(dsv4_attn_backend="flashmla_mega" if mega else "flashmla",
                         enable_deepseek_v4_fp4_indexer=False),
               features=ns(enable_encoder_swa_bounded_replay=False))
    schedule = ns(_swa_full_tokens_ratio_explicitly_set=given_ratio is not None,
                  swa_full_tokens_ratio=given_ratio, max_running_requests=mrr,
                  swa_prefix_tails=None, chunked_prefill_size=chunk,
                  disable_overlap_schedule=False)
    spec = ns(speculative_algorithm=None, speculative_num_draft_tokens=None)
    memory = ns(enable_hisparse=False, disable_radix_cache=not radix)
    disagg = ns(disaggregation_mode="null", disaggregation_decode_extra_slots=0)
    for mod in (pc, mp):
        monkeypatch.setattr(mod, "get_exec", lambda: exec_)
        monkeypatch.setattr(mod, "get_spec", lambda: spec)
    monkeypatch.setattr(pc, "get_schedule", lambda: schedule)
    monkeypatch.setattr(pc, "get_memory", lambda: memory)
    monkeypatch.setattr(pc, "get_disagg", lambda: disagg)
    monkeypatch.setattr(pc, "max_speculative_num_draft_tokens", lambda: None)
    monkeypatch.setattr(mp, "DSV41_INDEX_PAGE_SIZE", 128 if gpu == "sm100" else 64)
    if gpu == "sm100":  # select_dsv4_kv_layout asks torch for the device
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
        monkeypatch.setattr(torch.version, "cuda", "12.8")
    model = ns(qk_nope_head_dim=cfg.head_dim - cfg.qk_rope_head_dim,
               qk_rope_head_dim=cfg.qk_rope_head_dim, index_head_dim=cfg.index_head_dim,
               compress_ratios=cfg.compress_ratios, window_size=cfg.window_size,
               context_len=cfg.max_position_embeddings,
               hf_config=ns(kv_source_layer_ids=cfg.kv_source_layer_ids))
    kvc = ns(kv_cache_dtype_str="fp8_e4m3", model_config=model, pp_size=1,
             layer_info=ns(start_layer=0, end_layer=cfg.num_hidden_layers),
             sliding_window_size=cfg.window_size, page_size=256, attn_dp_size=dp,
             spec_algorithm=_Spec(), spec_aux_config=None)
    return pc.DSV4PoolConfigurator(kvc)


@pytest.mark.parametrize("preset,gpu,attn_tp,dp,mrr,chunk,ratio,radix", [
    ("v41-flash", "sm90", 8, 2, 256, 8192, None, True),
    ("v41-flash", "sm90", 8, 1, 64, 8192, None, False),
    ("v41-flash", "sm90", 4, 2, 256, 8192, 0.1, True),
    ("v41-flash", "sm100", 1, 8, 256, 16384, None, True),
    ("small", "sm90", 1, 1, 256, 8192, None, True),
    ("small", "sm100", 1, 1, 32, 16384, None, True),
    ("tiny-v4", "sm90", 1, 1, 256, 8192, None, True),
])
def test_kv_sizing_equals_sglangs_configurator(monkeypatch, preset, gpu, attn_tp, dp, mrr, chunk,
                                                ratio, radix):
    cfg = get_preset(preset)
    ours = dsv4_kv_sizing(cfg, gpu=gpu, attn_tp_size=attn_tp, attn_dp_size=dp,
                          max_running_requests=mrr, chunked_prefill_size=chunk,
                          swa_full_tokens_ratio=ratio, radix_cache=radix)
    sg = _sglang_configurator(monkeypatch, cfg, gpu=gpu, attn_tp=attn_tp, dp=dp, mrr=mrr,
                              chunk=chunk, ratio=ratio, radix=radix)
    assert ours.bytes_per_token == sg.bytes_per_full_token
    assert ours.swa_bytes_per_slot == sg.bytes_per_swa_token
    assert ours.swa_cap_slots == (sg.swa_cap_tokens or 0)
    assert ours.swa_fixed_bytes == sg._get_swa_fixed_bytes()
    reqs = sg._resolve_max_running_requests_per_worker(20 * GIB)
    assert ours.requests_per_worker == reqs
    assert ours.state_fixed_bytes == (sg._get_c128_state_fixed_bytes(reqs)
                                      + sg._get_c2_state_fixed_bytes(reqs))
    for full in (256 * 1000, 256 * 4321):
        assert ours.padding_bytes(full) == sg._get_low_ratio_kv_padding_bytes(full)
    for budget in (20 * GIB, 50 * GIB + 12345, 12 * GIB + 7, 3 * GIB):
        try:
            want = sg.calculate_pool_sizes(budget, 256).max_total_num_tokens
        except RuntimeError:  # the SWA cap alone exceeds the budget ("Not enough memory")
            want = 0
        assert ours.max_total_tokens(budget) == want, budget


def test_default_plan_uses_sglangs_pools_and_r3_binds():
    """The default plan sizes max_total_tokens from SGLang's pools (not 40,960 B/token), so R3
    (960 B per token per rank) becomes the host-memory limit it exists to check."""
    inp = PlanInput(model="v41-flash", nnodes=2, tp=8, dp=2, ep=16)
    res = make_plan(inp)
    s = dsv4_kv_sizing(FLASH, attn_tp_size=8, attn_dp_size=2)
    assert res.kv_bytes_per_token == 1632.5
    assert res.kv_fixed_bytes_per_gpu == math.ceil(s.fixed_bytes) == 7_293_536_256
    assert res.requested_max_total_tokens == s.max_total_tokens(20 * GIB) == 8_686_336
    assert res.kv_bytes_per_token_source.startswith("SGLang 0.5.23 DeepSeek-V4 pools:")
    assert "4 of 40 layers owning them (ratio 1: 1 x 653 B, ratio 2: 3 x 326.5 B)" in \
        res.kv_bytes_per_token_source
    assert "SWA pool 311,552 slots" in res.kv_fixed_bytes_source
    # 8 ranks x (8.69M + 256) x 960 B = 62 GiB of R3 per node: 256 GiB of host memory no longer
    # fits with the private Engram tables (94 GiB) and the base 32 GiB.
    tight = make_plan(replace(inp, host_gib_per_node=160))
    assert not tight.fits and tight.largest_safe_max_total_tokens < 8_686_336
    assert res.fits


@pytest.mark.parametrize("env,gpu,attn_tp", [("auto", "sm100", 8), ("auto", "sm90", 8),
                                             ("v41", "sm100", 8), ("v4", "sm100", 8)])
def test_kv_layout_set_explicitly_is_sglangs_choice(monkeypatch, env, gpu, attn_tp):
    """SGLang's own select_dsv4_kv_layout with SGLANG_DSV4_KV_LAYOUT set (attention tp > 1:
    the flashmla backend, deepseek_v4_hook.py), on a stub of the GPU it asks torch about."""
    mp = import_sglang("sglang.srt.mem_cache.deepseek_v4_memory_pool")
    ns = SimpleNamespace
    monkeypatch.setattr(mp, "get_exec", lambda: ns(kernel=ns(dsv4_attn_backend="flashmla")))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda *a: (10, 0) if gpu == "sm100" else (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", env)
    layout, _ = mp.select_dsv4_kv_layout()
    assert resolve_dsv4_kv_layout(FLASH, env, gpu, attn_tp) == layout.value
