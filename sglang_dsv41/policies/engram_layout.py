"""Where the Engram host tables live: one rule for the embedded engine and the SGLang plugin.

``shared``: one copy per node in shared memory, opened by every rank of the node (SGLang opens
rank 0's memfd through /proc/<pid>/fd, which only works inside one node and PID namespace).
``private``: each rank holds its own row shard (SGLang calls this layout ``per_rank``).
A deployment over several nodes cannot use ``shared``; ``auto`` picks by node count.
"""

from __future__ import annotations

LAYOUTS = ("shared", "private")
# our layout name -> SGLang 0.5.23's SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT value
SGLANG_LAYOUT_NAMES = {"shared": "shared", "private": "per_rank"}


class EngramLayoutError(ValueError):
    """A layout that cannot work on this deployment; the message says why."""


def choose_engram_layout(requested: str, spans_nodes: bool, host_tables: bool = True) -> str:
    """-> "shared" or "private". ``requested`` is auto, shared or private. ``host_tables``:
    whether the tables live in host memory at all (SGLang keeps them on the device unless
    SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE); where they do not, the layout is never used and
    nothing is refused."""
    if requested == "auto":
        return "private" if spans_nodes else "shared"
    if requested not in LAYOUTS:
        raise EngramLayoutError(f"Engram layout must be one of {('auto',) + LAYOUTS}, "
                                f"got {requested!r}")
    if requested == "shared" and spans_nodes and host_tables:
        raise EngramLayoutError(
            "Engram layout 'shared' keeps one table per node in shared memory that every rank "
            "opens through /proc/<pid>/fd; ranks on other nodes cannot open it. Use 'private' "
            "(SGLang: SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT=per_rank) or 'auto'")
    return requested


def layout_from_sglang_name(name: str) -> str:
    """SGLang's env value (shared / per_rank) -> our layout name."""
    for ours, theirs in SGLANG_LAYOUT_NAMES.items():
        if name == theirs:
            return ours
    raise EngramLayoutError(f"SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT must be one of "
                            f"{sorted(SGLANG_LAYOUT_NAMES.values())}, got {name!r}")
