"""Let ``transformers`` import where the installed torchvision cannot load its operators.

transformers' DeepseekV4 import reaches torchvision, and torchvision's import registers fake
kernels for ``torchvision::nms`` / ``qnms``, which fails ("operator torchvision::nms does not
exist") when its C++ library cannot load into this torch: the README's CPU install, whose
torchvision (pinned by SGLang 0.5.23) is a CUDA build. Defining the two operator schemas first
lets the import finish; nothing here runs them. A torchvision that works is left alone: its own
library is loaded first, and the schemas are defined only when it did not register them.
The tests install the same shim (tests/sglang_cpu.py re-exports this one).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os

import torch

_shim = None  # None: not tried; False: not needed; else the torch.library.Library defined


def _torchvision_ops_loaded() -> bool:
    try:
        torch.ops.torchvision.nms
        return True
    except (AttributeError, RuntimeError):
        return False


def _load_torchvision_library() -> None:
    """Load torchvision's ``_C`` as its own import would (torchvision.extension), without
    importing the package: a working build registers its operators here, and defining them
    afterwards would collide with its library."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    loader = (importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES)
    for directory in spec.submodule_search_locations:
        ext = importlib.machinery.FileFinder(directory, loader).find_spec("_C")
        if ext is not None and ext.origin and os.path.isfile(ext.origin):
            try:
                torch.ops.load_library(ext.origin)
            except (OSError, RuntimeError):  # built for another torch or CUDA: shim below
                pass
            return


def install_torchvision_shim() -> None:
    """Idempotent; call it before anything imports transformers' DeepseekV4 (or SGLang)."""
    global _shim
    if _shim is not None:
        return
    if _torchvision_ops_loaded():
        _shim = False
        return
    if importlib.util.find_spec("torchvision") is None:
        _shim = False  # transformers imports no torchvision then
        return
    _load_torchvision_library()
    if _torchvision_ops_loaded():
        _shim = False
        return
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold, float scale, "
               "int zero_point) -> Tensor")
    _shim = lib
