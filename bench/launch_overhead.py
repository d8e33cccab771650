"""Host time of one kernel launch from Python on this machine (CUDA): an aten op, our Triton
RoPE wrapper (attention/rope_triton.py), the bare Triton JIT call of its kernel, and the
compiled kernel launched directly (the JIT's argument binding, specialization key and cache
lookup skipped). A host-bound training step pays the difference on each of its ~300 Triton
launches (bench/results/train_h200.txt).

  python bench/launch_overhead.py [--calls 3000]
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
    """Median over 5 rounds of the host time per call (the GPU has no time to fall behind:
    every kernel here is a few microseconds)."""
    rounds = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(rounds)[2]


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
    base = None  # the aten op, measured first: the yardstick of this host
    for name, fn in rows.items():
        us = per_call_us(fn, args.calls)
        base = base or us
        print(f"{name:40s} {us:7.1f} us a call  {us / base:5.2f}x the aten op", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
