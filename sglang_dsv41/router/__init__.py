"""DP-sticky routing client: pins each session to (engine, dp_rank) across its turns."""

from .base import NoEngineAvailable, Route, RouterError, SessionRouter
from .sticky import SlotState, StickyRouter, kv_free_by_dp_rank

__all__ = ["NoEngineAvailable", "Route", "RouterError", "SessionRouter", "SlotState",
           "StickyRouter", "kv_free_by_dp_rank"]
