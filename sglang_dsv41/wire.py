"""The array wire format of /generate's routed experts (SGLang's ``routed_experts`` field): base64
of the little-endian bytes, with the shape sent beside it. The server encodes, the trainer
decodes, and the trainer's rollout files reuse it."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np


def encode_array(x: Any, dtype: str) -> tuple[str, list[int]]:
    """base64 of the little-endian bytes of ``x`` (numpy or CPU torch) and its shape."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    arr = np.ascontiguousarray(np.asarray(x), dtype=np.dtype(dtype).newbyteorder("<"))
    return base64.b64encode(arr.tobytes()).decode("ascii"), list(arr.shape)


def decode_array(b64: str, shape: list[int], dtype) -> np.ndarray:
    """The inverse of encode_array, as a writable array in the native byte order."""
    arr = np.frombuffer(base64.b64decode(b64), dtype=np.dtype(dtype).newbyteorder("<"))
    return arr.reshape(shape).astype(dtype)
