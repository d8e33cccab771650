"""Which threads of a benchmark take the host's CPU, and where they run.

A host-bound training step moves with the host: on one H200 lease the same code's step took
193-285 ms from run to run (bench/results/train_h200.txt). This runs a command (bench/train.py,
say) as a child and samples /proc every --every seconds: per thread of the child, its share of
one core over each interval and the core it last ran on. At the end it prints, for the busiest
threads, the mean share and the cores seen, and how often the busiest thread (the Python main
thread in a host-bound step) shared its core, or an SMT sibling of it, with another busy thread
of the same process.

  python bench/host_threads.py [--every 0.5] [--busy 0.2] -- python bench/train.py ...
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time

TICKS = os.sysconf("SC_CLK_TCK")


def thread_stats(pid: int) -> dict[int, tuple[str, int, int]]:
    """tid -> (name, user + system ticks, last core)."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                raw = f.read()
        except FileNotFoundError:
            continue
        name = raw[raw.index("(") + 1:raw.rindex(")")]
        fields = raw[raw.rindex(")") + 2:].split()
        # fields[0] is stat's field 3 (state): utime 14, stime 15, processor 39
        out[int(tid)] = (name, int(fields[11]) + int(fields[12]), int(fields[36]))
    return out


def core_siblings() -> dict[int, frozenset[int]]:
    """cpu -> the cpus of its physical core (itself included)."""
    sib = {}
    for cpu in range(os.cpu_count() or 1):
        path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
        try:
            text = open(path).read().strip()
        except FileNotFoundError:
            sib[cpu] = frozenset([cpu])
            continue
        cpus = set()
        for part in text.split(","):
            a, _, b = part.partition("-")
            cpus.update(range(int(a), int(b or a) + 1))
        sib[cpu] = frozenset(cpus)
    return sib


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--every", type=float, default=0.5, help="seconds between samples")
    p.add_argument("--busy", type=float, default=0.2,
                   help="a thread is busy in an interval above this share of a core")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("give the command to run after --")
    if args.every <= 0:
        p.error(f"--every {args.every}: must be > 0")
    sib, top = core_siblings(), 12
    child = subprocess.Popen(cmd)
    share = collections.defaultdict(list)       # (name, tid) -> shares
    cores = collections.defaultdict(collections.Counter)
    names = {}
    main_intervals = shared_core = shared_smt = 0
    prev, t_prev = thread_stats(child.pid), time.monotonic()
    while child.poll() is None:
        time.sleep(args.every)
        now, t_now = thread_stats(child.pid), time.monotonic()
        dt = (t_now - t_prev) * TICKS
        busy = []
        for tid, (name, ticks, cpu) in now.items():
            if tid in prev and dt > 0:
                s = (ticks - prev[tid][1]) / dt
                share[tid].append(s)
                cores[tid][cpu] += 1
                names[tid] = name
                if s > args.busy:
                    busy.append((s, tid, name, cpu))
        busy.sort(reverse=True)
        if busy and busy[0][1] == child.pid:  # the main thread is the busiest
            main_intervals += 1
            cpu = busy[0][3]
            others = [b for b in busy[1:]]
            shared_core += any(b[3] == cpu for b in others)
            shared_smt += any(b[3] != cpu and b[3] in sib.get(cpu, ()) for b in others)
        prev, t_prev = now, t_now
    print(f"\n# host threads of: {' '.join(cmd)}")
    print(f"# {os.cpu_count()} cpus; SMT siblings of cpu0: {sorted(sib.get(0, []))}")
    print(f"{'thread (tid)':<28}{'mean core share':>16}{'max':>8}  cores seen (samples)")
    ranked = sorted(share.items(), key=lambda kv: -sum(kv[1]) / len(kv[1]))
    for tid, vals in ranked[:top]:
        mean = sum(vals) / len(vals)
        if mean < 0.01:
            break
        seen = " ".join(f"{c}:{n}" for c, n in cores[tid].most_common(6))
        label = f"{names[tid]} ({'main' if tid == child.pid else tid})"
        print(f"{label:<28}{mean:>16.2f}{max(vals):>8.2f}  {seen}")
    print(f"main thread busiest in {main_intervals} intervals; another busy thread of this "
          f"process on its cpu in {shared_core}, on an SMT sibling in {shared_smt}")
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
