"""Sink attention: torch reference, Triton kernels, and one dispatch for trainer and server.

Backend choice, first match wins: the `backend` argument, the environment variable
SGLANG_DSV41_ATTENTION_BACKEND, then automatic: CUDA tensors go to flash-attn when it is
installed and the call has no sinks (FA2 has none) and a half dtype, else to Triton; CPU tensors
go to the torch reference. Triton on CPU tensors runs only under TRITON_INTERPRET=1 (tests).
Backends are imported lazily, so importing this package needs neither triton nor flash-attn.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Callable

import torch

from .dsv4 import DSV4_BACKENDS, dsv4_attention, dsv4_decode
from .reference import sink_attention_reference, sink_decode_reference
from .transformers_backend import register_transformers_attention

BACKEND_ENV = "SGLANG_DSV41_ATTENTION_BACKEND"
PREFILL_BACKENDS = ("reference", "triton", "flash_attn")
DECODE_BACKENDS = ("reference", "triton")

__all__ = ["sink_attention", "sink_decode", "sink_attention_reference", "sink_decode_reference",
           "resolve_backend", "PREFILL_BACKENDS", "DECODE_BACKENDS", "BACKEND_ENV",
           "dsv4_attention", "dsv4_decode", "DSV4_BACKENDS", "register_transformers_attention"]


def _flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def _triton_runs_on(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(device: torch.device, dtype: torch.dtype, has_sinks: bool,
                    backend: str | None = None, decode: bool = False) -> str:
    choices = DECODE_BACKENDS if decode else PREFILL_BACKENDS
    name = backend or os.environ.get(BACKEND_ENV) or "auto"
    if name == "auto":
        if device.type != "cuda":
            return "reference"
        if (not decode and not has_sinks and dtype in (torch.float16, torch.bfloat16)
                and _flash_attn_available()):
            return "flash_attn"
        return "triton"
    if name not in choices:
        raise ValueError(f"attention backend {name!r} unknown; choose one of {choices} or 'auto'")
    if name == "triton" and not _triton_runs_on(device):
        raise ValueError("the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    if name == "flash_attn" and (has_sinks or not _flash_attn_available()):
        raise ValueError("the flash_attn backend needs flash-attn installed and sinks=None")
    return name


def _check_prefill(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, window):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q/k/v must be [tokens, heads, dim], got {q.shape}, {k.shape}, {v.shape}")
    if k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ValueError(f"k/v shapes {k.shape}, {v.shape} do not match q {q.shape}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"Hq={q.shape[1]} must be a multiple of Hkv={k.shape[1]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q/k/v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"sinks must have shape [{q.shape[1]}], got {tuple(sinks.shape)}")
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be 1-D with one entry per boundary")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")


def _flash_attn_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window, softmax_scale):
    from flash_attn import flash_attn_varlen_func

    # FA2 >= 2.1 aligns causal masks to the bottom-right, like our reference.
    window_size = (-1, -1) if window is None else (window - 1, 0 if causal else -1)
    cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.int32)
    cu_k = cu_seqlens_k.to(device=q.device, dtype=torch.int32)
    max_q = int((cu_q[1:] - cu_q[:-1]).max()) if cu_q.numel() > 1 else 0
    max_k = int((cu_k[1:] - cu_k[:-1]).max()) if cu_k.numel() > 1 else 0
    return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0,
                                  softmax_scale=softmax_scale, causal=causal,
                                  window_size=window_size)


def _triton_prefill(*args) -> torch.Tensor:
    from .triton_prefill import sink_attention_triton

    return sink_attention_triton(*args)


_PREFILL: dict[str, Callable] = {
    "reference": sink_attention_reference,
    "triton": _triton_prefill,
    "flash_attn": lambda q, k, v, sinks, *rest: _flash_attn_prefill(q, k, v, *rest),
}


def sink_attention(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, causal=True, window=None,
                   softmax_scale=None, backend: str | None = None):
    """q [total_q, Hq, D], k/v [total_k, Hkv, D], sinks fp32 [Hq] or None -> [total_q, Hq, D]."""
    _check_prefill(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, window)
    name = resolve_backend(q.device, q.dtype, sinks is not None, backend)
    return _PREFILL[name](q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, causal, window,
                          softmax_scale)


def sink_decode(q, k_cache, v_cache, page_table, seq_lens, sinks, window=None, softmax_scale=None,
                backend: str | None = None):
    """q [B, Hq, D]; k/v_cache [num_pages, page_size, Hkv, D]; page_table [B, max_pages];
    seq_lens [B] -> [B, Hq, D]."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"bad decode shapes q {q.shape}, k_cache {k_cache.shape}, "
                         f"v_cache {v_cache.shape}")
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q {q.shape} does not fit the cache's Hkv/D {k_cache.shape}")
    if (page_table.dim() != 2 or page_table.shape[0] != q.shape[0]
            or tuple(seq_lens.shape) != (q.shape[0],)):
        raise ValueError("page_table must be [B, max_pages] and seq_lens [B]")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    name = resolve_backend(q.device, q.dtype, sinks is not None, backend, decode=True)
    if name == "reference":
        return sink_decode_reference(q, k_cache, v_cache, page_table, seq_lens, sinks, window,
                                     softmax_scale)
    from .triton_decode import sink_decode_triton

    return sink_decode_triton(q, k_cache, v_cache, page_table, seq_lens,
                              sinks.float().contiguous() if sinks is not None else None, window,
                              softmax_scale)
