"""The attention module's RoPE (model/dsv4/rope.py) has a hand-written backward; it must give
autograd's gradient of the plain formula bit for bit, in every dtype, both directions."""

import os

import pytest
import torch

from sglang_dsv41.attention.rope_triton import rope_triton
from sglang_dsv41.model.dsv4.rope import _with_rotated_tail, apply_rope, inv_freq, rope_table


def rope_by_autograd(x, positions, freqs, inverse):
    """The formula in plain torch ops, differentiated by autograd."""
    rope_dim = 2 * freqs.shape[0]
    angles = positions.float()[:, None] * freqs[None, :] * (-1 if inverse else 1)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim // 2,)
    cos, sin = angles.cos().view(shape), angles.sin().view(shape)
    pairs = x[..., -rope_dim:].float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), -1).flatten(-2)
    return torch.cat([x[..., :-rope_dim], rotated.to(x.dtype)], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(200, 4, 96), (200, 96)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_gradient_is_autograds_bit_for_bit(dtype, shape, inverse):
    gen = torch.Generator().manual_seed(0)
    freqs = inv_freq(64, 10000.0)
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    positions = torch.randint(0, 1 << 20, (shape[0],), generator=gen)
    grad = torch.randn(*shape, generator=gen).to(dtype)
    ours, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, want = apply_rope(ours, positions, freqs, inverse), rope_by_autograd(ref, positions,
                                                                                freqs, inverse)
    out.backward(grad)
    want.backward(grad)
    assert out.dtype == dtype and torch.equal(out, want)
    assert torch.equal(ours.grad, ref.grad)
    # The head channels pass through; the rope channels really rotate.
    assert torch.equal(out[..., :-64], x[..., :-64])
    assert not torch.equal(out[..., -64:], x[..., -64:])
    # One table of the positions' angles serves both directions (the attention's q, kv and
    # output de-rotation share it), with the same bits and gradients.
    shared = x.clone().requires_grad_()
    out_shared = apply_rope(shared, positions, freqs, inverse, table=rope_table(positions, freqs))
    out_shared.backward(grad)
    assert torch.equal(out_shared, want) and torch.equal(shared.grad, ref.grad)
    # overwrite_grad: the backward rotates the incoming gradient where it is (the same bits);
    # a gradient strided in its last dimension is copied instead.
    for incoming in (grad.clone(), grad.clone().transpose(0, -1).contiguous().transpose(0, -1)):
        held = x.clone().requires_grad_()
        apply_rope(held, positions, freqs, inverse, overwrite_grad=True).backward(incoming)
        assert torch.equal(held.grad, ref.grad)
        assert torch.equal(incoming, grad) != (incoming.stride(-1) == 1)  # rotated where it is


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1" and
                    not torch.cuda.is_available(), reason="Triton needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("negate_sin", [False, True])
def test_triton_rope_is_the_torch_path_bit_for_bit(dtype, negate_sin):
    """The CUDA path (one Triton pass) against the CPU path, on a contiguous x, an x strided
    over tokens and heads (as the grouped output projection's gradient), and 2-D keys."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(1)
    freqs = inv_freq(32, 10000.0)
    positions = torch.randint(0, 1 << 20, (9,), generator=gen)
    angles = positions.float()[:, None] * freqs[None, :]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    base = (torch.randn(3, 9, 5, 80, generator=gen) * 3).to(dtype)
    for x in (base[0], base.transpose(0, 1)[:, 1], base[2, :, 0]):
        want = _with_rotated_tail(x, cos if x.dim() == 3 else cos[:, 0],
                                  sin if x.dim() == 3 else sin[:, 0], negate_sin)
        got = rope_triton(x.to(device), cos.to(device), sin.to(device), negate_sin)
        assert got.is_contiguous() and got.dtype == dtype
        assert torch.equal(got.cpu(), want)
        # In place: the same bits, in x's own (strided) layout, the kept channels untouched.
        # (On the CPU x.to(device) is x itself: this rotates base's slice, which the other
        # layouts of the loop do not share.)
        mine = x.to(device)
        before = mine.clone()
        same = rope_triton(mine, cos.to(device), sin.to(device), negate_sin, in_place=True)
        assert same is mine and torch.equal(mine.cpu(), want)
        keep = x.shape[-1] - 2 * cos.shape[-1]
        assert torch.equal(mine[..., :keep], before[..., :keep])
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        rope_triton(base[0].transpose(-1, -2), cos, sin, in_place=True)
    with pytest.raises(ValueError, match="fold to \\[T, H, D\\] as a view"):
        rope_triton(base.transpose(0, 1), cos[:, None], sin[:, None], in_place=True)


def test_a_forward_computes_each_rope_table_once_and_its_layers_share_them():
    """The context keeps one table per frequency set for a forward; that is right only because
    every layer of a kind has the same frequencies, which this checks on the real layer list."""
    from sglang_dsv41.attention.dsv4_reference import sequence_first_rows
    from sglang_dsv41.model.dsv4 import get_preset
    from sglang_dsv41.model.dsv4.context import DSV4Context
    from sglang_dsv41.model.dsv4.model import DSV4ForCausalLM

    cfg = get_preset("tiny")
    model = DSV4ForCausalLM(cfg)
    kinds = {}
    for layer in model.layers:
        kinds.setdefault(layer.attn.ratio > 0, []).append(layer.attn.freqs)
    assert set(kinds) == {True, False}
    for freqs in kinds.values():
        assert all(torch.equal(f, freqs[0]) for f in freqs)
    assert not torch.equal(kinds[True][0], kinds[False][0])

    ctx = DSV4Context.packed([5, 3])
    for compressed, freqs in kinds.items():
        table = ctx.rope_table(freqs[0], compressed)
        assert ctx.rope_table(freqs[-1], compressed) is table
        want = rope_table(ctx.positions, freqs[0])
        assert torch.equal(table[0], want[0]) and torch.equal(table[1], want[1])
    assert ctx.rope_table(kinds[True][0], True) is not ctx.rope_table(kinds[False][0], False)
    assert ctx.first_rows is ctx.first_rows
    assert ctx.first_rows.tolist() == [0] * 5 + [5] * 3
    assert torch.equal(ctx.first_rows, sequence_first_rows(ctx.cu_seqlens, 8))
