"""The grouped-GEMM MoE (tokens sorted by expert) equals the per-expert loop: outputs and every
gradient, fp32 and bf16, with the router, with R3 replay, on hash-routed layers, with experts
that get no token, and on an expert-parallel slice of the experts."""

from __future__ import annotations

import copy

import pytest
import torch

from sglang_dsv41.model.dsv4 import get_preset
from sglang_dsv41.model.dsv4.context import DSV4Context
from sglang_dsv41.model.dsv4.model import DSV4ForCausalLM, init_weights
from sglang_dsv41.model.dsv4.moe import MoE
from sglang_dsv41.model.dsv4.names import per_expert_state

T = 40


class SlicedExperts(DSV4Context):
    """An expert-parallel rank computing experts [lo, hi) only."""

    lo, hi = 2, 6

    def expert_range(self, n_experts: int) -> range:
        return range(self.lo, self.hi)


def moe_pair(layer_id: int, dtype: torch.dtype) -> tuple[MoE, MoE]:
    cfg = get_preset("tiny")
    model = DSV4ForCausalLM(cfg)
    init_weights(model, seed=3, std=0.2)
    grouped = model.layers[layer_id].ffn.to(dtype)
    loop = copy.deepcopy(grouped)
    grouped.grouped, loop.grouped = True, False
    return grouped, loop


def run(moe: MoE, x: torch.Tensor, ids: torch.Tensor, ctx: DSV4Context):
    x = x.clone().requires_grad_(True)
    out = moe(x, ids, ctx)
    (out.float() * torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)
     ).sum().backward()
    # Per expert (views of the stacked gradients): each expert compared on its own.
    grads = per_expert_state({n: p.grad for n, p in moe.named_parameters()
                              if p.grad is not None})
    return out.detach(), x.grad, grads, ctx.routed


def assert_close(a: torch.Tensor, b: torch.Tensor, tol: float, msg: str = "") -> None:
    """fp32: elementwise; bf16: relative error of the whole tensor (sums of k bf16 products are
    rounded in another order, so single elements near zero differ by more than their size)."""
    if a.dtype == torch.float32:
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=msg)
    else:
        err = (a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)
        assert err < tol, (msg, float(err))


def assert_same(moe_g: MoE, moe_l: MoE, ctx_factory, dtype, tol, input_ids=None):
    torch.manual_seed(0)
    x = torch.randn(T, moe_g.gate.weight.shape[1], dtype=dtype)
    ids = input_ids if input_ids is not None else torch.randint(0, 300, (T,))
    out_g, dx_g, gr_g, routed_g = run(moe_g, x, ids, ctx_factory())
    out_l, dx_l, gr_l, routed_l = run(moe_l, x, ids, ctx_factory())
    assert_close(out_g, out_l, tol, "out")
    assert_close(dx_g, dx_l, tol, "dx")
    # The loop leaves an idle expert's gradient None, the grouped GEMM makes it zero.
    for n in set(gr_g) | set(gr_l):
        ref = gr_l.get(n, torch.zeros_like(gr_g.get(n, torch.zeros(0))))
        got = gr_g.get(n, torch.zeros_like(ref))
        if ref.abs().sum() == 0:
            assert got.abs().sum() == 0, n
        else:
            assert_close(got, ref, tol, n)
    for layer in routed_l:  # same routing recorded
        assert torch.equal(routed_g[layer][0], routed_l[layer][0])
    return out_g, gr_g


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("layer_id", [0, 3], ids=["hash", "topk"])
def test_grouped_equals_loop_with_router(layer_id, dtype, tol):
    g, l = moe_pair(layer_id, dtype)
    assert g.gate.is_hash == (layer_id == 0)
    out, _ = assert_same(g, l, lambda: DSV4Context.packed([T], record_routing=True), dtype, tol)
    assert out.abs().sum() > 0


def test_grouped_equals_loop_on_replayed_routing_with_empty_experts():
    g, l = moe_pair(3, torch.float32)
    gen = torch.Generator().manual_seed(1)
    # Only experts 1, 4 and 6 receive tokens: the others are empty groups.
    ids = torch.tensor([1, 4, 6])[torch.randint(0, 3, (T, 2), generator=gen)]
    ids[:, 1] = torch.where(ids[:, 1] == ids[:, 0], (ids[:, 0] + 3) % 8, ids[:, 1])
    w = torch.rand(T, 2, generator=gen)
    replay = {3: (ids.to(torch.int32), w)}
    _, grads = assert_same(
        g, l, lambda: DSV4Context.packed([T], routing_replay=replay, record_routing=True),
        torch.float32, 1e-5)
    idle = set(range(8)) - set(ids.unique().tolist())
    assert idle and all(grads[f"experts.{e}.{w}.weight"].abs().sum() == 0
                        for e in idle for w in ("w1", "w2", "w3"))


def test_grouped_equals_loop_on_an_expert_parallel_slice():
    g, l = moe_pair(3, torch.float32)
    assert_same(g, l, lambda: SlicedExperts.packed([T]), torch.float32, 1e-5)


def test_grouped_is_bitwise_reproducible():
    g, _ = moe_pair(3, torch.float32)
    x = torch.randn(T, g.gate.weight.shape[1])
    ids = torch.randint(0, 300, (T,))
    a = run(g, x, ids, DSV4Context.packed([T]))
    g.zero_grad()
    b = run(g, x, ids, DSV4Context.packed([T]))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_whole_model_loss_and_gradients_equal_the_loop_path():
    """The tiny V4.1 model (every layer kind, Engram, hash layers) on one packed batch: the loss
    and every parameter gradient of the grouped path equal the per-expert loop's."""
    cfg = get_preset("tiny")
    model = DSV4ForCausalLM(cfg)
    init_weights(model, seed=5, std=0.1)
    ids = torch.randint(0, 256, (2 * T,), generator=torch.Generator().manual_seed(2))
    results = []
    for grouped in (True, False):
        for layer in model.layers:
            layer.ffn.grouped = grouped
        model.zero_grad(set_to_none=True)
        logits = model(ids, DSV4Context.packed([T, T]))
        loss = torch.nn.functional.cross_entropy(logits[:-1], ids[1:])
        loss.backward()
        results.append((loss.detach(), per_expert_state(
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})))
    (loss_g, grads_g), (loss_l, grads_l) = results
    torch.testing.assert_close(loss_g, loss_l, atol=1e-6, rtol=1e-6)
    assert set(grads_l) <= set(grads_g)
    for n, g in grads_g.items():
        assert_close(g, grads_l.get(n, torch.zeros_like(g)), 1e-5, n)


def test_grouped_takes_zero_tokens():
    """An idle rank (DP attention) runs the MoE on no token: an empty output and no error."""
    g, _ = moe_pair(3, torch.float32)
    x = torch.zeros(0, g.gate.weight.shape[1], requires_grad=True)
    out = g(x, torch.zeros(0, dtype=torch.long), DSV4Context.packed([]))
    assert out.shape == x.shape
    out.sum().backward()
