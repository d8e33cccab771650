"""engram_gate's Triton kernels (CUDA; here under TRITON_INTERPRET=1) against its torch
expression: the output and every gradient, fp32 and bf16, a D that is not a multiple of the
column step, padded hc and token blocks, dots on both sides of the clamp, and no tokens."""

import os

import pytest
import torch

from sglang_dsv41.model.dsv4.engram import GATE_CLAMP, engram_gate_torch
from sglang_dsv41.model.dsv4.engram_triton import engram_gate_fused

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") != "1" and not torch.cuda.is_available(),
    reason="Triton needs CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(t, hc, d, dtype, gen):
    streams = torch.randn(t, hc, d, generator=gen).to(dtype)
    kv = torch.randn(t, (hc + 1) * d, generator=gen).to(dtype)
    q = (1 + 0.3 * torch.randn(hc, d, generator=gen)).to(dtype)
    k = (1 + 0.3 * torch.randn(hc, d, generator=gen)).to(dtype)
    if t > 2:  # two tokens whose copy 0 has dot 0 exactly (key 0): under the clamp
        kv[:2, :d] = 0
    return [x.to(DEV) for x in (streams, kv, q, k)]


def _exact(streams, kv, q_weight, k_weight, eps, clamp):
    """engram_gate's formula with no casts (the torch path computes in fp32 whatever it gets):
    in float64 on float64 leaves, the oracle."""
    hc, d = streams.shape[-2:]
    key, value = kv.split([hc * d, d], dim=-1)
    key = key.unflatten(-1, (hc, d))
    rstd = torch.rsqrt(streams.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (streams * (q_weight * k_weight) * key).sum(-1) * rstd * d**-0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(clamp).sqrt(), dot))
    return streams + gate.unsqueeze(-1) * value.unsqueeze(-2)


def _run(fn, leaves, grad, eps):
    leaves = [x.clone().requires_grad_() for x in leaves]
    out = fn(*leaves, eps, GATE_CLAMP)
    out.backward(grad)
    return [out.detach()] + [x.grad for x in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,hc,d", [(13, 4, 80), (5, 3, 48)])
def test_kernels_match_the_torch_expression(seed, dtype, t, hc, d):
    # Both against the expression in float64 on the same inputs: the kernels' error may not
    # exceed 4x the torch path's own or a tenth of the bound (a different order of fp32 sums;
    # near the clamp the signed root's 1/sqrt amplifies either's rounding), and stays under
    # the bound, 1e-4 (fp32) / 2e-2 (bf16).
    gen = torch.Generator().manual_seed(seed)
    leaves = _inputs(t, hc, d, dtype, gen)
    grad = torch.randn(t, hc, d, generator=gen).to(dtype).to(DEV)
    eps = 1e-6
    exact = _run(_exact, [x.double() for x in leaves], grad.double(), eps)
    torch_path = _run(engram_gate_torch, leaves, grad, eps)
    got = _run(engram_gate_fused, leaves, grad, eps)
    bound = 1e-4 if dtype == torch.float32 else 2e-2

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()

    names = ["out", "d streams", "d kv", "d q_weight", "d k_weight"]
    for name, ours, theirs, ref in zip(names, got, torch_path, exact):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, name
        err, own = rel(ours, ref), rel(theirs, ref)
        assert err <= max(4 * own, bound / 10) and err < bound, (name, err, own)


def test_no_tokens_and_refusals():
    streams = torch.zeros(0, 4, 32, device=DEV, requires_grad=True)
    kv = torch.zeros(0, 160, device=DEV, requires_grad=True)
    q = torch.ones(4, 32, device=DEV, requires_grad=True)
    out = engram_gate_fused(streams, kv, q, q.detach(), 1e-6, GATE_CLAMP)
    out.sum().backward()
    assert out.shape == (0, 4, 32) and q.grad.shape == (4, 32) and not q.grad.any()
    with pytest.raises(ValueError, match="does not match streams"):
        engram_gate_fused(torch.zeros(2, 4, 32, device=DEV), torch.zeros(2, 128, device=DEV),
                          q.detach(), q.detach(), 1e-6, GATE_CLAMP)
