"""Convert a release checkpoint (multimodal, FP8 block-quantized) to a text-only bf16 one.

    python -m sglang_dsv41.convert SRC DST [--verify] [--max-shard-size 5GB] [--quiet]

Every header is read and checked against the model first; then tensors are streamed in source
order, one source shard open at a time, and written chunk by chunk into output shards whose
headers were planned up front, so memory stays near one source shard. DST is built in a hidden
sibling directory and renamed into place only when complete (and verified, with --verify).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from .loader.atomic_dir import StagedDir
from .loader.checkpoint import DEFAULT_MAX_SHARD_BYTES, iter_checkpoint_tensors, load_model
from .loader.release_layout import ConversionPlan, SourceReader, plan_conversion
from .loader.shards import (CONFIG_FILE, StreamingShardWriter, plan_shards, shard_file_name,
                            write_index)
from .model.config import DSV41Config
from .model.context import ForwardContext
from .model.model import DSV41ForCausalLM, build_model
from .tokenizer import ByteTokenizer

# Test hook: seconds to sleep after each finished output shard (to kill a conversion midway).
SHARD_DELAY_ENV = "SGLANG_DSV41_CONVERT_SHARD_DELAY_S"
VERIFY_PROMPTS = ("The quick brown fox jumps over the lazy dog.",
                  "def f(x):\n    return x * 2\n",
                  "Engram tables live in host memory; attention sinks are one logit per head.")
# Logits of the fp32 reference on bf16-rounded weights stay within this fraction of the largest
# logit magnitude: measured 1.2e-3 on the tiny preset with float32 scales; a lost scale gives ~1.
VERIFY_RTOL = 2**-6


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot parse size {text!r} (e.g. 5GB, 500MiB, 1000000)")
    unit = (m.group(2) or "").upper().rstrip("B")
    base = 1024 if unit.endswith("I") else 1000
    power = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit.rstrip("I")]
    size = int(float(m.group(1)) * base**power)
    if size <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return size


def _write_shards(plan: ConversionPlan, out_dir: str, max_shard_bytes: int,
                  progress: bool) -> dict[str, str]:
    groups = plan_shards([e.dst_bytes for e in plan.entries], max_shard_bytes)
    delay = float(os.environ.get(SHARD_DELAY_ENV, "0") or 0)
    reader = SourceReader(plan)
    bar = tqdm(total=sum(e.dst_bytes for e in plan.entries), unit="B", unit_scale=True,
               desc="converting", disable=not progress)
    weight_map: dict[str, str] = {}
    try:
        for k, group in enumerate(groups):
            file = shard_file_name(k, len(groups))
            entries = [plan.entries[i] for i in group]
            with StreamingShardWriter(os.path.join(out_dir, file),
                                      [(e.dst_name, torch.bfloat16, e.shape) for e in entries]
                                      ) as writer:
                for e in entries:
                    for chunk in reader.chunks(e, torch.bfloat16):
                        writer.write(e.dst_name, chunk)
                        bar.update(chunk.nbytes)
                    weight_map[e.dst_name] = file
            if delay:
                time.sleep(delay)
    finally:
        reader.close()
        bar.close()
    return weight_map


def convert(src: str, dst: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
            progress: bool = True, verify: bool = False) -> dict:
    """Release checkpoint ``src`` -> text-only bf16 checkpoint ``dst`` (replaced atomically).
    Returns a summary; with ``verify`` it also holds the verification result."""
    src = os.path.abspath(src)
    if not os.path.isdir(src):
        raise ValueError(f"source checkpoint {src} is not a directory")
    if os.path.abspath(dst) == src:
        raise ValueError("DST must differ from SRC")
    plan = plan_conversion(src)
    staged = StagedDir(dst)
    try:
        total_size = sum(e.dst_bytes for e in plan.entries)
        weight_map = _write_shards(plan, staged.path, max_shard_bytes, progress)
        write_index(staged.path, weight_map, total_size)
        with open(os.path.join(staged.path, CONFIG_FILE), "w") as f:
            json.dump(plan.config, f, indent=2, sort_keys=True)
        for name in plan.tokenizer_files:
            shutil.copy2(os.path.join(src, name), os.path.join(staged.path, name))
        summary = {"dst": os.path.abspath(dst), "tensors": len(plan.entries),
                   "shards": len(set(weight_map.values())), "dropped": plan.dropped,
                   "total_size": total_size}
        if verify:
            result = verify_conversion(src, staged.path)
            summary["verify"] = result.__dict__
            if not result.ok:
                raise ValueError(f"verification failed: {result.describe()}")
    except BaseException:
        staged.discard()
        raise
    staged.publish(replace=True)
    return summary


# ---- verification ---------------------------------------------------------------------------
class _ReferenceContext(ForwardContext):
    """Pins attention to the torch reference, whatever the default dispatch becomes."""

    def attend(self, layer_id, q, k, v, sinks, window, scale):
        from .attention.reference import sink_attention_reference

        return sink_attention_reference(q, k, v, sinks, self.cu_seqlens, self.cu_seqlens, True,
                                        window, scale)


@dataclass
class VerifyResult:
    max_logit_diff: float
    max_abs_logit: float
    tolerance: float
    tensors_checked: int
    tensors_not_bit_exact: list[str]

    @property
    def ok(self) -> bool:
        return self.max_logit_diff <= self.tolerance and not self.tensors_not_bit_exact

    def describe(self) -> str:
        return (f"max |logit diff| {self.max_logit_diff:.3e} (tolerance {self.tolerance:.3e}, "
                f"max |logit| {self.max_abs_logit:.3f}); {self.tensors_checked} tensors checked, "
                f"{len(self.tensors_not_bit_exact)} differ from bf16(dequantized source)"
                + (f": {self.tensors_not_bit_exact[:3]}" if self.tensors_not_bit_exact else ""))


def prompt_ids(cfg: DSV41Config) -> list[list[int]]:
    try:
        tok = ByteTokenizer.from_config(cfg)
        return [tok.encode(p, add_bos=True) for p in VERIFY_PROMPTS]
    except ValueError:  # no byte tokenizer for this vocabulary: fixed pseudo-random ids
        return [[(i * 7919 + j * 31) % cfg.vocab_size for j in range(24)] for i in range(3)]


def reference_logits(model: DSV41ForCausalLM, seqs: list[list[int]]) -> torch.Tensor:
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    ctx = _ReferenceContext.packed([len(s) for s in seqs])
    with torch.no_grad():
        return model.compute_logits(model(ids, ctx))


def load_dequantized_source(src: str, dtype: torch.dtype = torch.float32) -> DSV41ForCausalLM:
    """The reference model with the release's text weights dequantized straight to ``dtype``."""
    plan = plan_conversion(src)
    model = build_model(DSV41Config.from_dict(plan.config), dtype, "cpu", seed=None)
    params = dict(model.state_dict(keep_vars=True))
    reader = SourceReader(plan)
    try:
        with torch.no_grad():
            for e in plan.entries:
                params[e.dst_name].copy_(reader.tensor(e, torch.float32))
    finally:
        reader.close()
    return model


def verify_conversion(src: str, dst: str) -> VerifyResult:
    """Every DST tensor must equal bf16(dequantized source) bit for bit, and the fp32 reference
    model's logits on DST must match those on the fp32 dequantized source within bf16 rounding."""
    source = load_dequantized_source(src, torch.float32)
    params = dict(source.state_dict(keep_vars=True))
    checked, differ = 0, []
    for name, t in iter_checkpoint_tensors(dst):
        checked += 1
        if name not in params or t.dtype != torch.bfloat16 or not torch.equal(
                params[name].detach().to(torch.bfloat16), t):
            differ.append(name)
    converted = load_model(dst, dtype=torch.float32)
    seqs = prompt_ids(source.config)
    ref, out = reference_logits(source, seqs), reference_logits(converted, seqs)
    max_abs = float(ref.abs().max())
    return VerifyResult(float((ref - out).abs().max()), max_abs,
                        VERIFY_RTOL * max(1.0, max_abs), checked, differ)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sglang_dsv41.convert",
                                description=__doc__.splitlines()[0])
    p.add_argument("src", help="release checkpoint directory")
    p.add_argument("dst", help="output directory (written atomically, replaced if present)")
    p.add_argument("--verify", action="store_true",
                   help="compare fp32 reference logits on DST with the dequantized source "
                   "(builds the model twice in fp32: meant for small checkpoints)")
    p.add_argument("--max-shard-size", default="5GB", help="output shard size (5GB, 500MiB)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    try:
        summary = convert(args.src, args.dst, parse_size(args.max_shard_size),
                          progress=not args.quiet, verify=args.verify)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {summary['dst']}: {summary['tensors']} tensors in {summary['shards']} shards "
          f"({summary['total_size'] / 1e6:.1f} MB bf16); dropped {summary['dropped']}")
    if "verify" in summary:
        print(f"verify: ok: {VerifyResult(**summary['verify']).describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
