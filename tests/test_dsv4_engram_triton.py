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


# A random dot this close to 0 (but over the clamp) is ill-conditioned in any fp32 evaluation:
# the gradient of sqrt(|dot|) is 1/(2 sqrt|dot|), so one rounding in the dot's sum moves it by
# the sum's rounding over |dot|. At |dot| ~ 1e-5 the torch path itself is 2e-2 off float64; such
# draws measure the inputs, not the kernels, so _inputs redraws them.
ILL_CONDITIONED_DOT = 0.05


def _dot(streams, kv, q_weight, k_weight, eps):
    """engram_gate's normalized dot per (token, copy), with no casts."""
    hc, d = streams.shape[-2:]
    key = kv[..., : hc * d].unflatten(-1, (hc, d))
    rstd = torch.rsqrt(streams.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    return (streams * (q_weight * k_weight) * key).sum(-1) * rstd * d**-0.5


def _inputs(t, hc, d, dtype, gen, eps=1e-6):
    streams = torch.randn(t, hc, d, generator=gen).to(dtype)
    kv = torch.randn(t, (hc + 1) * d, generator=gen).to(dtype)
    q = (1 + 0.3 * torch.randn(hc, d, generator=gen)).to(dtype)
    k = (1 + 0.3 * torch.randn(hc, d, generator=gen)).to(dtype)
    if t > 2:  # two tokens whose copy 0 has dot 0 exactly (key 0): under the clamp
        kv[:2, :d] = 0
    while True:  # redraw the streams of every other (token, copy) whose dot is near 0
        dot = _dot(*(x.double() for x in (streams, kv, q, k)), eps).abs()
        redraw = (dot > 0) & (dot < ILL_CONDITIONED_DOT)
        if not redraw.any():
            break
        streams[redraw] = torch.randn(int(redraw.sum()), d, generator=gen).to(dtype)
    return [x.to(DEV) for x in (streams, kv, q, k)]


def _exact(streams, kv, q_weight, k_weight, eps, clamp):
    """engram_gate's formula with no casts (the torch path computes in fp32 whatever it gets):
    in float64 on float64 leaves, the oracle."""
    hc, d = streams.shape[-2:]
    value = kv[..., hc * d:]
    dot = _dot(streams, kv, q_weight, k_weight, eps)
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
    # exceed 4x the torch path's own or a tenth of the bound (a different order of fp32 sums),
    # and stays under the bound, 1e-4 (fp32) / 2e-2 (bf16). _inputs keeps the random dots
    # away from 0, where no fp32 order is accurate.
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
