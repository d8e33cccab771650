"""Sink-attention reference math and the backend dispatch (CPU, float64, no Triton needed)."""

import pytest
import torch
import torch.nn.functional as F

from sglang_dsv41.attention import (BACKEND_ENV, resolve_backend, sink_attention,
                                    sink_attention_reference, sink_decode_reference)


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _visible(lq, lk, causal, window):
    qpos = torch.arange(lk - lq, lk)[:, None]
    kpos = torch.arange(lk)[None, :]
    mask = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        mask &= kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    return mask


@pytest.mark.parametrize("causal,window", [(True, None), (True, 5), (False, 4)])
def test_reference_equals_sdpa_times_sink_sigmoid(seed, causal, window):
    # REFERENCE.md A: out_sink = out_nosink * sigmoid(lse_nosink - b), computed independently.
    lq, lk, hq, hkv, d = [4, 11], [9, 11], 4, 2, 8
    q = torch.randn(sum(lq), hq, d, dtype=torch.float64)
    k = torch.randn(sum(lk), hkv, d, dtype=torch.float64)
    v = torch.randn(sum(lk), hkv, d, dtype=torch.float64)
    sinks = torch.randn(hq, dtype=torch.float64)
    out = sink_attention_reference(q, k, v, sinks, _cu(lq), _cu(lk), causal, window)
    cq, ck = _cu(lq).tolist(), _cu(lk).tolist()
    for b in range(len(lq)):
        qb = q[cq[b]:cq[b + 1]].transpose(0, 1)
        kb = k[ck[b]:ck[b + 1]].repeat_interleave(hq // hkv, 1).transpose(0, 1)
        vb = v[ck[b]:ck[b + 1]].repeat_interleave(hq // hkv, 1).transpose(0, 1)
        mask = _visible(lq[b], lk[b], causal, window)
        plain = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask)
        lse = torch.logsumexp((qb @ kb.transpose(-1, -2) * d ** -0.5).masked_fill(~mask, -1e300),
                              -1)
        expect = plain * torch.sigmoid(lse - sinks[:, None])[..., None]
        torch.testing.assert_close(out[cq[b]:cq[b + 1]], expect.transpose(0, 1),
                                   msg=f"seed {seed}")


def test_dsink_matches_closed_form(seed):
    # dL/db_h = -sum_i exp(b_h - L_i) * (dO_i . O_i), the formula the kernels implement.
    lens, hq, d = [6, 13], 3, 8
    q = torch.randn(sum(lens), hq, d, dtype=torch.float64)
    k = torch.randn(sum(lens), hq, d, dtype=torch.float64)
    v = torch.randn(sum(lens), hq, d, dtype=torch.float64)
    sinks = torch.randn(hq, dtype=torch.float64, requires_grad=True)
    out = sink_attention_reference(q, k, v, sinks, _cu(lens), _cu(lens))
    dout = torch.randn_like(out)
    (dsink,) = torch.autograd.grad(out, sinks, dout)
    s = torch.einsum("qhd,khd->hqk", q, k) * d ** -0.5
    blockmask = torch.zeros(sum(lens), sum(lens), dtype=torch.bool)
    for a, b in zip(_cu(lens)[:-1].tolist(), _cu(lens)[1:].tolist()):
        blockmask[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    lse = torch.logaddexp(torch.logsumexp(s.masked_fill(~blockmask, float("-inf")), -1),
                          sinks.detach()[:, None])
    delta = (dout * out.detach()).sum(-1).T
    expect = -(torch.exp(sinks.detach()[:, None] - lse) * delta).sum(-1)
    torch.testing.assert_close(dsink, expect, msg=f"seed {seed}")


@pytest.mark.parametrize("with_sinks", [True, False])
def test_fully_masked_rows_are_zero(seed, with_sinks):
    lq, lk = [5, 3], [2, 0]  # queries before any key (and an empty key set) see nothing
    q = torch.randn(sum(lq), 2, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(lk), 1, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(lk), 1, 4, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(2, dtype=torch.float64, requires_grad=True) if with_sinks else None
    out = sink_attention_reference(q, k, v, sinks, _cu(lq), _cu(lk))
    assert torch.isfinite(out).all()
    assert out[:3].abs().max() == 0 and out[5:].abs().max() == 0
    assert out[3:5].abs().max() > 0
    leaves = [x for x in (q, k, v, sinks) if x is not None]
    for g in torch.autograd.grad(out.sum(), leaves):
        assert torch.isfinite(g).all()


def test_decode_reference_is_last_prefill_row(seed):
    lens, page_size, hq, hkv, d, window = [1, 9, 14], 4, 4, 2, 8, 6
    pages = [(n + page_size - 1) // page_size for n in lens]
    k_cache = torch.randn(sum(pages) + 2, page_size, hkv, d, dtype=torch.float64)
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(k_cache.shape[0])
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[start:start + n]
        start += n
    q = torch.randn(len(lens), hq, d, dtype=torch.float64)
    sinks = torch.randn(hq, dtype=torch.float64)
    out = sink_decode_reference(q, k_cache, v_cache, table, torch.tensor(lens), sinks, window)
    for b, n in enumerate(lens):
        k = k_cache[table[b, :pages[b]].long()].reshape(-1, hkv, d)[:n]
        v = v_cache[table[b, :pages[b]].long()].reshape(-1, hkv, d)[:n]
        row = sink_attention_reference(q[b:b + 1], k, v, sinks, _cu([1]), _cu([n]), True, window)
        torch.testing.assert_close(out[b:b + 1], row, msg=f"seed {seed}")


def test_dispatch_cpu_defaults_to_reference(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert resolve_backend(torch.device("cpu"), torch.float32, True) == "reference"
    monkeypatch.setenv(BACKEND_ENV, "reference")
    assert resolve_backend(torch.device("cpu"), torch.float32, True) == "reference"
    monkeypatch.setenv(BACKEND_ENV, "nope")
    with pytest.raises(ValueError, match="unknown"):
        resolve_backend(torch.device("cpu"), torch.float32, True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        resolve_backend(torch.device("cpu"), torch.float32, True, backend="triton")
    with pytest.raises(ValueError, match="sinks=None"):
        resolve_backend(torch.device("cpu"), torch.bfloat16, True, backend="flash_attn")


@pytest.mark.parametrize("bad", ["heads", "sinks", "window", "dtype", "cu"])
def test_dispatch_rejects_bad_input(bad):
    q, k, v = torch.randn(6, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    sinks, cu, window = torch.zeros(4), _cu([6]), None
    if bad == "heads":
        q = torch.randn(6, 3, 8)
    elif bad == "sinks":
        sinks = torch.zeros(2)
    elif bad == "window":
        window = 0
    elif bad == "dtype":
        k = k.double()
    else:
        cu = torch.tensor([[0, 6]])
    with pytest.raises(ValueError):
        sink_attention(q, k, v, sinks, cu, cu, window=window)
