"""The fused mHC weights kernels (hc_weights_triton, run by the Triton interpreter on CPU) equal
mhc._hc_weights and its autograd gradients: values, and the gradients of mix, base and scale."""

from __future__ import annotations

import os

import pytest
import torch

from sglang_dsv41.model.dsv4 import mhc
from sglang_dsv41.model.dsv4.hc_weights_triton import hc_weights_fused

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and
                                not torch.cuda.is_available(),
                                reason="Triton kernels: CUDA or TRITON_INTERPRET=1")


def _inputs(tokens: int, hc: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    n = (2 + hc) * hc
    mix = (torch.randn(tokens, n, generator=gen) * 2).to(dev)
    base = (torch.randn(n, generator=gen) * 0.5).to(dev)
    scale = (torch.rand(3, generator=gen) + 0.5).to(dev)
    grads = [torch.randn(tokens, hc, generator=gen).to(dev),
             torch.randn(tokens, hc, generator=gen).to(dev),
             torch.randn(tokens, hc, hc, generator=gen).to(dev)]
    return mix, base, scale, grads


@pytest.mark.parametrize("tokens,iters", [(37, 20), (5, 1), (64, 3)])
def test_fused_equals_torch_values_and_gradients(tokens, iters):
    hc, eps = 4, 1e-6
    mix, base, scale, grads = _inputs(tokens, hc, seed=tokens)
    results = []
    for fn in (mhc._hc_weights, hc_weights_fused):
        leaves = [t.clone().requires_grad_(True) for t in (mix, base, scale)]
        outs = fn(*leaves, hc, iters, eps)
        sum((o * g).sum() for o, g in zip(outs, grads)).backward()
        results.append([o.detach() for o in outs] + [t.grad for t in leaves])
    names = ["pre", "post", "comb", "d mix", "d base", "d scale"]
    for name, ref, got in zip(names, *results):
        assert got.dtype == torch.float32 and got.shape == ref.shape, name
        torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-6, msg=name)


def test_fused_takes_zero_tokens_and_refuses_bad_shapes():
    mix, base, scale, _ = _inputs(0, 4, seed=0)
    pre, post, comb = hc_weights_fused(mix, base, scale, 4, 20, 1e-6)
    assert pre.shape == (0, 4) and post.shape == (0, 4) and comb.shape == (0, 4, 4)
    with pytest.raises(ValueError, match="power of two"):
        hc_weights_fused(torch.zeros(2, 15), torch.zeros(15), torch.ones(3), 3, 20, 1e-6)
    with pytest.raises(ValueError, match="sinkhorn_iters"):
        hc_weights_fused(torch.zeros(2, 24), torch.zeros(24), torch.ones(3), 4, 0, 1e-6)
