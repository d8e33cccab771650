"""Triton kernels compiled for an H200 (sm_90) on a machine without a GPU, with the installed
Triton and its ptxas: what a launch there would build, so that a kernel the interpreter runs but
the GPU compiler refuses fails here. Pointer arguments are marked 16-byte aligned, as torch's
allocations are at launch. In a child process without TRITON_INTERPRET (under it, @triton.jit
makes interpreted functions, which do not compile)."""

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
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(specs)], env=env,
                         capture_output=True, text=True, timeout=300)
    if out.returncode:
        raise RuntimeError(f"compile_sm90 failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout)


_CHILD = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ptx = []
for module, name, types, constants, num_warps in json.loads(sys.argv[1]):
    kernel = getattr(importlib.import_module(module), name)
    names = [p.name for p in kernel.params]
    missing = [n for n in names if n not in types and n not in constants]
    if missing:
        raise SystemExit(f"{name}: no type for {missing}")
    signature = {n: "constexpr" if n in constants else types[n] for n in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if signature[n].startswith("*")}
    compiled = triton.compile(ASTSource(kernel, signature, constants, aligned),
                              target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps))
    ptx.append(compiled.asm["ptx"])
print(json.dumps(ptx))
"""
