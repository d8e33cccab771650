"""transformers' DeepseekV4ForCausalLM with the registered DSV4 kernel vs its own eager attention.

Tiny fp32 config on the CPU with sliding, CSA and HCA layers; compress rates small and the
sequence long enough that HCA has several blocks and CSA's indexer really selects (top-k below
the number of ready blocks). The kernel runs under TRITON_INTERPRET=1 (or on CUDA).
"""

import os
import subprocess
import sys

import pytest
import torch

import sglang_dsv41.attention.transformers_backend as backend
from sglang_dsv41.attention import register_transformers_attention
from tests.sglang_cpu import install_torchvision_shim

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                reason="Triton needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cpu" if INTERPRET else "cuda"


def _tiny_model():
    if not torch.cuda.is_available():  # the CPU venv's torchvision is a CUDA build (shim)
        install_torchvision_shim()
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    config = DeepseekV4Config(
        vocab_size=64, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, head_dim=64, q_lora_rank=32, num_experts_per_tok=2,
        n_routed_experts=4, n_shared_experts=1, o_groups=2, o_lora_rank=16, index_n_heads=2,
        index_head_dim=16, index_topk=3, sliding_window=8, hc_mult=2, hc_sinkhorn_iters=3,
        num_nextn_predict_layers=0, partial_rotary_factor=0.25,
        layer_types=["sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention"],
        mlp_layer_types=["moe"] * 3,
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 8},
        attn_implementation="eager")
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(config).to(DEVICE)
    with torch.no_grad():  # random sinks and position biases: zeros would hide their gradients
        for name, param in model.named_parameters():
            if "sinks" in name or "position_bias" in name:
                param.normal_()
    return model


def _logits_and_grads(model, ids):
    model.zero_grad()
    logits = model(input_ids=ids).logits
    (logits.float().square().mean()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                             if p.grad is not None}


def test_registered_kernel_matches_eager(monkeypatch):
    monkeypatch.setenv("SGLANG_DSV41_ATTENTION_BACKEND", "triton")
    calls = {"kernel": 0}
    real = backend.dsv4_attention

    def counted(*args, **kwargs):
        calls["kernel"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(backend, "dsv4_attention", counted)
    model = _tiny_model()
    ids = torch.randint(0, 64, (2, 24), device=DEVICE, generator=None)
    eager_logits, eager_grads = _logits_and_grads(model, ids)

    name = register_transformers_attention()
    model.set_attn_implementation(name)
    logits, grads = _logits_and_grads(model, ids)
    assert calls["kernel"] == 3, f"kernel ran {calls['kernel']} times, expected once per layer"
    torch.testing.assert_close(logits, eager_logits, rtol=1e-4, atol=1e-4)
    assert grads.keys() == eager_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], eager_grads[n], rtol=1e-3, atol=1e-5, msg=n)
    # The indexer's top-k has no gradient; both compressors (CSA layer 1, HCA layer 2) do.
    for kind in ("sinks", "layers.1.self_attn.compressor.kv_proj", "layers.2.self_attn.compressor"):
        assert any(kind in n and grads[n].abs().sum() > 0 for n in grads), kind


def test_selection_from_mask_lists_allowed_columns():
    allowed = torch.tensor([[[True, False, True], [False, False, False]]])
    assert backend.selection_from_mask(allowed).tolist() == [[[0, 2], [-1, -1]]]


def test_registration_needs_no_test_shim():
    """On the README's CPU install transformers' imports reach a torchvision whose operators
    cannot load (tests/conftest.py hides that): the registration installs the package's shim
    itself. A fresh interpreter, without the conftest's."""
    code = ("from sglang_dsv41.attention import register_transformers_attention\n"
            "print(register_transformers_attention())\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=root)
    assert p.returncode == 0 and p.stdout.split() == ["sglang_dsv41_dsv4"], p.stderr[-3000:]
