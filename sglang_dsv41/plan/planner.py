"""PlanInput -> PlanResult: the per-node host budget and the largest safe max_total_tokens.

Every node is planned alike (same GPUs per node, same share of everything), with one scheduler
process per GPU. The rollout server and a CPU-offloaded trainer are assumed colocated, so their
host memory adds up. A plan fits when the node's total at the requested KV budget is within the
host memory given; an oversized request is refused (the plan as given cannot run), and the
result still carries the largest max_total_tokens that would fit.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ..model.dsv4.config import DSV4Config
from ..model.dsv4.presets import load_config
from ..policies.engram_layout import EngramLayoutError, choose_engram_layout
from .memory import (DEFAULT_PINNED_CAP_MB, DSV4_MAX_RUNNING_REQUESTS, DSV4_PAGE_SIZE,
                     ENGRAM_LAYOUTS, GIB, GPU_ARCHS, HOST_PAGE_BYTES, KV_LAYOUTS,
                     OPTIMIZER_MODES, OPTIMIZER_PINNED_BYTES_PER_PARAM, PINNED_CAP_ENV_KEY,
                     dsv4_kv_sizing, engram_host_bytes, kv_tokens_for_budget,
                     optimizer_host_bytes, pinned_alloc_bytes, r3_buffer_bytes,
                     r3_bytes_per_token, r3_host_bytes, r3_largest_tokens)
from .rules import ParallelLayout, PlanError, validate_parallel_layout
from .shapes import count_parameters

LAYOUT_CONVENTION = ("tp is attention TP per DP replica (tp <= o_groups), "
                     "tp x dp x pp = nnodes x gpus_per_node")
MIN_PAGES = 2  # ServerArgs needs max_total_tokens > page_size, so the least usable is two pages


@dataclass(frozen=True)
class PlanInput:
    model: str = "v41-flash"  # a preset name or a checkpoint dir / config.json
    nnodes: int = 1
    gpus_per_node: int = 8
    tp: int = 8  # attention TP per DP replica; tp x dp x pp = nnodes x gpus_per_node
    dp: int = 1
    ep: int | None = None  # None: tp x dp (experts over every rank of a stage)
    pp: int = 1
    kv_gib_per_gpu: float = 20.0  # what SGLang's pool configurator gets for the KV pools
    kv_bytes_per_token: int | None = None  # None: memory.dsv4_kv_sizing (SGLang's own pools)
    # SGLang server settings the KV pools depend on (memory.dsv4_kv_sizing)
    gpu: str = "sm90"
    kv_layout: str = "unset"
    max_running_requests: int = DSV4_MAX_RUNNING_REQUESTS  # SGLang's, over all DP replicas
    chunked_prefill_size: int | None = None  # None: SGLang's default for the GPU
    swa_full_tokens_ratio: float | None = None
    radix_cache: bool = True
    page_size: int = DSV4_PAGE_SIZE
    host_gib_per_node: float = 2048.0
    base_gib_per_rank: float = 4.0  # runtime, CUDA context, tokenizer, ... per rank process
    r3: bool = True
    engram_layout: str = "auto"  # auto: private (SGLang per_rank) across nodes, else shared
    hugepage: str = ""  # SGLANG_HUGEPAGE_SIZE for SGLang's mmap host buffers: "", 2MB, 1GB
    optimizer: str = "none"
    pinned_cap: bool = False
    pinned_cap_mb: int = DEFAULT_PINNED_CAP_MB

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        for name in ("nnodes", "gpus_per_node", "tp", "dp", "pp", "page_size",
                     "max_running_requests"):
            need(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be >= 1")
        need(self.ep is None or self.ep >= 1, "--ep must be >= 1")
        # inf/nan would pass the comparisons below (or fail them with a misleading reason) and
        # then overflow when turned into bytes: refused as illegal input.
        for name in ("kv_gib_per_gpu", "host_gib_per_node", "base_gib_per_rank"):
            need(math.isfinite(getattr(self, name)),
                 f"--{name.replace('_', '-')} must be a finite number, got {getattr(self, name)}")
        need(self.kv_gib_per_gpu > 0, "--kv-gib-per-gpu must be > 0")
        need(self.kv_bytes_per_token is None or self.kv_bytes_per_token >= 1,
             "--kv-bytes-per-token must be >= 1")
        need(self.gpu in GPU_ARCHS, f"--gpu must be one of {GPU_ARCHS}")
        need(self.kv_layout in KV_LAYOUTS, f"--kv-layout must be one of {KV_LAYOUTS}")
        need(self.chunked_prefill_size is None or self.chunked_prefill_size >= -1,
             "--chunked-prefill-size must be >= -1 (-1 or 0: chunked prefill off)")
        need(self.swa_full_tokens_ratio is None
             or (math.isfinite(self.swa_full_tokens_ratio)
                 and 0 < self.swa_full_tokens_ratio <= 1),
             "--swa-full-tokens-ratio must be in (0, 1]")
        need(self.host_gib_per_node > 0, "--host-gib-per-node must be > 0")
        need(self.base_gib_per_rank >= 0, "--base-gib-per-rank must be >= 0")
        need(self.engram_layout in ("auto",) + ENGRAM_LAYOUTS,
             f"--engram-layout must be one of auto, {', '.join(ENGRAM_LAYOUTS)}")
        need(self.hugepage in HOST_PAGE_BYTES,
             f"--hugepage must be one of {sorted(HOST_PAGE_BYTES)}")
        need(self.optimizer in OPTIMIZER_MODES, f"--optimizer must be one of {OPTIMIZER_MODES}")
        need(self.pinned_cap_mb >= 0, "--pinned-cap-mb must be >= 0")

    @property
    def resolved_engram_layout(self) -> str:
        """One rule (policies/engram_layout.py); shared across nodes is refused there."""
        try:
            return choose_engram_layout(self.engram_layout, spans_nodes=self.nnodes > 1)
        except EngramLayoutError as e:
            raise PlanError(str(e)) from e


@dataclass(frozen=True)
class NodeBudget:
    """Host bytes on one node, by consumer."""

    r3_buffers: int
    engram: int
    optimizer: int
    pinned_rounding: int
    base: int
    available: int

    @property
    def total(self) -> int:
        return self.r3_buffers + self.engram + self.optimizer + self.pinned_rounding + self.base

    @property
    def headroom(self) -> int:
        return self.available - self.total


@dataclass(frozen=True)
class PlanResult:
    inp: PlanInput
    layout: ParallelLayout
    engram_layout: str
    n_params: int
    kv_bytes_per_token: float  # per token of max_total_tokens, one GPU
    kv_bytes_per_token_source: str
    kv_fixed_bytes_per_gpu: int  # KV pools that scale with max_running_requests, not tokens
    kv_fixed_bytes_source: str
    r3_bytes_per_token: int
    r3_buffer_bytes_per_rank: int  # exact request of one scheduler process
    r3_pinned_bytes_per_rank: int  # its mmap + cudaHostRegister mapping (page-rounded only)
    requested_max_total_tokens: int  # what the KV budget per GPU holds
    host_limit_max_total_tokens: int | None  # None: host memory sets no limit (R3 off)
    largest_safe_max_total_tokens: int | None  # None: nothing fits
    budget: NodeBudget
    fits: bool
    reason: str = ""
    hints: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layout"].update(world_size=self.layout.world_size,
                           sglang_tp_size=self.layout.sglang_tp_size,
                           sglang_flags=self.layout.sglang_flags(),
                           convention=LAYOUT_CONVENTION)
        d["budget"].update(total=self.budget.total, headroom=self.budget.headroom)
        d["r3_host_bytes_per_node"] = self.budget.r3_buffers
        return d


def _gib(n: int) -> str:
    return f"{n / GIB:,.1f} GiB"


def make_plan(inp: PlanInput, cfg: DSV4Config | None = None) -> PlanResult:
    """Raises PlanError for an illegal layout or input; a plan that does not fit is returned with
    fits=False and the reason (the caller decides how to refuse)."""
    if cfg is None:
        try:
            cfg = load_config(inp.model)
        except (OSError, TypeError, ValueError) as e:
            raise PlanError(f"cannot load model config {inp.model!r}: {e}") from e
    layout = validate_parallel_layout(cfg, inp.tp, inp.dp, inp.ep, inp.pp, inp.r3, inp.nnodes,
                                      inp.gpus_per_node)
    local, world, page = inp.gpus_per_node, layout.world_size, inp.page_size
    kv_budget = int(inp.kv_gib_per_gpu * GIB)
    if inp.kv_bytes_per_token is not None:
        kv_bpt, kv_source = inp.kv_bytes_per_token, "given (--kv-bytes-per-token)"
        kv_fixed, fixed_source = 0, "none (--kv-bytes-per-token given)"
        requested = kv_tokens_for_budget(kv_budget, kv_bpt, page)
    else:
        try:
            sizing = dsv4_kv_sizing(
                cfg, page_size=page, kv_layout=inp.kv_layout, gpu=inp.gpu,
                attn_tp_size=layout.tp, attn_dp_size=layout.dp,
                max_running_requests=inp.max_running_requests,
                chunked_prefill_size=inp.chunked_prefill_size,
                swa_full_tokens_ratio=inp.swa_full_tokens_ratio, radix_cache=inp.radix_cache)
        except ValueError as e:
            raise PlanError(str(e)) from e
        kv_bpt, kv_source = sizing.bytes_per_token, sizing.describe()
        kv_fixed = math.ceil(sizing.fixed_bytes)
        fixed_source = (f"{sizing.requests_per_worker} requests per DP replica: compress-state "
                        f"rings {sizing.state_fixed_bytes:,} B")
        if sizing.swa_mode == "cap":
            fixed_source += (f", SWA pool {sizing.swa_cap_slots:,} slots x "
                             f"{sizing.swa_bytes_per_slot:g} B")
        requested = sizing.max_total_tokens(kv_budget)
    if requested < MIN_PAGES * page:
        raise PlanError(f"--kv-gib-per-gpu {inp.kv_gib_per_gpu} holds {requested} tokens at "
                        f"{kv_bpt:g} B/token after {_gib(kv_fixed)} of request-slot pools, "
                        f"fewer than {MIN_PAGES} pages of {page}")

    engram_layout = inp.resolved_engram_layout
    # SGLang shards Engram rows over its tp group (= every rank of a pipeline stage); the
    # busiest node holds the most rows.
    tp_size = layout.sglang_tp_size
    engram = max((engram_host_bytes(cfg, engram_layout, tp_size,
                                    range(n * local, min((n + 1) * local, tp_size)))
                  for n in range(max(1, -(-tp_size // local)))), default=0) \
        if cfg.engram_layer_ids else 0
    n_params = count_parameters(cfg)  # Engram tables excluded: frozen, never in the optimizer
    optimizer = -(-optimizer_host_bytes(n_params, inp.optimizer) // inp.nnodes)
    # The bf16 copy is modelled as one flat pinned buffer per rank (its FSDP shard).
    opt_pinned = 0
    if inp.optimizer != "none":
        opt_pinned = OPTIMIZER_PINNED_BYTES_PER_PARAM * -(-n_params // world)
    opt_rounding = (pinned_alloc_bytes(opt_pinned, inp.pinned_cap, inp.pinned_cap_mb)
                    - opt_pinned) * local
    base = int(inp.base_gib_per_rank * GIB) * local
    available = int(inp.host_gib_per_node * GIB)

    r3_bpt = r3_bytes_per_token(cfg)
    r3_exact = r3_buffer_bytes(cfg, requested, page) if inp.r3 else 0
    r3_mapped = r3_host_bytes(cfg, requested, page, inp.hugepage) if inp.r3 else 0
    budget = NodeBudget(r3_buffers=r3_mapped * local, engram=engram, optimizer=optimizer,
                        pinned_rounding=opt_rounding, base=base, available=available)

    fixed = engram + optimizer + opt_rounding + base
    host_limit: int | None = None
    if inp.r3:
        per_rank = (available - fixed) // local
        host_limit = max(0, r3_largest_tokens(per_rank, r3_bpt, page, inp.hugepage))
        safe = r3_largest_tokens(per_rank, r3_bpt, page, inp.hugepage, max_tokens=requested)
    else:
        safe = requested if fixed <= available else -1
    largest_safe = safe if safe >= MIN_PAGES * page else None

    fits = budget.total <= available
    reason = ""
    if largest_safe is None:
        reason = (f"nothing fits: even max_total_tokens={MIN_PAGES * page} ({MIN_PAGES} pages) "
                  f"exceeds host memory; the fixed costs (Engram {_gib(engram)}, optimizer "
                  f"{_gib(optimizer + opt_rounding)}, base {_gib(base)}) take "
                  f"{_gib(fixed)} of {_gib(available)} per node")
    elif not fits:
        reason = (f"the plan needs {_gib(budget.total)} of host memory per node but "
                  f"{_gib(available)} is available: the requested max_total_tokens={requested} "
                  f"({inp.kv_gib_per_gpu:g} GiB KV per GPU) exceeds the largest safe value "
                  f"{largest_safe}; lower --kv-gib-per-gpu or launch with --max-total-tokens "
                  f"{largest_safe}")
    hints = []
    if budget.pinned_rounding and not inp.pinned_cap:
        hints.append(f"torch's pinned allocator rounds the trainer's buffers up to powers of "
                     f"two, wasting "
                     f"{_gib(budget.pinned_rounding)} per node: set PYTORCH_ALLOC_CONF="
                     f"{PINNED_CAP_ENV_KEY}:{inp.pinned_cap_mb} (plan with --pinned-cap)")
    return PlanResult(inp=inp, layout=layout, engram_layout=engram_layout, n_params=n_params,
                      kv_bytes_per_token=kv_bpt, kv_bytes_per_token_source=kv_source,
                      kv_fixed_bytes_per_gpu=kv_fixed, kv_fixed_bytes_source=fixed_source,
                      r3_bytes_per_token=r3_bpt if inp.r3 else 0,
                      r3_buffer_bytes_per_rank=r3_exact, r3_pinned_bytes_per_rank=r3_mapped,
                      requested_max_total_tokens=requested, host_limit_max_total_tokens=host_limit,
                      largest_safe_max_total_tokens=largest_safe, budget=budget, fits=fits,
                      reason=reason, hints=tuple(hints))
