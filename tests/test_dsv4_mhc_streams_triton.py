"""The fused mHC stream kernels (mhc_streams_triton, run by the Triton interpreter on CPU) equal
their torch expressions and gradients (mhc.hc_expand_torch through autograd,
mhc.weighted_stream_sum_torch through its hand-written backward). The expressions run in
float64: on an H200 the fp32 torch expression's d comb (a matmul backward over D) was itself
off by more than 1e-5 at D 300, while the kernel stayed within 1e-7 of float64
(bench/results/train_h200.txt, runs L and M)."""

from __future__ import annotations

import os

import pytest
import torch

from sglang_dsv41.model.dsv4 import mhc
from sglang_dsv41.model.dsv4.mhc_streams_triton import hc_expand_fused, weighted_stream_sum_fused

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and
                                not torch.cuda.is_available(),
                                reason="Triton kernels: CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("hc", [2, 4, 8])
@pytest.mark.parametrize("tokens,dim", [(37, 72), (8, 128), (3, 300)])
def test_fused_expand_equals_torch_values_and_gradients(tokens, dim, hc):
    gen = torch.Generator().manual_seed(tokens)
    inputs = [torch.randn(tokens, hc, dim, generator=gen), torch.randn(tokens, dim, generator=gen),
              torch.rand(tokens, hc, generator=gen) * 2, torch.rand(tokens, hc, hc, generator=gen)]
    grad = torch.randn(tokens, hc, dim, generator=gen).to(DEV)
    results = []
    for fn, dtype in ((mhc.hc_expand_torch, torch.float64), (hc_expand_fused, torch.float32)):
        leaves = [t.to(DEV, dtype).requires_grad_(True) for t in inputs]
        out = fn(*leaves)
        out.backward(grad.to(dtype))
        results.append([out.detach()] + [t.grad for t in leaves])
    for name, ref, got in zip(["out", "d streams", "d y", "d post", "d comb"], *results):
        assert got.dtype == torch.float32 and got.shape == ref.shape, name
        torch.testing.assert_close(got, ref.float(), rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("tokens,dim", [(37, 72), (3, 300)])
def test_fused_weighted_sum_equals_torch_values_and_gradients(tokens, dim):
    hc = 4
    gen = torch.Generator().manual_seed(tokens)
    inputs = [torch.randn(tokens, hc, dim, generator=gen), torch.rand(tokens, hc, generator=gen)]
    grad = torch.randn(tokens, dim, generator=gen).to(DEV)
    results = []
    for fn, dtype in ((mhc.weighted_stream_sum_torch, torch.float64),
                      (weighted_stream_sum_fused, torch.float32)):
        leaves = [t.to(DEV, dtype).requires_grad_(True) for t in inputs]
        out = fn(*leaves)
        out.backward(grad.to(dtype))
        results.append([out.detach()] + [t.grad for t in leaves])
    for name, ref, got in zip(["out", "d streams", "d pre"], *results):
        assert got.dtype == torch.float32 and got.shape == ref.shape, name
        torch.testing.assert_close(got, ref.float(), rtol=1e-5, atol=1e-5, msg=name)


def test_fused_takes_zero_tokens_and_refuses_bad_inputs():
    streams, y = torch.zeros(0, 4, 16, device=DEV), torch.zeros(0, 16, device=DEV)
    out = hc_expand_fused(streams, y, torch.zeros(0, 4, device=DEV),
                          torch.zeros(0, 4, 4, device=DEV))
    assert out.shape == (0, 4, 16)
    assert weighted_stream_sum_fused(streams, torch.zeros(0, 4, device=DEV)).shape == (0, 16)
    with pytest.raises(ValueError, match="power of two"):
        weighted_stream_sum_fused(torch.zeros(2, 3, 8), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="power of two"):
        hc_expand_fused(torch.zeros(2, 3, 8), torch.zeros(2, 8), torch.zeros(2, 3),
                        torch.zeros(2, 3, 3))
    with pytest.raises(ValueError, match="dtype"):
        hc_expand_fused(torch.zeros(2, 4, 8), torch.zeros(2, 8, dtype=torch.float64),
                        torch.zeros(2, 4), torch.zeros(2, 4, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("order", ["sublayer", "mix first"])
def test_stream_grad_sum_gives_autograd_sum(order, dtype):
    """A sublayer's three fused uses of its streams (the mix, the collapse, the write-back)
    sharing a StreamGradSum give the streams the gradient autograd's own sum gives, whichever
    use's backward runs first (sublayer: the write-back's; "mix first": the three on separate
    branches made in reverse, so the mix's runs first), and the same again on a retained graph.
    Each later use adds in fp32 before one rounding where autograd rounds twice: in bf16 the
    two differ by up to a few rounding steps of the largest gradient (the uses' terms, larger,
    cancel)."""
    from sglang_dsv41.model.dsv4.hc_mix_triton import hc_mix_fused

    tokens, hc, dim, n_out = 19, 4, 48, 24
    gen = torch.Generator().manual_seed(7)
    streams0 = torch.randn(tokens, hc, dim, generator=gen)
    fn = (torch.randn(n_out, hc * dim, generator=gen) * 0.1).to(DEV)
    pre, post = (torch.rand(tokens, hc, generator=gen).to(DEV) for _ in range(2))
    comb = torch.rand(tokens, hc, hc, generator=gen).to(DEV)
    mix_weight = torch.randn(tokens, n_out, generator=gen).to(DEV)
    out_weight = torch.randn(tokens, hc, dim, generator=gen).to(DEV, dtype)
    y_leaf = torch.randn(tokens, dim, generator=gen).to(DEV, dtype)

    def loss(streams, grad_sum):
        if order == "sublayer":
            mix = hc_mix_fused(streams, fn, 1e-6, grad_sum)
            y = torch.tanh(weighted_stream_sum_fused(streams, pre, grad_sum))
            out = hc_expand_fused(streams, y, post, comb, grad_sum)
            return (out * out_weight).float().sum() + (mix * mix_weight).sum()
        out = hc_expand_fused(streams, y_leaf, post, comb, grad_sum)
        x = weighted_stream_sum_fused(streams, pre, grad_sum)
        mix = hc_mix_fused(streams, fn, 1e-6, grad_sum)
        return ((out * out_weight).float().sum() + x.float().square().sum()
                + (mix * mix_weight).sum())

    grads = {}
    for name, grad_sum in (("autograd", None), ("summed", mhc.StreamGradSum())):
        streams = streams0.to(DEV, dtype, copy=True).requires_grad_(True)
        value = loss(streams, grad_sum)
        if grad_sum is not None:
            assert grad_sum.uses == 3
        value.backward(retain_graph=True)
        grads[name] = streams.grad.clone()
        value.backward()
        torch.testing.assert_close(streams.grad, grads[name] * 2, rtol=0, atol=0, msg=name)
    step = 1e-6 if dtype == torch.float32 else 2 ** -6
    torch.testing.assert_close(grads["summed"], grads["autograd"], rtol=0,
                               atol=step * grads["autograd"].abs().max().item())
    assert grads["summed"].abs().sum() > 0
