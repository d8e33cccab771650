"""Which DP rank a request is pinned to: one rule for the embedded API and the SGLang plugin.

A request can name its rank three ways: ``routed_dp_rank`` in the body, the deprecated body alias
``data_parallel_rank``, and the ``X-Data-Parallel-Rank`` header (what sglang-router and the
OpenAI routes use). They must agree; a rank outside [0, dp_size) is an error, never a silent
round robin. An empty header counts as absent (proxies forward empty headers).
"""

from __future__ import annotations

HEADER = "X-Data-Parallel-Rank"


class DPRankPinError(ValueError):
    """A pin that cannot be honoured; the message names the field and the valid range."""


def resolve_dp_rank_pin(routed_dp_rank: int | None, data_parallel_rank: int | None,
                        header: str | None, dp_size: int) -> int | None:
    """-> the pinned DP rank, or None when the request names none."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    given: dict[str, int] = {}
    for name, value in (("routed_dp_rank", routed_dp_rank),
                        ("data_parallel_rank", data_parallel_rank)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise DPRankPinError(f"{name} must be an integer, got {value!r}")
        given[name] = value
    if header is not None and header.strip() != "":
        try:
            given[HEADER] = int(header.strip())
        except ValueError:
            raise DPRankPinError(f"{HEADER} must be an integer, got {header!r}") from None
    if not given:
        return None
    if len(set(given.values())) > 1:
        raise DPRankPinError(f"conflicting DP ranks: {given}")
    name, rank = next(iter(given.items()))
    if not 0 <= rank < dp_size:
        raise DPRankPinError(f"{name}={rank} out of range: the server has {dp_size} DP ranks, "
                             f"valid ranks are [0, {dp_size})")
    return rank
