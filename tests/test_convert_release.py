"""Release layout -> text-only bf16: names, dtypes, byte-exact Engram/tid2eid, dequantized
values, SGLang 0.5.23's config flattening, atomicity under SIGKILL, corrupt input."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

from sglang_dsv41.convert import convert
from sglang_dsv41.loader.conversion_logits import verify_logits
from sglang_dsv41.loader.fp4 import dequantize_fp4
from sglang_dsv41.loader.fp8 import dequantize_fp8_blocks, scale_shape
from sglang_dsv41.loader.release_layout import is_dropped, normalize_v41_config, plan_conversion
from sglang_dsv41.loader.shards import INDEX_FILE, RawShardReader, checkpoint_files
from sglang_dsv41.model.dsv4 import get_preset
from sglang_dsv41.tools.make_checkpoint import make_checkpoint
from tests.sglang_cpu import import_sglang


def tiny_cfg():
    cfg = get_preset("tiny")
    if not cfg.engram_num_embeddings:  # rows = sum of SGLang's primes per layer
        layout = import_sglang("sglang.srt.layers.engram").EngramLayout.from_config(cfg)
        rows = [layout.column_bounds(i)[-1] for i in range(len(cfg.engram_layer_ids))]
        cfg = replace(cfg, engram_num_embeddings=rows)
    return cfg


def read_all(d):
    out = {}
    for file in checkpoint_files(str(d)):
        r = RawShardReader(os.path.join(d, file))
        out.update({n: r.read(n) for n in r.tensors})
        r.close()
    return out


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "release"
    make_checkpoint(str(out), tiny_cfg(), "release", seed=3, num_shards=4)
    return out


def test_release_has_real_names_and_dtypes(release):
    t = read_all(release)
    assert t["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert t["layers.0.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    assert t["layers.0.attn.attn_sink"].dtype == torch.float32
    assert t["layers.0.ffn.gate.tid2eid"].dtype == torch.int32
    assert t["layers.1.engram.embed.weight"].dtype == torch.float8_e4m3fn
    assert t["layers.1.engram.embed.scale"].dtype == torch.float8_e8m0fnu
    assert t["layers.3.ffn.experts.0.w1.weight"].dtype == torch.int8  # packed FP4
    assert any(n.startswith("vision.") for n in t) and any(n.startswith("mtp.") for n in t)
    assert "layers.3.ffn.gate.bias_vl" in t and len(checkpoint_files(str(release))) == 4
    cfg = json.load(open(release / "config.json"))
    assert cfg["quantization_config"]["weight_block_size"] == [32, 32]


def test_convert_dequantizes_and_copies_byte_exact(release, tmp_path):
    dst = tmp_path / "bf16"
    summary = convert(str(release), str(dst), max_shard_bytes=200_000, progress=False,
                      verify=True)
    assert summary["verify"]["differ"] == [] and summary["shards"] > 1
    logits = summary["verify"]["logits"]
    assert logits["ok"] and logits["tokens"] == 256 and logits["logit_scale"] > 0.1
    assert logits["max_abs_diff"] == 0  # e8m0 scales and FP4: exact in bf16
    src, out = read_all(release), read_all(dst)
    assert not any(n.startswith(("vision.", "aligner.", "image_", "mtp.")) or
                   n.endswith(".bias_vl") or n.endswith(".wq_a.scale") for n in out)
    for n in ("layers.1.engram.embed.weight", "layers.1.engram.embed.scale",
              "layers.0.ffn.gate.tid2eid"):
        assert out[n].dtype == src[n].dtype and torch.equal(
            out[n].view(torch.uint8), src[n].view(torch.uint8))
    w = "layers.0.attn.wq_b"
    assert out[w + ".weight"].dtype == torch.bfloat16
    assert torch.equal(out[w + ".weight"], dequantize_fp8_blocks(src[w + ".weight"],
                                                                 src[w + ".scale"], (32, 32)))
    e = "layers.3.ffn.experts.1.w2"
    assert torch.equal(out[e + ".weight"], dequantize_fp4(src[e + ".weight"], src[e + ".scale"]))
    assert out["layers.0.attn.attn_sink"].dtype == torch.float32


def test_config_flattened_as_sglang_and_loads(release, tmp_path):
    v41 = import_sglang("sglang.srt.configs.deepseek_v41")
    raw = json.load(open(release / "config.json"))
    assert normalize_v41_config(raw) == v41.normalize_deepseek_v41_config(raw)
    dst = tmp_path / "bf16"
    convert(str(release), str(dst), progress=False)
    flat = json.load(open(dst / "config.json"))
    assert "vision_config" not in flat and "quantization_config" not in flat
    assert flat["num_nextn_predict_layers"] == 0 and not any(k.startswith("dspark_") for k in flat)
    assert flat["compress_ratios"] == tiny_cfg().compress_ratios  # one per text layer
    cfg = v41.DeepseekV41Config(**flat)
    assert cfg.model_type == "deepseek_v41" and cfg.vision_n_layers == 0
    assert list(cfg.kv_source_layer_ids) == [3, 4]


@pytest.mark.parametrize("preset", ["tiny", "tiny-v4"])
def test_converted_config_is_the_presets(release, tmp_path, preset):
    """The bf16 config rebuilds the model the release was made from: V4 stays deepseek_v4
    (V4.1's router gate is keyed on model_type), V4.1 keeps every layer kind."""
    from dataclasses import asdict

    from sglang_dsv41.model.dsv4.config import DSV4Config

    src = release
    if preset != "tiny":
        src = tmp_path / "release"
        make_checkpoint(str(src), get_preset(preset), "release", seed=1, num_shards=2)
    raw = json.load(open(src / "config.json"))
    assert ("vision_config" in raw) == (preset == "tiny")
    convert(str(src), str(tmp_path / "bf16"), progress=False)
    got = asdict(DSV4Config.from_pretrained(str(tmp_path / "bf16")))
    want = asdict(get_preset(preset))
    got.pop("torch_dtype"), want.pop("torch_dtype")
    assert got == want


def test_corrupt_inputs_name_file_or_tensor(release, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(release, bad)
    shard = sorted(f for f in os.listdir(bad) if f.endswith(".safetensors"))[0]
    with open(bad / shard, "r+b") as f:
        f.truncate(os.path.getsize(bad / shard) - 10)
    with pytest.raises(ValueError, match=shard):
        convert(str(bad), str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()
    cfg = json.load(open(release / "config.json"))
    cfg["quantization_config"]["weight_block_size"] = [64, 64]
    bad2 = tmp_path / "bad2"
    shutil.copytree(release, bad2)
    json.dump(cfg, open(bad2 / "config.json", "w"))
    with pytest.raises(ValueError, match=r"scale 'layers\.\d+\..*\.scale' .* has shape"):
        convert(str(bad2), str(tmp_path / "out"), progress=False)


def test_sigkill_leaves_no_dst(release, tmp_path):
    dst = tmp_path / "killed"
    env = dict(os.environ, SGLANG_DSV41_CONVERT_SHARD_DELAY_S="30")
    p = subprocess.Popen([sys.executable, "-m", "sglang_dsv41.convert", str(release), str(dst),
                          "--quiet", "--max-shard-size", "100KB"], env=env)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not any(
                n.startswith(".killed.tmp-") and os.listdir(tmp_path / n)
                for n in os.listdir(tmp_path)):
            time.sleep(0.2)
        time.sleep(1)
        p.send_signal(signal.SIGKILL)
    finally:
        p.wait(timeout=30)
    assert p.returncode == -signal.SIGKILL and not dst.exists()
    convert(str(release), str(dst), progress=False)  # the next run cleans the dead sibling
    assert dst.exists() and not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_logit_check_fails_on_a_wrong_dst(release, tmp_path):
    dst = tmp_path / "bf16"
    convert(str(release), str(dst), progress=False)
    plan = plan_conversion(str(release))
    tensors = read_all(dst)
    for file in checkpoint_files(str(dst)):
        os.remove(dst / file)
    # The e8m0 exponent read one too high: every FP8 weight doubled.
    fp8 = [e.name for e in plan.entries if e.kind == "fp8"]
    for name in fp8:
        tensors[name] = tensors[name] * 2
    save_file(tensors, str(dst / "model-00001-of-00001.safetensors"))
    bad = verify_logits(plan, str(dst))
    assert not bad["ok"] and bad["mean_abs_diff"] > 2e-2 * bad["logit_spread"], bad
    table = tensors["layers.1.engram.embed.weight"]
    tensors["layers.1.engram.embed.weight"] = table.bfloat16()  # upcast: refused, not cast back
    save_file(tensors, str(dst / "model-00001-of-00001.safetensors"))
    with pytest.raises(ValueError, match=r"engram\.embed\.weight.* is torch\.bfloat16"):
        verify_logits(plan, str(dst))
    tensors["layers.1.engram.embed.weight"] = table
    del tensors["norm.weight"]
    save_file(tensors, str(dst / "model-00001-of-00001.safetensors"))
    with pytest.raises(ValueError, match=r"DST lacks \['norm\.weight'\]"):
        verify_logits(plan, str(dst))


def test_engram_wkv_scale_dequantizes_and_the_table_scale_stays(release, tmp_path):
    """SGLang 0.5.23 renames ``layers.N.engram.wkv.scale`` to wkv's weight_scale_inv (an FP8
    block scale) but keeps ``layers.N.engram.embed.scale`` (the table's own e8m0 scale): the
    converter must dequantize the first and copy the second byte for byte."""
    remap = import_sglang("sglang.srt.models.deepseek_v4").DeepseekV4ForCausalLM \
        .remap_weight_name_to_dpsk_hf_format
    src = read_all(release)
    wkv, table = "layers.5.engram.wkv", "layers.5.engram.embed"
    assert src[wkv + ".weight"].dtype == torch.float8_e4m3fn
    assert src[wkv + ".scale"].dtype == torch.float8_e8m0fnu
    assert list(src[wkv + ".scale"].shape) == list(scale_shape(src[wkv + ".weight"].shape,
                                                               (32, 32)))
    assert src[table + ".scale"].shape[0] == src[table + ".weight"].shape[0]
    plan = plan_conversion(str(release))
    kinds = {e.name: e.kind for e in plan.entries}
    assert kinds[wkv + ".weight"] == "fp8" and kinds[table + ".scale"] == "copy"
    # Every release tensor: SGLang loads it as a block scale exactly when we dequantize with it.
    for name in src:
        if is_dropped(name):
            continue
        sglang_scale = remap(name).endswith(".weight_scale_inv")
        assert sglang_scale == (name not in kinds), name
    convert(str(release), str(tmp_path / "bf16"), progress=False)
    out = read_all(tmp_path / "bf16")
    assert wkv + ".scale" not in out and out[wkv + ".weight"].dtype == torch.bfloat16
    assert torch.equal(out[wkv + ".weight"], dequantize_fp8_blocks(
        src[wkv + ".weight"], src[wkv + ".scale"], (32, 32)))
    assert torch.equal(out[table + ".scale"].view(torch.uint8), src[table + ".scale"].view(
        torch.uint8))
    # A release whose wkv lost its scale is refused, naming the tensor.
    bad = tmp_path / "noscale"
    shutil.copytree(release, bad)
    index = json.load(open(bad / INDEX_FILE))
    file = index["weight_map"].pop(wkv + ".scale")
    json.dump(index, open(bad / INDEX_FILE, "w"))
    shard = {n: t for n, t in read_all_file(bad / file).items() if n != wkv + ".scale"}
    save_file(shard, str(bad / file))
    with pytest.raises(ValueError, match=r"layers\.5\.engram\.wkv\.weight.*no 'layers\.5\."
                                         r"engram\.wkv\.scale' scale"):
        convert(str(bad), str(tmp_path / "out"), progress=False)


def read_all_file(path):
    r = RawShardReader(str(path))
    try:
        return {n: r.read(n) for n in r.tensors}
    finally:
        r.close()
