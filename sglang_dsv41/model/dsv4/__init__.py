"""The real DeepSeek V4 / V4.1 text model (SGLang 0.5.23 names and numerics, transformers parity)."""

from .config import DSV4Config
from .presets import PRESETS, get_preset, load_config

__all__ = ["DSV4Config", "PRESETS", "get_preset", "load_config"]
