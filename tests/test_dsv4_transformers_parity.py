"""Parity of our V4 model with transformers 5.23's DeepseekV4ForCausalLM (the public training
definition), on the same weights: logits and every parameter gradient, fp32 CPU. transformers
loads our flat checkpoint through its own deepseek_v4 conversion mapping, so the names are
checked against transformers' code, not against our map alone."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from sglang_dsv41.model.dsv4 import get_preset, names
from sglang_dsv41.model.dsv4.context import DSV4Context
from sglang_dsv41.model.dsv4.model import DSV4ForCausalLM, init_weights

transformers = pytest.importorskip("transformers")
assert transformers.__version__ == "5.23.0", transformers.__version__
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402

SEQ = 272  # > 2 x 128: two HCA blocks; 68 CSA blocks for a top-4 indexer to choose from


def random_model(seed: int) -> DSV4ForCausalLM:
    """Every parameter and routing buffer non-trivial (sinks, ape, mHC bases, router bias)."""
    cfg = get_preset("tiny-v4")
    torch.manual_seed(seed)
    model = DSV4ForCausalLM(cfg)
    init_weights(model, seed=seed, std=0.08)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("ape"):
                p.add_(torch.randn_like(p) * 0.3)
        for name, b in model.named_buffers():
            if name.endswith("gate.bias"):
                b.copy_(torch.randn_like(b) * 0.5)
    return model


def transformers_twin(model: DSV4ForCausalLM, tmp_path) -> DeepseekV4ForCausalLM:
    """Save our flat checkpoint and let transformers load it with its own name conversion."""
    hf_cfg = DeepseekV4Config(**names.to_transformers_config(model.cfg))
    hf_cfg.save_pretrained(tmp_path)
    save_file({k: v.clone() for k, v in model.state_dict().items()},  # experts: views
              str(tmp_path / "model.safetensors"))
    twin = DeepseekV4ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    return twin.eval()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    model = random_model(seed=1234)
    return model, transformers_twin(model, tmp_path_factory.mktemp("hf"))


def test_transformers_loads_every_flat_name_to_the_same_tensor(pair):
    model, twin = pair
    expected = names.to_transformers(model.state_dict())
    got = twin.state_dict()
    assert set(got) == set(expected)
    for name, t in expected.items():
        assert torch.equal(got[name].to(t.dtype), t), name


def test_name_map_round_trips_every_tensor(pair):
    model, twin = pair
    flat = model.state_dict()
    back = names.from_transformers(names.to_transformers(flat))
    assert set(back) == set(flat)
    for k, v in flat.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    again = names.to_transformers(names.from_transformers(twin.state_dict()))
    assert all(torch.equal(again[k], v.to(again[k].dtype)) for k, v in twin.state_dict().items())


def test_logits_and_gradients_match_transformers(pair):
    model, twin = pair
    torch.manual_seed(7)
    ids = torch.randint(0, model.cfg.vocab_size, (2, SEQ))
    ctx = DSV4Context.packed([SEQ, SEQ])
    ours = model(ids.flatten(), ctx)
    theirs = twin(input_ids=ids).logits.reshape(-1, model.cfg.vocab_size)
    scale = theirs.abs().max()
    assert (ours - theirs).abs().max() <= 1e-4 * scale, (ours - theirs).abs().max()

    probe = torch.randn_like(ours)
    (ours * probe).sum().backward()
    (theirs * probe).sum().backward()
    grads = names.to_transformers({k: torch.zeros_like(p) if p.grad is None else p.grad
                                   for k, p in model.named_parameters()})
    checked = 0
    for name, p in twin.named_parameters():
        g_ref = torch.zeros_like(p) if p.grad is None else p.grad
        g = grads[name]
        tol = 1e-4 * g_ref.abs().max().clamp_min(1e-6)
        assert (g - g_ref).abs().max() <= tol, (name, (g - g_ref).abs().max().item(), tol.item())
        checked += 1
    assert checked == len(list(twin.parameters()))


def test_hash_layers_route_by_tid2eid_exactly(pair):
    model, _ = pair
    ids = torch.randint(0, model.cfg.vocab_size, (64,))
    ctx = DSV4Context.packed([64], record_routing=True)
    model(ids, ctx)
    for layer in range(model.cfg.num_hidden_layers):
        routed, weights = ctx.routed[layer]
        gate = model.layers[layer].ffn.gate
        if model.cfg.is_hash_layer(layer):
            assert torch.equal(routed, gate.tid2eid[ids].long())
        else:
            assert not torch.equal(routed.sort(-1).values,
                                   gate.tid2eid[ids].long().sort(-1).values
                                   if hasattr(gate, "tid2eid") else routed.sort(-1).values + 1)
        assert torch.allclose(weights.sum(-1), torch.full((64,), model.cfg.routed_scaling_factor))
