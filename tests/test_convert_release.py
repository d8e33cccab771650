"""Release (multimodal, FP8) -> text-only bf16 conversion on the tiny preset, checked against an
independent dequantization written here, plus the error paths."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang_dsv41 import convert as convert_mod
from sglang_dsv41.convert import convert, reference_logits, verify_conversion
from sglang_dsv41.loader.checkpoint import iter_checkpoint_tensors, load_model, save_checkpoint
from sglang_dsv41.loader.shards import INDEX_FILE
from sglang_dsv41.model import DSV41Config, build_model, get_preset
from sglang_dsv41.tokenizer import ByteTokenizer
from sglang_dsv41.tools.make_checkpoint import make_checkpoint

DRAFT_KEYS = ("num_nextn_predict_layers", "dspark_config", "draft_model_type")


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    out = tmp_path_factory.mktemp("release") / "fp32-scales"
    make_checkpoint(str(out), get_preset("tiny"), "release", seed=3, num_shards=4)
    return str(out)


def naive_text_weights(src: str) -> dict[str, torch.Tensor]:
    """Dequantize the release to fp32 the slow, obvious way: load everything, loop over blocks."""
    raw = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            raw.update(load_file(os.path.join(src, f)))
    block = json.load(open(os.path.join(src, "config.json")))["quantization_config"][
        "weight_block_size"]
    out = {}
    for name, t in raw.items():
        if not name.startswith("language_model.") or name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = raw[name + "_scale_inv"]
            s = (2.0 ** (s.view(torch.uint8).float() - 127) if s.dtype == torch.float8_e8m0fnu
                 else s.float())
            w = torch.empty(t.shape)
            for i in range(s.shape[0]):
                for j in range(s.shape[1]):
                    rows = slice(i * block[0], (i + 1) * block[0])
                    cols = slice(j * block[1], (j + 1) * block[1])
                    w[rows, cols] = t[rows, cols].float() * s[i, j]
            t = w
        out[name[len("language_model."):]] = t.float()
    return out


def logits_max_diff(src: str, dst: str) -> tuple[float, float]:
    cfg = DSV41Config.from_pretrained(dst)
    ref = build_model(cfg, torch.float32, seed=None)
    ref.load_state_dict(naive_text_weights(src), strict=True)
    got = load_model(dst, dtype=torch.float32)
    seqs = convert_mod.prompt_ids(cfg)
    a, b = reference_logits(ref, seqs), reference_logits(got, seqs)
    return float((a - b).abs().max()), float(a.abs().max())


def test_release_converts_to_text_only_bf16(release, tmp_path):
    src_cfg = json.load(open(os.path.join(release, "config.json")))
    src_shards = {f for f in os.listdir(release) if f.endswith(".safetensors")}
    assert len(src_shards) >= 4
    assert {"vision_config", "quantization_config", "dspark_config"} <= set(src_cfg)
    dst = str(tmp_path / "dst")
    assert convert_mod.main([release, dst, "--max-shard-size", "400KB", "--quiet"]) == 0

    cfg = json.load(open(os.path.join(dst, "config.json")))
    for key in ("quantization_config", "vision_config", "text_config", "image_token_index",
                *DRAFT_KEYS):
        assert key not in cfg, key
    assert not [k for k in cfg if k.startswith(("draft_", "mtp_", "dspark_", "vision_"))]
    for key, value in src_cfg["text_config"].items():
        if key not in DRAFT_KEYS:
            assert cfg[key] == value, key
    assert cfg["architectures"] == ["DeepseekV41ForCausalLM"]
    assert cfg["model_type"] == "deepseek_v41" and cfg["torch_dtype"] == "bfloat16"

    index = json.load(open(os.path.join(dst, INDEX_FILE)))
    tensors = dict(iter_checkpoint_tensors(dst))
    assert len(set(index["weight_map"].values())) >= 3
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert not [n for n in tensors if n.startswith(("vision", "multi_modal", "mtp", "language"))
                or "scale_inv" in n]
    expected = naive_text_weights(release)
    assert set(tensors) == set(expected)
    for name, t in tensors.items():  # bit-exact bf16 rounding of the independent dequant
        assert torch.equal(t, expected[name].to(torch.bfloat16)), name
    assert ByteTokenizer.from_pretrained(dst).vocab_size == cfg["vocab_size"]

    diff, max_logit = logits_max_diff(release, dst)
    assert 0 < diff <= convert_mod.VERIFY_RTOL * max(1.0, max_logit), (diff, max_logit)
    result = verify_conversion(release, dst)
    assert result.ok and result.tensors_checked == len(tensors), result.describe()
    assert result.max_logit_diff == pytest.approx(diff, rel=1e-6, abs=1e-7)


def test_ue8m0_scales_convert_exactly(tmp_path):
    src = str(tmp_path / "rel")
    make_checkpoint(src, get_preset("tiny"), "release", seed=4, num_shards=5, scale_fmt="ue8m0")
    scales = [t for n, t in iter_checkpoint_tensors(src) if n.endswith("_scale_inv")]
    assert scales and {t.dtype for t in scales} == {torch.float8_e8m0fnu}
    dst = str(tmp_path / "dst")
    convert(src, dst, progress=False)
    expected = naive_text_weights(src)
    for name, t in iter_checkpoint_tensors(dst):
        assert torch.equal(t, expected[name].to(torch.bfloat16)), name
    diff, max_logit = logits_max_diff(src, dst)
    assert diff <= convert_mod.VERIFY_RTOL * max(1.0, max_logit)


def test_verify_catches_a_wrong_dst_and_leaves_no_output(release, tmp_path, monkeypatch):
    good = str(tmp_path / "good")
    convert(release, good, progress=False)
    tensors = dict(iter_checkpoint_tensors(good))
    raw = {}
    for f in sorted(os.listdir(release)):
        if f.endswith(".safetensors"):
            raw.update(load_file(os.path.join(release, f)))
    name = "model.layers.2.mlp.experts.3.up_proj.weight"  # scale forgotten: raw fp8 values
    tensors[name] = raw["language_model." + name].to(torch.bfloat16)
    bad = str(tmp_path / "bad")
    save_checkpoint(tensors, bad, json.load(open(os.path.join(good, "config.json"))))
    result = verify_conversion(release, bad)
    assert not result.ok and result.tensors_not_bit_exact == [name]
    assert result.max_logit_diff > result.tolerance, result.describe()
    # A failed --verify exits non-zero and publishes nothing.
    monkeypatch.setattr(convert_mod, "VERIFY_RTOL", 0.0)
    dst = str(tmp_path / "dst")
    assert convert_mod.main([release, dst, "--verify", "--quiet"]) == 1
    assert not os.path.exists(dst)


def _copy(release: str, tmp_path) -> str:
    src = str(tmp_path / "src")
    shutil.copytree(release, src)
    return src


def _leftovers(tmp_path) -> list[str]:
    return sorted(f for f in os.listdir(tmp_path) if f.startswith("."))


@pytest.mark.parametrize("damage", ["missing_shard", "truncated_shard", "garbage_header",
                                    "missing_scale", "bad_config"])
def test_broken_release_errors_name_the_culprit(release, tmp_path, damage):
    src = _copy(release, tmp_path)
    shard = os.path.join(src, "model-00003-of-00004.safetensors")
    if damage == "missing_shard":
        os.remove(shard)
        match = "model-00003-of-00004.safetensors, which is missing"
    elif damage == "truncated_shard":
        data = open(shard, "rb").read()
        open(shard, "wb").write(data[: len(data) - 1000])
        match = "corrupt checkpoint shard .*model-00003-of-00004"
    elif damage == "garbage_header":
        open(shard, "r+b").write(b"\xff" * 16)
        match = "corrupt checkpoint shard .*model-00003-of-00004"
    elif damage == "missing_scale":
        index_path = os.path.join(src, INDEX_FILE)
        index = json.load(open(index_path))
        weight = next(n for n in index["weight_map"]
                      if n.startswith("language_model.") and n.endswith("q_proj.weight"))
        file = os.path.join(src, index["weight_map"].pop(weight + "_scale_inv"))
        tensors = load_file(file)
        del tensors[weight + "_scale_inv"]
        save_file(tensors, file)
        json.dump(index, open(index_path, "w"))
        match = f"FP8 weight '{weight}' .* has no scale tensor"
    else:
        open(os.path.join(src, "config.json"), "w").write("{ truncated")
        match = "corrupt config .*config.json"
    # An existing DST is kept as it was when the new conversion fails.
    dst = str(tmp_path / "dst")
    os.makedirs(dst)
    open(os.path.join(dst, "marker"), "w").write("old")
    with pytest.raises(ValueError, match=match):
        convert(src, dst, progress=False)
    assert os.listdir(dst) == ["marker"] and _leftovers(tmp_path) == []
    shutil.rmtree(dst)
    assert convert_mod.main([src, dst, "--quiet"]) == 1
    assert not os.path.exists(dst) and _leftovers(tmp_path) == []
