"""Host time of one call from Python on this machine (CUDA), for the calls a host-bound training
step makes many of (bench/results/train_h200.txt):
- a kernel launch: an aten op, our Triton RoPE wrapper (attention/rope_triton.py), the bare
  Triton JIT call of its kernel, and the compiled kernel launched directly (the JIT's argument
  binding, specialization key and cache lookup skipped); ~300 Triton launches a step;
- a bf16 GEMM of the model's size with torch's BLAS backend set to cuBLAS, then cuBLASLt
  (a profiled step: aten::mm held the host a median 40 us for an 8 us launch; ~350 a step);
- FSDP2's gradient copy-in (fsdp::chunk_cat) of one decoder layer's gradients of the small
  preset, bf16 into an fp32 buffer: torch's kernel, then ours (trainer_bridge/fsdp_copy_in.py);
  13 a step.

  python bench/launch_overhead.py [--calls 3000]

Each row's ratio is to the first row of its group, measured just before it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sglang_dsv41.attention import rope_triton as rt  # noqa: E402


def per_call_us(fn, calls: int) -> float:
    """Median over 5 rounds of the host time per call. Keep ``calls`` below the device's launch
    queue (~1000) where a call's GPU work outlasts its host time: the host never waits."""
    rounds = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(rounds)[2]


def gemm_rows(dev) -> dict:
    """linear of the model's size under each BLAS backend: (fn, set up before its rounds)."""
    a = torch.randn(4096, 1024, device=dev, dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16)
    return {f"linear 4096x1024 @ 1024x1024 bf16, {b}":
            (lambda: torch.nn.functional.linear(a, w),
             lambda b=b: torch.backends.cuda.preferred_blas_library(b))
            for b in ("cublas", "cublaslt")}


def copy_in_rows(dev) -> dict:
    from sglang_dsv41.model.dsv4 import get_preset
    from sglang_dsv41.model.dsv4.model import DecoderLayer
    from trainer_bridge.fsdp_copy_in import chunk_cat

    with torch.device("meta"):
        layer = DecoderLayer(get_preset("small"), 1)
    grads = [torch.randn(p.shape, device=dev, dtype=torch.bfloat16)
             for p in layer.parameters()]
    out = torch.empty(1, sum(g.numel() for g in grads), device=dev)
    return {f"fsdp::chunk_cat {len(grads)} layer gradients, torch's":
            lambda: torch._chunk_cat(grads, 0, 1, out=out),
            f"fsdp::chunk_cat {len(grads)} layer gradients, ours":
            lambda: chunk_cat(grads, 0, 1, out)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--calls", type=int, default=3000)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    x = torch.randn(4, 2, 64, device=dev, dtype=torch.bfloat16)
    cos, sin = torch.rand(4, 16, device=dev), torch.rand(4, 16, device=dev)
    out = torch.empty_like(x)
    small = torch.randn(16, device=dev)
    jit_args = (x, cos, sin, out, 2, 64, 32, 16, x.stride(0), x.stride(1), 1.0)
    meta = dict(BH=2, BD=64, BP=16, DOT_PREC="tf32")
    grid = (4, 1)
    compiled = rt._rope_kernel[grid](*jit_args, **meta, num_warps=4, enable_fp_fusion=False)
    rows = {"aten mul (torch.mul of 16 floats)": lambda: torch.mul(small, 2.0),
            "rope_triton (our wrapper)": lambda: rt.rope_triton(x, cos, sin),
            "Triton JIT call (kernel[grid](...))":
                lambda: rt._rope_kernel[grid](*jit_args, **meta, num_warps=4,
                                              enable_fp_fusion=False)}
    try:
        runner = compiled[(*grid, 1)]  # the compiled kernel's runner reads grid[2]
        runner(*jit_args, *meta.values())
        rows["compiled kernel launched directly"] = lambda: runner(*jit_args, *meta.values())
    except Exception as e:  # the compiled kernel's launch signature differs between versions
        print(f"direct launch failed: {type(e).__name__}: {e}")
    import triton
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    groups = [(rows, args.calls), (gemm_rows(dev), min(args.calls, 500)),
              (copy_in_rows(dev), min(args.calls, 50))]
    for group, calls in groups:
        base = None  # the group's first row: the yardstick of this host
        for name, fn in group.items():
            if isinstance(fn, tuple):
                fn, setup = fn
                setup()
            us = per_call_us(fn, calls)
            base = base or us
            print(f"{name:52s} {us:7.1f} us a call  {us / base:5.2f}x the group's first",
                  flush=True)
    torch.backends.cuda.preferred_blas_library("default")
    return 0


if __name__ == "__main__":
    sys.exit(main())
