"""Release layout -> text-only bf16: names, dtypes, byte-exact Engram/tid2eid, dequantized
values, SGLang 0.5.23's config flattening, atomicity under SIGKILL, corrupt input."""

import json
import os
import re
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
from sglang_dsv41.convert import main as convert_main
from sglang_dsv41.loader import atomic_dir
from sglang_dsv41.loader.atomic_dir import OUTPUT_MARKER
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


def cli(capsys, *args):
    """The converter's CLI entry point: (exit code, stderr). An uncaught exception (a raw
    traceback on the command line) fails the test."""
    rc = convert_main([*map(str, args), "--quiet"])
    return rc, capsys.readouterr().err


def tree(d):
    return sorted(os.path.join(r, n) for r, dirs, files in os.walk(d) for n in dirs + files)


def test_dst_that_would_delete_src_or_foreign_files_is_refused(release, tmp_path, capsys):
    """DST = the parent of SRC, SRC itself through a symlinked parent, a directory inside SRC,
    a symlink, or a non-empty directory this tool did not write: refused before any work,
    nothing deleted; --force replaces only the last kind; a DST this tool wrote is replaced."""
    models = tmp_path / "models"
    shutil.copytree(release, models / "rel")
    (models / "notes.txt").write_text("precious")
    (tmp_path / "alias").symlink_to(tmp_path)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "thesis.tex").write_text("precious")
    (tmp_path / "link").symlink_to(tmp_path / "home")
    before = tree(tmp_path)
    src = models / "rel"
    for dst, why in ((models, "contains the source"),
                     (tmp_path / "alias" / "models" / "rel", "is the source"),
                     (src / "sub", "lies inside the source"),
                     (tmp_path / "link", "is a symlink"),
                     (tmp_path / "home", "did not write .*--force")):
        with pytest.raises(ValueError, match=why):
            convert(str(src), str(dst), progress=False)
        assert tree(tmp_path) == before, dst
    rc, err = cli(capsys, src, models)
    assert rc == 1 and err.startswith("error: ") and "contains the source" in err
    rc, err = cli(capsys, src, tmp_path / "home")
    assert rc == 1 and "--force" in err and (tmp_path / "home" / "thesis.tex").exists()
    with pytest.raises(ValueError, match="contains the source"):  # --force never deletes SRC
        convert(str(src), str(models), progress=False, force=True)
    # A directory this tool wrote (it carries the marker) is replaced without --force.
    convert(str(src), str(tmp_path / "out"), progress=False)
    assert (tmp_path / "out" / OUTPUT_MARKER).is_file()
    convert(str(src), str(tmp_path / "out"), progress=False)
    assert cli(capsys, src, tmp_path / "home", "--force")[0] == 0
    assert not (tmp_path / "home" / "thesis.tex").exists()
    assert (tmp_path / "home" / INDEX_FILE).is_file()
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n or ".old-" in n]


def test_failed_publish_leaves_no_staged_copy(release, tmp_path, monkeypatch):
    """publish() runs inside convert()'s cleanup: a DST that became a symlink while the
    conversion ran fails the rename, and the complete staged copy is removed."""
    dst = tmp_path / "dst"
    module = sys.modules[convert.__module__]
    real_write_index = module.write_index

    def write_index_then_swap_dst(*args):
        real_write_index(*args)
        os.makedirs(tmp_path / "elsewhere")
        os.symlink(tmp_path / "elsewhere", dst)

    monkeypatch.setattr(module, "write_index", write_index_then_swap_dst)
    with pytest.raises(OSError):
        convert(str(release), str(dst), progress=False)
    assert sorted(os.listdir(tmp_path)) == ["dst", "elsewhere"]


def _dead_pid() -> int:
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                       capture_output=True, text=True, check=True)
    return int(p.stdout)


def test_crash_between_publish_renames_keeps_the_complete_copy(release, tmp_path):
    """Without RENAME_EXCHANGE, publish is two renames; a writer SIGKILLed between them leaves
    DST missing, the previous output in .dst.old-* and the new one in .dst.tmp-*. The next
    writer restores the previous output before it cleans, even when its own run then fails."""
    dst = tmp_path / "dst"
    convert(str(release), str(dst), progress=False)
    child = f"""
import os, sys, time
from sglang_dsv41.loader import atomic_dir
atomic_dir._exchange = lambda a, b: False  # a filesystem without RENAME_EXCHANGE
real = os.rename
def slow(a, b):
    real(a, b)
    if '.old-' in b:
        print('first rename done', flush=True)
        time.sleep(60)
os.rename = slow
staged = atomic_dir.StagedDir({str(dst)!r})
open(os.path.join(staged.path, 'new'), 'w').close()
staged.publish()
"""
    p = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "first rename done"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    assert not dst.exists() and len(os.listdir(tmp_path)) == 2
    with pytest.raises(ValueError, match="foreign"):
        with atomic_dir.staged_output(str(dst)):
            raise ValueError("foreign failure after the staged directory was made")
    assert sorted(os.listdir(tmp_path)) == ["dst"] and (dst / INDEX_FILE).is_file()
    assert not (dst / "new").exists()  # the previous output, as before the interrupted run
    # No previous output, only a sealed staged copy (killed before its rename): restored.
    shutil.rmtree(dst)
    sealed = tmp_path / f".dst{atomic_dir.STAGING_TAG}{_dead_pid()}-0000"
    sealed.mkdir()
    (sealed / OUTPUT_MARKER).write_text("{}")
    unsealed = tmp_path / f".dst{atomic_dir.STAGING_TAG}{_dead_pid()}-0001"
    unsealed.mkdir()  # killed while writing: junk
    assert atomic_dir.clean_stale_siblings(str(dst)) == [unsealed.name]
    assert (dst / OUTPUT_MARKER).is_file() and sorted(os.listdir(tmp_path)) == ["dst"]
    # Another host's siblings (a shared filesystem): its writer may be alive, whatever pid
    # runs here; neither restored nor removed
    shutil.rmtree(dst)
    remote = tmp_path / f".dst{atomic_dir.STAGING_TAG}{_dead_pid()}@elsewhere-host-0002"
    remote.mkdir()
    (remote / OUTPUT_MARKER).write_text("{}")
    assert atomic_dir.clean_stale_siblings(str(dst)) == [] and not dst.exists()
    assert remote.is_dir()


def test_every_file_reaches_the_disk_before_the_marker(tmp_path, monkeypatch):
    """The marker vouches for the whole output: config.json, the index and the shards are
    synced before it is written (a power loss must not leave a marked, empty config.json)."""
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    monkeypatch.setattr(atomic_dir.os, "fsync", fsync)
    make_checkpoint(str(tmp_path / "out"), get_preset("tiny"), "bf16", num_shards=2)
    marker = synced.index(OUTPUT_MARKER)
    for name in ("config.json", INDEX_FILE, *os.listdir(tmp_path / "out")):
        if name != OUTPUT_MARKER:
            assert name in synced[:marker], (name, synced)


def _rewrite(ckpt, name, fn):
    """Replace tensor ``name`` in its shard by fn(tensor)."""
    file = json.load(open(ckpt / INDEX_FILE))["weight_map"][name]
    tensors = read_all_file(ckpt / file)
    tensors[name] = fn(tensors[name])
    save_file(tensors, str(ckpt / file))
    return file


@pytest.mark.parametrize("name,dtype,want", [
    ("layers.1.engram.embed.weight", torch.bfloat16, "F8_E4M3"),
    ("layers.1.engram.embed.scale", torch.float32, "F8_E8M0"),
    ("layers.0.ffn.gate.tid2eid", torch.int64, "I32")])
def test_copied_tensor_of_the_wrong_dtype_refused_before_writing(release, tmp_path, capsys,
                                                                 name, dtype, want):
    bad = tmp_path / "bad"
    shutil.copytree(release, bad)
    file = _rewrite(bad, name, lambda t: t.to(dtype))
    with pytest.raises(ValueError, match=rf"tensor '{re.escape(name)}' in {file} has dtype "
                                         rf"\w+, expected {want}"):
        plan_conversion(str(bad))
    rc, err = cli(capsys, bad, tmp_path / "out")
    assert rc == 1 and want in err and not (tmp_path / "out").exists()
    assert sorted(os.listdir(tmp_path)) == ["bad"]


def test_tensor_in_two_shards_or_against_the_index_refused(release, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(release, bad)
    index = json.load(open(bad / INDEX_FILE))["weight_map"]
    name = next(n for n, f in index.items() if f.startswith("model-00001-") and
                n.endswith("norm.weight"))
    last = sorted(set(index.values()))[-1]
    value = read_all_file(bad / index[name])[name]
    tensors = read_all_file(bad / last)
    save_file({**tensors, name: torch.full_like(value, 7)}, str(bad / last))
    with pytest.raises(ValueError, match=rf"'{re.escape(name)}' is stored in two shards, "
                                         rf"{index[name]} and {last}"):
        convert(str(bad), str(tmp_path / "out"), progress=False)
    # Only in another shard than the index says: refused, naming both.
    first = read_all_file(bad / index[name])
    save_file({n: t for n, t in first.items() if n != name}, str(bad / index[name]))
    save_file({**tensors, name: value}, str(bad / last))
    with pytest.raises(ValueError, match=rf"index assigns tensor '{re.escape(name)}' to "
                                         rf"{index[name]}, but it is stored in {last}"):
        plan_conversion(str(bad))
    # A name that the index does not list is refused too (which copy is meant is unknown).
    save_file(first, str(bad / index[name]))
    save_file(tensors, str(bad / last))
    other = sorted(set(index.values()))[1]
    save_file({**read_all_file(bad / other), "layers.0.extra.weight": value}, str(bad / other))
    with pytest.raises(ValueError, match=rf"{other} holds tensor 'layers\.0\.extra\.weight', "
                                         "which the index does not list"):
        plan_conversion(str(bad))
    assert not (tmp_path / "out").exists()


def test_bad_inputs_end_in_one_error_line(release, tmp_path, capsys):
    """Each refused before any output is written, with `error: ...` and exit 1."""
    cases = {}
    q = tmp_path / "q"
    shutil.copytree(release, q)
    cfg = json.load(open(q / "config.json"))
    json.dump({**cfg, "quantization_config": ["fp8"]}, open(q / "config.json", "w"))
    cases[q] = "quantization_config must be an object, got list"
    tok = tmp_path / "tok"
    shutil.copytree(release, tok)
    (tok / "tokenizer.json").mkdir()
    cases[tok] = "tokenizer.json is a directory"
    tok2 = tmp_path / "tok2"
    shutil.copytree(release, tok2)
    (tok2 / "tokenizer_config.json").symlink_to(tmp_path / "nonexistent")
    cases[tok2] = "tokenizer_config.json is a dangling symlink"
    ids = tmp_path / "ids"
    shutil.copytree(release, ids)
    n_experts = tiny_cfg().n_routed_experts
    _rewrite(ids, "layers.0.ffn.gate.tid2eid", lambda t: t + n_experts)
    cases[ids] = rf"tid2eid' .* holds expert ids {n_experts}\.\.\d+, outside \[0, {n_experts}\)"
    for src, why in cases.items():
        rc, err = cli(capsys, src, tmp_path / "out", "--verify")
        assert rc == 1 and err.startswith("error: ") and re.search(why, err), (src, err)
        assert not [n for n in os.listdir(tmp_path) if n.startswith((".out", "out"))], src
    (tmp_path / "afile").write_text("x")
    rc, err = cli(capsys, release, tmp_path / "afile" / "out")
    assert rc == 1 and f"{tmp_path / 'afile'} is not a directory" in err


def test_disk_full_is_one_error_naming_the_file(release, tmp_path):
    """A write that fails (RLIMIT_FSIZE: EFBIG, as a full disk's ENOSPC) is reported once,
    with the shard's path, and the staged copy is removed."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (500_000, 500_000))

    p = subprocess.run([sys.executable, "-m", "sglang_dsv41.convert", str(release),
                        str(tmp_path / "out"), "--quiet", "--max-shard-size", "100GB"],
                       capture_output=True, text=True, timeout=120, preexec_fn=limit)
    rc, err = p.returncode, p.stderr
    assert rc == 1 and err.count("error: ") == 1 and "File too large" in err, err
    assert "model-00001-of-00001.safetensors" in err
    assert os.listdir(tmp_path) == []


def test_help_describes_the_tool_in_whole_sentences(capsys):
    with pytest.raises(SystemExit):
        convert_main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "to the text-only bf16 one SGLang 0.5.23 and our trainer load." in out
    assert "--force" in out and "Exit status: 0 written, 1 refused or failed" in out
    # python -OO strips docstrings: the tools still import and run (no description)
    for module in ("sglang_dsv41.convert", "sglang_dsv41.tools.make_checkpoint"):
        p = subprocess.run([sys.executable, "-OO", "-m", module, "--help"], capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0 and "usage:" in p.stdout, p.stderr
