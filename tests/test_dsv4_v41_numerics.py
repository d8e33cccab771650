"""V4.1 serving numerics, routing scores and mHC pieces against SGLang 0.5.23's own code on CPU.

The fake-FP4 and RoPE paths are SGLang's torch forms. ``mhc_combine``, the Sinkhorn split and the
fused router gate are SGLang's Triton kernels, run under TRITON_INTERPRET=1; in the gate, CUDA's
libdevice exp/log1p/sqrt (absent on a CPU) are numpy's, everything else is the kernel's code.
"""

from __future__ import annotations

import os
import types

import numpy as np
import pytest
import torch

from sglang_cpu import import_sglang
from sglang_dsv41.model.dsv4 import mhc as lead_mhc
from sglang_dsv41.model.dsv4 import v41
from sglang_dsv41.model.dsv4.norm import RMSNorm
from sglang_dsv41.model.dsv4.rope import apply_rope, inv_freq

TRITON = os.environ.get("TRITON_INTERPRET", "0") == "1" or torch.cuda.is_available()
needs_triton = pytest.mark.skipif(not TRITON, reason="Triton needs CUDA or TRITON_INTERPRET=1")


def _awkward(dtype, rows=48, dim=128):
    x = torch.randn(rows, dim) * torch.logspace(-9, 4, rows)[:, None]
    x[0] = 0                                   # an all-zero block
    x[1, :16] = 0
    x[2, :32] = torch.tensor([0.25, 0.75, 1.25, 2.5, 3.5, 5.0, 6.0, 7.0] * 4)  # e2m1 ties
    x[3, :32] *= 1e6                           # a scale past e4m3's range
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quant_matches_sglang(dtype, seed):
    fq = import_sglang("sglang.kernels.ops.quantization.fp4_fake_quant")
    x = _awkward(dtype)
    assert torch.equal(v41.fake_quant_fp4(x), fq.fake_quant_fp4(x))
    assert torch.equal(v41.fake_quant_compressed_kv(x), fq.fake_quant_compressed_kv(x))
    assert not torch.equal(v41.fake_quant_fp4(x), x)
    with pytest.raises(ValueError, match="multiple of 32"):
        v41.fake_quant_fp4(torch.ones(2, 48))


def test_fake_quant_passes_gradients_straight_through():
    x = torch.randn(4, 64, requires_grad=True)
    (v41.fake_quant_fp4(x) * 3).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))


@pytest.mark.parametrize("compressed_kv", [False, True])
def test_rope_then_fake_quant_matches_sglang_rope_fq4(compressed_kv, seed):
    sparse = import_sglang("sglang.srt.layers.attention.dsv4.dsv41_sparse")
    freqs = inv_freq(32, 160000.0, 64, 4.0, 32, 1)
    pos = torch.randint(0, 512, (40,))
    ang = torch.arange(512).float()[:, None] * freqs
    table = torch.complex(ang.cos(), ang.sin())   # our angles as SGLang's complex table
    x = torch.randn(40, 4, 128).to(torch.bfloat16) if not compressed_kv else \
        torch.randn(40, 128).to(torch.bfloat16)
    quant = v41.fake_quant_compressed_kv if compressed_kv else v41.fake_quant_fp4
    ours = quant(apply_rope(x, pos, freqs))
    theirs = sparse._rope_fq4(x, table, 32, compressed_kv=compressed_kv, positions=pos)
    assert torch.equal(ours, theirs)
    assert torch.equal(apply_rope(x, pos, freqs), sparse.rope_tail(x, table[pos], 32))


@needs_triton
def test_log1p_scores_match_sglang_fused_gate(seed):
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    gate = import_sglang("sglang.kernels.ops.moe.moe_fused_gate")

    def numpy_unary(f):
        def op(x, *_, **__):
            with np.errstate(all="ignore"):
                data = f(x.handle.data).astype(x.handle.data.dtype)
            return tl.core.tensor(TensorHandle(data, x.handle.dtype), x.type)
        return op

    saved = gate.libdevice
    if TRITON and not torch.cuda.is_available():
        gate.libdevice = types.SimpleNamespace(exp=numpy_unary(np.exp), log1p=numpy_unary(np.log1p),
                                               sqrt=numpy_unary(np.sqrt))
    try:
        logits = torch.randn(8, 32) * 8
        logits[0, 5] = 25.0                     # the x > 20 branch
        logits[1, 7] = float("nan")             # ranked first
        logits[2] = -40.0                       # tiny positive scores
        bias = torch.randn(32) * 0.1
        w, ids = gate.moe_fused_gate(logits, bias, 4, scoring_func="sqrtsoftplus",
                                     renormalize=True, routed_scaling_factor=1.5,
                                     apply_routed_scaling_factor_on_output=True,
                                     sqrtsoftplus_log1p=True)
    finally:
        gate.libdevice = saved
    scores = v41.sqrtsoftplus_log1p(logits)
    ours = torch.topk(scores + bias, 4, dim=-1).indices
    assert torch.equal(ours.sort(-1).values, ids.long().sort(-1).values)
    assert ours[1, 0] == 7 and ids[1, 0] == 7
    weights = v41.renormalize_topk_weights(scores.gather(1, ids.long())) * 1.5
    torch.testing.assert_close(weights, w, rtol=1e-6, atol=0, equal_nan=True)
    assert w[1, 1:].isfinite().all()            # a NaN sum leaves the row unnormalised


@needs_triton
def test_mhc_combine_matches_sglang_kernel(seed):
    kernels = import_sglang("sglang.kernels.ops.layernorm.mhc")
    streams = torch.randn(7, 4, 40).to(torch.bfloat16)
    pre = torch.rand(7, 4)
    # fp32 out: the interpreter's fp32 -> bf16 store truncates where CUDA rounds to nearest
    want = kernels.mhc_combine(streams.flatten(1), pre, 4, torch.float32)
    assert torch.equal(v41.mhc_combine(streams.float(), pre), want)
    assert torch.equal(v41.mhc_combine(streams, pre), want.to(torch.bfloat16))


@needs_triton
def test_hc_pre_from_prev_dataflow_matches_sglang(monkeypatch, seed):
    """Two sublayers and the final head through SGLang's mHC module (``combine``,
    ``run_attn_post``, the Sinkhorn split's Triton port) against the lead's mHC weights with
    this module's lagged ``pre``."""
    monkeypatch.setenv("SGLANG_OPT_USE_TILELANG_MHC_POST", "0")
    kernels = import_sglang("sglang.kernels.ops.layernorm.mhc")
    mhc = import_sglang("sglang.srt.models.deepseek_v4_mhc")
    monkeypatch.setattr(kernels, "hc_split_sinkhorn", kernels._hc_split_sinkhorn_triton)
    T, hc, D, eps = 6, 4, 32, 1e-6
    cfg = mhc.HcConfig(mult=hc, sinkhorn_iters=20, eps=eps, rms_eps=eps, hidden=D,
                       pre_from_prev=True, cp_prefill=False)
    subs = []
    for _ in range(2):
        norm = RMSNorm(D, eps)
        norm.weight.data = 1 + 0.1 * torch.randn(D)
        subs.append(mhc.HcSubLayer(cfg, torch.randn(24, hc * D) * 0.1, torch.rand(3),
                                   torch.randn(24) * 0.1, norm))
    sublayer = [torch.nn.Linear(D, D), torch.nn.Linear(D, D)]
    streams = torch.randn(T, 1, D).repeat(1, hc, 1)
    state, ours, prev_pre = mhc.HcState(streams), streams, None
    with torch.no_grad():
        for sub, f in zip(subs, sublayer):
            residual = state.residual
            x_theirs = mhc.combine(sub, state)
            state = mhc.run_attn_post(sub, f(x_theirs), residual, stats_stream=None, next=None,
                                      world_size=1)
            x_ours = sub.norm(v41.hc_input_from_prev(ours, prev_pre))
            torch.testing.assert_close(x_ours, x_theirs, rtol=1e-5, atol=1e-5)
            pre, post, comb = lead_mhc.hc_weights(lead_mhc.hc_mix(ours, sub.fn, eps), sub.base,
                                                  sub.scale, hc, 20, eps)
            ours, prev_pre = lead_mhc.hc_expand(ours, f(x_ours), post, comb), pre
        torch.testing.assert_close(ours, state.residual, rtol=1e-5, atol=1e-5)
        head_theirs = kernels.mhc_combine(state.residual.flatten(1), state.pre, hc, ours.dtype)
        torch.testing.assert_close(v41.mhc_combine(ours, prev_pre), head_theirs,
                                   rtol=1e-5, atol=1e-5)
    # the lag is real: collapsing with this sublayer's own pre (V4) gives another input
    own = lead_mhc.hc_weights(lead_mhc.hc_mix(ours, subs[0].fn, eps), subs[0].base,
                              subs[0].scale, hc, 20, eps)[0]
    assert not torch.allclose(v41.mhc_combine(ours, own), v41.mhc_combine(ours, prev_pre))
