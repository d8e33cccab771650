"""Host-memory formulas of a deployment: R3 buffers, KV sizing, Engram tables, CPU optimizer state
and the pinned-memory allocator's rounding.

Every function returns bytes (int) and takes plain numbers or a DSV41Config, so the embedded
engine (sizing its R3 buffer), ServerArgs and the trainer bridge can import them directly.
"""

from __future__ import annotations

from ..model.config import DSV41Config

GIB = 1 << 30
MIB = 1 << 20
R3_EXPERT_ID_BYTES = 4  # SGLang stores routed expert ids as int32
ENGRAM_DTYPES = ("fp8", "bf16")
ENGRAM_FP8_BLOCK = 128  # one fp32 scale per block of this many fp8 values
ENGRAM_LAYOUTS = ("shared", "private")
OPTIMIZER_MODES = ("none", "full", "chunked")
# Host bytes per parameter of a CPU-offloaded Adam: fp32 master 4 + fp32 grad 4 + two fp32 moments
# 8 + bf16 pinned copy 2 = 18; offloading the state in chunks keeps the peak at 12.
OPTIMIZER_BYTES_PER_PARAM = {"none": 0, "full": 18, "chunked": 12}
OPTIMIZER_PINNED_BYTES_PER_PARAM = 2  # the bf16 copy that the H2D transfer reads
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


def r3_bytes_per_token(cfg: DSV41Config) -> int:
    """Routed-expert ids kept per KV token: every layer's top-k as int32 (40 x 6 x 4 = 960 B).

    SGLang's buffer spans all num_hidden_layers, dense layers included, so we count them too.
    """
    return cfg.num_hidden_layers * cfg.num_experts_per_tok * R3_EXPERT_ID_BYTES


def r3_buffer_bytes(cfg: DSV41Config, max_total_tokens: int, page_size: int) -> int:
    """One scheduler process's R3 host buffer: int32[max_total_tokens + page_size, layers, top_k]
    (SGLang's routed-experts capturer), in bytes."""
    _need(max_total_tokens >= 0, f"max_total_tokens must be >= 0, got {max_total_tokens}")
    _need(page_size >= 1, f"page_size must be >= 1, got {page_size}")
    return (max_total_tokens + page_size) * r3_bytes_per_token(cfg)


def kv_bytes_per_token(cfg: DSV41Config, dtype_bytes: int = 2, attn_tp_size: int = 1) -> int:
    """KV-cache bytes one token takes on one GPU: every layer stores K and V for its KV heads.

    KV heads are split over the attention-TP ranks and replicated when there are fewer heads
    than ranks (SGLang's get_num_kv_heads). This is the plain GQA size: the real V4.1 caches a
    compressed MLA latent and is far smaller per token, so pass the measured figure instead
    (``--kv-bytes-per-token``) when planning a real deployment.
    """
    _need(dtype_bytes >= 1 and attn_tp_size >= 1, "dtype_bytes and attn_tp_size must be >= 1")
    heads_per_rank = max(1, cfg.num_key_value_heads // attn_tp_size)
    return cfg.num_hidden_layers * 2 * heads_per_rank * cfg.head_dim * dtype_bytes


def kv_tokens_for_budget(kv_bytes: int, bytes_per_token: int, page_size: int) -> int:
    """Tokens a KV budget holds, rounded down to whole pages (as SGLang aligns max_total_tokens)."""
    _need(bytes_per_token >= 1 and page_size >= 1, "bytes_per_token and page_size must be >= 1")
    return (max(kv_bytes, 0) // bytes_per_token) // page_size * page_size


def engram_table_bytes(cfg: DSV41Config, dtype: str = "fp8") -> int:
    """Bytes of all Engram tables (one per Engram layer); fp8 adds one fp32 scale per 128 values."""
    _need(dtype in ENGRAM_DTYPES, f"engram dtype must be one of {ENGRAM_DTYPES}, got {dtype!r}")
    values = cfg.engram_num_rows * cfg.engram_dim
    if dtype == "fp8":
        per_table = values + -(-values // ENGRAM_FP8_BLOCK) * 4
    else:
        per_table = values * 2
    return per_table * len(cfg.engram_layers)


def engram_host_bytes(cfg: DSV41Config, layout: str, nnodes: int, gpus_per_node: int,
                      dtype: str = "fp8") -> int:
    """Engram host bytes on one node.

    shared: one full copy per node, attached by every local rank. private: every rank of the
    whole deployment owns a row shard, so a node holds its local ranks' share of the tables.
    """
    _need(layout in ENGRAM_LAYOUTS,
          f"engram layout must be one of {ENGRAM_LAYOUTS}, got {layout!r}")
    _need(nnodes >= 1 and gpus_per_node >= 1, "nnodes and gpus_per_node must be >= 1")
    total = engram_table_bytes(cfg, dtype)
    if layout == "shared":
        return total
    world = nnodes * gpus_per_node
    rows_per_rank = -(-cfg.engram_num_rows // world)  # the last rank's shard may be shorter
    per_rank = total * rows_per_rank // cfg.engram_num_rows if cfg.engram_num_rows else 0
    return min(total, per_rank * gpus_per_node)


def optimizer_host_bytes(n_params: int, mode: str) -> int:
    """Host bytes of a CPU-offloaded Adam over n_params: 18N (full) or 12N (chunked) or 0."""
    _need(mode in OPTIMIZER_MODES, f"optimizer mode must be one of {OPTIMIZER_MODES}, got {mode!r}")
    _need(n_params >= 0, f"n_params must be >= 0, got {n_params}")
    return OPTIMIZER_BYTES_PER_PARAM[mode] * n_params


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
