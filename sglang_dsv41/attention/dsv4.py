"""Dispatch of the DSV4 sparse sink attention: one entry for the model, the trainer and the engine.

Backends: "reference" (torch, dsv4_reference.py) and "triton" (dsv4_triton_*.py). The choice,
first match wins: the `backend` argument, then SGLANG_DSV41_ATTENTION_BACKEND, then CUDA ->
triton, CPU -> reference; triton on CPU only under TRITON_INTERPRET=1 (tests). Inputs are
validated here, once, before any kernel launch.
"""

from __future__ import annotations

import os

import torch

from .dsv4_reference import dsv4_attention_reference, window_indices

DSV4_BACKENDS = ("reference", "triton")
BACKEND_ENV = "SGLANG_DSV41_ATTENTION_BACKEND"


def _triton_runs_on(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(device: torch.device, backend: str | None) -> str:
    """The backend a DSV4 kernel's dispatch takes: ``backend``, else the environment's
    (BACKEND_ENV), else auto (triton on CUDA, the torch reference elsewhere); triton refused
    where it cannot run."""
    name = backend or os.environ.get(BACKEND_ENV) or "auto"
    if name == "auto":
        return "triton" if device.type == "cuda" else "reference"
    if name not in DSV4_BACKENDS:
        raise ValueError(f"DSV4 attention backend {name!r} unknown; choose one of "
                         f"{DSV4_BACKENDS} or 'auto'")
    if name == "triton" and not _triton_runs_on(device):
        raise ValueError("the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    return name


_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_sinks_and_window(sinks, heads, window):
    if sinks is not None and tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks must have shape [{heads}], got {tuple(sinks.shape)}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")


def _check_selection(comp_kv, comp_idx, rows, dim, check_values):
    """comp_idx [rows, K] of rows of comp_kv [C, dim] (-1 = none); check_values: its range."""
    if comp_idx is None:
        return
    if comp_idx.dim() != 2 or comp_idx.shape[0] != rows:
        raise ValueError(f"comp_idx must be [{rows}, K], a row of picks a query; got "
                         f"{tuple(comp_idx.shape)}")
    if comp_idx.dtype not in _INDEX_DTYPES:
        raise ValueError(f"comp_idx must be int32 (or int64); got {comp_idx.dtype}")
    if comp_kv is None:
        raise ValueError("comp_idx given without comp_kv")
    if comp_kv.dim() != 2 or comp_kv.shape[1] != dim:
        raise ValueError(f"comp_kv must be [C, {dim}]; got {tuple(comp_kv.shape)}")
    if check_values and comp_idx.numel():
        low, high = (int(x) for x in torch.aminmax(comp_idx))
        if low < -1 or high >= comp_kv.shape[0]:
            raise ValueError(f"comp_idx entries must lie in [-1, {comp_kv.shape[0]}); got "
                             f"[{low}, {high}]")


def _check(q, kv, sinks, cu_seqlens, window, comp_kv, comp_idx, check_values):
    if q.dim() != 3 or kv.dim() != 2 or kv.shape != (q.shape[0], q.shape[2]):
        raise ValueError(f"q must be [T, H, D] and kv [T, D]; got {tuple(q.shape)}, "
                         f"{tuple(kv.shape)}")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"unsupported dtype {q.dtype}")
    if kv.dtype != q.dtype or (comp_kv is not None and comp_kv.dtype != q.dtype):
        raise ValueError(f"q, kv and comp_kv must share a dtype; got {q.dtype}, {kv.dtype}, "
                         f"{None if comp_kv is None else comp_kv.dtype}")
    _check_sinks_and_window(sinks, q.shape[1], window)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or (
            check_values and int(cu_seqlens[-1]) != q.shape[0]):
        raise ValueError(f"cu_seqlens must be 1-D and end at T={q.shape[0]}; got "
                         f"{cu_seqlens.tolist() if cu_seqlens.numel() < 16 else cu_seqlens.shape}")
    _check_selection(comp_kv, comp_idx, q.shape[0], q.shape[2], check_values)


def _check_decode_pages(kv_cache, page_table, seq_lens, window):
    """Each request holds at least its query's own latent, no more than its page table row
    maps, and every page its window reads is one of the cache's (entries past a request's
    length are not read, and may be anything)."""
    pages, page = kv_cache.shape[:2]
    lens = seq_lens.long()
    shortest, longest = (int(x) for x in torch.aminmax(lens))
    if shortest < 1 or longest > page_table.shape[1] * page:
        raise ValueError(f"seq_lens must lie in [1, {page_table.shape[1] * page}] (the query's "
                         f"own latent cached, within its page table row); got "
                         f"[{shortest}, {longest}]")
    pos = lens[:, None] - 1 - torch.arange(min(window, longest), device=lens.device)
    entries = page_table.long().gather(1, pos.clamp_min(0) // page)
    bad = ((pos >= 0) & ((entries < 0) | (entries >= pages))).nonzero()
    if len(bad):
        b, i = (int(x) for x in bad[0])
        raise ValueError(f"request {b}: its window reads page table entry "
                         f"{int(pos[b, i]) // page} = {int(entries[b, i])}, not a page of the "
                         f"cache's {pages}")


def dsv4_attention(q: torch.Tensor, kv: torch.Tensor, sinks: torch.Tensor | None,
                   cu_seqlens: torch.Tensor, window: int, scale: float,
                   comp_kv: torch.Tensor | None = None, comp_idx: torch.Tensor | None = None,
                   backend: str | None = None, check_values: bool = True,
                   first_rows: torch.Tensor | None = None) -> torch.Tensor:
    """The reference's contract (dsv4_reference.dsv4_attention_reference) on the chosen backend.

    check_values reads cu_seqlens' end and comp_idx's range back to the host (a device sync
    each on CUDA); a caller that already holds those facts on the host (the model's context:
    its sequence bounds, its own indexer's picks) passes False and keeps the shape checks.
    first_rows: sequence_first_rows(cu_seqlens, T) for the kernel, when the caller keeps it
    for all its layers (computed here otherwise)."""
    _check(q, kv, sinks, cu_seqlens, window, comp_kv, comp_idx, check_values)
    if resolve_backend(q.device, backend) == "reference" or q.dtype == torch.float64:
        return dsv4_attention_reference(q, kv, sinks, cu_seqlens, window, scale, comp_kv,
                                        comp_idx)
    from .dsv4_triton_backward import dsv4_attention_triton

    return dsv4_attention_triton(q, kv, sinks, cu_seqlens, window, scale, comp_kv, comp_idx,
                                 first_rows=first_rows)


def dsv4_decode_reference(q, kv_cache, page_table, seq_lens, sinks, window, scale, comp_kv=None,
                          comp_idx=None) -> torch.Tensor:
    """Paged decode through the prefill reference: gather each request's window, one query each."""
    batch, _, dim = q.shape
    page = kv_cache.shape[1]
    outs = []
    for b in range(batch):
        n = int(seq_lens[b])
        lo = max(0, n - window)
        pos = torch.arange(lo, n, device=q.device)
        rows = page_table[b, pos // page].long() * page + pos % page
        keys = kv_cache.reshape(-1, dim)[rows]
        # The query is the last of a pseudo-sequence of its window keys; only its row counts.
        qs = torch.zeros(n - lo, *q.shape[1:], dtype=q.dtype, device=q.device)
        qs[-1] = q[b]
        cu = torch.tensor([0, n - lo], dtype=torch.int32, device=q.device)
        cidx = None
        if comp_idx is not None:
            cidx = comp_idx[b:b + 1].expand(n - lo, -1)
        outs.append(dsv4_attention_reference(qs, keys, sinks, cu, window, scale, comp_kv,
                                             cidx)[-1])
    return torch.stack(outs) if outs else q.new_zeros(q.shape)


def dsv4_decode(q, kv_cache, page_table, seq_lens, sinks, window, scale, comp_kv=None,
                comp_idx=None, backend: str | None = None,
                check_values: bool = True) -> torch.Tensor:
    """q [B, H, D]; kv_cache [pages, page_size, D]; page_table [B, max_pages]; seq_lens [B]
    (the query's own latent already cached); comp_kv [C, D] pool; comp_idx [B, K] -> [B, H, D].
    check_values: as in dsv4_attention (seq_lens' range, the pages the windows read and the
    picks' range are read back to the host)."""
    if q.dim() != 3 or kv_cache.dim() != 3 or kv_cache.shape[2] != q.shape[2]:
        raise ValueError(f"q must be [B, H, D] and kv_cache [pages, page_size, D]; got "
                         f"{tuple(q.shape)}, {tuple(kv_cache.shape)}")
    if page_table.dim() != 2 or page_table.shape[0] != q.shape[0] or \
            tuple(seq_lens.shape) != (q.shape[0],):
        raise ValueError("page_table must be [B, max_pages] and seq_lens [B]")
    if page_table.dtype not in _INDEX_DTYPES or seq_lens.dtype not in _INDEX_DTYPES:
        raise ValueError(f"page_table and seq_lens must be int32 (or int64); got "
                         f"{page_table.dtype}, {seq_lens.dtype}")
    _check_sinks_and_window(sinks, q.shape[1], window)
    _check_selection(comp_kv, comp_idx, q.shape[0], q.shape[2], check_values)
    if check_values and seq_lens.numel():
        _check_decode_pages(kv_cache, page_table, seq_lens, window)
    if resolve_backend(q.device, backend) == "reference":
        return dsv4_decode_reference(q, kv_cache, page_table, seq_lens, sinks, window, scale,
                                     comp_kv, comp_idx)
    from .dsv4_triton_decode import dsv4_decode_triton

    return dsv4_decode_triton(q, kv_cache, page_table, seq_lens,
                              sinks.float().contiguous() if sinks is not None else None,
                              window, scale, comp_kv, comp_idx)


__all__ = ["dsv4_attention", "dsv4_decode", "dsv4_attention_reference", "dsv4_decode_reference",
           "window_indices", "DSV4_BACKENDS"]
