"""The trainer's log-probabilities of the sampled tokens, computed a chunk of rows at a time
(token_logprobs.py), against the plain ``log_softmax(head(x).float())`` path: values and the
gradients of the hidden states and the head, fp32 and bf16 heads, and through the whole model."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv41.model.dsv4 import get_preset, token_logprobs as tl
from sglang_dsv41.model.dsv4.context import DSV4Context
from sglang_dsv41.model.dsv4.model import DSV4ForCausalLM, init_weights


def _plain(hidden, weight, targets):
    logits = torch.nn.functional.linear(hidden, weight).float()
    return logits.log_softmax(-1).gather(1, targets[:, None]).squeeze(1)


def _value_and_grads(fn, hidden, weight, targets, upstream):
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    out = fn(h, w, targets)
    (out * upstream).sum().backward()
    return out.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk_rows", [1, 7, 64, 1000])
def test_chunked_equals_plain_in_fp32(monkeypatch, chunk_rows):
    vocab, dim, rows = 97, 24, 61
    monkeypatch.setattr(tl, "LOGPROB_CHUNK_ELEMENTS", chunk_rows * vocab)
    gen = torch.Generator().manual_seed(chunk_rows)
    hidden = torch.randn(rows, dim, generator=gen)
    weight = torch.randn(vocab, dim, generator=gen) * 0.5
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[3] = targets[4]  # the same token on several rows: the head gradient sums them
    upstream = torch.randn(rows, generator=gen)  # like the PPO loss: a weight per token
    got = _value_and_grads(tl.token_logprobs, hidden, weight, targets, upstream)
    want = _value_and_grads(_plain, hidden, weight, targets, upstream)
    for g, w, what in zip(got, want, ("logp", "d hidden", "d head")):
        assert g.dtype == w.dtype, what
        assert (g - w).abs().max() <= 1e-6 * max(1.0, w.abs().max()), what


def _float64(hidden, weight, targets, upstream):
    return _value_and_grads(_plain, hidden.double(), weight.double(), targets, upstream.double())


def _rel(got, want):
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("chunk_rows,k_chunk", [(5, 16), (1000, 1024)])
def test_tf32x3_split_on_the_cpu_is_fp32_accurate(monkeypatch, chunk_rows, k_chunk):
    """On a CPU (no TF32) the three products of the split operands are fp32 ones: the split's
    algebra (masks, transposes, inner-dimension chunks, accumulation, the in-place remainder) is
    what is checked: as close to float64 as the plain fp32 path. A wrong part (hi twice, lo
    dropped) is off by ~1e-3 (the last check)."""
    vocab, dim, rows = 131, 48, 23
    monkeypatch.setattr(tl, "LOGPROB_CHUNK_ELEMENTS", chunk_rows * vocab)
    monkeypatch.setattr(tl, "TF32_K_CHUNK", k_chunk)
    gen = torch.Generator().manual_seed(chunk_rows)
    hidden = torch.randn(rows, dim, generator=gen)
    weight = torch.randn(vocab, dim, generator=gen) * 0.5
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    upstream = torch.randn(rows, generator=gen)
    want = _float64(hidden, weight, targets, upstream)
    got = _value_and_grads(lambda h, w, t: tl.token_logprobs(h, w, t, "tf32x3"), hidden, weight,
                           targets, upstream)
    ieee = _value_and_grads(tl.token_logprobs, hidden, weight, targets, upstream)
    for g, i, w, what in zip(got, ieee, want, ("logp", "d hidden", "d head")):
        assert g.dtype == torch.float32, what
        assert _rel(g, w) <= max(4 * _rel(i, w), 1e-6), what
    hi = tl.split_operand(hidden, "tf32x3")[0]
    assert _rel(hi, hidden.double()) > 1e-4  # hi alone is TF32-coarse
    # tf32x3-logits: the same split logits, gradients from the unsplit operands (one product:
    # fp32 on a CPU) -> the same logp to the bit, gradients as close to float64 as ieee's.
    mixed = _value_and_grads(lambda h, w, t: tl.token_logprobs(h, w, t, "tf32x3-logits"),
                             hidden, weight, targets, upstream)
    assert torch.equal(mixed[0], got[0])
    for g, i, w, what in zip(mixed[1:], ieee[1:], want[1:], ("d hidden", "d head")):
        assert g.dtype == torch.float32 and _rel(g, w) <= max(4 * _rel(i, w), 1e-6), what


@pytest.mark.skipif(not torch.cuda.is_available(), reason="TF32 tensor cores: CUDA only")
def test_tf32x3_on_a_gpu_is_close_to_float64():
    """The real TF32 products, the small preset's head size: logp (what the trainer compares
    with the server's) within 4x the plain fp32 GEMMs' distance to float64; both gradients
    within 3e-5 (d hidden is rounded to bf16 next, 3.9e-3). One plain TF32 pass (torch's
    "high" fp32 precision) misses both by far (measured 1.1e-4 logp, 5.6e-4 d hidden)."""
    gen = torch.Generator().manual_seed(0)
    rows, dim, vocab = 4096, 1024, 32000
    hidden = torch.randn(rows, dim, generator=gen).cuda()
    weight = (torch.randn(vocab, dim, generator=gen) * 0.05).cuda()
    targets = torch.randint(0, vocab, (rows,), generator=gen).cuda()
    upstream = torch.randn(rows, generator=gen).cuda()
    want = _float64(hidden, weight, targets, upstream)
    ieee = _value_and_grads(tl.token_logprobs, hidden, weight, targets, upstream)
    got = _value_and_grads(lambda h, w, t: tl.token_logprobs(h, w, t, "tf32x3"), hidden, weight,
                           targets, upstream)
    with tl.fp32_matmul("tf32"):
        one_pass = _value_and_grads(_plain, hidden, weight, targets, upstream)
    assert _rel(got[0], want[0]) <= 4 * _rel(ieee[0], want[0])
    assert _rel(one_pass[0], want[0]) > 4 * _rel(ieee[0], want[0])
    for i, what in ((1, "d hidden"), (2, "d head")):
        assert _rel(got[i], want[i]) <= 3e-5, (what, _rel(got[i], want[i]))
        assert _rel(one_pass[i], want[i]) > 3e-5, what
    # tf32x3-logits: tf32x3's logp to the bit; gradients of one TF32 product, within 2e-3
    # (bf16's rounding is 3.9e-3) and coarser than tf32x3's (so the product is TF32's).
    mixed = _value_and_grads(lambda h, w, t: tl.token_logprobs(h, w, t, "tf32x3-logits"),
                             hidden, weight, targets, upstream)
    assert torch.equal(mixed[0], got[0])
    for i, what in ((1, "d hidden"), (2, "d head")):
        assert 3e-5 < _rel(mixed[i], want[i]) <= 2e-3, (what, _rel(mixed[i], want[i]))


def test_an_unknown_fp32_gemm_is_refused():
    with pytest.raises(ValueError, match="fp32_gemm 'tf32' is not one of"):
        tl.token_logprobs(torch.zeros(4, 8), torch.zeros(10, 8), torch.zeros(4, dtype=torch.long),
                          "tf32")


def test_bf16_head_keeps_its_meaning(monkeypatch):
    """--no-fp32-lm-head: bf16 logits read in fp32, bf16 gradients, as head(x).float() gives."""
    monkeypatch.setattr(tl, "LOGPROB_CHUNK_ELEMENTS", 16 * 200)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 32, generator=gen).bfloat16()
    weight = (torch.randn(200, 32, generator=gen) * 0.3).bfloat16()
    targets = torch.randint(0, 200, (50,), generator=gen)
    upstream = torch.randn(50, generator=gen)
    got = _value_and_grads(tl.token_logprobs, hidden, weight, targets, upstream)
    want = _value_and_grads(_plain, hidden, weight, targets, upstream)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.bfloat16
    # the same bf16 logits; x - logsumexp vs log_softmax differ in the last fp32 bits only
    assert (got[0] - want[0]).abs().max() <= 1e-6 * want[0].abs().max()
    for g, w in zip(got[1:], want[1:]):
        assert (g.float() - w.float()).abs().max() <= 2e-2 * w.float().abs().max()


def test_the_model_returns_the_targets_logprobs_without_the_logits(monkeypatch):
    monkeypatch.setattr(tl, "LOGPROB_CHUNK_ELEMENTS", 5 * 320)  # tiny's vocab 320, 5 rows
    torch.manual_seed(0)
    model = DSV4ForCausalLM(get_preset("tiny"))
    init_weights(model, seed=1, std=0.08)
    seqs = [23, 18]
    ids = torch.randint(0, 256, (sum(seqs),))
    # as trainer_bridge.batch.pack: row t predicts token t + 1 of its own sequence
    hidden_index = torch.tensor([*range(0, 22), *range(23, 40)])
    targets = ids[hidden_index + 1]
    logp = model(ids, DSV4Context.packed(seqs), hidden_index=hidden_index, targets=targets)
    logp.sum().backward()
    got = [logp.detach()] + [p.grad.clone() for p in (model.head.weight, model.embed.weight)]
    model.zero_grad()
    logits = model(ids, DSV4Context.packed(seqs))
    plain = logits.index_select(0, hidden_index).float().log_softmax(-1)
    plain = plain.gather(1, targets[:, None]).squeeze(1)
    plain.sum().backward()
    want = [plain.detach()] + [p.grad for p in (model.head.weight, model.embed.weight)]
    for g, w in zip(got, want):
        assert (g - w).abs().max() <= 1e-5 * max(1.0, w.abs().max())


def test_a_rollout_temperature_gives_the_servers_distribution():
    """At temperature T the trainer's logprobs are log_softmax(logits / T), what the server
    returns for tokens it sampled at T (SGLang's default, engine/sampling.py)."""
    torch.manual_seed(0)
    model = DSV4ForCausalLM(get_preset("tiny"))
    init_weights(model, seed=1, std=0.08)
    ids = torch.randint(0, 256, (12,))
    hidden_index, targets = torch.arange(11), ids[1:]
    with torch.no_grad():
        logits = model(ids, DSV4Context.packed([12])).float()[:11]
        for t in (0.7, 1.0, 2.5):
            got = model(ids, DSV4Context.packed([12]), hidden_index=hidden_index,
                        targets=targets, temperature=t)
            want = (logits / t).log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        model(ids, DSV4Context.packed([12]), hidden_index=hidden_index, targets=targets,
              temperature=0.0)


def test_bad_inputs_are_refused():
    model = DSV4ForCausalLM(get_preset("tiny"))
    ids = torch.randint(0, 256, (8,))
    with pytest.raises(ValueError, match="together"):
        model(ids, DSV4Context.packed([8]), hidden_index=torch.arange(7))
    with pytest.raises(ValueError, match=r"in \[0, 320\)"):
        model(ids, DSV4Context.packed([8]), hidden_index=torch.arange(7),
              targets=torch.full((7,), 320))
    with pytest.raises(ValueError, match="must be"):
        tl.token_logprobs(torch.zeros(4, 8), torch.zeros(10, 8), torch.zeros(3, dtype=torch.long))


def test_the_policy_checks_targets_on_the_host():
    """CUDA targets are not read back by token_logprobs (a host sync per micro-batch): the
    trainer's Policy checks the micro-batch's host copy before the forward."""
    from trainer_bridge.batch import Sample, pack
    from trainer_bridge.policy import Policy

    model = DSV4ForCausalLM(get_preset("tiny"))
    policy = Policy(model, "tiny", torch.device("cpu"))
    mb = pack([Sample([1, 2, 999], [0, 1, 1], [0.0] * 3, 1.0, 0)], policy.routed_layers, False)

    def not_reached(*args, **kwargs):
        raise AssertionError("the model ran on targets out of the vocabulary")
    model.forward = not_reached
    with pytest.raises(ValueError, match=r"in \[0, 320\)"):
        policy.forward(mb, replay=False)
    tl.check_targets(torch.tensor([0, 319]), 320)
    with pytest.raises(ValueError, match=r"in \[0, 320\)"):
        tl.check_targets(torch.tensor([-1]), 320)


def test_a_kept_single_chunk_serves_one_backward_then_recomputes():
    """When every row fits one chunk the forward keeps its log_softmax for the backward; a
    second backward of the same graph (retain_graph) recomputes it and gets the same grads."""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(9, 16, generator=gen).requires_grad_(True)
    weight = torch.randn(50, 16, generator=gen).requires_grad_(True)
    out = tl.token_logprobs(hidden, weight, torch.randint(0, 50, (9,), generator=gen))
    out.sum().backward(retain_graph=True)
    first = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    out.sum().backward()
    assert torch.equal(hidden.grad, first[0]) and torch.equal(weight.grad, first[1])
