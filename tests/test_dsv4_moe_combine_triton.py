"""The routed experts' outputs back on their tokens as one Triton kernel each way
(moe_combine_triton, run by the Triton interpreter on CPU) against moe.combine_slots' torch path
in float64 under autograd: the tokens, d rows and d weights, fp32 and bf16, widths past one
column block and not a power of two, an expert-parallel slice (pairs of other ranks' experts add
nothing, their rows do not exist), zero tokens, weights without gradient; deterministic d
weights; and the whole MoE's CUDA-path dispatch (the kernel) against its CPU path."""

from __future__ import annotations

import os

import pytest
import torch

from sglang_dsv41.model.dsv4 import moe
from sglang_dsv41.model.dsv4.moe_combine_triton import combine_slots_triton

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and
                                not torch.cuda.is_available(),
                                reason="Triton kernels: CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def pairs(n_tok: int, k: int, seed: int):
    """(order, inverse): a random permutation of the n_tok*k pairs, as MoE.routed_grouped makes
    (under expert parallelism the rows past this rank's are the other ranks' pairs)."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(n_tok * k, generator=gen)
    return order, moe.inverse_permutation(order)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("n_tok,k,hidden,local", [(13, 6, 40, None), (5, 2, 1500, None),
                                                  (9, 4, 64, 20)],
                         ids=["small", "two-col-blocks", "expert-parallel"])
def test_fused_combine_equals_float64(n_tok, k, hidden, local, dtype, tol):
    order, inverse = pairs(n_tok, k, seed=hidden)
    rows = n_tok * k if local is None else local
    gen = torch.Generator().manual_seed(rows)
    y0 = torch.randn(rows, hidden, generator=gen)
    w0 = torch.rand(n_tok, k, generator=gen)
    grad = torch.randn(n_tok, hidden, generator=gen)
    outs = []
    for fn, precision in ((moe.combine_slots_torch, torch.float64),
                          (combine_slots_triton, dtype)):
        y = y0.to(DEV, precision).requires_grad_(True)
        w = w0.to(DEV, torch.float64 if precision == torch.float64 else torch.float32
                  ).requires_grad_(True)
        args = (y, w, inverse.to(DEV))
        out = fn(*args, order.to(DEV)) if fn is moe.combine_slots_torch else fn(*args)
        out.backward(grad.to(out.device, out.dtype))
        assert out.dtype == precision and y.grad.dtype == precision
        outs.append([t.detach().double().cpu() for t in (out, y.grad, w.grad)])
    for name, got, want in zip(("out", "d rows", "d weights"), outs[1], outs[0]):
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol}"
    if local is not None:  # the pairs of other ranks' experts: no row, no weight gradient
        others = inverse.view(n_tok, k) >= local
        assert others.any() and (outs[1][2][others] == 0).all()


def test_fused_combine_weights_gradient_is_deterministic_and_optional():
    order, inverse = pairs(7, 3, seed=1)
    y = torch.randn(21, 2100, device=DEV).requires_grad_(True)  # three column blocks
    w = torch.rand(7, 3, device=DEV).requires_grad_(True)
    grads = []
    for _ in range(2):
        y.grad = w.grad = None
        combine_slots_triton(y, w, inverse.to(DEV)).square().sum().backward()
        grads.append((y.grad.clone(), w.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    frozen = w.detach()  # replayed routing: weights are constants
    y.grad = None
    combine_slots_triton(y, frozen, inverse.to(DEV)).square().sum().backward()
    assert torch.equal(y.grad, grads[0][0])


def test_fused_combine_empty_and_refusals():
    y = torch.zeros(0, 32, device=DEV, requires_grad=True)
    w = torch.zeros(0, 6, device=DEV, requires_grad=True)
    out = combine_slots_triton(y, w, torch.zeros(0, dtype=torch.long, device=DEV))
    out.sum().backward()
    assert out.shape == (0, 32) and y.grad.shape == (0, 32) and w.grad.shape == (0, 6)
    with pytest.raises(ValueError, match="combine_slots_triton"):
        combine_slots_triton(torch.zeros(4, 8, device=DEV), torch.zeros(2, 3, device=DEV),
                             torch.zeros(5, dtype=torch.long, device=DEV))


def test_moe_layer_with_the_kernel_equals_its_torch_path(monkeypatch, seed):
    """MoE.routed_grouped on the kernel (as on CUDA) vs the torch path (as on CPU), on the
    device the kernel runs on here: tokens and gradients."""
    from test_dsv4_moe_grouped import T, moe_pair, run

    from sglang_dsv41.model.dsv4.context import DSV4Context

    g, _ = moe_pair(3, torch.float32)
    g = g.to(DEV)
    x = torch.randn(T, g.gate.weight.shape[1], device=DEV)
    ids = torch.randint(0, 300, (T,), device=DEV)
    results = []
    for combine in (moe.combine_slots_torch,
                    lambda y, w, inverse, order: combine_slots_triton(y, w, inverse)):
        monkeypatch.setattr(moe, "combine_slots", combine)
        g.zero_grad(set_to_none=True)
        results.append(run(g, x, ids, DSV4Context.packed([T], device=DEV)))
    want, got = results
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    for name in want[2]:
        # A weight's gradient sums its experts' tokens, whose combine adds in another order:
        # elements near zero after cancellation differ by up to 2.8e-7 of the tensor's largest
        # (40 seeds; max |grad| 1.9-63), past a fixed 1e-6 once in CI; the bound scales.
        scale = float(want[2][name].abs().max())
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-5, atol=2e-6 * scale)


def test_kernels_compile_for_the_h200():
    from triton_compile import compile_many_sm90

    types = {"y_ptr": "*bf16", "w_ptr": "*fp32", "inv_ptr": "*i64", "out_ptr": "*bf16",
             "dout_ptr": "*bf16", "dy_ptr": "*bf16", "dw_ptr": "*fp32"}
    types.update({n: "i32" for n in ("n_rows", "hidden", "stride_y", "stride_out",
                                     "stride_dout", "stride_dy", "n_col_blocks")})
    consts = dict(K=6, BLOCK=1024, ROUND="tf32")
    module = "sglang_dsv41.model.dsv4.moe_combine_triton"
    fwd, bwd, bwd_no_dw = compile_many_sm90(
        [(module, "_combine_fwd_kernel", types, consts, 4)]
        + [(module, "_combine_bwd_kernel", types, {**consts, "NEED_DW": d}, 4)
           for d in (True, False)])
    assert "ld.global" in fwd and "st.global" in bwd and "st.global" in bwd_no_dw
