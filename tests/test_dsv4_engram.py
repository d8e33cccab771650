"""The real model's Engram layer against SGLang 0.5.23's own Engram module (built on CPU with a
1-rank TP override, weights loaded through SGLang's weight loaders): parameter names and dtypes,
table rows looked up, the layer's output; plus the table's fp8 guarantees and gradients."""

from __future__ import annotations

import pytest
import torch
from sglang_cpu import import_sglang

from sglang_dsv41.model.dsv4 import get_preset
from sglang_dsv41.model.dsv4.engram import Engram, EngramHasher, EngramTable, engram_gate
from sglang_dsv41.model.dsv4.model import default_dtype

LAYER = 5  # the tiny preset's second Engram layer (hash index 1)


@pytest.fixture(scope="module")
def cfg():
    return get_preset("tiny")


@pytest.fixture(scope="module")
def pair(cfg):
    """(ours, SGLang's) Engram for LAYER in bf16 (SGLang's serving dtype), same weights."""
    sg = import_sglang("sglang.srt.layers.engram")
    from sglang.srt.model_loader.weight_utils import default_weight_loader
    from sglang.srt.runtime_context import get_parallel

    gen = torch.Generator().manual_seed(0)
    ours = Engram(cfg, LAYER).to(torch.bfloat16)
    # Every fp8 byte but NaN, scales 2^-20..2^4: rows from subnormal to 7168.
    raw = torch.randint(0, 256, ours.embed.weight.shape, generator=gen, dtype=torch.uint8)
    ours.embed.weight.view(torch.uint8).copy_(raw.masked_fill((raw & 0x7F) == 0x7F, 0))
    ours.embed.scale.view(torch.uint8).copy_(torch.randint(
        107, 132, ours.embed.scale.shape, generator=gen, dtype=torch.uint8))
    with torch.no_grad():
        ours.wkv.weight.copy_(torch.randn(ours.wkv.weight.shape, generator=gen) * 0.05)
        ours.q_weight.copy_(1 + 0.5 * torch.randn(ours.q_weight.shape, generator=gen))
        ours.k_weight.copy_(1 + 0.5 * torch.randn(ours.k_weight.shape, generator=gen))
    with get_parallel().override(tp_size=1, tp_rank=0), default_dtype(torch.bfloat16):
        theirs = sg.Engram(cfg, LAYER, sg.EngramLayout.from_config(cfg))
    params = dict(theirs.named_parameters())
    for name, tensor in ours.state_dict().items():
        param = params[name]
        getattr(param, "weight_loader", default_weight_loader)(param, tensor)
    return ours, theirs


def test_names_shapes_dtypes_are_sglangs(pair):
    ours, theirs = pair
    want = {n: (tuple(p.shape), p.dtype) for n, p in theirs.named_parameters()}
    got = {n: (tuple(t.shape), t.dtype) for n, t in ours.state_dict().items()}
    assert got == want
    assert got["embed.weight"][1] == torch.float8_e4m3fn
    assert got["embed.scale"][1] == torch.float8_e8m0fnu
    assert ours.layer_hash_index == theirs.layer_hash_index == 1


def test_rows_looked_up_are_sglangs_bit_for_bit(pair):
    ours, theirs = pair
    rows = ours.embed.weight.shape[0]
    gen = torch.Generator().manual_seed(1)
    ids = torch.cat([torch.tensor([[0, rows - 1, 1, rows - 2]]),
                     torch.randint(0, rows, (63, 4), generator=gen)])
    got, want = ours.embed(ids), theirs.embed(ids)
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == (64, 4, 32)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert got.abs().amax() > 1  # the rows are not trivially zero


def test_layer_output_is_sglangs(pair, cfg):
    ours, theirs = pair
    gen = torch.Generator().manual_seed(2)
    lens = [7, 1, 12]
    input_ids = torch.randint(0, cfg.vocab_size, (sum(lens),), generator=gen)
    cu = torch.tensor([0] + lens).cumsum(0)
    hash_ids = EngramHasher(cfg)(input_ids, cu)[:, ours.layer_hash_index]
    streams = torch.randn(sum(lens), cfg.hc_mult, cfg.hidden_size, generator=gen).bfloat16()
    got = ours(streams, hash_ids)
    with torch.no_grad():
        want = theirs(streams, hash_ids, None, input_ids=input_ids)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert not torch.equal(got, streams)


def test_gate_is_sglangs_in_fp32(cfg):
    sg = import_sglang("sglang.srt.layers.engram")
    gen = torch.Generator().manual_seed(3)
    hc, dim = cfg.hc_mult, cfg.hidden_size
    x = torch.randn(9, hc, dim, generator=gen)
    kv = torch.randn(9, (hc + 1) * dim, generator=gen)
    kv[0, :hc * dim] = 0  # a zero key: the gate's clamp decides
    q, k = (1 + torch.randn(hc, dim, generator=gen) for _ in range(2))
    want = sg.engram_gate(x, kv, q, k, cfg.rms_norm_eps, 1e-6)
    assert torch.equal(engram_gate(x, kv, q, k, cfg.rms_norm_eps), want)


def test_table_stays_fp8_and_loads_byte_exact(cfg):
    m = Engram(cfg, 1)
    m.embed.reset_table_(torch.Generator().manual_seed(4))
    before = {n: t.view(torch.uint8).clone() for n, t in m.embed.state_dict().items()}
    m.to(torch.bfloat16).half().float()
    assert m.embed.weight.dtype == torch.float8_e4m3fn
    assert m.embed.scale.dtype == torch.float8_e8m0fnu and m.wkv.weight.dtype == torch.float32
    for n, t in m.embed.state_dict().items():
        assert torch.equal(t.view(torch.uint8), before[n]), n
    fresh = Engram(cfg, 1)
    fresh.load_state_dict(m.state_dict())
    assert torch.equal(fresh.embed.weight.view(torch.uint8), before["weight"])
    upcast = dict(m.state_dict(), **{"embed.weight": m.embed.weight.bfloat16()})
    with pytest.raises(ValueError, match="embed.weight: expected torch.float8_e4m3fn"):
        fresh.load_state_dict(upcast)
    with torch.device("meta"):
        meta = Engram(cfg, 1)
    meta.to_empty(device="cpu")
    assert meta.embed.weight.dtype == torch.float8_e4m3fn and meta.embed.weight.device.type == "cpu"


def test_gradients_reach_projection_and_gate_not_table(cfg):
    m = Engram(cfg, 1)
    m.embed.reset_table_(torch.Generator().manual_seed(5))
    with torch.no_grad():
        m.q_weight.normal_(1, 0.5)
    streams = torch.randn(6, cfg.hc_mult, cfg.hidden_size, requires_grad=True)
    hash_ids = EngramHasher(cfg)(torch.arange(6), torch.tensor([0, 6]))[:, m.layer_hash_index]
    m(streams, hash_ids).square().sum().backward()
    for p in (m.wkv.weight, m.q_weight, m.k_weight, streams):
        assert p.grad is not None and p.grad.abs().sum() > 0
    assert [n for n, _ in m.named_parameters()] == ["q_weight", "k_weight", "wkv.weight"]
    with pytest.raises(ValueError, match="hash_ids must be"):
        m(streams, hash_ids[:, :2])
    with pytest.raises(ValueError, match="not an Engram layer"):
        Engram(cfg, 0)
    with pytest.raises(ValueError, match="multiple of 32"):
        EngramTable(10, 40)
