"""Convert a DeepSeek V4.1 release checkpoint to the text-only bf16 one SGLang 0.5.23 and our
trainer load.

    python -m sglang_dsv41.convert SRC DST [--verify] [--max-shard-size 5GB] [--quiet] [--force]

Every header is read and checked first (loader/release_layout.py); then tensors stream in
source order, one source shard open at a time, a few MiB per chunk, into output shards whose
headers are planned up front, so memory stays near one chunk. Dense FP8 and FP4 experts become
bf16; Engram tables and tid2eid are copied byte for byte. DST is built in a hidden sibling
(loader/atomic_dir.py StagedDir) and renamed into place only when complete (and verified).
``--verify`` re-reads DST tensor by tensor against the streamed source, then (for configs the
model can build on this machine) runs DSV4ForCausalLM on the source dequantized in float32
through safetensors' own reader and on DST, and compares the logits.

DST may not be SRC, hold SRC or lie inside it (real paths are compared), nor be a symlink; an
existing non-empty DST is replaced only if this tool wrote it (it holds .sglang_dsv41_output),
or with --force. All of this is checked before any work (loader/atomic_dir.py). Exit status: 0
written, 1 refused or failed (error: ..., DST left as it was), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from typing import Iterator

import torch
from tqdm import tqdm

from .loader.atomic_dir import staged_output
from .loader.fp4 import dequantize_fp4
from .loader.fp8 import CHUNK_BYTES, iter_dequantized_rows
from .loader.release_layout import (RELEASE_SCALE_SUFFIX, ConversionPlan, PlanEntry,
                                    plan_conversion)
from .loader.conversion_logits import verify_logits
from .loader.shards import (CONFIG_FILE, RawShardReader, StreamingShardWriter, plan_shards,
                            shard_file_name, tensor_nbytes, write_index)
from .tools import help_description, run_reporting_errors

# Test hook: seconds to sleep after each finished output shard (to kill a conversion midway).
SHARD_DELAY_ENV = "SGLANG_DSV41_CONVERT_SHARD_DELAY_S"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot parse size {text!r} (e.g. 5GB, 500MiB, 1000000)")
    unit = (m.group(2) or "").upper().rstrip("B")
    base = 1024 if unit.endswith("I") else 1000
    size = int(float(m.group(1)) * base ** {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[
        unit.rstrip("I")])
    if size <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return size


class SourceReader:
    """Reads plan entries chunk by chunk with plain file reads, one source shard open at a
    time (scales from another shard are opened briefly), so resident memory is one chunk."""

    def __init__(self, plan: ConversionPlan):
        self.plan, self._reader = plan, None

    def _open(self, file: str) -> RawShardReader:
        path = os.path.join(self.plan.src, file)
        if self._reader is None or self._reader.path != path:
            self.close()
            self._reader = RawShardReader(path)
        return self._reader

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def _scale_rows(self, e: PlanEntry, a: int, b: int) -> torch.Tensor:
        name = e.name[: -len(".weight")] + RELEASE_SCALE_SUFFIX
        path = os.path.join(self.plan.src, e.scale_file)
        if self._reader is not None and self._reader.path == path:
            return self._reader.read_rows(name, a, b)
        other = RawShardReader(path)
        try:
            return other.read_rows(name, a, b)
        finally:
            other.close()

    def chunks(self, e: PlanEntry) -> Iterator[torch.Tensor]:
        f = self._open(e.src_file)
        stored = f.tensors.get(e.name, (None, None))
        if stored[0] != e.src_dtype:
            raise ValueError(f"checkpoint shard {f.path} changed since it was planned: "
                             f"tensor {e.name!r}")
        rows = e.shape[0] if e.shape else 1
        try:
            if e.kind == "fp8":
                scale = self._scale_rows(e, 0, -(-rows // self.plan.block[0]))
                yield from iter_dequantized_rows(lambda a, b: f.read_rows(e.name, a, b),
                                                 e.shape, scale, self.plan.block, torch.bfloat16)
                return
            row_bytes = max(1, tensor_nbytes(torch.float32, e.shape[1:]))
            step = max(1, CHUNK_BYTES // row_bytes)
            for a in range(0, rows, step):
                b = min(rows, a + step)
                if not e.shape:
                    t = f.read(e.name)
                else:
                    t = f.read_rows(e.name, a, b)
                if e.kind == "fp4":
                    t = dequantize_fp4(t, self._scale_rows(e, a, b))
                elif e.kind == "cast":
                    t = t.to(torch.bfloat16)
                yield t
        except ValueError as err:
            raise ValueError(f"tensor {e.name!r} in {f.path}: {err}") from err

    def tensor(self, e: PlanEntry) -> torch.Tensor:
        parts = list(self.chunks(e))
        return torch.cat(parts, 0).reshape(e.shape) if parts else torch.empty(e.shape)


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
                                      [(e.name, e.dst_dtype, e.shape) for e in entries]) as w:
                for e in entries:
                    for chunk in reader.chunks(e):
                        w.write(e.name, chunk)
                        bar.update(chunk.nbytes)
                    weight_map[e.name] = file
            if delay:
                time.sleep(delay)
    finally:
        reader.close()
        bar.close()
    return weight_map


def convert(src: str, dst: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
            progress: bool = True, verify: bool = False, force: bool = False) -> dict:
    """Release checkpoint ``src`` -> text-only bf16 checkpoint ``dst`` (replaced atomically;
    an existing ``dst`` that this tool did not write only with ``force``)."""
    src = os.path.abspath(src)
    if not os.path.isdir(src):
        raise ValueError(f"source checkpoint {src} is not a directory")
    # DST is refused (StagedDir) before the (long) planning and conversion
    with staged_output(dst, sources=[src], force=force) as out:
        plan = plan_conversion(src)
        total = sum(e.dst_bytes for e in plan.entries)
        weight_map = _write_shards(plan, out, max_shard_bytes, progress)
        write_index(out, weight_map, total)
        with open(os.path.join(out, CONFIG_FILE), "w") as f:
            json.dump(plan.config, f, indent=2, sort_keys=True)
        for name in plan.tokenizer_files:
            shutil.copy2(os.path.join(src, name), os.path.join(out, name))
        summary = {"dst": os.path.abspath(dst), "tensors": len(plan.entries),
                   "shards": len(set(weight_map.values())), "dropped": plan.dropped,
                   "total_size": total}
        if verify:
            differ = verify_tensors(plan, out)
            summary["verify"] = {"tensors_checked": len(plan.entries), "differ": differ}
            if differ:
                raise ValueError(f"verification failed: {len(differ)} tensors differ from the "
                                 f"dequantized source, e.g. {differ[:3]}")
            logits = verify_logits(plan, out)
            summary["verify"]["logits"] = logits
            if not logits.get("ok", True):
                raise ValueError(f"verification failed: logits of DST differ from the "
                                 f"dequantized source's: {logits}")
    return summary


def verify_tensors(plan: ConversionPlan, dst: str) -> list[str]:
    """Names of DST tensors that are not bf16(dequantized source) bit for bit (Engram tables,
    tid2eid and fp32 tensors: not byte-identical to the source)."""
    from .loader.shards import checkpoint_files

    src = SourceReader(plan)
    by_name = {e.name: e for e in plan.entries}
    differ = []
    try:
        for file in checkpoint_files(dst):
            out = RawShardReader(os.path.join(dst, file))
            try:
                for name in out.tensors:
                    got, want = out.read(name), src.tensor(by_name[name])
                    if got.dtype != want.dtype or not torch.equal(
                            got.view(torch.uint8), want.contiguous().view(torch.uint8)):
                        differ.append(name)
            finally:
                out.close()
    finally:
        src.close()
    return differ


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sglang_dsv41.convert",
                                description=help_description(__doc__))
    p.add_argument("src", help="release checkpoint directory")
    p.add_argument("dst", help="output directory (written atomically; an existing one is "
                   "replaced only if this tool wrote it, or with --force)")
    p.add_argument("--verify", action="store_true",
                   help="re-read DST and compare every tensor with the dequantized source, "
                   "then the model's logits on both")
    p.add_argument("--max-shard-size", default="5GB", help="output shard size (5GB, 500MiB)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--force", action="store_true",
                   help="replace DST even if it is a non-empty directory this tool did not "
                   "write (everything in it is deleted; DST holding or inside SRC is refused "
                   "regardless)")
    args = p.parse_args(argv)
    summary, failed = run_reporting_errors(lambda: convert(
        args.src, args.dst, parse_size(args.max_shard_size), progress=not args.quiet,
        verify=args.verify, force=args.force))
    if failed:
        return failed
    print(f"wrote {summary['dst']}: {summary['tensors']} tensors in {summary['shards']} shards "
          f"({summary['total_size'] / 1e6:.1f} MB); dropped {summary['dropped']} "
          "vision/aligner/image/bias_vl/mtp tensors")
    if "verify" in summary:
        v = summary["verify"]
        print(f"verify: ok: {v['tensors_checked']} tensors equal the dequantized source")
        if "skipped" in v["logits"]:
            print(f"verify: logits not compared: {v['logits']['skipped']}")
        else:
            print(f"verify: ok: logits on {v['logits']['tokens']} tokens differ by at most "
                  f"{v['logits']['max_abs_diff']:.3g} (logit scale "
                  f"{v['logits']['logit_scale']:.3g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
