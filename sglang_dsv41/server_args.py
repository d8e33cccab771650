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
    dist_init_port: int | None = None   # None: a free port is picked
    log_level: str = "info"
    # ---- plugin flags (sglang-dsv41) ----
    enable_prefill_padding: bool = True
    enable_idle_batch: bool = True
    stall_timeout: float = 60.0         # seconds; <= 0 disables the watchdog
    engram_layout: str = "auto"
    allow_engram_update: bool = False
    checkpoint_cache_dir: str | None = None  # where preset checkpoints are built
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
        if self.engram_layout != "auto":
            return self.engram_layout
        return "private" if self.nnodes > 1 else "shared"

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
            flag = "--" + f.name.replace("_", "-")
            default = getattr(d, f.name) if f.default is not dataclasses.MISSING else None
            if f.type in ("bool", bool):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
                continue
            kind = {"int": int, "float": float, "str": str, "int | None": int,
                    "str | None": str, "float | None": float}.get(str(f.type), str)
            choices = {"backend": BACKENDS, "load_format": LOAD_FORMATS,
                       "engram_layout": ENGRAM_LAYOUTS, "device": DEVICES,
                       "dtype": DTYPES}.get(f.name)
            parser.add_argument(flag, type=kind, default=default, choices=choices)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "ServerArgs":
        names = {f.name for f in fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})
