"""How busy the GPU was while the host ran each phase of a training step, from the chrome trace
that `bench/train.py --profile-seq N --trace-dir DIR` writes: for each `trainer.forward`,
`trainer.backward` and `trainer.optimizer` range, its host time and the union of the kernel,
copy and memset time inside it. A phase whose GPU time is well below its host time is
host-bound there (the GPU waited for launches).

  python bench/trace_gaps.py DIR/ours_small_ac_none_4096.json[.gz]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def busy_us(spans: list[tuple[float, float]], start: float, end: float) -> float:
    """Length of the union of the (sorted) spans within [start, end)."""
    total, reached = 0.0, start
    for s, e in spans:
        s, e = max(s, reached), min(e, end)
        if e > s:
            total += e - s
            reached = e
    return total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("trace")
    args = p.parse_args(argv)
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as f:
        trace = json.load(f)
    events = [e for e in (trace["traceEvents"] if isinstance(trace, dict) else trace)
              if e.get("ph") == "X"]
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                   if e.get("cat") in DEVICE_CATS)
    phases = sorted((e["ts"], e["dur"], e["name"]) for e in events
                    if e.get("cat") == "user_annotation" and e["name"].startswith("trainer."))
    if not phases or not spans:
        print(f"{args.trace}: no trainer.* ranges or no device events", file=sys.stderr)
        return 1
    print(f"{'phase':20s} {'host ms':>9s} {'GPU busy ms':>12s} {'busy share':>10s}")
    for start, dur, name in phases:
        busy = busy_us(spans, start, start + dur)
        print(f"{name:20s} {dur / 1e3:9.1f} {busy / 1e3:12.1f} {busy / max(dur, 1e-9):10.0%}")
    first, last = spans[0][0], max(e for _, e in spans)
    print(f"first to last device event {(last - first) / 1e3:.1f} ms, GPU busy "
          f"{busy_us(spans, first, last) / 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
