"""The routed experts' fused clamped SwiGLU (swiglu_triton, run by the Triton interpreter on CPU)
against the torch expression (moe.swiglu) in float64 under autograd: the output and the
gradient of gate|up, with values past the clamp limits and exactly at them, fp32 and bf16,
widths that are not a power of two, empty rows; and the MoE's dispatch (the torch path on CPU)."""

from __future__ import annotations

import os

import pytest
import torch

from sglang_dsv41.model.dsv4 import moe
from sglang_dsv41.model.dsv4.swiglu_triton import swiglu_packed_triton

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and
                                not torch.cuda.is_available(),
                                reason="Triton kernels: CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
LIMIT = 10.0


def reference(gate_up: torch.Tensor) -> torch.Tensor:
    return moe.swiglu(*gate_up.chunk(2, dim=-1), LIMIT)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("rows,inter", [(37, 40), (5, 512), (64, 24)])
def test_fused_swiglu_equals_float64(rows, inter, dtype, tol):
    gen = torch.Generator().manual_seed(rows + inter)
    gu = torch.randn(rows, 2 * inter, generator=gen) * 8  # many values past +-LIMIT
    gu[0, :4] = torch.tensor([LIMIT, -LIMIT, LIMIT + 1, -LIMIT - 1])  # gate at/past the limit
    gu[0, inter:inter + 4] = torch.tensor([LIMIT, -LIMIT, LIMIT + 1, -LIMIT - 1])  # up too
    gu = gu.to(dtype)  # both from the same values: rounding moves some across the limits
    grad = torch.randn(rows, inter, generator=gen)
    outs = []
    for fn, precision in ((reference, torch.float64), (swiglu_packed_triton, dtype)):
        x = gu.to(DEV, precision).requires_grad_(True)
        y = fn(x, LIMIT) if fn is swiglu_packed_triton else fn(x)
        y.backward(grad.to(DEV, y.dtype))
        assert y.dtype == precision and x.grad.dtype == precision
        outs.append((y.detach().double().cpu(), x.grad.double().cpu()))
    (y64, g64), (y, g) = outs
    for name, got, want in (("out", y, y64), ("d gate_up", g, g64)):
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol}"
    # the clamps' gradient masks, bounds included (torch's clamp backward)
    assert g[0, 0] != 0 and g[0, 2] == 0  # gate = limit passes, gate > limit does not
    assert g[0, inter] != 0 and g[0, inter + 1] != 0  # up = +-limit passes
    assert g[0, inter + 2] == 0 and g[0, inter + 3] == 0  # |up| > limit does not


def test_fused_swiglu_empty_and_refusals():
    x = torch.zeros(0, 32, device=DEV, requires_grad=True)
    y = swiglu_packed_triton(x, LIMIT)
    y.sum().backward()
    assert y.shape == (0, 16) and x.grad.shape == (0, 32)
    with pytest.raises(ValueError, match=r"\[rows, 2I\]"):
        swiglu_packed_triton(torch.zeros(4, 7, device=DEV), LIMIT)


def test_moe_dispatch_keeps_the_torch_path_on_cpu():
    gu = torch.randn(6, 16)
    assert torch.equal(moe.swiglu_packed(gu, LIMIT), reference(gu))
