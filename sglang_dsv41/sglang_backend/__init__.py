"""The ``sglang`` backend: real SGLang (pinned version) with the sglang-dsv41 plugins patched
into the main process and every scheduler / DP-controller process. Imports SGLang lazily."""

from .launch import launch

__all__ = ["launch"]
