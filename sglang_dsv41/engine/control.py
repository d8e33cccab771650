"""Control ops: calls that run on every scheduler rank at the same step boundary.

All-or-nothing: every rank validates, the verdicts are all-gathered, and only if every rank
said yes does every rank apply. Each rank answers with its own ControlOut; the caller succeeds
only when all ranks answered ok.

Handlers are ``apply(runner, **args) -> result`` (picklable) with an optional
``validate(runner, **args)`` that raises ValueError naming the problem. ``runner`` is the rank's
ModelRunner: ``runner.model``, ``runner.weight_version`` (settable), ``runner.flush_cache_hook()``
(flushes this DP group's prefix cache; returns True), ``runner.info`` (ParallelInfo),
``runner.model_dir``, ``runner.args``, ``runner.groups``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..model.dsv4.names import per_expert_state
from .messages import ControlOut, ControlReq

if TYPE_CHECKING:
    from .model_runner import ModelRunner


@dataclass(frozen=True)
class ControlOp:
    apply: Callable[..., Any]
    validate: Callable[..., None] | None = None


CONTROL_OPS: dict[str, ControlOp] = {}


def register_control_op(name: str, apply: Callable[..., Any],
                        validate: Callable[..., None] | None = None, replace: bool = False) -> None:
    if name in CONTROL_OPS and not replace:
        raise ValueError(f"control op {name!r} is already registered")
    CONTROL_OPS[name] = ControlOp(apply, validate)


def run_control_op(runner: "ModelRunner", req: ControlReq) -> ControlOut:
    """Called by every rank for the same req at the same step; collectives inside stay aligned
    because every rank reaches the verdict exchange whatever its own outcome."""
    rank = runner.info.rank
    op = CONTROL_OPS.get(req.op)
    error = None
    if op is None:
        error = f"unknown control op {req.op!r}; known: {sorted(CONTROL_OPS)}"
    elif op.validate is not None:
        try:
            op.validate(runner, **req.args)
        except (ValueError, TypeError, KeyError) as e:
            error = f"rank {rank}: {e}"
    if not runner.groups.all_agree(error is None, f"control:{req.op}"):
        return ControlOut(req.req_id, False, None,
                          error or "refused: another rank rejected the call", rank)
    try:
        return ControlOut(req.req_id, True, op.apply(runner, **req.args), None, rank)
    except Exception as e:  # noqa: BLE001 - reported to the caller, the server keeps serving
        return ControlOut(req.req_id, False, None, f"rank {rank}: {type(e).__name__}: {e}", rank)


# ---- ops ---------------------------------------------------------------------------------------
def _register_loader_ops() -> None:
    """Weight updates and Engram checksums (engine/weight_update_ops.py, over the loader's
    weight-update functions)."""
    from .weight_update_ops import LOADER_CONTROL_OPS

    for name, (apply, validate) in LOADER_CONTROL_OPS.items():
        register_control_op(name, apply, validate, replace=True)


def _flush_cache(runner: "ModelRunner") -> bool:
    return bool(runner.flush_cache_hook()) if runner.flush_cache_hook else True


def _get_model_info(runner: "ModelRunner") -> dict[str, Any]:
    cfg = runner.cfg
    return {"model_path": runner.model_dir, "weight_version": runner.weight_version,
            "is_generation": True, "dtype": str(runner.dtype).replace("torch.", ""),
            "num_hidden_layers": cfg.num_hidden_layers, "vocab_size": cfg.vocab_size,
            "max_total_tokens": runner.max_total_tokens, "page_size": runner.page_size,
            "context_length": runner.context_length}


def _validate_name(runner: "ModelRunner", name: str, truncate_size: int = 100) -> None:
    if name not in per_expert_state(dict(runner.model.named_parameters())):
        raise ValueError(f"no parameter named {name!r}")


def _get_weights_by_name(runner: "ModelRunner", name: str, truncate_size: int = 100
                         ) -> dict[str, Any]:
    p = per_expert_state(dict(runner.model.named_parameters()))[name].detach().float().cpu()
    return {"name": name, "shape": list(p.shape), "values": p.flatten()[:truncate_size].tolist(),
            "sha256": hashlib.sha256(p.numpy().tobytes()).hexdigest()}


register_control_op("flush_cache", _flush_cache)
register_control_op("get_model_info", _get_model_info)
register_control_op("get_weights_by_name", _get_weights_by_name, _validate_name)
_register_loader_ops()
