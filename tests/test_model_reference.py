"""The reference model: packing, sink gradient, router replay, RoPE without a cached table."""

import math

import pytest
import torch

from sglang_dsv41.attention import sink_attention_reference
from sglang_dsv41.model import (DSV41Config, ForwardContext, build_model, get_preset,
                                reference_logprobs)
from sglang_dsv41.model.engram import engram_rows, ngram_window_from_history, ngram_window_from_packed


@pytest.fixture(scope="module")
def model():
    return build_model(get_preset("tiny"), torch.float32, seed=1)


def _random_seqs(gen, lens, vocab=256):
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]


def test_packed_batch_equals_each_sequence_alone(model):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    seqs = _random_seqs(gen, [7, 33, 2, 19])
    packed, _ = reference_logprobs(model, seqs)
    for s, lp in zip(seqs, packed):
        alone, _ = reference_logprobs(model, [s])
        torch.testing.assert_close(lp, alone[0], rtol=0, atol=1e-5)


def test_sink_gradient_matches_autograd_float64():
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    t, hq, hkv, d = 11, 4, 2, 8
    q = torch.randn(t, hq, d, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(t, hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(t, hkv, d, generator=gen, dtype=torch.float64)
    sinks = torch.randn(hq, generator=gen, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 5, 11], dtype=torch.int32)
    out = sink_attention_reference(q, k, v, sinks, cu, cu, causal=True, window=3)
    d_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (out * d_out).sum().backward()

    # REFERENCE.md A: dL/db_h = -sum_i P_sink_i * D_i with D_i = dO_i . O_i and
    # P_sink_i = exp(b - L_i), L_i the sink-inclusive log-sum-exp of row i.
    scale = 1 / math.sqrt(d)
    kf, expected = k.repeat_interleave(hq // hkv, 1), torch.zeros(hq, dtype=torch.float64)
    for b in range(2):
        lo, hi = int(cu[b]), int(cu[b + 1])
        s = torch.einsum("qhd,khd->hqk", q[lo:hi].detach(), kf[lo:hi]) * scale
        i = torch.arange(hi - lo)
        mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 3)
        s = s.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(torch.cat([s, sinks.detach()[:, None, None].expand(-1, hi - lo, 1)],
                                        -1), -1)
        p_sink = torch.exp(sinks.detach()[:, None] - lse)
        big_d = (d_out[lo:hi] * out[lo:hi].detach()).sum(-1).T
        expected -= (p_sink * big_d).sum(-1)
    torch.testing.assert_close(sinks.grad, expected, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda qq, ss: sink_attention_reference(qq, k, v, ss, cu, cu, True, 3), (q, sinks))


def test_fully_masked_row_gives_zero_not_nan():
    q = torch.randn(2, 2, 4, dtype=torch.float64)
    k = torch.randn(2, 2, 4, dtype=torch.float64)
    v = torch.randn(2, 2, 4, dtype=torch.float64)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    # window 0 would be rejected by configs; causal with k after q masks everything here.
    out = sink_attention_reference(q, k, v, None, cu, cu, causal=True, window=None)
    assert torch.isfinite(out).all()
    masked = sink_attention_reference(q[:1], k[:0], v[:0], torch.zeros(2, dtype=torch.float64),
                                      torch.tensor([0, 1], dtype=torch.int32),
                                      torch.tensor([0, 0], dtype=torch.int32))
    assert torch.equal(masked, torch.zeros_like(masked))


def test_replaying_returned_routing_reproduces_output_exactly(model):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    seqs = _random_seqs(gen, [9, 21])
    first, ctx = reference_logprobs(model, seqs, record_routing=True)
    assert set(ctx.routed) == {i for i in range(model.config.num_hidden_layers)
                               if model.config.is_moe_layer(i)}
    replayed, ctx2 = reference_logprobs(model, seqs, routing_replay=ctx.routed, record_routing=True)
    for a, b in zip(first, replayed):
        assert torch.equal(a, b)
    # Replay must use the given weights, not recompute them: perturbing them changes the output.
    layer = next(iter(ctx.routed))
    ids, w = ctx.routed[layer]
    bumped = {**ctx.routed, layer: (ids, w * 1.5)}
    changed, _ = reference_logprobs(model, seqs, routing_replay=bumped)
    assert not torch.equal(changed[0], first[0])


def test_replay_with_wrong_shape_is_refused(model):
    ctx = ForwardContext.packed([4], routing_replay={1: (torch.zeros(3, 2, dtype=torch.int32),
                                                         torch.ones(3, 2))})
    with pytest.raises(ValueError, match="layer 1"):
        model(torch.arange(4), ctx)


def test_longer_sequence_than_any_seen_before_works():
    cfg = get_preset("tiny")
    cfg.max_position_embeddings = 64
    m = build_model(cfg, torch.float32, seed=0)
    short, _ = reference_logprobs(m, [list(range(10))])
    long_seq = [i % 250 for i in range(300)]
    long, _ = reference_logprobs(m, [long_seq])
    assert torch.isfinite(long[0]).all() and long[0].shape == (299,)
    # Positions are computed per call: the short sequence is unaffected by the long one.
    again, _ = reference_logprobs(m, [list(range(10))])
    assert torch.equal(short[0], again[0])


def test_yarn_rope_scaling_runs_and_differs_from_plain():
    base = get_preset("tiny")
    yarn = DSV41Config(**{**base.__dict__, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}})
    a, _ = reference_logprobs(build_model(base, torch.float32, seed=0), [list(range(40))])
    b, _ = reference_logprobs(build_model(yarn, torch.float32, seed=0), [list(range(40))])
    assert torch.isfinite(b[0]).all() and not torch.allclose(a[0], b[0])


def test_engram_windows_agree_between_packed_and_decode_paths():
    ids = torch.tensor([5, 6, 7, 8, 1, 2])
    cu = torch.tensor([0, 4, 6], dtype=torch.int32)
    win = ngram_window_from_packed(ids, cu, 3)
    assert win.tolist()[3] == [8, 7, 6] and win.tolist()[4] == [1, -1, -1]
    assert ngram_window_from_history([5, 6, 7, 8], 3) == win.tolist()[3]
    rows = engram_rows(win, [2, 3], 2, 1000)
    assert rows.shape == (6, 4) and int(rows.min()) >= 0 and int(rows.max()) < 1000


def test_config_round_trip_and_validation(tmp_path):
    cfg = get_preset("tiny")
    cfg.save_pretrained(str(tmp_path))
    assert DSV41Config.from_pretrained(str(tmp_path)) == cfg
    with pytest.raises(ValueError, match="o_groups"):
        DSV41Config(num_attention_heads=8, o_groups=3)
    with pytest.raises(ValueError, match="convert"):
        DSV41Config.from_dict({"model_type": "deepseek_v41", "text_config": {}})
    assert get_preset("v41-flash").num_parameters() > 2e11
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt model config .*config.json"):
        DSV41Config.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="is missing"):
        DSV41Config.from_pretrained(str(tmp_path / "nowhere"))
