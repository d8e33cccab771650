"""sglang-dsv41: SGLang plugins, an embedded DP-attention engine and tooling for DSV4.1-class RL."""

__version__ = "0.1.0"
