"""The fp8 KV-cache round trip (serving numerics) against SGLang 0.5.23's own store and read.

SGLang's Triton store (``kvcache/triton_store_cache.py``: the ROCm twin of the CUDA
``fused_store_flashmla_cache``, same layout and rule, amax floor 1e-8 instead of 1e-4), its pool
writer for a quantized pack (``dsv4_main_kv_store``) and its Triton read
(``dequant_k_cache.dequantize_k_cache_paged_dsv4``) run under TRITON_INTERPRET=1. One piece is
replaced: the interpreter's fp32 -> e4m3 cast, which rounds half up and drops the carry into an
odd exponent (124.5 becomes 64), by an independent numpy round-to-nearest-even (CUDA's
``cvt.rn.satfinite``; the kernel clamps to +-448 first). SGLang's torch read
(``test/kernels/deepseek_v4/k_cache_reference.py``) checks the buffer too.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from sglang_cpu import import_sglang
from sglang_dsv41.model.dsv4 import kv_numerics as kvn
from sglang_dsv41.model.dsv4.context import DSV4Context
from sglang_dsv41.model.dsv4.model import DSV4ForCausalLM, init_weights
from sglang_dsv41.model.dsv4.presets import get_preset

TRITON = os.environ.get("TRITON_INTERPRET", "0") == "1" or torch.cuda.is_available()
needs_triton = pytest.mark.skipif(not TRITON, reason="Triton needs CUDA or TRITON_INTERPRET=1")
BF16 = torch.bfloat16
PAGE = 4


def _e4m3_values() -> np.ndarray:
    """The 127 non-negative finite e4m3fn values, in code order (decoding is exact)."""
    return torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()


def _e4m3_rne_codes(x: np.ndarray) -> np.ndarray:
    """float32 in [-448, 448] -> e4m3fn bytes, round to nearest even, in float64 on the grid."""
    a = np.abs(x.astype(np.float64))
    _, ex = np.frexp(a)
    step = np.exp2(np.maximum(ex - 1, -6) - 3.0)       # subnormals share the 2^-9 step
    q = np.round(a / step) * step                       # numpy rounds ties to even
    code = np.searchsorted(_e4m3_values(), q).astype(np.uint8)
    return code | (np.signbit(x).astype(np.uint8) << 7)


@pytest.fixture
def rne_interpreter_cast(monkeypatch):
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter._convert_float

    def fixed(data, src, dst, rounding_mode):
        if src == tl.float32 and dst == tl.float8e4nv:
            return _e4m3_rne_codes(data).reshape(data.shape)
        return convert(data, src, dst, rounding_mode)

    if not torch.cuda.is_available():
        monkeypatch.setattr(interpreter, "_convert_float", fixed)


def _awkward_rows() -> torch.Tensor:
    """Rows of 512: spread magnitudes, an all-zero tile, tiles below the 1e-4 floor, exact e4m3
    ties at scale 1 and in the subnormal range, a power-of-two amax, FP4-rounded latents."""
    fq = import_sglang("sglang.kernels.ops.quantization.fp4_fake_quant")
    x = torch.randn(14, 512) * torch.logspace(-3, 3, 14)[:, None]
    x[0, :64] = 0
    x[1, 64:128] = torch.randn(64) * 1e-6               # tile amax below both floors' crossover
    mids = torch.tensor([124.0, 120.0 + 4, 9.5, 10.5, 0.5 * (1 + 1.125), 3 * 2.0 ** -10,
                         5 * 2.0 ** -10, -13.0, -27.0])
    x[2, :64] = 1.0
    x[2, 0] = 448.0                                     # scale exactly 1
    x[2, 1:1 + mids.numel()] = mids
    x[3, 128:192] = torch.linspace(-256, 256, 64)       # amax a power of two
    x[4:8] = fq.fake_quant_compressed_kv(torch.randn(4, 512).to(BF16)).float()
    return x.to(BF16)


def _sglang_buffer(num_pages: int) -> torch.Tensor:
    per_page = -(-PAGE * 584 // 576) * 576
    return torch.zeros(num_pages, per_page, dtype=torch.uint8)


@needs_triton
def test_store_and_read_match_sglang_bitwise(rne_interpreter_cast, seed):
    store = import_sglang("sglang.kernels.ops.kvcache.triton_store_cache")
    pack_store = import_sglang("sglang.kernels.ops.kvcache.dsv4_main_kv_store")
    read = import_sglang("sglang.kernels.ops.attention.dsv4.dequant_k_cache")
    read_ref = import_sglang("sglang.test.kernels.deepseek_v4.k_cache_reference")
    x = _awkward_rows()
    loc = torch.randperm(4 * PAGE)[:x.shape[0]]          # scattered over pages and slots

    theirs = _sglang_buffer(4)
    store.triton_fused_store_flashmla(x, theirs, loc, PAGE)
    rows = kvn.quantize_kv_rows(x, 64, kvn.ROCM_AMAX_FLOOR)
    ours = _sglang_buffer(4)
    pack = pack_store.NopeFp8RopeBf16Pack(rows.nope_fp8.contiguous(), rows.rope_bf16.contiguous(),
                                          rows.nope_scale.contiguous())
    pack_store._set_k_and_s_triton(ours, loc, pack, PAGE)
    assert torch.equal(ours, theirs)                     # every byte of the paged cache

    served = kvn.kv_cache_round_trip(x, 64, kvn.ROCM_AMAX_FLOOR)
    assert torch.equal(read.dequantize_k_cache_paged_dsv4(theirs, loc, PAGE)[:, 0], served)
    assert torch.equal(read_ref.dequantize_k_cache_paged_ref(theirs, loc, PAGE)[:, 0], served)

    # The CUDA floor (1e-4) agrees wherever every tile's amax reaches it, and the FP4-rounded
    # latents are not e4m3 values: SGLang's requantization changes them.
    normal = (x[:, :448].float().abs().unflatten(-1, (7, 64)).amax(-1) >= 1e-4).all(-1)
    assert not normal.all()
    assert torch.equal(kvn.kv_cache_round_trip(x, 64)[normal], served[normal])
    assert not torch.equal(served[4:8], x[4:8])


def test_cuda_amax_floor():
    """store.cuh: scale = ue8m0(max(1e-4, amax) / 448); 1e-4 / 448 = 2^-22.1 -> byte 127 - 22."""
    x = torch.zeros(1, 512)
    x[0, :64] = 3e-7
    x[0, 64:128] = 1.0
    rows = kvn.quantize_kv_rows(x, 64)
    assert rows.nope_scale[0, :2].tolist() == [105, 127 - 8]   # 1 / 448 -> 2^-8
    assert rows.nope_fp8[0, 0].float().item() == 1.25          # 3e-7 * 2^22 = 1.258 -> 1.25
    assert kvn.quantize_kv_rows(x, 64, kvn.ROCM_AMAX_FLOOR).nope_scale[0, 0].item() == 127 - 30


def test_rne_reference_against_torch_cast():
    """The test's numpy cast and torch's (used by kv_numerics) agree on every tie."""
    v = _e4m3_values()
    mids = np.concatenate([(v[:-1] + v[1:]) / 2, v, -(v[:-1] + v[1:]) / 2]).astype(np.float32)
    torch_codes = torch.from_numpy(mids).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(_e4m3_rne_codes(mids), torch_codes)


def test_round_trip_is_idempotent_straight_through_and_validated(seed):
    x = torch.cat([_awkward_rows().float(), torch.randn(6, 512) * 30]).requires_grad_()
    once = kvn.kv_cache_round_trip(x, 64)
    assert once.dtype == torch.float32 and torch.equal(once.to(BF16).float(), once)
    assert torch.equal(kvn.kv_cache_round_trip(once.detach(), 64), once.detach())
    assert not torch.equal(once.detach(), x.detach())
    w = torch.randn_like(x)
    (once * w).sum().backward()
    assert torch.equal(x.grad, w)
    short = torch.randn(5, 32)                          # the tiny presets: 24 nope + 8 rope
    assert torch.equal(kvn.kv_cache_round_trip(short, 8)[:, 24:], short[:, 24:].to(BF16).float())
    with pytest.raises(ValueError, match="RoPE"):
        kvn.quantize_kv_rows(short, 32)
    with pytest.raises(ValueError, match="float"):
        kvn.quantize_kv_rows(torch.ones(2, 512, dtype=torch.int32), 64)


class _Recorder(DSV4Context):
    def attend(self, layer_id, q, kv, sinks, window, scale, comp_kv, comp_idx):
        self.shared.setdefault("recorded", {})[layer_id] = (kv, comp_kv)
        return super().attend(layer_id, q, kv, sinks, window, scale, comp_kv, comp_idx)


@pytest.mark.parametrize("preset, lens, kinds", [("tiny", [24, 16], {1, 2, 4}),
                                                 ("tiny-v4", [136, 20], {4, 128})])
def test_model_attends_to_what_the_cache_returns(preset, lens, kinds, seed):
    """Every layer's window K=V and compressed entries reach the attention core as cache rows
    (fixed points of the round trip; the plain ones are not), the window K=V from the fp32
    norm + RoPE; the V4.1 kinds (ratio 1/2 after their FP4 fake quant) run in "tiny", V4's
    HCA (ratio 128, one entry needs 128 tokens) in "tiny-v4"."""
    cfg = get_preset(preset)
    model = DSV4ForCausalLM(cfg)
    init_weights(model, seed=seed % 1000)
    ids = torch.randint(0, 256, (sum(lens),))
    inputs = {}
    model.layers[0].attn.register_forward_pre_hook(lambda m, a: inputs.__setitem__(0, a[0]))
    rope = cfg.qk_rope_head_dim

    def run(serving):
        ctx = _Recorder.packed(lens, serving_numerics=serving)
        with torch.set_grad_enabled(serving):
            logits = model(ids, ctx)
        return logits, ctx.shared["recorded"]

    plain_logits, plain = run(False)
    logits, served = run(True)
    fixed = lambda t: torch.equal(kvn.kv_cache_round_trip(t.detach(), rope), t.detach())
    seen = set()
    for layer_id, (kv, comp_kv) in served.items():
        assert fixed(kv) and not fixed(plain[layer_id][0]), f"layer {layer_id} window kv"
        if comp_kv is not None and comp_kv.numel():
            seen.add(cfg.compress_ratio(layer_id))
            assert fixed(comp_kv) and not fixed(plain[layer_id][1]), f"layer {layer_id} entries"
    assert seen == kinds
    attn = model.layers[0].attn
    x = inputs[0]
    want = kvn.served_window_kv(attn.wkv(x), attn.kv_norm, DSV4Context.packed(lens).positions,
                                attn.freqs)
    assert torch.equal(served[0][0], want)
    logits.float().square().mean().backward()
    assert attn.wkv.weight.grad is not None and attn.wkv.weight.grad.isfinite().all()
    assert not torch.equal(logits, plain_logits)
