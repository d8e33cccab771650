"""Import the real SGLang 0.5.23 on a CPU machine.

SGLang's Python code runs on CPU torch, with one blocker: `import sglang` reaches torchvision
through transformers, and the index's torchvision is a CUDA build whose C++ ops cannot register
on CPU torch. Defining the two `torchvision` operator schemas it needs before anything imports
torchvision lets every scheduler, model-runner, layer and HTTP module import. SGLang's CUDA
kernels stay out of reach; the tests call SGLang's torch paths.
"""

from __future__ import annotations

import importlib

import torch

SGLANG_VERSION = "0.5.23"
_shim = None


def install_torchvision_shim() -> None:
    global _shim
    if _shim is not None:
        return
    try:
        torch.ops.torchvision.nms  # a working torchvision build registered it already
        _shim = False
        return
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold, float scale, "
               "int zero_point) -> Tensor")
    _shim = lib


def import_sglang(module: str):
    """Import `module` from the installed SGLang 0.5.23 (the README's test install has it)."""
    install_torchvision_shim()
    version = importlib.import_module("sglang.version").__version__
    if version != SGLANG_VERSION:
        raise RuntimeError(f"tests need sglang=={SGLANG_VERSION}, found {version}")
    return importlib.import_module(module)
