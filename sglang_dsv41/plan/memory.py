"""Host-memory formulas of a deployment: R3 buffers, KV sizing, Engram tables, CPU optimizer state
and the pinned-memory allocator's rounding.

Every function returns bytes (int) and takes plain numbers or a DSV4Config, so the embedded
engine (sizing its R3 buffer), ServerArgs and the trainer bridge can import them directly.
The R3 and Engram figures are SGLang 0.5.23's own allocations (file:line cited per function);
the pinned power-of-two rounding applies only to the trainer's torch pinned buffers.
"""

from __future__ import annotations

from ..model.dsv4.config import DSV4Config
from ..policies.engram_layout import LAYOUTS as ENGRAM_LAYOUTS
from ..policies.r3_buffer import R3_EXPERT_ID_BYTES, r3_buffer_bytes, r3_bytes_per_token
from .shapes import ENGRAM_SCALE_BLOCK, engram_columns

GIB = 1 << 30
MIB = 1 << 20
# SGLang's alloc_mmap rounds to the mmap page (mem_cache/storage/mmap/mmap_allocator.py:191);
# 4 KiB unless SGLANG_HUGEPAGE_SIZE asks for 2MB / 1GB pages.
HOST_PAGE_BYTES = {"": 4096, "2MB": 2 << 20, "1GB": 1 << 30}
# --optimizer-offload of the trainer bridge (trainer_bridge/optimizer_offload.py has the layout).
OPTIMIZER_MODES = ("none", "fsdp", "chunked")
# Host bytes per trained parameter. fsdp (FSDP2 CPUOffloadPolicy): fp32 master 4 + fp32 grad 4 +
# two fp32 moments 8 = 16. chunked: the moments only (8); the fp32 masters and grads stay the
# FSDP2 shards on the GPU and a chunk of the moments streams through one pinned buffer. There is
# no bf16 host copy in either: FSDP2 casts to bf16 on the device at all-gather.
OPTIMIZER_BYTES_PER_PARAM = {"none": 0, "fsdp": 16, "chunked": 8}
# fsdp pins the master and grad shards (8 B per parameter, one allocation per tensor).
OPTIMIZER_PINNED_BYTES_PER_PARAM = 8
# torch's CachingHostAllocator skips power-of-two rounding for requests above this many MiB when
# PYTORCH_ALLOC_CONF=pinned_max_round_threshold_mb:<N> is set (c10/core/AllocatorConfig.h).
PINNED_CAP_ENV_KEY = "pinned_max_round_threshold_mb"
DEFAULT_PINNED_CAP_MB = 128


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), as c10::llvm::PowerOf2Ceil."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def pinned_alloc_bytes(nbytes: int, capped: bool = False,
                       cap_mb: int = DEFAULT_PINNED_CAP_MB) -> int:
    """Host bytes that a pinned request of ``nbytes`` really takes.

    The caching host allocator rounds every request up to a power of two (11 GiB takes 16 GiB);
    with the cap on (pinned_max_round_threshold_mb:cap_mb) requests above cap_mb MiB are exact.
    """
    _need(nbytes >= 0, f"pinned request must be >= 0 bytes, got {nbytes}")
    _need(cap_mb >= 0, f"pinned cap must be >= 0 MiB, got {cap_mb}")
    if nbytes == 0:
        return 0
    if capped and nbytes > cap_mb * MIB:
        return nbytes
    return next_pow2(nbytes)


def mmap_bytes(nbytes: int, hugepage: str = "") -> int:
    """alloc_mmap's mapping size: ceil(nbytes / page) x page (mmap_allocator.py:175-191)."""
    _need(hugepage in HOST_PAGE_BYTES, f"hugepage must be one of {sorted(HOST_PAGE_BYTES)}")
    page = HOST_PAGE_BYTES[hugepage]
    return -(-nbytes // page) * page


def r3_host_bytes(cfg: DSV4Config, max_total_tokens: int, page_size: int,
                  hugepage: str = "") -> int:
    """Host bytes that request really takes: alloc_with_host_register -> alloc_mmap (MAP_SHARED
    | MAP_POPULATE, page-rounded) + cudaHostRegister (pool_host/common.py:330-350). No
    power-of-two rounding: it never goes through torch's caching host allocator."""
    return mmap_bytes(r3_buffer_bytes(cfg, max_total_tokens, page_size), hugepage)


def r3_largest_tokens(budget_bytes: int, bytes_per_token: int, page_size: int,
                      hugepage: str = "", max_tokens: int | None = None) -> int:
    """The largest page-aligned max_total_tokens (<= max_tokens if given) whose R3 host mapping
    (r3_host_bytes) fits in budget_bytes; -1 when not even 0 tokens fit."""
    _need(bytes_per_token >= 1 and page_size >= 1, "bytes_per_token and page_size must be >= 1")
    page = HOST_PAGE_BYTES[hugepage]
    whole_pages = max(budget_bytes, 0) // page * page  # the mapping is a whole number of pages
    tokens = (whole_pages // bytes_per_token - page_size) // page_size * page_size
    if max_tokens is not None:
        tokens = min(tokens, max_tokens // page_size * page_size)
    return tokens if tokens >= 0 else -1


def kv_bytes_per_token(cfg: DSV4Config, dtype_bytes: int = 2, attn_tp_size: int = 1) -> int:
    """A plain upper bound of KV bytes per token on one GPU: one K=V latent of head_dim per
    layer (V4 attention has one KV head, replicated over attention TP). The real V4.1 cache
    holds compressed fp4/fp8 entries on its kv-source layers only (890 B/token global on
    V4.1-Flash plus the 128-token windows): pass the measured figure (--kv-bytes-per-token)."""
    _need(dtype_bytes >= 1 and attn_tp_size >= 1, "dtype_bytes and attn_tp_size must be >= 1")
    return cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes


def kv_tokens_for_budget(kv_bytes: int, bytes_per_token: int, page_size: int) -> int:
    """Tokens a KV budget holds, rounded down to whole pages (as SGLang aligns max_total_tokens)."""
    _need(bytes_per_token >= 1 and page_size >= 1, "bytes_per_token and page_size must be >= 1")
    return (max(kv_bytes, 0) // bytes_per_token) // page_size * page_size


def engram_row_bytes(cfg: DSV4Config) -> int:
    """fp8 row + its e8m0 scales: head_dim + head_dim/32 (engram.py:1043-1046; 264 B at 256)."""
    return cfg.engram_head_dim + cfg.engram_head_dim // ENGRAM_SCALE_BLOCK


def engram_table_bytes(cfg: DSV4Config) -> int:
    """Bytes of all Engram tables (weights + scales), as stored and as SGLang holds them."""
    return sum(cfg.engram_num_embeddings) * engram_row_bytes(cfg)


def engram_shard_rows(num_embeddings: int, n_columns: int, tp_rank: int, tp_size: int
                      ) -> tuple[int, int]:
    """SGLang's shard_range (engram.py:960-982): whole hash columns per rank when the column
    count divides evenly by tp_size, else the equal-row split. ``n_columns`` is
    (max_ngram_size - 1) x n_heads; the column bounds only matter in the even case, where the
    row range is taken from the layer's primes (see engram_host_bytes)."""
    return (num_embeddings * tp_rank // tp_size, num_embeddings * (tp_rank + 1) // tp_size)


def engram_host_bytes(cfg: DSV4Config, layout: str, tp_size: int, local_ranks: range,
                      column_bounds: list[tuple[int, ...]] | None = None) -> int:
    """Engram host bytes on one node with SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE=1.

    shared: one memfd per table holding every row, mapped by all ranks of the node
    (engram.py:1043 n = num_embeddings). private (SGLang per_rank): each rank maps its own row
    shard (n = shard_range rows), so the node holds the sum over its ``local_ranks`` (global TP
    ranks). ``column_bounds`` (per table, SGLang's EngramLayout.column_bounds) gives the
    whole-column split when the column count divides by tp_size; without it the equal split.
    """
    _need(layout in ENGRAM_LAYOUTS, f"engram layout must be one of {ENGRAM_LAYOUTS}, got {layout!r}")
    _need(tp_size >= 1, f"tp_size must be >= 1, got {tp_size}")
    row = engram_row_bytes(cfg)
    if layout == "shared":
        return engram_table_bytes(cfg)
    cols = engram_columns(cfg)
    rows = 0
    for t, n in enumerate(cfg.engram_num_embeddings):
        for r in local_ranks:
            if column_bounds is not None and cols % tp_size == 0:
                per = cols // tp_size
                lo, hi = column_bounds[t][r * per], column_bounds[t][(r + 1) * per]
            else:
                lo, hi = engram_shard_rows(n, cols, r, tp_size)
            rows += hi - lo
    return rows * row


def optimizer_host_bytes(n_params: int, mode: str, chunk_bytes: int = 0, ranks: int = 1) -> int:
    """Host bytes of the optimizer over n_params trained parameters held by ``ranks`` processes:
    16N (fsdp), 8N plus one pinned chunk of ``chunk_bytes`` per rank (chunked), or 0 (none)."""
    _need(mode in OPTIMIZER_MODES, f"optimizer mode must be one of {OPTIMIZER_MODES}, got {mode!r}")
    _need(n_params >= 0 and chunk_bytes >= 0 and ranks >= 1,
          f"need n_params >= 0, chunk_bytes >= 0, ranks >= 1; got {n_params}, {chunk_bytes}, {ranks}")
    chunks = chunk_bytes * ranks if mode == "chunked" else 0
    return OPTIMIZER_BYTES_PER_PARAM[mode] * n_params + chunks


def largest_tokens_within(budget_bytes: int, bytes_per_token: int, page_size: int,
                          capped: bool = False, cap_mb: int = DEFAULT_PINNED_CAP_MB,
                          max_tokens: int | None = None) -> int:
    """The largest page-aligned max_total_tokens (<= max_tokens if given) whose pinned R3
    buffer fits in budget_bytes.

    Returns -1 when not even max_total_tokens = 0 fits. The allocator's cost is not monotone
    around the cap (a request just above it is exact, one just below is rounded up), so both
    regimes are solved separately and each candidate is checked.
    """
    _need(bytes_per_token >= 1 and page_size >= 1, "bytes_per_token and page_size must be >= 1")

    def cost(tokens: int) -> int:
        return pinned_alloc_bytes((tokens + page_size) * bytes_per_token, capped, cap_mb)

    def align(tokens: int) -> int:
        return tokens // page_size * page_size

    if budget_bytes <= 0:
        return -1
    candidates = []
    # Rounded regime: the request must fit in the largest power of two within the budget (and
    # stay at or under the cap when capped, where rounding applies).
    limit = 1 << (budget_bytes.bit_length() - 1)
    if capped:
        limit = min(limit, max(cap_mb * MIB, 0))
    candidates.append(align(limit // bytes_per_token - page_size))
    if capped:  # exact regime above the cap
        candidates.append(align(budget_bytes // bytes_per_token - page_size))
    if max_tokens is not None:
        candidates = [min(t, align(max_tokens)) for t in candidates]
    fitting = [t for t in candidates if t >= 0 and cost(t) <= budget_bytes]
    if fitting:
        return max(fitting)
    return 0 if cost(0) <= budget_bytes else -1
