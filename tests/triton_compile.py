"""Triton kernels compiled for an H200 (sm_90) on a machine without a GPU
(triton_common.compile_for_gpu): what a launch there would build, so that a kernel the
interpreter runs but the GPU compiler refuses fails here. In a child process without
TRITON_INTERPRET (under it, @triton.jit makes interpreted functions, which do not compile)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def compile_sm90(module: str, kernel: str, types: dict[str, str], constants: dict,
                 num_warps: int = 4) -> str:
    """types: every non-constexpr argument's Triton type ("*bf16", "i32", "fp32", ...);
    -> the PTX of ``module.kernel``."""
    return compile_many_sm90([(module, kernel, types, constants, num_warps)])[0]


def compile_many_sm90(specs: list[tuple]) -> list[str]:
    """specs: (module, kernel, types, constants, num_warps[, aligned, num_stages]); aligned:
    the integer arguments a launch at real shapes marks multiples of 16."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(specs)], env=env,
                         capture_output=True, text=True, timeout=300)
    if out.returncode:
        raise RuntimeError(f"compile_sm90 failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout)


_CHILD = """
import importlib, json, sys
from sglang_dsv41.attention.triton_common import compile_for_gpu

def ptx(module, name, types, constants, num_warps, aligned=(), num_stages=3):
    return compile_for_gpu(getattr(importlib.import_module(module), name), types, constants,
                           aligned, num_warps=num_warps, num_stages=num_stages).asm["ptx"]

print(json.dumps([ptx(*spec) for spec in json.loads(sys.argv[1])]))
"""
