"""Pieces shared by the DSV4 Triton kernels: matmul precision and rounding that behave the same
on a GPU and in the CPU interpreter (TRITON_INTERPRET=1, the tests); the column block of a
kernel that gives one program a row; where the Gluon wgmma kernels (dsv4_gluon.py) serve a call;
a kernel compiled for a GPU target on a machine without one, and what its PTX loads."""

from __future__ import annotations

import functools
import logging
import os
import re

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_precision(dtype) -> str:
    """Value for the kernels' DOT_PREC: fp32 inputs must not silently drop to tf32 (1e-3 error
    budget). The CPU interpreter multiplies bf16 tiles as raw uint16 bits (triton 3.9), so there
    bf16 operands are widened to fp32 first, which is exact and matches bf16 MMA with fp32
    accumulation."""
    import torch

    if dtype == torch.float32:
        return "ieee"
    if dtype == torch.bfloat16 and interpreting():
        return "widen"
    return "tf32"


@triton.jit
def mma(a, b, DOT_PREC: tl.constexpr):
    if DOT_PREC == "widen":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PREC)


@triton.jit
def to_dtype(x, dtype: tl.constexpr, DOT_PREC: tl.constexpr):
    """x.to(dtype) with round-to-nearest-even; the interpreter (the "widen" mode) truncates
    fp32 -> bf16, so there the rounding is done on the bits first."""
    if DOT_PREC == "widen" and dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(dtype)
    else:
        return x.to(dtype)


@functools.lru_cache(maxsize=None)
def gluon_kernels():
    """The dsv4_gluon module, or None where this Triton has no Gluon (or not its Hopper parts)."""
    try:
        from . import dsv4_gluon
    except (ImportError, AttributeError):
        return None
    return dsv4_gluon


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability(device_index)


def wgmma_applies(q, *others) -> bool:
    """Whether dsv4_gluon's kernel serves a call with queries q [rows, H, D] and key tensors
    others: all bf16 on an sm_90 GPU, D 512, 33-64 heads (its programs take 64 heads), and this
    Triton has Gluon."""
    import torch

    _, heads, dim = q.shape
    if not (q.is_cuda and dim == 512 and 32 < heads <= 64 and not interpreting()
            and all(x.dtype == q.dtype == torch.bfloat16 for x in others)):
        return False
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return _capability(index) == (9, 0) and gluon_kernels() is not None


_warned: set[str] = set()


def unbuilt_message(what: str, why: str) -> str:
    """Why the wgmma `what` (decode, forward) does not build with this Triton."""
    return f"the wgmma {what} does not build with Triton {triton.__version__}: {why}"


def warn_unbuilt(what: str, why: str) -> str:
    """Logs once per message that a Gluon kernel does not build here -> the message."""
    message = unbuilt_message(what, why)
    if message not in _warned:
        _warned.add(message)
        logging.getLogger(__name__).warning(message + f"; the Triton {what} serves it instead")
    return message


def row_block(width: int, most: int = 1024) -> int:
    """Columns a program takes of a row ``width`` wide (the rest in further programs): the
    next power of two, at least 16, at most ``most``."""
    return min(most, triton.next_power_of_2(max(width, 16)))


def compile_for_gpu(kernel, types: dict[str, str], constants: dict, aligned=(), arch: int = 90,
                    **options):
    """``kernel`` (a @triton.jit or @gluon.jit function: not under TRITON_INTERPRET=1, which
    makes interpreted ones) compiled for sm_<arch> with the installed Triton and its ptxas, no
    GPU needed -> the compiled kernel (.asm["ptx"], .metadata). ``types``: each non-constexpr
    argument's Triton type ("*bf16", "i32", "fp32"); pointers, and the integer arguments named
    in ``aligned``, are marked multiples of 16, as a launch marks them."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = [p.name for p in kernel.params]
    missing = [n for n in names if n not in types and n not in constants]
    if missing:
        raise ValueError(f"compile_for_gpu: no type for {missing}")
    signature = {n: "constexpr" if n in constants else types[n] for n in names}
    marks = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if signature[n].startswith("*") or n in aligned}
    source = ASTSource
    if getattr(kernel, "is_gluon", lambda: False)():  # a @gluon.jit kernel
        from triton.experimental.gluon._runtime import GluonASTSource as source
    return triton.compile(source(kernel, signature, constants, marks),
                          target=GPUTarget("cuda", arch, 32), options=options)


def ptx_global_loads(ptx: str) -> tuple[int, int, int]:
    """-> (asynchronous copies (cp.async), plain global loads, those of them of one 16-bit
    element) in a kernel's PTX: the third are gathers Triton could neither vectorize nor turn
    into asynchronous copies."""
    return (len(re.findall(r"\bcp\.async\.c[ag]\b", ptx)),
            len(re.findall(r"\bld\.global\.", ptx)),
            len(re.findall(r"\bld\.global(?:\.[a-z]+)*\.[bu]16\b", ptx)))
