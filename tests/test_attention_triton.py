"""Triton sink-attention kernels against the float64 reference.

CI runs these on the CPU under TRITON_INTERPRET=1 (tiny shapes, 16-wide tiles); on a CUDA
machine they run on the GPU. Inputs are drawn fresh each run (seed in every failure message);
the reference sees the same rounded inputs upcast to float64.
"""

import dataclasses
import os

import pytest
import torch

import sglang_dsv41.attention as attention
from sglang_dsv41.attention import sink_attention, sink_attention_reference, sink_decode_reference

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                reason="Triton needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cpu" if INTERPRET else "cuda"
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-3}


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                        device=DEVICE)


def _rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300)).item()


def _run_both(lq, lk, hq, hkv, d, dtype, causal, window, with_sinks, blocks=None):
    """-> (triton out and grads, reference out and grads) for fresh random inputs."""
    from sglang_dsv41.attention.triton_prefill import sink_attention_triton

    def draw(n, h):
        return torch.randn(n, h, d, device=DEVICE).to(dtype)

    q, k, v = draw(sum(lq), hq), draw(sum(lk), hkv), draw(sum(lk), hkv)
    sinks = torch.randn(hq, device=DEVICE) if with_sinks else None
    dout = draw(sum(lq), hq)
    ins = [x for x in (q, k, v, sinks) if x is not None]
    leaves = [x.clone().requires_grad_() for x in ins]
    s = leaves[3] if with_sinks else None
    out = sink_attention_triton(*leaves[:3], s, _cu(lq), _cu(lk), causal, window, None, blocks)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [x.double().requires_grad_() for x in ins]
    s = ref_leaves[3] if with_sinks else None
    ref = sink_attention_reference(*ref_leaves[:3], s, _cu(lq), _cu(lk), causal, window)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.double())
    return (out, *grads), (ref, *ref_grads)


# (lq, lk, Hq, Hkv, D, dtype, causal, window, sinks). bf16 cases use 8 heads: with fewer, the
# bf16 rounding of O alone puts dsink's relative error near 1e-2 in ~1% of draws.
CASES = {
    "gqa_causal": ([5, 24, 17], [5, 24, 17], 4, 2, 16, torch.float32, True, None, True),
    "prefix_window": ([5, 20, 3], [9, 24, 17], 4, 1, 16, torch.float32, True, 6, True),
    "bf16_prefix_window": ([7, 20, 12], [9, 24, 16], 8, 2, 16, torch.bfloat16, True, 7, True),
    "bf16_causal": ([16, 24, 9], [16, 24, 9], 8, 4, 16, torch.bfloat16, True, None, True),
    "noncausal_window_d24": ([5, 20], [9, 24], 2, 2, 24, torch.float32, False, 5, False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_prefill_matches_reference(seed, name):
    lq, lk, hq, hkv, d, dtype, causal, window, with_sinks = CASES[name]
    got, ref = _run_both(lq, lk, hq, hkv, d, dtype, causal, window, with_sinks)
    for label, g, r in zip(["out", "dq", "dk", "dv", "dsink"], got, ref):
        assert torch.isfinite(g).all(), f"{label} not finite (seed {seed})"
        err = _rel(g, r)
        assert err <= TOL[dtype], f"{name} {label}: rel err {err:.2e} (seed {seed})"


def test_prefill_uneven_tiles(seed):
    # Query and key tiles of different sizes exercise the masked/unmasked range split.
    from sglang_dsv41.attention.triton_common import PrefillBlocks

    blocks = PrefillBlocks(32, 16, 1, 1, 16, 32, 1, 1, 32, 16, 1, 1, 16)
    got, ref = _run_both([23, 40], [40, 40], 2, 1, 16, torch.float32, True, 19, True, blocks)
    for label, g, r in zip(["out", "dq", "dk", "dv", "dsink"], got, ref):
        assert _rel(g, r) <= 1e-3, f"{label}: {_rel(g, r):.2e} (seed {seed})"


def test_dkdv_group_split_matches_reference(seed):
    # MQA (8 query heads on one KV head) with the group split over 3 programs: fp32 partial
    # dK/dV buffers summed after the kernel.
    from sglang_dsv41.attention.triton_common import INTERPRET_BLOCKS

    blocks = dataclasses.replace(INTERPRET_BLOCKS, dkdv_splits=3)
    got, ref = _run_both([9, 20], [9, 20], 8, 1, 16, torch.float32, True, 6, True, blocks)
    for label, g, r in zip(["out", "dq", "dk", "dv", "dsink"], got, ref):
        assert _rel(g, r) <= 1e-3, f"{label}: {_rel(g, r):.2e} (seed {seed})"


@pytest.mark.parametrize("with_sinks", [True, False])
def test_fully_masked_rows_give_zero(seed, with_sinks):
    # Queries placed before every key (and a sequence with no keys) have nothing to attend to.
    got, ref = _run_both([6, 4], [3, 0], 2, 1, 16, torch.float32, True, None, with_sinks)
    out = got[0]
    assert out[:3].abs().max() == 0 and out[6:].abs().max() == 0
    for g, r in zip(got, ref):
        assert torch.isfinite(g).all()
        assert _rel(g, r) <= 1e-3, f"seed {seed}"


def test_dsink_is_deterministic(seed):
    from sglang_dsv41.attention.triton_prefill import sink_attention_triton

    q = torch.randn(30, 4, 16, device=DEVICE)
    k, v = torch.randn(30, 2, 16, device=DEVICE), torch.randn(30, 2, 16, device=DEVICE)
    dout = torch.randn_like(q)
    sinks0 = torch.randn(4, device=DEVICE)
    runs = []
    for _ in range(2):
        sinks = sinks0.clone().requires_grad_()
        out = sink_attention_triton(q, k, v, sinks, _cu([11, 19]), _cu([11, 19]))
        runs.append(torch.autograd.grad(out, sinks, dout)[0])
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("dtype,window,with_sinks,splits", [
    (torch.float32, None, True, None), (torch.bfloat16, 9, True, 3),
    (torch.float32, None, False, 4)])
def test_decode_matches_reference(seed, dtype, window, with_sinks, splits):
    from sglang_dsv41.attention.triton_decode import sink_decode_triton

    lens, page_size, hq, hkv, d = [0, 7, 40, 23], 8, 4, 2, 16
    max_pages = max((n + page_size - 1) // page_size for n in lens)
    num_pages = len(lens) * max_pages + 3
    k_cache = torch.randn(num_pages, page_size, hkv, d, device=DEVICE).to(dtype)
    v_cache = torch.randn(num_pages, page_size, hkv, d, device=DEVICE).to(dtype)
    table = torch.randperm(num_pages, device=DEVICE)[:len(lens) * max_pages]
    table = table.view(len(lens), max_pages).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), hq, d, device=DEVICE).to(dtype)
    sinks = torch.randn(hq, device=DEVICE) if with_sinks else None
    out = sink_decode_triton(q, k_cache, v_cache, table, seq_lens, sinks, window,
                             num_splits=splits)
    ref = sink_decode_reference(q.double(), k_cache.double(), v_cache.double(), table, seq_lens,
                                sinks, window)
    assert out[0].abs().max() == 0  # an empty sequence attends to nothing
    assert _rel(out, ref) <= TOL[dtype], f"seed {seed}"


def test_dispatch_forced_triton_backprops_into_sink_parameter(seed, monkeypatch):
    calls = []
    triton_fn = attention._PREFILL["triton"]
    monkeypatch.setitem(attention._PREFILL, "triton", lambda *a: calls.append(1) or triton_fn(*a))
    monkeypatch.setenv(attention.BACKEND_ENV, "triton")
    sinks = torch.nn.Parameter(torch.randn(4, device=DEVICE))
    q = torch.randn(20, 4, 16, device=DEVICE, requires_grad=True)
    k, v = torch.randn(20, 2, 16, device=DEVICE), torch.randn(20, 2, 16, device=DEVICE)
    out = sink_attention(q, k, v, sinks, _cu([20]), _cu([20]), window=8)
    out.square().sum().backward()
    assert calls == [1]
    ref_sinks = sinks.detach().double().requires_grad_()
    ref_q = q.detach().double().requires_grad_()
    ref = sink_attention_reference(ref_q, k.double(), v.double(), ref_sinks, _cu([20]),
                                   _cu([20]), window=8)
    ref.square().sum().backward()
    assert _rel(sinks.grad, ref_sinks.grad) <= 1e-3, f"seed {seed}"
    assert _rel(q.grad, ref_q.grad) <= 1e-3, f"seed {seed}"
