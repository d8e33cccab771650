"""Reference DSV4.1-style model: sink attention, MoE with router replay (R3), Engram, RoPE."""

from .config import PRESETS, DSV41Config, get_preset, load_config
from .context import ForwardContext
from .engram import EngramTable, ParameterEngramTable
from .model import DSV41ForCausalLM, build_model, is_engram_table, reference_logprobs

__all__ = ["PRESETS", "DSV41Config", "get_preset", "load_config", "ForwardContext", "EngramTable",
           "ParameterEngramTable", "DSV41ForCausalLM", "build_model", "is_engram_table",
           "reference_logprobs"]
