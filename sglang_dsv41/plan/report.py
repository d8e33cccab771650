"""Human table and machine JSON for a PlanResult."""

from __future__ import annotations

import json

from .memory import GIB
from .planner import LAYOUT_CONVENTION, PlanResult


def _gib(n: int) -> str:
    return f"{n / GIB:12,.2f}"


def format_plan(res: PlanResult) -> str:
    inp, lay, b = res.inp, res.layout, res.budget
    local = lay.gpus_per_node
    cap = f"capped above {inp.pinned_cap_mb} MiB" if inp.pinned_cap else "power-of-two rounding"
    lines = [
        f"model {inp.model}: {res.n_params:,} trainable params (Engram excluded)",
        f"layout: {lay.nnodes} node(s) x {local} GPUs = {lay.world_size} ranks; attention tp="
        f"{lay.tp} per DP replica x dp={lay.dp} x pp={lay.pp}; ep={lay.ep}",
        f"  convention: {LAYOUT_CONVENTION}",
        f"  SGLang flags: {lay.sglang_flags()}",
    ]
    lines += [f"  warning: {w}" for w in lay.warnings]
    lines += [
        f"KV cache: {res.kv_bytes_per_token:,g} B/token per GPU ({res.kv_bytes_per_token_source})",
        f"  + {res.kv_fixed_bytes_per_gpu:,} B per GPU fixed, scaling with max_running_requests "
        f"({res.kv_fixed_bytes_source})",
        f"  {inp.kv_gib_per_gpu:g} GiB per GPU holds max_total_tokens="
        f"{res.requested_max_total_tokens:,} (page {inp.page_size})",
    ]
    if inp.r3:
        lines.append(
            f"R3: {res.r3_bytes_per_token} B/token; one buffer of "
            f"{res.r3_buffer_bytes_per_rank:,} B per scheduler process, mapped as "
            f"{res.r3_pinned_bytes_per_rank:,} B (SGLang mmap + cudaHostRegister), x {local} "
            "processes per node")
    else:
        lines.append("R3: off")
    lines += [
        f"Engram: {res.engram_layout} layout (fp8 + e8m0 scales); optimizer: {inp.optimizer} "
        f"(trainer pinned buffers: {cap})",
        "",
        f"{'host memory per node (all nodes alike)':<40}{'GiB':>12}",
    ]
    rows = [
        (f"R3 buffers ({local} x mmap mapping)", b.r3_buffers),
        ("Engram tables", b.engram),
        ("CPU optimizer (node share)", b.optimizer),
        ("pinned rounding overhead", b.pinned_rounding),
        (f"base ({inp.base_gib_per_rank:g} GiB x {local} rank processes)", b.base),
        ("total", b.total),
        ("available", b.available),
        ("headroom", b.headroom),
    ]
    lines += [f"  {label:<38}{_gib(value)}" for label, value in rows]
    lines.append("")
    if inp.r3:
        lines.append(f"R3 host bytes per node: {b.r3_buffers:,} ({b.r3_buffers / GIB:,.2f} GiB, "
                     "cudaHostRegister-pinned)")
    limit = res.host_limit_max_total_tokens
    lines.append("host-memory limit on max_total_tokens: "
                 + ("none (R3 off)" if limit is None else f"{limit:,}"))
    safe = res.largest_safe_max_total_tokens
    lines.append("largest safe max_total_tokens: " + ("none" if safe is None else f"{safe:,}"))
    lines += [f"hint: {h}" for h in res.hints]
    lines.append("PLAN FITS" if res.fits else f"PLAN REFUSED: {res.reason}")
    return "\n".join(lines)


def plan_json(res: PlanResult) -> str:
    return json.dumps(res.to_dict(), indent=2, sort_keys=True)
