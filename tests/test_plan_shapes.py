"""plan/shapes.py's tensor inventory (what the planner counts for v41-flash, never built) equals
the real model's state_dict, names, shapes and checkpoint dtypes, for every preset the model can
build, so the two descriptions cannot drift apart. The model is built on the meta device with
bf16 as the default dtype, as SGLang builds it: what it keeps in fp32 or fp8 shows."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv41.model.dsv4 import get_preset
from sglang_dsv41.model.dsv4.model import DSV4ForCausalLM, default_dtype
from sglang_dsv41.plan.shapes import checkpoint_dtype, count_parameters, text_tensor_specs


def model_specs(cfg) -> dict[str, tuple[list[int], torch.dtype]]:
    with default_dtype(torch.bfloat16), torch.device("meta"):
        model = DSV4ForCausalLM(cfg)
    return {n: (list(t.shape), checkpoint_dtype(n, t.dtype)) for n, t in model.state_dict().items()}


@pytest.mark.parametrize("preset", ["tiny", "tiny-v4", "small"])
def test_specs_equal_the_models_state_dict(preset):
    cfg = get_preset(preset)
    want, got = model_specs(cfg), text_tensor_specs(cfg)
    assert sorted(set(want) - set(got)) == [] and sorted(set(got) - set(want)) == []
    wrong = {n: (got[n], want[n]) for n in want if got[n] != want[n]}
    assert wrong == {}
    # The checkpoint keeps what serving needs in full precision or byte-exact.
    dtypes = {n.rsplit(".", 1)[-1] if "engram" not in n else n.split(".", 2)[-1]: d
              for n, (_, d) in got.items()}
    assert dtypes["attn_sink"] == dtypes["hc_attn_fn"] == dtypes["bias"] == torch.float32
    assert dtypes["tid2eid"] == torch.int32
    if cfg.engram_layer_ids:
        assert dtypes["engram.embed.weight"] == torch.float8_e4m3fn
        assert dtypes["engram.embed.scale"] == torch.float8_e8m0fnu
    n_model = sum(_numel(s) for n, (s, _) in want.items()
                  if not n.endswith((".tid2eid", ".embed.scale", ".embed.weight")))
    assert count_parameters(cfg) == n_model


def _numel(shape: list[int]) -> int:
    k = 1
    for s in shape:
        k *= s
    return k


def test_norms_are_bf16_in_checkpoints_though_the_model_computes_them_in_fp32():
    assert checkpoint_dtype("layers.0.attn.kv_norm.weight", torch.float32) == torch.bfloat16
    assert checkpoint_dtype("norm.weight", torch.float32) == torch.bfloat16
    assert checkpoint_dtype("layers.0.attn.attn_sink", torch.float32) == torch.float32
    assert checkpoint_dtype("layers.1.engram.embed.scale",
                            torch.float8_e8m0fnu) == torch.float8_e8m0fnu
