"""Probe for issue #15's lead: how much of the optimizer step (the gradient norm and the Triton
AdamW, ~11.5 ms of a 4k step of the ``small`` preset on one H200) can run under the graphed
forward and backward on a second stream?

Times (bench/train.py's time_steps: device-synchronised, medians of --steps after --warmup):
  fb          the micro-batch graph alone (forward, loss, backward)
  opt         clip_and_step alone (the norm's square sums and AdamW)
  sequential  fb, then opt (a step)
  overlapped  fb on the current stream, opt launched right after it on a side stream
The optimizer runs with lr 0 and no weight decay: the overlapped run races it against the
backward's gradient writes (gradients and moments garbage, parameters and their compute copies
unchanged to the bit), so the model, its routing and the kernels' work stay a real step's. What
it measures is an upper bound on what the design in docs/trainer_bridge.md could hide (each
layer's update waited on by the next forward's layer; none under the backward): sequential -
overlapped.

  python bench/overlap_probe.py [--preset small --seq 4096 --steps 8 --warmup 3]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import train as bench_train  # noqa: E402  (bench/train.py: the same build and step)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    for flag, value, least in (("--seq", args.seq, 2), ("--steps", args.steps, 1),
                               ("--warmup", args.warmup, 0)):
        if value < least:
            p.error(f"{flag} {value}: at least {least}")
    device = bench_train.resolve_device("auto")
    if device.type != "cuda":
        raise SystemExit("overlap_probe: needs a GPU (streams)")
    info = bench_train.init_distributed(device)
    ours = bench_train.Ours(bench_train.get_preset(args.preset), info, device, "triton", "none",
                            cuda_graphs=True)
    for group in ours.opt.param_groups:
        group["lr"], group["weight_decay"] = 0.0, 0.0
    fb = ours.stepper(bench_train.Shape.parse(str(args.seq)), 1, optimizer=False)
    side = torch.cuda.Stream(device)

    def opt():
        bench_train.clip_and_step(ours.opt, ours.optim_cfg.max_grad_norm)

    def zero():
        ours.opt.zero_grad(set_to_none=True)

    def fb_alone():
        zero()  # every fb a step's first micro-batch: the same graph each time
        fb()

    def sequential():
        fb_alone()
        opt()

    def overlapped():
        # fb's graph first: its launch takes the host ~no time, while clip_and_step's host work
        # (~3 ms) would otherwise finish most of AdamW before the graph even started.
        main = torch.cuda.current_stream(device)
        side.wait_stream(main)
        fb_alone()
        with torch.cuda.stream(side):
            opt()
        main.wait_stream(side)

    def ms_of(fn, before=None) -> float:
        return bench_train.time_steps(fn, args, device, None, before=before)[0] * 1e3

    rows = [("fb", ms_of(fb_alone)), ("opt", ms_of(opt, before=fb_alone)),
            ("sequential", ms_of(sequential)), ("overlapped", ms_of(overlapped))]
    ms = dict(rows)
    print(f"{args.preset}, one sequence of {args.seq} tokens, micro-batch graphs; "
          f"{torch.cuda.get_device_name(device)}; medians of {args.steps} after {args.warmup}")
    for name, value in rows:
        print(f"{name:<12} {value:8.2f} ms")
    print(f"hidden under fb: {ms['sequential'] - ms['overlapped']:.2f} ms of opt's "
          f"{ms['opt']:.2f} (sequential - overlapped); overlapped / sequential "
          f"{ms['overlapped'] / ms['sequential']:.3f}")
    ours.close()
    bench_train.close_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
