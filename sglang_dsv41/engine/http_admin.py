"""Admin and weight-update routes (an APIRouter): each becomes one ControlReq run on every
scheduler rank (all-or-nothing), answered as SGLang does: {"success", "message", ...}; a refused
update is a 400 naming the tensor or rank, a dead engine a 503.

Admin routes are POST-only and, besides the API key or loopback rule, refuse what a browser on
another site can send without a CORS preflight: a foreign Origin, a cross-site fetch, a body
that is not JSON (text/plain and form posts are "simple" requests).
"""

from __future__ import annotations

import base64
import binascii
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field, model_validator

from .api_models import ApiSchema
from .dp_controller import ControlError, EngineUnavailable

if TYPE_CHECKING:
    from .http_server import ServerState

# A weight update may move gigabytes through the queues; checksums hash whole Engram tables.
CONTROL_TIMEOUT_S = 600.0
MAX_WEIGHT_BODY_BYTES = 16 << 30    # base64 safetensors of one push
ADMIN_PATHS = frozenset({
    "/update_weights_from_tensor", "/update_weights_from_disk", "/init_weights_update_group",
    "/update_weights_from_distributed", "/flush_cache",
    "/abort_request", "/pause_generation", "/continue_generation", "/engram_checksum",
    "/get_weights_by_name"})
_READ_ONLY_ADMIN = frozenset({"/engram_checksum", "/get_weights_by_name"})


class ApiError(Exception):
    """Raised by a route; the app's one handler answers it as an error body."""

    def __init__(self, status: int, message: str, err_type: str = "BadRequest"):
        super().__init__(message)
        self.status, self.message, self.err_type = status, message, err_type


class AbortRequest(ApiSchema):
    rid: str = ""
    abort_all: bool = False

class PauseGenerationRequest(ApiSchema):
    mode: str = Field("abort", pattern="^(abort|retract|in_place)$")

class UpdateWeightsFromTensorRequest(ApiSchema):
    serialized_named_tensors: str  # base64 of safetensors bytes
    flush_cache: bool = True
    weight_version: str | None = None
    abort_all_requests: bool = False
    allow_engram_update: bool = False  # force overwriting frozen Engram tables (else refused)

class UpdateWeightsFromDiskRequest(ApiSchema):
    model_path: str
    flush_cache: bool = True  # accepted as SGLang does; a disk update always flushes
    weight_version: str | None = None
    abort_all_requests: bool = False

class InitWeightsUpdateGroupRequest(ApiSchema):
    master_address: str
    master_port: int = Field(gt=0, lt=65536)
    rank_offset: int = Field(ge=0)
    world_size: int = Field(ge=1)
    group_name: str = "weight_update_group"
    backend: str = "gloo"

class UpdateWeightsFromDistributedRequest(ApiSchema):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    weight_version: str | None = None
    abort_all_requests: bool = False
    allow_engram_update: bool = False  # force overwriting frozen Engram tables (else refused)

    @model_validator(mode="after")
    def _same_lengths(self) -> "UpdateWeightsFromDistributedRequest":
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError("names, dtypes and shapes must have the same length")
        return self


def error_response(status: int, message: str, err_type: str = "BadRequest") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": err_type, "code": status}},
                        status_code=status)


def refuse_cross_site(request: Request, non_loopback_without_key: bool) -> str | None:
    """Why an admin request is refused, or None."""
    path = request.url.path
    if non_loopback_without_key:
        return (f"{path} is only open to loopback callers unless the server runs with "
                "--api-key")
    origin = request.headers.get("origin")
    if origin is not None and urlsplit(origin).netloc != request.headers.get("host"):
        return f"{path} refuses cross-site requests (Origin {origin!r})"
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        return f"{path} refuses cross-site requests (Sec-Fetch-Site)"
    if path in _READ_ONLY_ADMIN:
        return None
    if request.method != "POST":
        return f"{path} only accepts POST"
    has_body = request.headers.get("content-length", "0") != "0" or \
        "transfer-encoding" in request.headers
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if (has_body or ctype) and ctype != "application/json":
        return f"{path} needs Content-Type: application/json, got {ctype or 'none'!r}"
    return None


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


def admin_router(state: "ServerState") -> APIRouter:
    router = APIRouter()

    async def call(op: str, args: dict[str, Any], new_version: str | None = None):
        try:
            replies = await state.controller.control_async(op, args, CONTROL_TIMEOUT_S)
        except EngineUnavailable as e:
            raise ApiError(503, f"engine unavailable: {e}", "ServiceUnavailable") from e
        except ControlError as e:
            raise ApiError(400, f"{op} failed: {e}") from e
        result = replies[0].result if replies else None
        if isinstance(result, dict) and result.get("weight_version") is not None:
            state.weight_version = str(result["weight_version"])
        elif new_version is not None:
            state.weight_version = new_version
        return {"success": True, "message": f"{op} done on {len(replies)} ranks",
                "weight_version": state.weight_version, "result": result}

    @router.post("/flush_cache")
    async def flush_cache():
        return await call("flush_cache", {})

    @router.post("/abort_request")
    async def abort_request(body: AbortRequest):
        if body.abort_all:
            return {"success": True, "message": f"aborted {state.controller.abort_all()}"}
        found = state.controller.abort(body.rid)
        return {"success": found, "message": "abort sent" if found else
                f"no running request with id {body.rid!r}"}

    @router.post("/pause_generation")
    async def pause_generation(body: PauseGenerationRequest | None = None):
        # New requests wait until /continue_generation; "abort" also ends the running ones
        # (the embedded engine has no retract-and-resume, so the other modes let them finish).
        state.running.clear()
        aborted = state.controller.abort_all() if (body is None or body.mode == "abort") else 0
        return {"success": True, "message": f"paused; aborted {aborted} running requests"}

    @router.post("/continue_generation")
    async def continue_generation():
        state.running.set()
        return {"success": True, "message": "generation continues"}

    @router.post("/update_weights_from_tensor", max_body_size=MAX_WEIGHT_BODY_BYTES)
    async def update_weights_from_tensor(body: UpdateWeightsFromTensorRequest):
        try:
            named = decode_named_tensors(body.serialized_named_tensors)
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        if body.abort_all_requests:
            state.controller.abort_all()
        return await call("update_weights_from_tensor",
                          {"named_tensors": named, "flush_cache": body.flush_cache,
                           "weight_version": body.weight_version,
                           **({"allow_engram_update": True} if body.allow_engram_update else {})},
                          body.weight_version)

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest):
        if body.abort_all_requests:
            state.controller.abort_all()
        # A disk update always flushes the prefix cache (the whole model changed).
        return await call("update_weights_from_disk", {"model_path": body.model_path,
                                                       "weight_version": body.weight_version},
                          body.weight_version)

    @router.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitWeightsUpdateGroupRequest):
        # Every rank blocks in the group's rendezvous until the trainer joins (or the setup
        # timeout of weight_sync_group fires): /health reports it meanwhile.
        state.pending_setup["init_weights_update_group"] = time.monotonic()
        try:
            return await call("init_weights_update_group", body.model_dump())
        finally:
            state.pending_setup.pop("init_weights_update_group", None)

    @router.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedRequest):
        if body.abort_all_requests:
            state.controller.abort_all()
        args = body.model_dump(exclude={"abort_all_requests"})
        return await call("update_weights_from_distributed", args, body.weight_version)

    @router.get("/engram_checksum")
    async def engram_checksum():
        return await call("engram_checksum", {})

    @router.get("/get_weights_by_name")
    async def get_weights_by_name(name: str):
        return await call("get_weights_by_name", {"name": name})

    return router
