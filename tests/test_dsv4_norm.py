"""RMSNorm's hand-written backward (model/dsv4/norm.py) equals autograd's of the plain
expression, and its forward the plain expression bit for bit."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv41.model.dsv4.norm import RMSNorm


def _plain(x, weight, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)


@pytest.mark.parametrize("shape, dtype, wdtype", [
    ((37, 64), torch.float64, torch.float64),
    ((5, 3, 48), torch.float32, torch.float32),
    ((9, 32), torch.bfloat16, torch.float32),
    ((9, 32), torch.bfloat16, torch.bfloat16),  # FSDP hands the weight over in bf16
])
def test_rms_norm_matches_autograd(shape, dtype, wdtype):
    gen = torch.Generator().manual_seed(0)
    x0 = (torch.randn(shape, generator=gen) * 3).to(dtype)
    w0 = (torch.rand(shape[-1], generator=gen) + 0.5).to(wdtype)
    grad = torch.randn(shape, generator=gen).to(dtype)
    norm = RMSNorm(shape[-1], 1e-6).to(wdtype)
    with torch.no_grad():
        norm.weight.copy_(w0)
    x = x0.clone().requires_grad_(True)
    out = norm(x)
    out.backward(grad)
    dx, dw = x.grad, norm.weight.grad
    assert torch.equal(x.detach(), x0)  # the backward must not write into the saved input
    x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    ref = _plain(x, w, 1e-6)
    ref.backward(grad)
    ref_dx, ref_dw = x.grad, w.grad
    assert torch.equal(out.detach(), ref.detach())
    # both compute in fp32 (x.float()), whatever x's dtype
    tol = {torch.float64: 1e-5, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    assert dx.dtype == x0.dtype and dw.dtype == w0.dtype
    torch.testing.assert_close(dx, ref_dx, rtol=tol, atol=tol)
    torch.testing.assert_close(dw, ref_dw, rtol=tol, atol=tol * shape[0])



@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's fused RMSNorm backward is CUDA-only")
@pytest.mark.parametrize("dtype, wdtype", [(torch.float32, torch.float32),
                                           (torch.bfloat16, torch.float32),
                                           (torch.bfloat16, torch.bfloat16)])
def test_rms_norm_cuda_fused_matches_plain(dtype, wdtype):
    """On CUDA the norm runs torch's fused kernels: the plain expression's values up to fp32
    rounding of the row statistics, and autograd's gradients."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x0 = (torch.randn(300, 1024, generator=gen, device="cuda") * 3).to(dtype)
    w0 = (torch.rand(1024, generator=gen, device="cuda") + 0.5).to(wdtype)
    grad = torch.randn(300, 1024, generator=gen, device="cuda").to(dtype)
    norm = RMSNorm(1024, 1e-6).to("cuda", wdtype)
    with torch.no_grad():
        norm.weight.copy_(w0)
    x = x0.clone().requires_grad_(True)
    out = norm(x)
    out.backward(grad)
    xr, wr = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    ref = _plain(xr, wr, 1e-6)
    ref.backward(grad)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    assert x.grad.dtype == dtype and norm.weight.grad.dtype == wdtype
    torch.testing.assert_close(x.grad, xr.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(norm.weight.grad, wr.grad, rtol=tol, atol=tol * 300)

