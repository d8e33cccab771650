"""Host-memory formulas of a deployment: R3 buffers, KV sizing, Engram tables, CPU optimizer state
and the pinned-memory allocator's rounding.

Every function returns bytes (int; SGLang's own float for the KV bytes per token) and takes
plain numbers or a DSV4Config, so the embedded engine (sizing its R3 buffer), ServerArgs and the
trainer bridge can import them directly. The R3, KV pool and Engram figures are SGLang 0.5.23's
own allocations (file:line cited per function);
the pinned power-of-two rounding applies only to the trainer's torch pinned buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model.dsv4.config import DSV4Config
from ..policies.engram_layout import LAYOUTS as ENGRAM_LAYOUTS
from ..policies.r3_buffer import r3_buffer_bytes, r3_bytes_per_token  # noqa: F401 (re-export)
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


# ---- SGLang 0.5.23's DeepSeek-V4 KV pools ---------------------------------------------------
# What one GPU's KV budget buys, following DSV4PoolConfigurator (model_executor/
# pool_configurator.py:1067-1712, "PC" below) and the pools it sizes (mem_cache/
# deepseek_v4_memory_pool.py, "MP" below) for a CUDA run with speculative decoding, HiSparse,
# encoder SWA replay, online c128 compression, PD disaggregation and pipeline parallelism off,
# kv_cache_dtype fp8_e4m3 (the CUDA pool's only store: deepseek_v4_memory_pool.py create_buffer
# asserts uint8; bfloat16 is the NPU pool) and the float32 compress state (environ.py:1832).
DSV4_PAGE_SIZE = 256  # model_overrides/deepseek_v4.py:51 (CUDA); PC:1642 wants a multiple of 128
DSV4_MAX_RUNNING_REQUESTS = 256  # arg_groups/deepseek_v4_hook.py:142, when not given
GPU_ARCHS = ("sm90", "sm100")  # Hopper (H100/H200) / Blackwell (B200/GB200)
# arg_groups/memory_hook.py:153 (80-160 GB: H100/H200) and :167 (B200: > 160 GB).
DSV4_CHUNKED_PREFILL = {"sm90": 8192, "sm100": 16384}
# MP:532-542: the ratio-1/2 indexer page is 128 slots with DeepGEMM's paged sparse MQA logits
# (Blackwell only, layers/deep_gemm_wrapper/configurer.py:64-78), else 64.
DSV4_INDEX_PAGE = {"sm90": 64, "sm100": 128}
# SGLANG_DSV4_KV_LAYOUT: unset (SGLang's default) or one of its values
KV_LAYOUTS = ("unset", "auto", "v4", "v41", "v41_new")
# kernels/ops/attention/dsv4/kv_layout.py:50-100: (data + scale bytes per entry, page alignment).
# v4: 448 fp8 nope + 64 bf16 rope + 7 ue8m0 scales + 1 pad = 584 B in 576-byte-aligned pages.
_LAYOUT_BYTES = {"v4": (584, 576), "v41": (528, 512), "v41_new": (528, 528),
                 "v41_fp4": (288, 256), "v41_fp4_new": (288, 288)}
SWA_EVICTION_INTERVAL = 128  # environ.py:730 SGLANG_SWA_EVICTION_INTERVAL
COMPRESS_STATE_BYTES = 4  # float32 (environ.py:1832 SGLANG_DSV4_COMPRESS_STATE_DTYPE)
# get_compress_state_ring_size without draft tokens (MP:60-79): rows per request ring.
_STATE_RING = {2: 2, 4: 8, 128: 128}


def dsv4_page_bytes(layout: str, page_size: int) -> int:
    """KVLayout.page_bytes (kv_layout.py:103-105): page_size entries padded to the alignment."""
    entry, align = _LAYOUT_BYTES[layout]
    return -(-(page_size * entry) // align) * align


def resolve_dsv4_kv_layout(cfg: DSV4Config, kv_layout: str = "unset", gpu: str = "sm90",
                           attn_tp_size: int = 1) -> str:
    """The main-cache layout SGLang picks (select_dsv4_kv_layout, MP:198-235). unset: the
    attention backend defaults to flashmla_mega for V4.1 on SM100 with attention tp 1
    (deepseek_v4_hook.py:45-60), which forces the v41 layout; every other case keeps the env
    default v4 (environ.py:1754). auto (set explicitly): v41 on any SM100 GPU, else v4.
    v41 / v41_new need SM100 (MP:233)."""
    _need(kv_layout in KV_LAYOUTS, f"kv layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    _need(gpu in GPU_ARCHS, f"gpu must be one of {GPU_ARCHS}, got {gpu!r}")
    if kv_layout == "unset":
        return "v41" if cfg.is_v41 and gpu == "sm100" and attn_tp_size == 1 else "v4"
    if kv_layout == "auto":
        return "v41" if gpu == "sm100" else "v4"
    _need(kv_layout == "v4" or gpu == "sm100",
          f"SGLang's {kv_layout} KV layout needs an SM100 / SM103 GPU "
          "(deepseek_v4_memory_pool.py select_dsv4_kv_layout)")
    return kv_layout


def _compressed_layout(main: str, ratio: int) -> str:
    """resolve_compressed_kv_layout with the option auto (MP:174-195): v4 everywhere under v4;
    under v41 the ratio-1/2 caches are fp4, ratios 4/128 fp8."""
    if main == "v4":
        return "v4"
    return main.replace("v41", "v41_fp4", 1) if ratio in (1, 2) else main


def _indexer_bytes(index_head_dim: int, fp4: bool) -> int:
    """get_dsv4_indexer_bytes_per_token (MP:53-57)."""
    if fp4:
        return index_head_dim // 2 + index_head_dim // 32
    return index_head_dim + index_head_dim // 128 * 4


@dataclass(frozen=True)
class DSV4KVSizing:
    """SGLang 0.5.23's KV pool sizing for one GPU (one scheduler process).

    ``bytes_per_token`` is DSV4PoolConfigurator's coefficient (bytes_per_full_token, a float as
    in SGLang) and ``fixed_bytes`` its bias (what does not scale with max_total_tokens but with
    max_running_requests: the capped SWA pool and the per-request compress-state rings);
    ``max_total_tokens(available)`` is calculate_pool_sizes (PC:1638-1701).
    """

    layout: str
    page_size: int
    index_page: int
    low_index_bytes: int  # one ratio-1/2 fp4 indexer key + scales
    n_layers: int
    # (ratio, owner layers, bytes one full token adds on one of them), in SGLang's sum order
    per_ratio: tuple[tuple[int, int, float], ...]
    swa_mode: str  # "cap" (SWA pool sized from max_running_requests) or "ratio"
    swa_ratio: float  # swa slots per full token in ratio mode (0 in cap mode)
    swa_bytes_per_slot: float  # one SWA slot on every layer (+ its c4 compress state)
    swa_cap_slots: int  # SWA slots reserved in cap mode (0 in ratio mode)
    requests_per_worker: int
    swa_fixed_bytes: float
    state_fixed_bytes: int  # ratio-2 pair rings + c128 rings, per request slot

    @property
    def bytes_per_token(self) -> float:
        """PC:1437-1446: swa_ratio x SWA slot + compressed (+ indexer) bytes per full token."""
        return self.swa_ratio * self.swa_bytes_per_slot + sum(
            per * layers for _, layers, per in self.per_ratio)

    @property
    def fixed_bytes(self) -> float:
        """PC:1658-1664 (c128 + c2 state, SWA cap pool; no replay window, no unified ring)."""
        return self.state_fixed_bytes + self.swa_fixed_bytes

    def padding_bytes(self, full_tokens: int) -> float:
        """PC:1406-1435: reserved ratio-1/2 main pages and indexer page rounding."""
        pad = 0.0
        for ratio, layers, _ in self.per_ratio:
            if ratio not in (1, 2):
                continue
            page = self.page_size // ratio
            main = self.page_size * (dsv4_page_bytes(_compressed_layout(self.layout, ratio),
                                                     page) / page)
            index_size = (full_tokens + self.page_size) // ratio
            ip = self.index_page
            index_slots = -(-(index_size + ip) // ip) * ip  # _num_dsv4_physical_kv_pages
            pad += (main + (index_slots - full_tokens // ratio) * self.low_index_bytes) * layers
        return pad

    def max_total_tokens(self, available_bytes: int) -> int:
        """calculate_pool_sizes (PC:1638-1679): the full pool's tokens for a KV budget."""
        avail = max(available_bytes - self.fixed_bytes, 0)
        bpt, page = self.bytes_per_token, self.page_size
        full = int(avail / bpt) // page * page
        while full > 0 and full * bpt + self.padding_bytes(full) > avail:
            full -= page
        return max(full, 0)

    def describe(self) -> str:
        kinds = ", ".join(f"ratio {r}: {n} x {p:g} B" for r, n, p in self.per_ratio)
        entry = _LAYOUT_BYTES[self.layout][0]
        owners = sum(n for _, n, _ in self.per_ratio)
        swa = (f"SWA pool {self.swa_ratio:g} slot/token x {self.swa_bytes_per_slot:g} B"
               if self.swa_mode == "ratio" else "SWA pool sized from the request cap: fixed")
        return (f"SGLang 0.5.23 DeepSeek-V4 pools: {self.bytes_per_token:g} B/token = "
                f"compressed entries ({self.layout} layout, {entry} B main entry, page "
                f"{self.page_size}) + indexer keys on the {owners} of {self.n_layers} layers "
                f"owning them ({kinds}); {swa}")


def dsv4_kv_sizing(cfg: DSV4Config, *, page_size: int = DSV4_PAGE_SIZE,
                   kv_layout: str = "unset", gpu: str = "sm90", attn_tp_size: int = 1,
                   attn_dp_size: int = 1, max_running_requests: int = DSV4_MAX_RUNNING_REQUESTS,
                   chunked_prefill_size: int | None = None,
                   swa_full_tokens_ratio: float | None = None,
                   radix_cache: bool = True) -> DSV4KVSizing:
    """SGLang 0.5.23's KV pool sizing for DeepSeek V4 / V4.1 on one GPU, from the config and the
    server settings (see the block comment above for what is assumed off)."""
    _need(page_size >= 1 and page_size % 128 == 0,
          f"SGLang's DeepSeek-V4 pools need page_size a multiple of 128 (pool_configurator.py "
          f"calculate_pool_sizes; it sets {DSV4_PAGE_SIZE}), got {page_size}")
    _need(attn_tp_size >= 1 and attn_dp_size >= 1 and max_running_requests >= 1,
          "attn_tp_size, attn_dp_size and max_running_requests must be >= 1")
    _need(swa_full_tokens_ratio is None or 0 < swa_full_tokens_ratio <= 1,
          f"swa_full_tokens_ratio must be in (0, 1], got {swa_full_tokens_ratio}")
    chunk = DSV4_CHUNKED_PREFILL[gpu] if chunked_prefill_size is None else chunked_prefill_size
    layout = resolve_dsv4_kv_layout(cfg, kv_layout, gpu, attn_tp_size)
    ratios, n_layers, window = cfg.compress_ratios, cfg.num_hidden_layers, cfg.window_size
    attn_dim, index_dim = cfg.head_dim, cfg.index_head_dim  # qk_nope + qk_rope = head_dim

    def paged(ratio: int) -> float:  # PC:1353-1370, bytes per entry with the page padding
        page = page_size // ratio if ratio else page_size
        return dsv4_page_bytes(_compressed_layout(layout, ratio) if ratio else layout,
                               page) / page

    # collect_sources_by_ratio (MP:94-115): every layer of ratios 4/128, the kv sources of 1/2.
    owners = {}
    for r in (4, 128, 1, 2):
        ids = ([i for i in cfg.kv_source_layer_ids if ratios[i] == r] if r in (1, 2)
               else [i for i in range(n_layers) if ratios[i] == r])
        if ids:
            owners[r] = len(ids)
    # ratio-1/2 indexer pools are fp4 (MP force_fp4, PC:1170); c4 takes the fp8 figure on CUDA
    # (PC:1111-1114).
    low_index, c4_index = _indexer_bytes(index_dim, True), _indexer_bytes(index_dim, False)
    per_ratio = []
    for r, n in owners.items():  # PC:1390-1404
        if r in (1, 2):
            per = (paged(r) + low_index) / r
        elif r == 4:
            per = 1 / 4 * paged(4) + 1 / 4 * c4_index
        else:
            per = 1 / 128 * paged(128)
        per_ratio.append((r, n, per))
    # PC:1372-1388: one SWA slot costs an entry on every layer plus c4's compress state.
    c4_state = (2 * 2 * attn_dim + 2 * 2 * index_dim) * COMPRESS_STATE_BYTES
    swa_slot = paged(0) * n_layers + (
        _STATE_RING[4] / page_size * c4_state * owners.get(4, 0))
    reqs = max(1, max_running_requests // attn_dp_size)  # PC:1132-1136
    slots = reqs + 1  # PC:1504-1507
    # V4 (not V4.1) gets swa_full_tokens_ratio 0.1 from model_overrides/deepseek_v4.py:48, which
    # counts as given (arg_groups/pipeline.py runs it before kv_cache_hook.py:415).
    ratio = swa_full_tokens_ratio
    if ratio is None and not cfg.is_v41:
        ratio = 0.1
    if ratio is None and chunk > 0:  # cap mode, PC:1328-1351 + compute_swa_request_cap 924-968
        per_request = window + SWA_EVICTION_INTERVAL * 1 + page_size + page_size
        cap = per_request * reqs + 2 * chunk + page_size
        tails = 4 * reqs if radix_cache else 0  # PC:1309-1326
        cap_slots = -(-(cap + tails * (window + page_size)) // page_size) * page_size
        mode, swa_ratio, swa_fixed = "cap", 0.0, cap_slots * swa_slot
    else:  # ratio mode (PC:1046 default 0.1 when chunked prefill is off)
        cap_slots, mode, swa_fixed = 0, "ratio", 0.0
        swa_ratio = 0.1 if ratio is None else ratio
    state = 0  # PC:1509-1543: fp32 (kv, score) rings per request slot
    if owners.get(128):
        rows = -(-(slots * _STATE_RING[128] + _STATE_RING[128] + 1) // 128) * 128
        state += rows * 2 * attn_dim * COMPRESS_STATE_BYTES * owners[128]
    if owners.get(2):
        rows = -(-(slots * _STATE_RING[2] + _STATE_RING[2] + 1) // 2) * 2
        state += rows * 2 * attn_dim * COMPRESS_STATE_BYTES * owners[2]
    return DSV4KVSizing(layout=layout, page_size=page_size, index_page=DSV4_INDEX_PAGE[gpu],
                        low_index_bytes=low_index, n_layers=n_layers,
                        per_ratio=tuple(per_ratio), swa_mode=mode,
                        swa_ratio=swa_ratio, swa_bytes_per_slot=swa_slot,
                        swa_cap_slots=cap_slots, requests_per_worker=reqs,
                        swa_fixed_bytes=swa_fixed, state_fixed_bytes=state)


def kv_bytes_per_token(cfg: DSV4Config, **settings) -> float:
    """KV bytes SGLang 0.5.23 allocates per token of max_total_tokens on one GPU
    (dsv4_kv_sizing's coefficient; the request-slot pools are its fixed_bytes)."""
    return dsv4_kv_sizing(cfg, **settings).bytes_per_token


def kv_tokens_for_budget(kv_bytes: int, bytes_per_token: int, page_size: int) -> int:
    """Tokens a KV budget holds at a given flat bytes/token (--kv-bytes-per-token), rounded down
    to whole pages (as SGLang aligns max_total_tokens)."""
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
    _need(layout in ENGRAM_LAYOUTS,
          f"engram layout must be one of {ENGRAM_LAYOUTS}, got {layout!r}")
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
          "need n_params >= 0, chunk_bytes >= 0, ranks >= 1; "
          f"got {n_params}, {chunk_bytes}, {ranks}")
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
