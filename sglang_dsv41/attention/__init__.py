"""DeepSeek V4 sparse sink attention: torch reference, Triton kernels (forward, backward, paged
decode), one dispatch for the model, the trainer and the engine, and a transformers backend.

Importing this package needs neither triton nor a GPU: kernels are imported on first use.
"""

from .dsv4 import BACKEND_ENV, DSV4_BACKENDS, dsv4_attention, dsv4_decode
from .dsv4_reference import dsv4_attention_reference
from .transformers_backend import register_transformers_attention

__all__ = ["BACKEND_ENV", "DSV4_BACKENDS", "dsv4_attention", "dsv4_decode",
           "dsv4_attention_reference", "register_transformers_attention"]
