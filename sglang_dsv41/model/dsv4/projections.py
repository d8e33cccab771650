"""Several linear layers of one input as one GEMM.

At the small preset's 4k tokens the model's [T, 1024] x [1024, 512] projections (attention's
wq_a and wkv, the shared expert's w1 and w3, a compressor's wkv and wgate) each fill about one
wave of an H200's SMs with short inner loops: on one H200 those shapes took 2.1 ms of a 4k step
forward and backward (bench/results/train_ops_h200.txt, run AG). One GEMM over the concatenated
weights has more tiles per wave, and its backward is one d x GEMM where autograd ran one per
layer and added them. The weights are concatenated each call (a copy of a few MiB): the
parameters, their names and their gradients stay the layers' own. The layers' forward hooks
do not run: a compressor's projections stay module calls (the engine's cache hooks them,
engine/model_hooks.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def linear_packed(x: torch.Tensor, *layers: nn.Linear) -> torch.Tensor:
    """-> [..., sum of their out_features]: the bias-free nn.Linear layers' outputs of x side
    by side, in the order given."""
    if any(layer.bias is not None for layer in layers):
        raise ValueError("linear_packed takes bias-free layers")
    return F.linear(x, torch.cat([layer.weight for layer in layers]))


def linears_of(x: torch.Tensor, *layers: nn.Linear) -> tuple[torch.Tensor, ...]:
    """-> (layer(x) for each layer), as column views of linear_packed's output."""
    return linear_packed(x, *layers).split([layer.out_features for layer in layers], dim=-1)
