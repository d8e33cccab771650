"""Paged cache: the page allocator (leader), the per-rank token-row pool and the R3 host buffer.

Slot s of the pool is token s % page_size of page s // page_size. Page 0 is reserved: padding
rows of a forward write their rows to slot 0 (DUMMY_SLOT), so they never touch a live page.
Pages are shared by reference count: a request holds one reference on each page of its page
table, the prefix cache holds one on each page it stores; a page is free at count 0.
"""

from __future__ import annotations

import torch

DUMMY_PAGE = 0
DUMMY_SLOT = 0
# The default KV budget per rank on CPU, where no device memory figure can size it.
CPU_KV_BUDGET_BYTES = 64 << 20
CUDA_KV_FRACTION = 0.4


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"the KV cache needs at least 2 pages (1 reserved), got {num_pages}")
        self.num_pages, self.page_size = num_pages, page_size
        self.ref = [0] * num_pages
        self.ref[DUMMY_PAGE] = 1
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low pages first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.ref[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            if self.ref[p] <= 0:
                raise RuntimeError(f"incref of free page {p}")
            self.ref[p] += 1

    def decref(self, pages: list[int]) -> int:
        """Drops one reference from each page; returns how many pages became free."""
        freed = 0
        for p in pages:
            if p == DUMMY_PAGE or self.ref[p] <= 0:
                raise RuntimeError(f"decref of page {p} with refcount {self.ref[p]}")
            self.ref[p] -= 1
            if self.ref[p] == 0:
                self._free.append(p)
                freed += 1
        return freed

    def check(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free) or DUMMY_PAGE in free:
            raise AssertionError("free list has duplicates or the dummy page")
        for p in range(1, self.num_pages):
            if (p in free) != (self.ref[p] == 0) or self.ref[p] < 0:
                raise AssertionError(f"page {p}: refcount {self.ref[p]}, in free list {p in free}")


def slots_of(pages: list[int], start: int, end: int, page_size: int) -> list[int]:
    """KV slots of token positions [start, end) of a sequence with this page table."""
    return [pages[i // page_size] * page_size + i % page_size for i in range(start, end)]


class TokenRowPool:
    """Per-token cache rows, all paged alike: a named tensor [num_pages * page_size, width] per
    cached quantity. For the DSV4 model (see docs/structures.md, "Cache"):
      layers.N.kv                          the K=V latent after RoPE (every layer, even sliding
                                           ones: one uniform paged row keeps prefix reuse and
                                           eviction identical for all layers)
      <compressor>.wkv / <compressor>.wgate the compressor's projections of each token (CSA,
                                           HCA and the CSA indexer's compressor)
    Because every compressor input is a per-token row, the compressed entries and the indexer
    keys of any prefix are a pure function of the rows: prefix reuse restores them exactly at
    any page boundary, and decode equals a whole-sequence recompute."""

    def __init__(self, widths: dict[str, int], num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.page_size, self.widths = page_size, dict(widths)
        self.rows = {name: torch.zeros(num_pages * page_size, w, dtype=dtype, device=device)
                     for name, w in widths.items()}

    def write(self, name: str, slots: torch.Tensor, values: torch.Tensor) -> None:
        buf = self.rows[name]
        buf[slots] = values.reshape(values.shape[0], buf.shape[1]).to(buf.dtype)

    def gather(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        return self.rows[name][slots]

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every quantity's rows at slots ``src`` into slots ``dst`` (copy-on-write of a
        prefix-cache page matched part-way)."""
        for buf in self.rows.values():
            buf[dst.to(buf.device)] = buf[src.to(buf.device)]


def row_bytes_per_token(widths: dict[str, int], dtype: torch.dtype) -> int:
    return sum(widths.values()) * torch.empty(0, dtype=dtype).element_size()


def default_max_total_tokens(bytes_per_token: int, page_size: int, device: torch.device,
                             context_length: int) -> int:
    """KV tokens per DP group when --max-total-tokens is not given."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * CUDA_KV_FRACTION)
    else:
        budget = CPU_KV_BUDGET_BYTES
    tokens = min(budget // max(bytes_per_token, 1), 4 * context_length)
    return max(tokens // page_size, 2) * page_size


class RoutedExpertsBuffer:
    """R3 host buffer as SGLang: int32 [(max_total_tokens + page_size), layers, top_k] expert ids
    and float32 weights, indexed by KV slot, so prefix-cached tokens keep their routing. Dense
    layers stay -1 (ids) / 0 (weights)."""

    def __init__(self, num_slots: int, num_layers: int, top_k: int):
        self.ids = torch.full((num_slots, num_layers, top_k), -1, dtype=torch.int32)
        self.weights = torch.zeros((num_slots, num_layers, top_k), dtype=torch.float32)
        if torch.cuda.is_available():
            self.ids, self.weights = self.ids.pin_memory(), self.weights.pin_memory()

    @property
    def nbytes(self) -> int:
        return self.ids.numel() * 4

    def write(self, slots: torch.Tensor, routed: dict[int, tuple[torch.Tensor, torch.Tensor]],
              rows: slice) -> None:
        for layer, (ids, weights) in routed.items():
            self.ids[slots, layer] = ids[rows].to("cpu", torch.int32)
            self.weights[slots, layer] = weights[rows].to("cpu", torch.float32)

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.ids[dst] = self.ids[src]
        self.weights[dst] = self.weights[src]

    def read(self, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(slots, dtype=torch.long)
        return self.ids[idx].clone(), self.weights[idx].clone()
