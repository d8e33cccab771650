"""The DeepSeek V4 / V4.1 text model (sglang_dsv41.model.dsv4; docs/model.md)."""

from .dsv4 import PRESETS, DSV4Config, get_preset, load_config
from .dsv4.context import DSV4Context
from .dsv4.model import DSV4ForCausalLM, init_weights

__all__ = ["PRESETS", "DSV4Config", "get_preset", "load_config", "DSV4Context",
           "DSV4ForCausalLM", "init_weights"]
