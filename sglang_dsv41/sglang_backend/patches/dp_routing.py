"""DP-rank pinning: /generate honours the X-Data-Parallel-Rank header (SGLang reads it only on
its OpenAI endpoints), conflicting pins are refused, out-of-range pins are refused with a 400
before they reach the DP controller, and the controller never indexes its workers with a bad
rank (a negative one would silently pick another worker)."""

from __future__ import annotations

import logging
from typing import Callable

from ..registry import Patch, Target
from . import VERSIONS

logger = logging.getLogger(__name__)

TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager"
DP_CONTROLLER = "sglang.srt.managers.data_parallel_controller"
HTTP_SERVER = "sglang.srt.entrypoints.http_server"
IO_STRUCT = "sglang.srt.managers.io_struct"
HEADER = "x-data-parallel-rank"


def resolve_routed_dp_rank(routed_dp_rank, data_parallel_rank, header_value: str | None,
                           dp_size: int) -> int | None:
    """The DP rank a request is pinned to, or None. Raises ValueError (HTTP 400) naming the
    problem: a non-integer or out-of-range rank, or two sources that disagree."""
    candidates = []
    for source, value in (("routed_dp_rank", routed_dp_rank),
                          ("data_parallel_rank", data_parallel_rank)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{source} must be an integer, got {value!r}")
        candidates.append((source, value))
    if header_value is not None:
        try:
            candidates.append(("X-Data-Parallel-Rank header", int(header_value.strip())))
        except ValueError:
            raise ValueError(f"X-Data-Parallel-Rank header must be an integer, got "
                             f"{header_value!r}") from None
    if not candidates:
        return None
    ranks = {v for _, v in candidates}
    if len(ranks) > 1:
        raise ValueError("conflicting DP ranks: " +
                         ", ".join(f"{s}={v}" for s, v in candidates))
    rank = ranks.pop()
    if not 0 <= rank < max(dp_size, 1):
        raise ValueError(f"DP rank {rank} out of range [0, {max(dp_size, 1)}) "
                         f"(from {candidates[0][0]})")
    return rank


def make_pin_validation(orig: Callable) -> Callable:
    async def generate_request(self, obj, request=None):
        if hasattr(obj, "routed_dp_rank"):  # GenerateReqInput; embeddings have no pin
            header = request.headers.get(HEADER) if request is not None else None
            rank = resolve_routed_dp_rank(obj.routed_dp_rank,
                                          getattr(obj, "data_parallel_rank", None), header,
                                          self.server_args.dp_size)
            obj.routed_dp_rank, obj.data_parallel_rank = rank, None
        async for out in orig(self, obj, request):
            yield out

    return generate_request


def make_dispatch_guard(orig: Callable) -> Callable:
    def maybe_external_dp_rank_routing(self, req):
        rank = getattr(req, "routed_dp_rank", None)
        if rank is not None and not 0 <= rank < len(self.workers):
            # The HTTP process refuses these with a 400; a request that bypassed it is dropped
            # loudly rather than sent to the wrong rank or crashing the controller.
            logger.error("sglang-dsv41: dropping request %s pinned to DP rank %s, outside "
                         "[0, %d)", getattr(req, "rid", "?"), rank, len(self.workers))
            return True
        return orig(self, req)

    return maybe_external_dp_rank_routing


PATCHES = [
    Patch("dp_rank_pin.validate", "dp_rank_pin",
          Target(TOKENIZER_MANAGER, "TokenizerManager.generate_request",
                 ("self", "obj", "request")),
          "main", VERSIONS,
          "reads X-Data-Parallel-Rank on /generate; refuses conflicting, non-integer or "
          "out-of-range pins with HTTP 400",
          requires=((TOKENIZER_MANAGER, "TokenizerManager.server_args"),
                    (IO_STRUCT, "GenerateReqInput.routed_dp_rank"),
                    (IO_STRUCT, "GenerateReqInput.data_parallel_rank")),
          make=make_pin_validation),
    Patch("dp_rank_pin.generate_handler", "dp_rank_pin",
          Target(HTTP_SERVER, "generate_request", ("obj", "request")),
          "main", VERSIONS,
          "checked only: /generate passes the HTTP request (with its headers) to the "
          "TokenizerManager and turns ValueError into HTTP 400"),
    Patch("dp_rank_pin.dispatch", "dp_rank_pin",
          Target(DP_CONTROLLER, "DataParallelController.maybe_external_dp_rank_routing",
                 ("self", "req")),
          "dp_controller", VERSIONS,
          "an out-of-range pin never indexes the worker list",
          requires=((DP_CONTROLLER, "DataParallelController.workers"),),
          make=make_dispatch_guard),
]
