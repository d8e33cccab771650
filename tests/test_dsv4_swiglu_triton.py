"""The fused clamped SwiGLU (swiglu_triton, run by the Triton interpreter on CPU) equals
moe.swiglu's torch expression and its autograd gradients, on strided halves of one tensor (the
grouped path's layout) and with values past the clamps."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from sglang_dsv41.model.dsv4.swiglu_triton import swiglu_fused

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and
                                not torch.cuda.is_available(),
                                reason="Triton kernels: CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _torch_swiglu(gate, up, limit):
    # moe.swiglu's CPU expression (on CUDA it dispatches to the fused kernel)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


@pytest.mark.parametrize("rows,inter", [(37, 40), (5, 300)])
def test_fused_equals_torch_values_and_gradients(rows, inter):
    limit = 2.0  # inputs of std 3: many values past the clamps on both sides
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * inter, generator=gen) * 3
    grad = torch.randn(rows, inter, generator=gen).to(DEV)
    results = []
    for fn in (_torch_swiglu, swiglu_fused):
        leaf = gate_up.to(DEV).clone().requires_grad_(True)
        gate, up = leaf.chunk(2, dim=-1)  # strided row views, as in MoE.routed_grouped
        out = fn(gate, up, limit)
        out.backward(grad)
        results.append([out.detach(), leaf.grad])
    for name, ref, got in zip(["out", "d gate|up"], *results):
        assert got.dtype == ref.dtype and got.shape == ref.shape, name
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=name)


def test_fused_takes_empty_rows_and_refuses_mismatched_inputs():
    assert swiglu_fused(torch.zeros(0, 8, device=DEV), torch.zeros(0, 8, device=DEV),
                        10.0).shape == (0, 8)
    with pytest.raises(ValueError, match="must match"):
        swiglu_fused(torch.zeros(2, 8), torch.zeros(2, 4), 10.0)
