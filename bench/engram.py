"""Engram host tables on CPU: lookup throughput of the store's layouts against a plain torch
index_select in the same run, and server start-up time of dummy weights + Engram vs a full load.

    python bench/engram.py                       # the tables (about a minute on 2 cores)
    python bench/engram.py --rows 4194304 --dim 256 --batch 65536 --tp 4

Lookup bytes are the float32 bytes returned (rows x dim x 4); "stored" is the table's dtype.
The private layout at tp > 1 runs in tp gloo processes, each asking for --batch rows per call
(so rows/s counts all ranks). Start-up times are one process, tp=1, best of
--startup-repeats, with a warm page cache and with the checkpoint evicted from it (cold).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

from sglang_dsv41.loader.checkpoint import model_tensors, save_checkpoint
from sglang_dsv41.loader.engram_source import find_engram_tables
from sglang_dsv41.loader.engram_store import PrivateEngramTable, SharedEngramTable
from sglang_dsv41.loader.fp8 import quantize_fp8_blocks, scale_name
from sglang_dsv41.loader.serving import load_serving_model
from sglang_dsv41.loader.shm import ShmNamespace
from sglang_dsv41.model import build_model
from sglang_dsv41.model.config import DSV41Config

NAME = "model.layers.0.engram.table.weight"


def timed(fn, iters: int) -> float:
    fn()  # warm-up
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def write_table(path: str, rows: int, dim: int, fp8: bool) -> torch.Tensor:
    from safetensors.torch import save_file

    table = torch.randn(rows, dim).to(torch.bfloat16)
    tensors = {NAME: table}
    if fp8:
        q, s = quantize_fp8_blocks(table)
        tensors = {NAME: q, scale_name(NAME): s}
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return table


def _private_rank(rank, world, path, batch, iters):
    source = find_engram_tables(path)[NAME]
    table = PrivateEngramTable(source, rank, world)
    gen = torch.Generator().manual_seed(rank)
    rows = torch.randint(0, source.num_rows, (batch,), generator=gen)
    return timed(lambda: table.lookup(rows), iters)


def lookup_rows(args, tmp: str) -> list[tuple]:
    out = []
    for fmt in ("bf16", "fp8"):
        path = os.path.join(tmp, fmt)
        table = write_table(path, args.rows, args.dim, fmt == "fp8")
        source = find_engram_tables(path)[NAME]
        rows = torch.randint(0, args.rows, (args.batch,))
        nbytes = args.batch * args.dim * 4
        if fmt == "bf16":
            f32 = table.float()
            base = timed(lambda: f32.index_select(0, rows), args.iters)
            out.append(("torch index_select fp32 table", "fp32", base, base))
            base = timed(lambda: table.index_select(0, rows).float(), args.iters)
            out.append(("torch index_select bf16 + .float()", "bf16", base, base))
            del f32
        else:
            base = out[1][2]
        ns = ShmNamespace(f"bench{os.getpid()}")
        ns.acquire_lease()
        SharedEngramTable.create_segment(source, ns, "t0")
        shared = SharedEngramTable(source, ns, "t0", 0, 1)
        out.append(("shared (node copy, /dev/shm)", fmt,
                    timed(lambda: shared.lookup(rows), args.iters), base))
        shared.close()
        ns.release_lease()
        private = PrivateEngramTable(source, 0, 1)
        out.append(("private tp=1", fmt, timed(lambda: private.lookup(rows), args.iters), base))
        private.close()
        if args.tp > 1:
            sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
            from loader_fixtures import run_world

            per_rank = run_world(_private_rank, args.tp, (path, args.batch, args.iters), 300)
            # every rank answers batch rows per call: the slowest rank sets the pace
            out.append((f"private tp={args.tp} (gloo all-to-all)", fmt,
                        max(per_rank) / args.tp, base))
        del table
    return [(name, fmt, args.batch / t, nbytes / t / 1e9, base / t) for name, fmt, t, base in out]


def startup(args, tmp: str) -> list[tuple]:
    cfg = DSV41Config(vocab_size=32000, hidden_size=768, num_hidden_layers=8,
                      num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                      o_groups=4, o_lora_rank=256, intermediate_size=2048,
                      moe_intermediate_size=512, n_routed_experts=8, num_experts_per_tok=2,
                      engram_layers=[1], engram_num_rows=args.startup_rows, engram_dim=128,
                      global_attn_layers=[1, 3, 5, 7])
    path = os.path.join(tmp, "startup_ckpt")
    model = build_model(cfg, torch.bfloat16, seed=0)
    save_checkpoint(model_tensors(model), path, cfg, tokenizer=False)
    n_params = sum(t.numel() for t in model_tensors(model).values())
    del model
    out = []
    for fmt, cold in (("auto", False), ("dummy", False), ("auto", True), ("dummy", True)):
        times = []
        for _ in range(args.startup_repeats):
            if cold:
                drop_page_cache(path)
            t0 = time.perf_counter()
            _, handle = load_serving_model(path, torch.float32, "cpu", fmt, "shared",
                                           namespace=f"bench{os.getpid()}")
            times.append(time.perf_counter() - t0)
            handle.close()
        out.append(((fmt, cold), min(times)))
    return [(n_params, cfg.engram_num_rows * 128 * 2)] + out


def drop_page_cache(path: str) -> None:
    """Evict a checkpoint's files from the page cache (no root needed), for cold-start times."""
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1 << 20)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1 << 16, help="rows per lookup call")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--tp", type=int, default=2, help="ranks of the private tp>1 run (1: skip)")
    ap.add_argument("--startup-rows", type=int, default=1 << 21)
    ap.add_argument("--startup-repeats", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="engram_bench_") as tmp:
        print(f"Engram lookup: table {args.rows} x {args.dim}, {args.batch} rows per call, "
              f"{torch.get_num_threads()} threads")
        print(f"| {'path':<38} | stored | {'rows/s':>10} | GB/s (f32 out) | vs index_select |")
        print(f"|{'-' * 40}|--------|{'-' * 12}|----------------|-----------------|")
        for name, fmt, rps, gbs, ratio in lookup_rows(args, tmp):
            print(f"| {name:<38} | {fmt:<6} | {rps:>10.3g} | {gbs:>14.2f} | {ratio:>14.2f}x |")
        (n_params, table_bytes), *times = startup(args, tmp)
        print(f"\nStart-up (load_serving_model, fp32 on CPU, {n_params / 1e6:.0f}M params incl. "
              f"a {table_bytes / 2**20:.0f} MiB bf16 Engram table, shared layout; cold = the "
              "checkpoint evicted from the page cache first)")
        t = dict(times)
        print("| page cache | full load s | dummy + Engram s | ratio full / dummy |")
        print("|------------|-------------|------------------|--------------------|")
        for cold in (False, True):
            full, dummy = t[("auto", cold)], t[("dummy", cold)]
            print(f"| {'cold' if cold else 'warm':<10} | {full:>11.2f} | {dummy:>16.2f} | "
                  f"{full / dummy:>17.2f}x |")


if __name__ == "__main__":
    main()
