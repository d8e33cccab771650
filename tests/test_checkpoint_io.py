"""Checkpoint I/O: tokenizer, atomic sharded save, streaming reads, strict loading, presets."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from sglang_dsv41.loader import checkpoint as ckpt
from sglang_dsv41.loader.checkpoint import (ensure_checkpoint, iter_checkpoint_tensors, load_model,
                                            model_tensors, save_checkpoint)
from sglang_dsv41.loader.shards import INDEX_FILE, split_into_shards
from sglang_dsv41.model import build_model, get_preset
from sglang_dsv41.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def tiny_model():
    return build_model(get_preset("tiny"), torch.bfloat16, seed=7)


def _files(d):
    return sorted(f for f in os.listdir(d))


# ---- tokenizer ------------------------------------------------------------------------------
def test_byte_tokenizer_round_trip_and_files(tmp_path):
    tok = ByteTokenizer.from_config(get_preset("tiny"))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.vocab_size) == (
        256, 257, 258, 320)
    text = "héllo, wörld ✓"
    ids = tok.encode(text, add_bos=True)
    assert ids[0] == 256 and ids[1:] == list(text.encode("utf-8"))
    assert tok.decode(ids + [tok.eos_token_id]) == text
    assert tok.decode([256, 104, 257], skip_special_tokens=False) == "<|bos|>h<|eos|>"
    assert tok.decode([0xC3]) == "\ufffd"  # truncated UTF-8 is replaced, not raised
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([320])
    with pytest.raises(ValueError, match="vocab_size >= 259"):
        ByteTokenizer(vocab_size=258)
    with pytest.raises(ValueError, match="distinct"):
        ByteTokenizer(300, 256, 256, 258)
    tok.save_pretrained(str(tmp_path))
    saved = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert saved["tokenizer_class"] == "ByteTokenizer" and saved["eos_token_id"] == 257
    again = ByteTokenizer.from_pretrained(str(tmp_path))
    assert again.to_dict() == tok.to_dict()
    with pytest.raises(ValueError, match="missing"):
        ByteTokenizer.from_pretrained(str(tmp_path / "nowhere"))
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt tokenizer file"):
        ByteTokenizer.from_pretrained(str(tmp_path))


# ---- save / load ----------------------------------------------------------------------------
def test_save_load_round_trip_exact(tmp_path, tiny_model):
    tensors = model_tensors(tiny_model)
    out = tmp_path / "ck"
    save_checkpoint(tensors, str(out), tiny_model.config, max_shard_bytes=300_000)
    index = json.loads((out / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    assert _files(out) == sorted(shards + ["config.json", INDEX_FILE, "tokenizer_config.json"])
    assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v41"
    streamed = dict(iter_checkpoint_tensors(str(out)))
    for name, t in tensors.items():  # mixed dtypes (bf16, fp32 sinks/lm_head) kept exactly
        assert streamed[name].dtype == t.dtype and torch.equal(streamed[name], t), name
    loaded = load_model(str(out))
    for name, t in model_tensors(loaded).items():
        assert torch.equal(t.detach(), tensors[name]), name
    only = dict(iter_checkpoint_tensors(str(out), names=["lm_head.weight"]))
    assert list(only) == ["lm_head.weight"]
    with pytest.raises(ValueError, match="'nope' is not in checkpoint"):
        list(iter_checkpoint_tensors(str(out), names=["nope"]))


def test_exact_shard_count_and_single_file(tmp_path, tiny_model):
    tensors = model_tensors(tiny_model)
    save_checkpoint(tensors, str(tmp_path / "four"), tiny_model.config, num_shards=4)
    index = json.loads((tmp_path / "four" / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) == 4
    assert split_into_shards([5, 0, 0, 100, 1], 5) == [[0], [1], [2], [3], [4]]
    from safetensors.torch import save_file

    single = tmp_path / "single"
    single.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(single / "model.safetensors"))
    tiny_model.config.save_pretrained(str(single))
    loaded = load_model(str(single))
    assert torch.equal(loaded.lm_head.weight, tensors["lm_head.weight"])


def test_load_is_strict_and_skip_leaves_tensors_alone(tmp_path, tiny_model):
    tensors = model_tensors(tiny_model)
    cfg = tiny_model.config
    bad = dict(tensors)
    del bad["model.norm.weight"]
    save_checkpoint(bad, str(tmp_path / "missing"), cfg)
    with pytest.raises(ValueError, match="'model.norm.weight' is missing"):
        load_model(str(tmp_path / "missing"))
    skipped = load_model(str(tmp_path / "missing"), skip=lambda n: n == "model.norm.weight")
    assert torch.equal(skipped.lm_head.weight, tensors["lm_head.weight"])
    bad = dict(tensors, **{"model.extra.weight": torch.zeros(2)})
    save_checkpoint(bad, str(tmp_path / "extra"), cfg)
    with pytest.raises(ValueError, match="unexpected tensor 'model.extra.weight'"):
        load_model(str(tmp_path / "extra"))
    bad = dict(tensors, **{"model.norm.weight": torch.ones(3)})
    save_checkpoint(bad, str(tmp_path / "shape"), cfg)
    with pytest.raises(ValueError, match=r"'model.norm.weight'.*shape \[3\]"):
        load_model(str(tmp_path / "shape"))
    # Dummy loading: skipped tensors keep what the caller put there, the Engram table is exact.
    save_checkpoint(tensors, str(tmp_path / "full"), cfg)
    table = "model.layers.1.engram.table.weight"
    model = build_model(cfg, torch.float32, seed=123)
    before = {n: t.detach().clone() for n, t in model_tensors(model).items()}
    loaded = ckpt.load_weights(model, str(tmp_path / "full"), skip=lambda n: n != table)
    assert loaded == [table]
    for name, t in model_tensors(model).items():
        want = tensors[table].float() if name == table else before[name]
        assert torch.equal(t.detach(), want), name


def test_corrupt_and_missing_shards_are_named(tmp_path, tiny_model):
    out = tmp_path / "ck"
    save_checkpoint(model_tensors(tiny_model), str(out), tiny_model.config, num_shards=3)
    second = out / "model-00002-of-00003.safetensors"
    data = second.read_bytes()
    second.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt checkpoint shard .*model-00002-of-00003"):
        list(iter_checkpoint_tensors(str(out)))
    second.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage!!!!!!!}")
    with pytest.raises(ValueError, match="model-00002-of-00003"):
        load_model(str(out))
    second.unlink()
    with pytest.raises(ValueError, match="model-00002-of-00003.safetensors, which is missing"):
        list(iter_checkpoint_tensors(str(out)))


def test_failed_save_keeps_the_old_checkpoint(tmp_path, tiny_model):
    out = tmp_path / "ck"
    save_checkpoint({"a": torch.ones(3)}, str(out), {"model_type": "x"}, tokenizer=False)
    before = _files(out)

    def broken():
        yield "b", torch.zeros(4)
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        save_checkpoint(broken(), str(out), {"model_type": "x"}, max_shard_bytes=1)
    assert _files(out) == before and [f for f in os.listdir(tmp_path) if f != "ck"] == []
    save_checkpoint({"c": torch.ones(2)}, str(out), {"model_type": "y"}, tokenizer=False)
    assert set(dict(iter_checkpoint_tensors(str(out)))) == {"c"}


# ---- presets --------------------------------------------------------------------------------
def test_ensure_checkpoint_builds_once_and_reuses(tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    builds = []
    real_build = ckpt.build_model
    monkeypatch.setattr(ckpt, "build_model",
                        lambda *a, **k: builds.append(1) or real_build(*a, **k))
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(ensure_checkpoint("tiny", cache)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(paths) == 2 and paths[0] == paths[1] == os.path.join(cache, "tiny-seed0")
    assert len(builds) == 1  # the racing caller waited on the lock and reused the build
    mtime = os.path.getmtime(os.path.join(paths[0], "config.json"))
    assert ensure_checkpoint("tiny", cache) == paths[0] and len(builds) == 1
    assert os.path.getmtime(os.path.join(paths[0], "config.json")) == mtime
    model = load_model("tiny", cache_dir=cache)
    ref = real_build(get_preset("tiny"), torch.bfloat16, seed=0)
    assert torch.equal(model.model.embed_tokens.weight, ref.model.embed_tokens.weight)
    dtypes = {t.dtype for _, t in iter_checkpoint_tensors(paths[0])}
    assert dtypes == {torch.bfloat16}
    assert ensure_checkpoint(paths[0]) == paths[0]
    with pytest.raises(ValueError, match="v41-flash.*planning"):
        ensure_checkpoint("v41-flash", cache)
    with pytest.raises(ValueError, match="neither a checkpoint directory nor a preset"):
        ensure_checkpoint("no-such-thing", cache)
    with pytest.raises(ValueError, match="has no config.json"):
        ensure_checkpoint(str(tmp_path))


def test_make_checkpoint_cli_bf16_layout(tmp_path, capsys):
    """The real-layout maker's bf16 layout (what the converter writes), on tiny-v4."""
    from sglang_dsv41.tools.make_checkpoint import main

    out = str(tmp_path / "bf16")
    assert main(["--preset", "tiny-v4", "--layout", "bf16", out, "--seed", "5",
                 "--num-shards", "3"]) == 0
    index = json.loads(open(os.path.join(out, INDEX_FILE)).read())
    assert len(set(index["weight_map"].values())) == 3
    assert "layers.0.attn.wq_a.weight" in index["weight_map"]
    cfg = json.loads(open(os.path.join(out, "config.json")).read())
    assert cfg["model_type"] == "deepseek_v4" and cfg["num_nextn_predict_layers"] == 0
    assert "quantization_config" not in cfg and "vision_config" not in cfg
    assert main(["--preset", "no-such", str(tmp_path / "x")]) == 1
    assert "unknown preset" in capsys.readouterr().err and not os.path.exists(tmp_path / "x")
