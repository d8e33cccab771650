"""``python -m sglang_dsv41.plan``: check a deployment's parallel layout and host memory.

Exit status: 0 the plan fits, 1 it does not fit in host memory, 2 the layout or input is illegal.
"""

from __future__ import annotations

import argparse
import json
import sys

from .memory import (ENGRAM_LAYOUTS, GPU_ARCHS, HOST_PAGE_BYTES, KV_LAYOUTS,
                     OPTIMIZER_MODES, PINNED_CAP_ENV_KEY)
from .planner import PlanInput, make_plan
from .report import format_plan, plan_json
from .rules import attn_tp_from_sglang

EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_ILLEGAL = 0, 1, 2

DESCRIPTION = """\
Plan a DSV4.1-class SGLang deployment (with an optional colocated CPU-offloaded trainer):
validate the parallel layout and print each node's host-memory budget and the largest safe
max_total_tokens.

Layout convention: --tp is the attention TP size of one DP-attention replica (it must be
<= o_groups and divide the attention heads), --dp the number of replicas, --pp the pipeline
depth, and tp x dp x pp must equal nnodes x gpus_per_node. SGLang calls the same layout
--tp-size tp*dp --dp-size dp --enable-dp-attention; pass --sglang-tp-size instead of --tp to
use that spelling (then tp_size must be a multiple of dp). pp > 1 is refused with R3.

KV: --kv-gib-per-gpu is what SGLang 0.5.23's DeepSeek-V4 pool configurator gets; the planner
sizes max_total_tokens from it as SGLang does (bytes per token of the compressed caches, after
the SWA pool and compress-state rings that scale with --max-running-requests); the R3 buffers
follow max_total_tokens. --kv-bytes-per-token replaces that with a flat figure.

Exit status: 0 fits, 1 does not fit in host memory, 2 illegal layout or input."""


def build_parser() -> argparse.ArgumentParser:
    d = PlanInput
    p = argparse.ArgumentParser(prog="python -m sglang_dsv41.plan", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", "--model-path", dest="model", default=d.model,
                   help="preset (tiny, small, v41-flash) or checkpoint dir / config.json "
                        "(default: %(default)s)")
    p.add_argument("--nnodes", type=int, default=d.nnodes)
    p.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node)
    tp = p.add_mutually_exclusive_group()
    tp.add_argument("--tp", type=int, default=d.tp,
                    help="attention TP per DP replica (default: %(default)s)")
    tp.add_argument("--sglang-tp-size", type=int, default=None,
                    help="SGLang's --tp-size (= tp x dp); replaces --tp")
    p.add_argument("--dp", type=int, default=d.dp, help="DP-attention replicas")
    p.add_argument("--ep", type=int, default=d.ep, help="expert parallel size (default: tp x dp)")
    p.add_argument("--pp", type=int, default=d.pp)
    p.add_argument("--kv-gib-per-gpu", type=float, default=d.kv_gib_per_gpu,
                   help="GPU memory SGLang's pool configurator gets for the KV pools "
                        "(default: %(default)s)")
    p.add_argument("--kv-bytes-per-token", type=int, default=d.kv_bytes_per_token,
                   help="override: KV bytes per token per GPU, no fixed pools (default: "
                        "SGLang 0.5.23's DeepSeek-V4 pool sizing from the config and the "
                        "settings below)")
    p.add_argument("--gpu", choices=GPU_ARCHS, default=d.gpu,
                   help="sm90 (H100/H200) or sm100 (B200/GB200): KV layout and SGLang's "
                        "chunked-prefill default (default: %(default)s)")
    p.add_argument("--kv-layout", choices=KV_LAYOUTS, default=d.kv_layout,
                   help="SGLANG_DSV4_KV_LAYOUT as set for SGLang (default: unset; the KV "
                        "cache is fp8, the CUDA pool's only store)")
    p.add_argument("--max-running-requests", type=int, default=d.max_running_requests,
                   help="SGLang's (all DP replicas; default: SGLang's DeepSeek-V4 default "
                        "%(default)s): sizes the SWA pool and the compress-state rings")
    p.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size,
                   help="SGLang's (default: its default for --gpu)")
    p.add_argument("--swa-full-tokens-ratio", type=float, default=d.swa_full_tokens_ratio,
                   help="SGLang's; given, the SWA pool scales with max_total_tokens instead "
                        "of the request cap")
    p.add_argument("--radix-cache", action=argparse.BooleanOptionalAction,
                   default=d.radix_cache, help="off: SGLang's --disable-radix-cache")
    p.add_argument("--page-size", type=int, default=d.page_size,
                   help="SGLang's page size (it sets 256 for DeepSeek V4)")
    p.add_argument("--host-gib-per-node", type=float, default=d.host_gib_per_node)
    p.add_argument("--base-gib-per-rank", type=float, default=d.base_gib_per_rank,
                   help="other host memory per rank process (default: %(default)s)")
    p.add_argument("--r3", action=argparse.BooleanOptionalAction, default=d.r3,
                   help="router replay (--enable-return-routed-experts) on/off")
    p.add_argument("--engram-layout", choices=("auto",) + ENGRAM_LAYOUTS,
                   default=d.engram_layout,
                   help="auto: private (SGLang per_rank) when nnodes > 1, else shared; shared "
                        "across nodes is refused")
    p.add_argument("--hugepage", choices=sorted(HOST_PAGE_BYTES), default=d.hugepage,
                   help="SGLANG_HUGEPAGE_SIZE of SGLang's mmap host buffers (R3)")
    p.add_argument("--optimizer", choices=OPTIMIZER_MODES, default=d.optimizer,
                   help="colocated CPU-offloaded Adam: full 18N, chunked 12N bytes")
    p.add_argument("--pinned-cap", action=argparse.BooleanOptionalAction, default=d.pinned_cap,
                   help=f"PYTORCH_ALLOC_CONF={PINNED_CAP_ENV_KEY}:<MB> is set: pinned requests "
                        "above it are exact instead of rounded up to a power of two")
    p.add_argument("--pinned-cap-mb", type=int, default=d.pinned_cap_mb)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def _refuse(msg: str, code: int, as_json: bool) -> int:
    if as_json:
        print(json.dumps({"fits": False, "illegal": code == EXIT_ILLEGAL, "reason": msg}))
    print(f"plan refused: {msg}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        tp = args.tp
        if args.sglang_tp_size is not None:
            tp = attn_tp_from_sglang(args.sglang_tp_size, args.dp)
        inp = PlanInput(
            model=args.model, nnodes=args.nnodes, gpus_per_node=args.gpus_per_node, tp=tp,
            dp=args.dp, ep=args.ep, pp=args.pp, kv_gib_per_gpu=args.kv_gib_per_gpu,
            kv_bytes_per_token=args.kv_bytes_per_token, gpu=args.gpu,
            kv_layout=args.kv_layout,
            max_running_requests=args.max_running_requests,
            chunked_prefill_size=args.chunked_prefill_size,
            swa_full_tokens_ratio=args.swa_full_tokens_ratio, radix_cache=args.radix_cache,
            page_size=args.page_size, host_gib_per_node=args.host_gib_per_node,
            base_gib_per_rank=args.base_gib_per_rank, r3=args.r3,
            engram_layout=args.engram_layout, hugepage=args.hugepage,
            optimizer=args.optimizer, pinned_cap=args.pinned_cap,
            pinned_cap_mb=args.pinned_cap_mb)
        res = make_plan(inp)
    except ValueError as e:  # PlanError is a ValueError
        return _refuse(str(e), EXIT_ILLEGAL, args.json)
    print(plan_json(res) if args.json else format_plan(res))
    if not res.fits:
        print(f"plan refused: {res.reason}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return EXIT_FITS


if __name__ == "__main__":
    sys.exit(main())
