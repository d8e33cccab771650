"""``convert --verify``'s end-to-end check: DSV4ForCausalLM's logits on the dequantized release
and on the converted checkpoint, same tokens.

The source side is read whole with safetensors' own reader and dequantized to float32
(loader/fp8.py, loader/fp4.py), not through the converter's chunked streaming; both sides are
copied one tensor at a time into one fp32 model. Only for configs the model can build here
(VERIFY_MAX_PARAMS): the real V4.1-Flash gets the per-tensor check alone.
"""

from __future__ import annotations

import os
from typing import Iterator

import torch

from .fp4 import dequantize_fp4
from .fp8 import dequantize_fp8_blocks
from .release_layout import RELEASE_SCALE_SUFFIX, ConversionPlan

VERIFY_SEQ_LENS = [160, 96]  # two packed sequences, 256 tokens
VERIFY_MAX_PARAMS = 2 * 10**9  # above this the fp32 model is not built (v41-flash: 550B)
# bf16 tolerance. With e8m0 scales (V4.1) dequantization is exact in bf16 and the logits are
# identical; with float32 scales each weight rounds by <= 2^-9, and on tiny that moved the mean
# |logit diff| by < 1% of the logits' mean spread and the max (routing and top-k flips) by
# ~2% of the largest logit; an FP4 nibble-order or e8m0 exponent bug moved the mean >= 4%.
VERIFY_MEAN_RTOL = 2e-2  # mean |diff| / mean |logit - its row mean|
VERIFY_MAX_RTOL = 1e-1  # max |diff| / max |logit|


def dequantized_source(plan: ConversionPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every text tensor, read whole with safetensors and dequantized to
    float32 (Engram tables, tid2eid and fp32 tensors as stored)."""
    from safetensors import safe_open

    opened: dict[str, object] = {}
    for e in plan.entries:
        for file in (e.src_file, e.scale_file):
            if file is not None and file not in opened:
                opened[file] = safe_open(os.path.join(plan.src, file), "pt")
        t = opened[e.src_file].get_tensor(e.name)
        if e.kind in ("fp8", "fp4"):
            scale = opened[e.scale_file].get_tensor(e.name[: -len(".weight")]
                                                    + RELEASE_SCALE_SUFFIX)
            t = (dequantize_fp8_blocks(t, scale, plan.block, torch.float32) if e.kind == "fp8"
                 else dequantize_fp4(t, scale, torch.float32))
        yield e.name, t


def dst_tensors(dst: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    from .shards import checkpoint_files

    for file in checkpoint_files(dst):
        with safe_open(os.path.join(dst, file), "pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def verify_logits(plan: ConversionPlan, dst: str, max_params: int = VERIFY_MAX_PARAMS) -> dict:
    """Logits of DSV4ForCausalLM (fp32) on the dequantized source and on DST, same tokens.
    -> {"ok", "tokens", "max_abs_diff", "logit_scale", "mean_abs_diff", "logit_spread"} or
    {"skipped": reason}. A check of the whole function at bf16 tolerance: a small error in one
    tensor hides in it (the per-tensor check finds those)."""
    from ..model.dsv4.config import DSV4Config
    from ..model.dsv4.context import DSV4Context
    from ..model.dsv4.model import DSV4ForCausalLM
    from ..plan.shapes import count_parameters

    cfg = DSV4Config.from_dict(plan.config)
    n = count_parameters(cfg, include_engram_tables=True)
    if n > max_params:
        return {"skipped": f"{n} parameters > {max_params}: the model is not built here"}
    model = DSV4ForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (sum(VERIFY_SEQ_LENS),),
                        generator=torch.Generator().manual_seed(0))

    @torch.no_grad()
    def logits(tensors: Iterator[tuple[str, torch.Tensor]], what: str) -> torch.Tensor:
        # Copied one tensor at a time into the model's own storage: one model in memory.
        state, seen = model.state_dict(), set()
        for name, t in tensors:
            if name not in state or state[name].shape != t.shape:
                raise ValueError(f"{what}: tensor {name!r} {list(t.shape)} does not fit the "
                                 "model")
            if not state[name].dtype.is_floating_point or state[name].element_size() == 1:
                if t.dtype != state[name].dtype:  # Engram tables, tid2eid: byte-exact only
                    raise ValueError(f"{what}: tensor {name!r} is {t.dtype}, expected "
                                     f"{state[name].dtype} byte for byte")
            state[name].copy_(t)
            seen.add(name)
        if seen != set(state):
            raise ValueError(f"{what} lacks {sorted(set(state) - seen)[:3]}")
        return model(ids, DSV4Context.packed(VERIFY_SEQ_LENS)).float()

    got = logits(dst_tensors(dst), "DST")  # first: a DST that does not fit fails fast
    want = logits(dequantized_source(plan), f"source {plan.src}")
    diff, scale = (got - want).abs().max().item(), want.abs().max().item()
    mean_diff = (got - want).abs().mean().item()
    spread = (want - want.mean(-1, keepdim=True)).abs().mean().item()
    ok = (bool(torch.isfinite(got).all()) and diff <= VERIFY_MAX_RTOL * scale
          and mean_diff <= VERIFY_MEAN_RTOL * spread)
    return {"ok": ok, "tokens": ids.numel(), "max_abs_diff": diff, "logit_scale": scale,
            "mean_abs_diff": mean_diff, "logit_spread": spread}
