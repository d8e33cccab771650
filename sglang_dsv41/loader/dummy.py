"""--load-format dummy: SGLang's dummy weights, except the frozen Engram tables.

As sglang.srt.model_loader.weight_utils.initialize_dummy_weights: every floating tensor of the
state dict gets uniform(-1e-3, 1e-3) from a generator re-seeded with the same seed for each
tensor (so every rank holds identical dummy weights); sub-16-bit dtypes are drawn in float16.
The trainer pushes the real weights later, but never the Engram tables, which must therefore
come from the checkpoint. tid2eid (int32) is not floating and keeps its loaded value.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..model.dsv4.names import is_engram_table

DUMMY_LOW, DUMMY_HIGH = -1e-3, 1e-3
DUMMY_SEED = 1234  # SGLang's initialize_dummy_weights default: identical on every rank


@torch.no_grad()
def dummy_init_(model: torch.nn.Module, seed: int = 0,
                skip: Callable[[str], bool] | None = is_engram_table) -> list[str]:
    """Fill every floating tensor whose name ``skip`` rejects; returns the names filled."""
    targets = [(n, t) for n, t in model.state_dict(keep_vars=True).items()
               if t.is_floating_point() and t.device.type != "meta"
               and not (skip is not None and skip(n))]
    # CPU uniform_ draws serially, so a tensor re-seeded with the same seed gets the first
    # numel values of one long draw: draw once per dtype, copy prefixes (same bits, ~10x less
    # RNG work). Other devices re-seed per tensor, exactly as SGLang does.
    longest: dict[torch.dtype, torch.Tensor] = {}
    for _, t in targets:
        if t.device.type == "cpu":
            draw = _draw_dtype(t.dtype)
            if longest.get(draw) is None or longest[draw].numel() < t.numel():
                longest[draw] = torch.empty(t.numel(), dtype=draw)
    for draw, buf in longest.items():
        buf.uniform_(DUMMY_LOW, DUMMY_HIGH, generator=torch.Generator().manual_seed(seed))
    for _, t in targets:
        if t.device.type == "cpu":
            src = longest[_draw_dtype(t.dtype)][:t.numel()].view(t.shape)
            t.data.copy_(src if src.dtype == t.dtype else src.to(t.dtype))
            continue
        gen = torch.Generator(device=t.device).manual_seed(seed)
        if t.dtype.itemsize < 2:  # uniform_ has no fp8 kernel
            t.data.copy_(torch.empty(t.shape, dtype=torch.float16, device=t.device).uniform_(
                DUMMY_LOW, DUMMY_HIGH, generator=gen).to(t.dtype))
        else:
            t.data.uniform_(DUMMY_LOW, DUMMY_HIGH, generator=gen)
    return [n for n, _ in targets]


def _draw_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float16 if dtype.itemsize < 2 else dtype
