"""ServerArgs: the one dataclass that owns every flag of ``launch_server`` and validates it.

SGLang's flag names where SGLang has one; plugin flags are ours. Each scheduler process gets
this object unchanged plus its rank; derived values are properties.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields

BACKENDS = ("auto", "embedded", "sglang")
LOAD_FORMATS = ("auto", "dummy")
ENGRAM_LAYOUTS = ("auto", "shared", "private")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# SGLang's short spellings of a few flags.
FLAG_ALIASES = {"tp_size": ("--tp",), "dp_size": ("--dp",), "ep_size": ("--ep",)}
FLAG_HELP = {
    "model_path": "a preset name (tiny, tiny-v4, small: random weights), our bf16 layout (flat "
                  "SGLang names, what convert.py writes) or a transformers DeepseekV4 directory",
    "dtype": "serving dtype of the weights and the cache (sinks, norms, mHC stay float32)",
    "backend": "auto: sglang when it imports and a GPU is present, else the embedded engine",
    "host": "bind address (loopback unless set)",
    "api_key": "require 'Authorization: Bearer KEY' on every endpoint",
    "tp_size": "scheduler ranks (GPUs); with DP attention, attention TP is tp/dp",
    "dp_size": "DP-attention groups (needs --enable-dp-attention)",
    "load_format": "dummy: random weights (the trainer pushes real ones), Engram still loaded",
    "max_total_tokens": "KV-cache tokens per DP group",
    "context_length": "default: the model's max_position_embeddings",
    "max_new_tokens_limit": "largest max_new_tokens a request may ask for",
    "load_balance_method": "placement of requests without routed_dp_rank",
    "enable_prefill_padding": "pad each prefill to a multiple of attn_tp_size (DP attention)",
    "enable_idle_batch": "ranks without work join every MoE collective with an idle batch",
    "stall_timeout": "seconds a collective may block before the rank is reported; <= 0: off",
    "engram_layout": "shared: one table per node; private: a row shard per rank",
    "health_check_timeout": "seconds /health_generate waits (SGLANG_HEALTH_CHECK_TIMEOUT)",
    "startup_timeout": "seconds every scheduler rank has to load and report ready",
    "max_request_bytes": "largest request body of /generate and the other non-weight routes "
                         "(413 past it); weight pushes have their own limit",
    "shutdown_grace": "seconds in-flight requests get to finish after SIGTERM before the "
                      "server stops",
}


@dataclass
class ServerArgs:
    model_path: str = "tiny"
    backend: str = "auto"
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    tp_size: int = 1
    dp_size: int = 1
    ep_size: int | None = None          # None: ep = tp (experts spread over every rank)
    enable_dp_attention: bool = False
    nnodes: int = 1
    node_rank: int = 0
    load_format: str = "auto"
    dtype: str = "auto"                 # auto: float32 on CPU, bfloat16 on GPU
    device: str = "auto"
    disable_cuda_graph: bool = False
    max_total_tokens: int | None = None  # KV-cache tokens per DP group (None: sized automatically)
    page_size: int = 16
    chunked_prefill_size: int = 512
    max_running_requests: int = 64
    context_length: int | None = None   # None: the model's max_position_embeddings
    max_new_tokens_limit: int = 32768
    enable_return_routed_experts: bool = False
    random_seed: int = 0
    load_balance_method: str = "round_robin"  # for requests without routed_dp_rank
    dist_init_port: int | None = None   # None: a free port is picked
    log_level: str = "info"
    # ---- plugin flags (sglang-dsv41) ----
    enable_prefill_padding: bool = True
    enable_idle_batch: bool = True
    stall_timeout: float = 60.0         # seconds; <= 0 disables the watchdog
    engram_layout: str = "auto"
    allow_engram_update: bool = False
    checkpoint_cache_dir: str | None = None  # where preset checkpoints are built
    # ---- embedded-engine server timeouts (seconds; SGLang reads the first from the env) ----
    health_check_timeout: float = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT
    startup_timeout: float = 300.0      # every scheduler rank must send ReadyMsg within this
    max_request_bytes: int = 32 << 20   # HTTP body limit (413); weight pushes have their own
    shutdown_grace: float = 30.0        # SIGTERM: in-flight requests finish within this
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        need(self.backend in BACKENDS, f"--backend must be one of {BACKENDS}")
        need(self.load_format in LOAD_FORMATS, f"--load-format must be one of {LOAD_FORMATS}")
        need(self.engram_layout in ENGRAM_LAYOUTS, f"--engram-layout must be one of {ENGRAM_LAYOUTS}")
        need(self.device in DEVICES, f"--device must be one of {DEVICES}")
        need(self.dtype in DTYPES, f"--dtype must be one of {DTYPES}")
        need(self.tp_size >= 1 and self.dp_size >= 1, "--tp-size and --dp-size must be >= 1")
        need(0 < self.port < 65536, "--port must be in 1..65535")
        need(self.page_size >= 1, "--page-size must be >= 1")
        need(self.chunked_prefill_size >= 1, "--chunked-prefill-size must be >= 1")
        need(self.max_running_requests >= 1, "--max-running-requests must be >= 1")
        need(self.max_total_tokens is None or self.max_total_tokens > self.page_size,
             "--max-total-tokens must exceed --page-size")
        if self.dp_size > 1:
            need(self.enable_dp_attention,
                 "--dp-size > 1 needs --enable-dp-attention (DP groups share the MoE ranks)")
        if self.enable_dp_attention:
            need(self.tp_size % self.dp_size == 0,
                 f"--tp-size {self.tp_size} must be a multiple of --dp-size {self.dp_size}")
        need(self.nnodes >= 1 and 0 <= self.node_rank < self.nnodes, "bad --nnodes/--node-rank")
        need(self.log_level in LOG_LEVELS, f"--log-level must be one of {LOG_LEVELS}")
        need(self.load_balance_method in LOAD_BALANCE_METHODS,
             f"--load-balance-method must be one of {LOAD_BALANCE_METHODS}")
        need(bool(self.model_path), "--model-path must not be empty")
        need(bool(self.host), "--host must not be empty")
        need(self.api_key is None or bool(self.api_key), "--api-key must not be empty")
        need(self.context_length is None or self.context_length >= 1,
             "--context-length must be >= 1")
        need(self.max_new_tokens_limit >= 1, "--max-new-tokens-limit must be >= 1")
        need(self.health_check_timeout > 0, "--health-check-timeout must be > 0")
        need(self.startup_timeout > 0, "--startup-timeout must be > 0")
        need(self.max_request_bytes > 0, "--max-request-bytes must be > 0")
        need(self.shutdown_grace > 0, "--shutdown-grace must be > 0")
        need(self.dist_init_port is None or 0 < self.dist_init_port < 65536,
             "--dist-init-port must be in 1..65535")
        need(self.dist_init_port != self.port,
             f"--dist-init-port {self.dist_init_port} is --port: the ranks' rendezvous store and "
             "the HTTP server need two ports")

    # ---- derived ----------------------------------------------------------------------------
    @property
    def attn_tp_size(self) -> int:
        """As sglang.srt.layers.dp_attention.compute_dp_attention_world_info (attn_cp_size 1)."""
        return self.tp_size // self.dp_size if self.enable_dp_attention else self.tp_size

    @property
    def effective_dp_size(self) -> int:
        return self.dp_size if self.enable_dp_attention else 1

    @property
    def resolved_engram_layout(self) -> str:
        from .policies.engram_layout import choose_engram_layout

        return choose_engram_layout(self.engram_layout, spans_nodes=self.nnodes > 1)

    def rank_to_dp(self, rank: int) -> tuple[int, int]:
        """Global TP rank -> (dp_rank, attn_tp_rank)."""
        return rank // self.attn_tp_size, rank % self.attn_tp_size

    def dp_leader(self, dp_rank: int) -> int:
        return dp_rank * self.attn_tp_size

    # ---- CLI ---------------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        d = ServerArgs
        for f in fields(ServerArgs):
            if f.name == "extra":
                continue
            flags = ["--" + f.name.replace("_", "-"), *FLAG_ALIASES.get(f.name, ())]
            default = getattr(d, f.name) if f.default is not dataclasses.MISSING else None
            if f.type in ("bool", bool):
                parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default,
                                    help=FLAG_HELP.get(f.name))
                continue
            kind = {"int": int, "float": float, "str": str, "int | None": int,
                    "str | None": str, "float | None": float}.get(str(f.type), str)
            choices = {"backend": BACKENDS, "load_format": LOAD_FORMATS,
                       "engram_layout": ENGRAM_LAYOUTS, "device": DEVICES,
                       "dtype": DTYPES, "load_balance_method": LOAD_BALANCE_METHODS,
                       "log_level": LOG_LEVELS}.get(f.name)
            parser.add_argument(*flags, type=kind, default=default, choices=choices,
                                help=FLAG_HELP.get(f.name))

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "ServerArgs":
        names = {f.name for f in fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})
