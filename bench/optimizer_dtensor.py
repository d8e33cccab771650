"""Host time of the optimizer phase: torch over FSDP2's DTensor parameters (the baseline) vs the
trainer's own phase on their local shards (trainer_bridge/local_shards.py): gradient clipping
(torch.nn.utils.clip_grad_norm_ vs local_shards.clip_grad_norm) and AdamW.step (torch.optim.AdamW
vs the trainer's LocalShardAdamW, the same groups and fused setting). The arithmetic is the
same (tests/test_trainer_local_shards.py); the difference is DTensor's dispatch, paid per op
(and per tensor on the paths that loop over tensors): host time. Each row gives the host's time
to issue the calls and the wall time until the device ran them (on a GPU a fused AdamW over
every parameter is bound by memory: wall ms is the device's time). One rank (a world of one)
on this machine's device.

  python bench/optimizer_dtensor.py [--preset tiny] [--device cpu] [--calls 30]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.train import Ours, Shape  # noqa: E402
from sglang_dsv41.model.dsv4 import get_preset  # noqa: E402
from trainer_bridge.dist import close_distributed, init_distributed  # noqa: E402
from trainer_bridge.policy import resolve_device  # noqa: E402
from trainer_bridge.local_shards import clip_grad_norm  # noqa: E402


def ms_per_call(fn, device: torch.device, calls: int) -> tuple[float, float]:
    """-> (host ms, wall ms) a call: the host's time to issue ``calls`` calls, and the time
    until the device has run them (the same on a CPU)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e3, (t2 - t0) / calls * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="auto")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--calls", type=int, default=30)
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    info = init_distributed(device)
    try:
        ours = Ours(get_preset(args.preset), info, device, None, "none")
        ours.stepper(Shape(1, args.seq), 1, optimizer=False)()  # gradients to work on
        params = [q for _, q in ours.policy.trainable_parameters() if q.grad is not None]
        torch_adamw = torch.optim.AdamW([dict(g) for g in ours.opt.param_groups])
        rows = {"clip_grad_norm_ (torch, DTensor)":
                lambda: torch.nn.utils.clip_grad_norm_(params, 1.0),
                "clip_grad_norm (ours, local shards)": lambda: clip_grad_norm(params, 1.0),
                "AdamW.step (torch, DTensor)": torch_adamw.step,
                "AdamW.step (ours, local shards)": ours.opt.step}
        print(f"{args.preset} on {device.type}: {len(params)} trained tensors with gradients, "
              f"torch {torch.__version__}")
        times = {}
        print(f"{'':36s} {'host ms':>8s} {'wall ms':>8s}  a call")
        for name, fn in rows.items():
            times[name] = ms_per_call(fn, device, args.calls)
            print(f"{name:36s} {times[name][0]:8.2f} {times[name][1]:8.2f}", flush=True)
        for what, dtensor, shards in (("clipping", *list(times)[:2]),
                                      ("AdamW.step", *list(times)[2:])):
            (host_a, wall_a), (host_b, wall_b) = times[dtensor], times[shards]
            print(f"{what}: torch over DTensors {host_a / host_b:.2f}x ours on the local shards "
                  f"in host time, {wall_a / wall_b:.2f}x in wall time")
    finally:
        close_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
