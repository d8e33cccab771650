"""Host work of a training step as a function of how many sequences one micro-batch packs: the
aten calls that launch a kernel (views and other metadata-only ops left out) in one step of
bench/train.py's trainer (forward, PPO loss, backward, clipping, AdamW) on the ``small``
preset's layers at narrow widths, on the CPU. RL packs many sequences into a micro-batch; a
loop over them in a layer adds launches per sequence, and on a GPU a 4k step of the small
preset is already bound by its host (bench/results/train_h200.txt, run W: 3,637 launches).

The CPU runs the torch paths where the GPU runs one Triton or fused kernel (RMSNorm, RoPE, mHC,
the expert GEMMs, the attention core), so the totals are the CPU's, not a GPU's; what a packed
sequence adds comes from the model's own per-sequence loops, which both take.

  python bench/packed_launches.py [--tokens 2048] [--packs 1,2,4,8]

Each row: calls a step, its ratio to the first row's (the baseline, measured in the same run),
and the calls each sequence beyond the first row's adds.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.train import Ours, Shape  # noqa: E402
from sglang_dsv41.model.dsv4 import get_preset  # noqa: E402
from trainer_bridge.dist import close_distributed, init_distributed  # noqa: E402

NO_KERNEL = {"detach", "view", "_unsafe_view", "alias", "t", "transpose", "as_strided", "slice",
             "select", "unsqueeze", "squeeze", "expand", "permute", "reshape", "split",
             "unbind", "chunk", "split_with_sizes", "narrow", "flatten", "unflatten", "empty",
             "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "_reshape_alias",
             "view_as", "_local_scalar_dense"}


class KernelCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func.overloadpacket.__name__ not in NO_KERNEL
        return func(*args, **(kwargs or {}))


def narrow_small():
    """The small preset's 12 layers (every V4.1 layer kind, Engram, hash layers, 64 experts)
    at widths a CPU steps in seconds."""
    return replace(get_preset("small"), hidden_size=128, num_attention_heads=16, head_dim=64,
                   qk_rope_head_dim=32, q_lora_rank=64, o_lora_rank=64, index_n_heads=4,
                   index_head_dim=64, moe_intermediate_size=32, engram_n_heads=4,
                   engram_head_dim=32, index_topk=64)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048, help="tokens a micro-batch")
    p.add_argument("--packs", default="1,2,4,8", help="sequences a micro-batch, comma-separated")
    args = p.parse_args(argv)
    try:
        packs = [int(n) for n in args.packs.split(",")]
    except ValueError:
        p.error(f"--packs {args.packs!r}: comma-separated integers")
    bad = [n for n in packs if n < 1 or args.tokens % n]
    if args.tokens < 1 or bad:
        p.error(f"--packs {bad}: each must be >= 1 and divide --tokens {args.tokens}")
    device = torch.device("cpu")
    info = init_distributed(device)
    try:
        ours = Ours(narrow_small(), info, device, None, "none", one_rank="copies")
        print(f"{'micro-batch':>12s} {'calls a step':>13s} {'x first row':>12s} "
              f"{'added a sequence':>17s}")
        first = None
        for n in packs:
            step = ours.stepper(Shape(n, args.tokens // n), 1)
            step()  # warm-up: the optimizer state, first-call caches
            with KernelCalls() as k:
                step()
            first = (n, k.calls) if first is None else first
            added = ((k.calls - first[1]) / (n - first[0])) if n != first[0] else float("nan")
            print(f"{f'{n}x{args.tokens // n}':>12s} {k.calls:13d} {k.calls / first[1]:12.3f} "
                  f"{added:17.1f}", flush=True)
    finally:
        close_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
