"""The fused RMSNorm kernels (norm_triton, run by the Triton interpreter on CPU) equal
norm.RMSNorm's torch expression and its autograd gradients of x and the weight."""

from __future__ import annotations

import os

import pytest
import torch

from sglang_dsv41.model.dsv4.norm_triton import rms_norm_fused

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and
                                not torch.cuda.is_available(),
                                reason="Triton kernels: CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _torch_rms_norm(x, weight, eps):
    # norm.RMSNorm's CPU expression (on CUDA it dispatches to the fused kernel)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)


@pytest.mark.parametrize("shape", [(37, 64), (5, 3, 48), (9, 1000)])
def test_fused_equals_torch_values_and_gradients(shape):
    eps = 1e-6
    gen = torch.Generator().manual_seed(shape[-1])
    inputs = [torch.randn(*shape, generator=gen) * 3, 1 + torch.randn(shape[-1], generator=gen)]
    grad = torch.randn(*shape, generator=gen).to(DEV)
    results = []
    for fn in (_torch_rms_norm, rms_norm_fused):
        leaves = [t.to(DEV).clone().requires_grad_(True) for t in inputs]
        out = fn(*leaves, eps)
        out.backward(grad)
        results.append([out.detach()] + [t.grad for t in leaves])
    for name, ref, got in zip(["out", "d x", "d weight"], *results):
        assert got.dtype == ref.dtype and got.shape == ref.shape, name
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=name)


def test_fused_takes_zero_rows_and_refuses_a_mismatched_weight():
    assert rms_norm_fused(torch.zeros(0, 8, device=DEV), torch.ones(8, device=DEV),
                          1e-6).shape == (0, 8)
    with pytest.raises(ValueError, match="last-dim"):
        rms_norm_fused(torch.zeros(2, 8), torch.ones(4), 1e-6)

