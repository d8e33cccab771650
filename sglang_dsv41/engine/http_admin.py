"""Admin and weight-update routes: each becomes one ControlReq run on every scheduler rank
(all-or-nothing), answered as SGLang does: {"success", "message", ...}; a refused update is a
400 naming the tensor or rank, a dead engine a 503. The loopback/API-key guard is in http_server.
"""

from __future__ import annotations

import base64
import binascii
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request

from .api_models import (AbortRequest, InitWeightsUpdateGroupRequest,
                         UpdateWeightsFromDiskRequest, UpdateWeightsFromDistributedRequest,
                         UpdateWeightsFromTensorRequest)
from .dp_controller import ControlError, EngineUnavailable

if TYPE_CHECKING:
    from .http_server import ServerState

# A weight update may move gigabytes through the queues; checksums hash whole Engram tables.
CONTROL_TIMEOUT_S = 600.0


def decode_named_tensors(serialized: str) -> list[tuple[str, Any]]:
    """base64 of safetensors bytes -> [(name, tensor)] in file order."""
    from safetensors.torch import load  # torch only where weights actually move

    try:
        raw = base64.b64decode(serialized, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"serialized_named_tensors is not valid base64: {e}") from e
    try:
        tensors = load(raw)
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise ValueError(f"serialized_named_tensors is not a safetensors payload: {e}") from e
    if not tensors:
        raise ValueError("serialized_named_tensors holds no tensors")
    return list(tensors.items())


def add_admin_routes(app: FastAPI, state: "ServerState") -> None:
    from .http_server import error_response, read_json_model

    async def call(op: str, args: dict[str, Any], new_version: str | None = None):
        try:
            replies = await state.controller.control_async(op, args, CONTROL_TIMEOUT_S)
        except EngineUnavailable as e:
            return error_response(503, f"engine unavailable: {e}", "ServiceUnavailable")
        except ControlError as e:
            return error_response(400, f"{op} failed: {e}")
        result = replies[0].result if replies else None
        if isinstance(result, dict) and result.get("weight_version") is not None:
            state.weight_version = str(result["weight_version"])
        elif new_version is not None:
            state.weight_version = new_version
        return {"success": True, "message": f"{op} done on {len(replies)} ranks",
                "weight_version": state.weight_version, "result": result}

    async def parse(request: Request, model: type):
        try:
            return await read_json_model(request, model), None
        except ValueError as e:
            return None, error_response(400, str(e))

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        return await call("flush_cache", {})

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body, err = await parse(request, AbortRequest)
        if err is not None:
            return err
        found = state.controller.abort(body.rid)
        return {"success": found, "message": "abort sent" if found else
                f"no running request with id {body.rid!r}"}

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        body, err = await parse(request, UpdateWeightsFromTensorRequest)
        if err is not None:
            return err
        try:
            named = decode_named_tensors(body.serialized_named_tensors)
        except ValueError as e:
            return error_response(400, str(e))
        if body.abort_all_requests:
            state.controller.abort_all()
        return await call("update_weights_from_tensor",
                          {"named_tensors": named, "flush_cache": body.flush_cache,
                           "weight_version": body.weight_version,
                           **({"allow_engram_update": True} if body.allow_engram_update else {})},
                          body.weight_version)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body, err = await parse(request, UpdateWeightsFromDiskRequest)
        if err is not None:
            return err
        if body.abort_all_requests:
            state.controller.abort_all()
        # A disk update always flushes the prefix cache (the whole model changed).
        return await call("update_weights_from_disk", {"model_path": body.model_path,
                                                       "weight_version": body.weight_version},
                          body.weight_version)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        body, err = await parse(request, InitWeightsUpdateGroupRequest)
        if err is not None:
            return err
        return await call("init_weights_update_group", body.model_dump())

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        body, err = await parse(request, UpdateWeightsFromDistributedRequest)
        if err is not None:
            return err
        if body.abort_all_requests:
            state.controller.abort_all()
        args = body.model_dump(exclude={"abort_all_requests"})
        return await call("update_weights_from_distributed", args, body.weight_version)

    @app.get("/engram_checksum")
    async def engram_checksum():
        return await call("engram_checksum", {})

    @app.get("/get_weights_by_name")
    async def get_weights_by_name(name: str):
        return await call("get_weights_by_name", {"name": name})
