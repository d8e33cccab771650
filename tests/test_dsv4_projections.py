"""projections.py: linear layers of one input as one GEMM give each layer's output and the
gradients of its weight and of the input that the separate layers give; a layer with a bias is
refused. The shared expert, which runs w1 and w3 that way, equals its plain expression, on
zero tokens too."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sglang_dsv41.model.dsv4.moe import Expert, swiglu
from sglang_dsv41.model.dsv4.projections import linear_packed, linears_of


def test_linears_of_one_input_equal_the_separate_layers_and_their_gradients():
    gen = torch.Generator().manual_seed(0)
    layers = [nn.Linear(24, n, bias=False) for n in (16, 8, 1)]
    for layer in layers:
        layer.weight.data = torch.randn(layer.weight.shape, generator=gen)
    x = torch.randn(3, 5, 24, generator=gen)
    weights = [torch.randn(3, 5, n, generator=gen) for n in (16, 8, 1)]
    grads = []
    for fused in (False, True):
        xi = x.clone().requires_grad_(True)
        for layer in layers:
            layer.weight.grad = None
        outs = linears_of(xi, *layers) if fused else [layer(xi) for layer in layers]
        assert [tuple(o.shape) for o in outs] == [(3, 5, 16), (3, 5, 8), (3, 5, 1)]
        sum((o * w).sum() for o, w in zip(outs, weights)).backward()
        grads.append([*(o.detach() for o in outs), xi.grad,
                      *(layer.weight.grad.clone() for layer in layers)])
    for want, got in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    packed = linear_packed(x, *layers)
    assert torch.equal(packed, torch.cat(linears_of(x, *layers), dim=-1))


def test_a_layer_with_a_bias_is_refused():
    with pytest.raises(ValueError, match="bias-free"):
        linears_of(torch.zeros(2, 4), nn.Linear(4, 3, bias=False), nn.Linear(4, 2))


@pytest.mark.parametrize("tokens", [0, 7])
def test_shared_expert_equals_its_plain_expression(tokens):
    torch.manual_seed(tokens)
    expert = Expert(16, 12, limit=1.5)
    x = torch.randn(tokens, 16) * 3
    want = expert.w2(swiglu(expert.w1(x), expert.w3(x), expert.limit))
    got = expert(x)
    assert got.shape == (tokens, 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
