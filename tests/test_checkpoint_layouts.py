"""make_checkpoint's weights are the real model's (DSV4ForCausalLM + init_weights) in checkpoint
dtypes, and ``--layout hf`` is transformers' own DeepseekV4 checkpoint of them: transformers
5.23 reloads it and gives our model's logits. The model holds each layer's routed experts
stacked, yet its state dict is the checkpoint's, per expert, both ways."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sglang_dsv41.loader.serving import load_serving_model
from sglang_dsv41.loader.shards import INDEX_FILE, checkpoint_files
from sglang_dsv41.model.dsv4 import get_preset
from sglang_dsv41.model.dsv4.context import DSV4Context
from sglang_dsv41.model.dsv4.model import DSV4ForCausalLM, init_weights
from sglang_dsv41.model.dsv4.names import from_transformers, storable_state, to_transformers
from sglang_dsv41.plan.shapes import text_tensor_specs
from sglang_dsv41.tools.make_checkpoint import main as make_checkpoint_main
from sglang_dsv41.tools.make_checkpoint import make_checkpoint, random_text_tensors

transformers = pytest.importorskip("transformers")
assert transformers.__version__ == "5.23.0", transformers.__version__
from transformers import DeepseekV4ForCausalLM  # noqa: E402

SEED = 11
SEQ = 272  # > 2 x 128: two HCA blocks, and CSA blocks for the indexer to choose from


def read_dir(d) -> dict[str, torch.Tensor]:
    out = {}
    for file in checkpoint_files(str(d)):
        with safe_open(os.path.join(d, file), "pt") as f:
            out.update({n: f.get_tensor(n) for n in f.keys()})
    return out


def test_bf16_layout_holds_the_models_init_weights(tmp_path):
    cfg = get_preset("tiny")
    make_checkpoint(str(tmp_path / "bf16"), cfg, "bf16", seed=SEED, num_shards=2)
    model = DSV4ForCausalLM(cfg)  # fp32, as the tests and the trainer build it
    init_weights(model, SEED)
    want = model.state_dict()
    got = read_dir(tmp_path / "bf16")
    specs = text_tensor_specs(cfg)  # checkpoint dtypes (tests/test_plan_shapes.py: = the model)
    assert set(got) == set(want)
    for n, t in want.items():
        dtype = specs[n][1]
        assert got[n].dtype == dtype, n
        assert torch.equal(got[n].view(torch.uint8), t.to(dtype).view(torch.uint8)), n
    assert got["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16
    assert got["layers.0.attn_norm.weight"].dtype == torch.bfloat16
    assert got["layers.0.hc_attn_fn"].dtype == torch.float32
    # a different seed gives different weights
    other = random_text_tensors(cfg, SEED + 1)
    assert not torch.equal(other["layers.0.attn.wq_a.weight"], got["layers.0.attn.wq_a.weight"])


def test_hf_layout_is_written_by_transformers_and_gives_our_logits(tmp_path):
    cfg = get_preset("tiny-v4")
    out = tmp_path / "hf"
    make_checkpoint(str(out), cfg, "hf", seed=SEED, num_shards=3)
    config = json.load(open(out / "config.json"))
    assert config["model_type"] == "deepseek_v4" and config["architectures"] == [
        "DeepseekV4ForCausalLM"]
    assert len([f for f in os.listdir(out) if f.endswith(".safetensors")]) >= 3
    stored = read_dir(out)
    sinks = [t for n, t in stored.items() if "sinks" in n or "attn_sink" in n]
    assert sinks and all(t.dtype == torch.float32 for t in sinks)
    assert {t.dtype for n, t in stored.items() if "experts" in n} == {torch.bfloat16}

    twin = DeepseekV4ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = DSV4ForCausalLM(cfg).eval()
    ours.load_state_dict(random_text_tensors(cfg, SEED), strict=True)
    ids = torch.randint(0, cfg.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ours(ids[0], DSV4Context.packed([SEQ]))
        got = twin(input_ids=ids).logits[0]
    scale = want.abs().max()
    assert scale > 0.1
    assert (got - want).abs().max() <= 1e-4 * scale, (got - want).abs().max()


def test_hf_layout_refuses_v41_presets(tmp_path):
    with pytest.raises(ValueError, match="--layout hf needs a V4 preset"):
        make_checkpoint(str(tmp_path / "hf"), get_preset("tiny"), "hf")
    assert not (tmp_path / "hf").exists()


def test_stacked_routed_experts_round_trip_under_per_expert_names(tmp_path):
    """bf16 checkpoint -> model -> safetensors -> a fresh model: the same names in the same
    order and the same values, though each MoE layer holds two expert parameters, not 3E."""
    cfg = get_preset("tiny")
    make_checkpoint(str(tmp_path / "bf16"), cfg, "bf16", seed=SEED, num_shards=2)
    stored = read_dir(tmp_path / "bf16")
    model = load_serving_model(str(tmp_path / "bf16"), torch.float32, "cpu")
    n_exp, hidden, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    layer = dict(model.layers[3].named_parameters())
    assert layer["ffn.experts.w13"].shape == (n_exp, 2 * inter, hidden)
    assert layer["ffn.experts.w2"].shape == (n_exp, hidden, inter)
    assert not [n for n in layer if n.startswith("ffn.experts.") and n[12].isdigit()]

    state = model.state_dict()
    assert set(state) == set(stored)
    for n, t in state.items():
        assert torch.equal(t.to(stored[n].dtype).view(torch.uint8), stored[n].view(torch.uint8)), n
    # The per-expert entries are views: expert 5's w3 is the second half of its w13 rows.
    assert torch.equal(state["layers.3.ffn.experts.5.w3.weight"],
                       model.layers[3].ffn.experts.w13[5, inter:])

    # safetensors takes the per-expert views as they are: nothing is copied for it.
    storable = storable_state(state)
    assert all(storable[n] is t for n, t in state.items())
    save_file(storable, str(tmp_path / "again.safetensors"))
    again = load_file(str(tmp_path / "again.safetensors"))
    fresh = DSV4ForCausalLM(cfg)
    fresh.load_state_dict(again, strict=True)
    back = fresh.state_dict()
    assert list(back) == list(state)
    for n, t in state.items():
        assert torch.equal(back[n].view(torch.uint8), t.view(torch.uint8)), n

    missing = dict(again)
    del missing["layers.3.ffn.experts.5.w3.weight"]
    with pytest.raises(RuntimeError, match=r"layers\.3\.ffn\.experts\.5\.w3\.weight: missing"):
        fresh.load_state_dict(missing)
    misshapen = dict(again, **{"layers.3.ffn.experts.2.w2.weight": torch.zeros(inter, hidden)})
    with pytest.raises(RuntimeError, match=r"experts\.2\.w2\.weight: shape \[%d, %d\]" % (
            inter, hidden)):
        fresh.load_state_dict(misshapen)


def test_storable_state_copies_only_casts_overlaps_and_strided_tensors():
    stack = torch.arange(24.0).reshape(2, 4, 3)
    named = {"a": stack[0, :2], "b": stack[0, 2:], "c": stack[1], "whole": stack[1, :1],
             "t": stack[0].t(), "cast": torch.ones(3)}
    out = storable_state(named, lambda n, t: torch.bfloat16 if n == "cast" else t.dtype)
    assert [n for n in named if out[n] is named[n]] == ["a", "b", "c"]
    assert out["whole"].data_ptr() != stack[1].data_ptr() and out["t"].is_contiguous()
    assert out["cast"].dtype == torch.bfloat16
    assert all(torch.equal(out[n].float(), named[n].float()) for n in named)
    save_file(out, "/dev/null")   # what safetensors would refuse is gone


def test_unknown_parameter_names_are_refused_by_name():
    with pytest.raises(ValueError, match=r"parameter 'layers\.0\.engram\.wkv\.weight'"):
        to_transformers({"layers.0.engram.wkv.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"parameter 'model\.layers\.0\.mlp\.bogus'"):
        from_transformers({"model.layers.0.mlp.bogus": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.down_proj: missing"):
        from_transformers({"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(2, 4, 2)})


def test_hf_layout_and_its_loading_need_no_test_shim(tmp_path):
    """On the README's CPU install transformers' DeepseekV4 import reaches a torchvision whose
    operators cannot load: make_checkpoint --layout hf and the serving loader install the
    package's shim themselves. A fresh interpreter, without tests/conftest.py's."""
    out = str(tmp_path / "hf")
    code = f"""
import torch
from sglang_dsv41.tools.make_checkpoint import main
assert main([{out!r}, "--preset", "tiny-v4", "--layout", "hf", "--num-shards", "2"]) == 0
from sglang_dsv41.loader.serving import load_serving_model
load_serving_model({out!r}, torch.float32, "cpu")
print("loaded")
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, cwd=root)
    assert p.returncode == 0 and "loaded" in p.stdout, p.stderr[-3000:]


def test_serving_loader_names_the_corrupt_or_duplicated_shard(tmp_path):
    ckpt = tmp_path / "bf16"
    make_checkpoint(str(ckpt), get_preset("tiny"), "bf16", seed=SEED, num_shards=3)
    files = sorted(checkpoint_files(str(ckpt)))
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    os.truncate(bad / files[1], os.path.getsize(bad / files[1]) - 100)
    with pytest.raises(ValueError, match=f"corrupt checkpoint shard .*{files[1]}"):
        load_serving_model(str(bad), torch.float32, "cpu")
    # A tensor stored twice: which copy the index means cannot be guessed.
    shutil.copyfile(ckpt / files[1], bad / files[1])
    first = load_file(str(bad / files[0]))
    name = next(iter(first))
    save_file({**load_file(str(bad / files[2])), name: first[name]}, str(bad / files[2]))
    with pytest.raises(ValueError, match=f"'{re.escape(name)}' is stored in two shards, "
                                         f".*{files[0]} and .*{files[2]}"):
        load_serving_model(str(bad), torch.float32, "cpu")


def test_serving_loader_reads_the_index_and_a_dummy_load_needs_the_frozen_tensors(tmp_path):
    cfg = get_preset("tiny")
    ckpt = tmp_path / "bf16"
    make_checkpoint(str(ckpt), cfg, "bf16", seed=SEED, num_shards=3)
    want = load_serving_model(str(ckpt), torch.float32, "cpu").state_dict()
    # a stray shard the index does not list (an older sharding's): not read, as SGLang
    tid2eid = next(n for n in want if n.endswith("tid2eid"))
    save_file({tid2eid: torch.zeros_like(want[tid2eid])}, str(ckpt / "model-00009.safetensors"))
    got = load_serving_model(str(ckpt), torch.float32, "cpu", "dummy").state_dict()
    assert torch.equal(got[tid2eid], want[tid2eid])
    # the frozen tensors missing (here from the index and its shard): refused, not left at
    # their construction values (tid2eid zeros: every token to expert 0)
    index = json.loads((ckpt / INDEX_FILE).read_text())
    file = index["weight_map"].pop(tid2eid)
    (ckpt / INDEX_FILE).write_text(json.dumps(index))
    save_file({n: t for n, t in load_file(str(ckpt / file)).items() if n != tid2eid},
              str(ckpt / file))
    with pytest.raises(ValueError, match=f"lacks 1 frozen tensor.*{re.escape(tid2eid)}"):
        load_serving_model(str(ckpt), torch.float32, "cpu", "dummy")


def test_make_checkpoint_cli_refuses_bad_outputs_in_one_line(tmp_path, capsys):
    """An OUT whose parent is a file, or a non-empty directory this tool did not write (only
    with --force): `error: ...`, exit 1, nothing touched; --help in whole sentences."""
    (tmp_path / "afile").write_text("x")
    assert make_checkpoint_main([str(tmp_path / "afile" / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and f"{tmp_path / 'afile'} is not a directory" in err
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("precious")
    assert make_checkpoint_main([str(home), "--layout", "bf16"]) == 1
    assert "--force" in capsys.readouterr().err and (home / "thesis.tex").exists()
    assert make_checkpoint_main([str(home), "--layout", "bf16", "--force"]) == 0
    assert not (home / "thesis.tex").exists() and (home / "config.json").exists()
    assert make_checkpoint_main([str(home), "--layout", "bf16"]) == 0  # its own output
    assert sorted(os.listdir(tmp_path)) == ["afile", "home"]
    with pytest.raises(SystemExit):
        make_checkpoint_main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert ("Write a random checkpoint of a preset: the real V4.1 release layout, the "
            "converted bf16 one, or transformers' DeepseekV4 layout.") in out
    assert "--force" in out
