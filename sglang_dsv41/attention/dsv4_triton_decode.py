"""Paged decode of the DSV4 sparse sink attention over the engine's cache (Triton).

One query token per request. The request's window is its last `window` cached positions, read
through the page table of a paged latent cache [num_pages, page_size, D] (one K=V head); its
compressed selection is a list of rows of a flat compressed pool [C, D] (-1 = none), exactly as
in prefill. The forward kernel serves both (PAGED=True); one program per (request, head block)
reads each key tile once for all heads of the block, which keeps decode bandwidth-bound.
"""

from __future__ import annotations

import torch

from .dsv4_triton_forward import (DSV4Blocks, default_blocks, dsv4_forward, interpreting,
                                  selection_or_empty)

# Best of `bench/dsv4_attention.py --decode-sweep` on one H200 (batch 512, page 64): with few
# heads, small head blocks give more programs than a batch alone would; with 64 heads one block
# of all heads reads each key once (1.8x faster at top-k 512 than four blocks of 16).
FEW_HEADS_DECODE_BLOCKS = DSV4Blocks(fwd_bh=16, fwd_bn=64, fwd_warps=4, fwd_stages=2)
MANY_HEADS_DECODE_BLOCKS = DSV4Blocks(fwd_bh=64, fwd_bn=32, fwd_warps=8, fwd_stages=2)


def dsv4_decode_triton(q, kv_cache, page_table, seq_lens, sinks, window, scale, comp_kv=None,
                       comp_idx=None, blocks: DSV4Blocks | None = None) -> torch.Tensor:
    """q [B, H, D]; kv_cache [pages, page_size, D]; page_table [B, max_pages] int32;
    seq_lens [B] (tokens cached, the query's own included) -> [B, H, D]."""
    batch, heads, dim = q.shape
    if blocks is None and interpreting():
        blocks = default_blocks(heads)
    elif blocks is None:
        blocks = MANY_HEADS_DECODE_BLOCKS if heads > 16 else FEW_HEADS_DECODE_BLOCKS
    ckv, cidx, sel_end = selection_or_empty(comp_kv, comp_idx, batch, dim, kv_cache)
    lens = seq_lens.to(torch.int32).contiguous()
    out, _ = dsv4_forward(q.contiguous(), kv_cache.reshape(-1, dim), sinks, lens, window, scale,
                          ckv, cidx, sel_end, blocks, store_lse=False,
                          page_table=page_table.to(torch.int32).contiguous(),
                          page_size=kv_cache.shape[1])
    return out
