"""Request plugins: ``X-Data-Parallel-Rank`` on ``/generate``, and sticky DP dispatch by
``routing_key`` in the DP controller.

SGLang 0.5.23 reads ``X-Data-Parallel-Rank`` on the OpenAI routes only
(entrypoints/openai/serving_base.py); ``/generate`` honours a header only as
``x-override-routed-dp-rank`` behind SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES. Its
``routing_key`` only feeds metrics: nothing keeps a session's turns on one DP rank.
"""

from __future__ import annotations

import logging

from ..policies.dp_rank_pin import HEADER, DPRankPinError, resolve_dp_rank_pin
from ..policies.sticky_dispatch import StickyDispatch
from .env import ENV

logger = logging.getLogger(__name__)


def _num_dp_ranks() -> int:
    from sglang.srt.entrypoints import http_server

    # the count TokenizerManager.generate_request range-checks routed_dp_rank against
    return int(http_server._global_state.tokenizer_manager.elastic_worker_count)


def _bad_request(message: str):
    from starlette.responses import JSONResponse

    return JSONResponse(status_code=400, content={"error": {
        "message": message, "type": "invalid_request_error", "code": 400}})


async def around_serve_generate_request(original, obj, request):
    """http_server.serve_generate_request: resolve the pin once, then SGLang serves it."""
    header = request.headers.get(HEADER.lower()) if request is not None else None
    try:
        rank = resolve_dp_rank_pin(obj.routed_dp_rank, obj.data_parallel_rank, header,
                                   max(1, _num_dp_ranks()))
    except DPRankPinError as e:
        return _bad_request(str(e))
    if rank is not None:
        obj.routed_dp_rank, obj.data_parallel_rank = rank, None
    return await original(obj, request)


def around_external_dp_rank_routing(original, self, req):
    """DataParallelController.maybe_external_dp_rank_routing: a request with a routing_key
    and no explicit pin is pinned to its key's DP rank, then SGLang routes it as a pin. Not on
    a PD prefill server (follow_bootstrap_room): its rank must be bootstrap_room % dp, where the
    decode side fetches the KV."""
    key = getattr(req, "routing_key", None)
    if (key and getattr(req, "routed_dp_rank", None) is None
            and ENV.DP_DISPATCH.get() == "routing_key"
            and getattr(self.load_balance_method, "name", "") != "FOLLOW_BOOTSTRAP_ROOM"):
        sticky = self.__dict__.get("_dsv41_sticky")
        if sticky is None:
            sticky = self.__dict__["_dsv41_sticky"] = StickyDispatch()
        budget = getattr(self, "dp_budget", None)
        loads = list(budget.total_requests) if budget is not None else None
        rank = req.routed_dp_rank = sticky.rank_for(key, list(self._active_workers), loads)
        if budget is not None and 0 <= rank < budget.num_dp_ranks:
            # what DPBudget.dispatch does for each request it places: the load snapshot is
            # refreshed at most every 20 ms, and without this a burst of new keys (an RL
            # rollout's sessions) all saw the same least-loaded rank and stayed pinned there
            budget.total_requests[rank] += 1
            budget.total_tokens[rank] += len(getattr(req, "input_ids", None) or ())
    return original(self, req)
