"""OpenAI-compatible per-trajectory agent gateway (``python -m sglang_dsv41.gateway``)."""

from .app import Gateway, create_gateway_app
from .trajectory import Trajectory, Turn

__all__ = ["Gateway", "Trajectory", "Turn", "create_gateway_app"]
