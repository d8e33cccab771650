"""Host time of the optimizer phase over FSDP2's DTensor parameters vs the same work on their
local shards (plain tensors): gradient clipping (trainer.clip_gradients vs foreach norm and
scale of the local gradients) and AdamW.step (the trainer's optimizer vs torch's AdamW over plain
copies of the local shards). AdamW is elementwise and FSDP2 shards dim 0, so the local work is
the same arithmetic; the difference is DTensor's dispatch, paid per op (and per tensor on the
paths that loop over tensors). One rank (a gloo world of one) on this machine's device.

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
from trainer_bridge.trainer import clip_gradients  # noqa: E402


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def ms_per_call(fn, device: torch.device, calls: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e3


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
        grads = [local(q.grad) for q in params]

        def clip_local():
            total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
            torch._foreach_mul_(grads, (1.0 / (total + 1e-6)).clamp(max=1.0))

        copies = [local(q).detach().clone().requires_grad_(True) for q in params]
        for c, g in zip(copies, grads):
            c.grad = g.clone()
        plain = torch.optim.AdamW(copies, lr=1e-5)
        rows = {"clip_gradients (DTensor)": lambda: clip_gradients(ours.policy, 1.0),
                "clip on local shards": clip_local,
                "AdamW.step (DTensor)": ours.opt.step,
                "AdamW.step (plain local copies)": plain.step}
        print(f"{args.preset} on {device.type}: {len(params)} trained tensors with gradients, "
              f"torch {torch.__version__}")
        times = {}
        for name, fn in rows.items():
            times[name] = ms_per_call(fn, device, args.calls)
            print(f"{name:34s} {times[name]:8.2f} ms a call", flush=True)
        for what, dtensor, shards in (("clipping", "clip_gradients (DTensor)",
                                       "clip on local shards"),
                                      ("AdamW.step", "AdamW.step (DTensor)",
                                       "AdamW.step (plain local copies)")):
            print(f"{what}: over DTensors {times[dtensor] / times[shards]:.2f}x the local "
                  "shards' time")
    finally:
        close_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
