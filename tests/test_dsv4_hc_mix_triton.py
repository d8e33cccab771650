"""The fused mHC mix kernels (hc_mix_triton, run by the Triton interpreter on CPU) equal the plain
expression in float64 under autograd: the mix, d streams, d fn; and the torch path (mhc._HcMix,
its hand-written backward, fp32) within fp32 rounding."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from sglang_dsv41.model.dsv4 import mhc
from sglang_dsv41.model.dsv4 import hc_mix_triton
from sglang_dsv41.model.dsv4.hc_mix_triton import hc_mix_fused

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and
                                not torch.cuda.is_available(),
                                reason="Triton kernels: CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def plain_mix(streams, fn, eps):
    return F.linear(mhc.unweighted_rms_norm(streams.flatten(1), eps), fn)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,hc,dim,n_out", [(37, 4, 72, 24), (8, 2, 128, 8), (65, 4, 40, 4)])
def test_fused_mix_equals_torch_values_and_gradients(tokens, hc, dim, n_out, dtype):
    gen = torch.Generator().manual_seed(tokens)
    streams = (torch.randn(tokens, hc, dim, generator=gen) * 3).to(dtype)
    fn = torch.randn(n_out, hc * dim, generator=gen) * 0.1
    grad = torch.randn(tokens, n_out, generator=gen)
    results = []
    for mix, precision in ((plain_mix, torch.float64), (mhc._HcMix.apply, None),
                           (hc_mix_fused, None)):
        s = streams.to(DEV, precision or dtype).clone().requires_grad_(True)
        f = fn.to(DEV, precision or torch.float32).clone().requires_grad_(True)
        out = mix(s, f, 1e-6)
        out.backward(grad.to(DEV, out.dtype))
        results.append((out.detach(), s.grad, f.grad))
    exact, torch_path, (out, ds, dfn) = results
    assert out.dtype == torch.float32 and ds.dtype == dtype and dfn.dtype == torch.float32
    for ref in (exact, torch_path):
        torch.testing.assert_close(out, ref[0].float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dfn, ref[2].float(), rtol=1e-5, atol=1e-5)
        # d streams is rounded to the streams' dtype, as the torch path rounds it
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2,
                                                                                atol=1e-2)
        torch.testing.assert_close(ds.float(), ref[1].to(dtype).float(), **tol)


def test_fused_mix_takes_zero_tokens_and_refuses_bad_shapes():
    streams = torch.zeros(0, 4, 16, device=DEV, requires_grad=True)
    fn = torch.randn(24, 64, device=DEV, requires_grad=True)
    out = hc_mix_fused(streams, fn, 1e-6)
    assert out.shape == (0, 24)
    out.sum().backward()
    assert streams.grad.shape == (0, 4, 16) and torch.equal(fn.grad, torch.zeros_like(fn))
    with pytest.raises(ValueError, match="n_out, hc x D"):
        hc_mix_fused(torch.zeros(2, 4, 16, device=DEV), torch.zeros(24, 63, device=DEV), 1e-6)


def test_gradients_summed_over_token_spans_are_exact_and_deterministic(monkeypatch):
    """Long inputs split the backward over spans of tokens (d fn's partials added in a fixed
    order): here spans of 32 tokens, 100 tokens -> 3 spans, the last one short. d fn is the same
    bits whether the launch also writes d streams or not, and across runs."""
    tiles = replace(hc_mix_triton.TILES, bwd_tokens=32)
    monkeypatch.setattr(hc_mix_triton, "TILES", tiles)
    spans = hc_mix_triton.bwd_spans
    assert spans(100, tiles) == 3 and spans(31, tiles) == 1
    assert spans(10 ** 9, tiles) == tiles.max_bwd_spans
    gen = torch.Generator().manual_seed(1)
    streams = torch.randn(100, 2, 24, generator=gen)
    fn = torch.randn(8, 48, generator=gen) * 0.1
    grad = torch.randn(100, 8, generator=gen)
    grads = []
    for mix, dtype, with_streams in ((plain_mix, torch.float64, True),
                                     (hc_mix_fused, torch.float32, True),
                                     (hc_mix_fused, torch.float32, False),
                                     (hc_mix_fused, torch.float32, True)):
        s = streams.to(DEV, dtype).clone().requires_grad_(with_streams)
        f = fn.to(DEV, dtype).clone().requires_grad_(True)
        mix(s, f, 1e-6).backward(grad.to(DEV, dtype))
        grads.append((s.grad, f.grad))
    (s64, f64), (s32, f32), (none, f32_alone), (s32_again, f32_again) = grads
    torch.testing.assert_close(f32, f64.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s32, s64.float(), rtol=1e-5, atol=1e-5)
    assert none is None
    assert torch.equal(f32, f32_alone) and torch.equal(f32, f32_again)
    assert torch.equal(s32, s32_again)
