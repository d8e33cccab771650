"""Same-host A/B of bench/train.py between two source trees, runs alternated.

A host-bound step's time moves with the host: on one H200 lease, five runs of the same code took
193-285 ms (bench/results/train_h200.txt, run P). One run per tree cannot show a 10% change; this
runs the trees in turn, A B A B ..., and prints every run, each tree's median and spread, and the
ratio of the medians, for the step time and for bench/train.py's host ms (the main thread's CPU
time a step, which the host's drift moves less when it comes from time taken away) and cpu ms
(every thread's: the backward's launches come from autograd's device thread).

  python bench/ab_train.py --prepare REV [REV ...]
      here, with git: each revision's sglang_dsv41, trainer_bridge and bench into
      build/ab/<short sha> (carry build/ab to a GPU machine: its git may be stale)
  python bench/ab_train.py TREE_A TREE_B [--rounds 4] -- [bench/train.py arguments]
      anywhere: bench/train.py of each tree with that tree first on PYTHONPATH; the step, host
      and cpu times of the first "ours" row of each run
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREE_PARTS = ("sglang_dsv41", "trainer_bridge", "bench")


def prepare(revs: list[str], out_dir: str) -> list[str]:
    trees = []
    for rev in revs:
        sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.strip()
        tree = os.path.join(out_dir, sha)
        os.makedirs(tree, exist_ok=True)
        archive = subprocess.run(["git", "archive", sha, *TREE_PARTS], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
        trees.append(tree)
    return trees


def column_end(header: str, name: str) -> int | None:
    """Where the right-aligned column ``name`` of bench/train.py's fixed-width table ends (its
    values end there too), or None when the header lacks it."""
    at = header.find(name)
    return None if at < 0 else at + len(name)


COLUMNS = (("step", "step ms"), ("host", "host ms"), ("cpu", "cpu ms"))


def ours_times(stdout: str) -> dict[str, float | None]:
    """{"step", "host", "cpu"} ms of the first "ours" row bench/train.py printed (a live row or
    the table's; the memory-plan lines also start with "ours" and are skipped). Columns are read
    where the table's header puts them, so an older tree's output without "host ms" or "cpu ms"
    still gives its step time (those None)."""
    lines = stdout.splitlines()
    header = next((line for line in lines if line.startswith("run ") and "step ms" in line), "")
    ends = {key: column_end(header, name) for key, name in COLUMNS}
    for line in lines:
        if not line.startswith("ours ") or "memory plan" in line or ends["step"] is None:
            continue
        try:
            float(line[:ends["step"]].split()[-1])
        except ValueError:
            continue  # an OOM row
        return {key: None if end is None else float(line[:end].split()[-1])
                for key, end in ends.items()}
    raise ValueError("bench/train.py printed no step time of ours:\n" + stdout[-2000:])


def run(tree: str, bench_args: list[str]) -> dict[str, float | None]:
    tree = os.path.abspath(tree)  # the run's working directory is the tree itself
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, os.path.join(tree, "bench", "train.py"), *bench_args],
                         cwd=tree, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"bench/train.py in {tree} failed:\n{out.stderr[-3000:]}")
    return ours_times(out.stdout)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("trees", nargs="*", help="TREE_A TREE_B")
    p.add_argument("--prepare", nargs="+", metavar="REV", help="archive these revisions")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "build", "ab"))
    p.add_argument("--rounds", type=int, default=4, help="runs of each tree (alternated)")
    args = p.parse_args(argv)
    if args.prepare:
        for tree in prepare(args.prepare, args.out_dir):
            print(tree)
        return 0
    if len(args.trees) != 2:
        p.error("give two trees (or --prepare REV ...)")
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: at least 1")
    for tree in args.trees:
        if not os.path.isfile(os.path.join(tree, "bench", "train.py")):
            p.error(f"{tree} has no bench/train.py (prepare it with --prepare)")
    # by position, not name: the same tree may be given twice (a noise check)
    runs: list[list[dict[str, float | None]]] = [[], []]
    for r in range(args.rounds):
        for i, tree in enumerate(args.trees):
            times = run(tree, bench_args)
            runs[i].append(times)
            shown = "".join(f", {key} {times[key]:.1f} ms" for key in ("host", "cpu")
                            if times[key] is not None)
            print(f"round {r + 1} {'AB'[i]} {tree}: {times['step']:.1f} ms{shown}", flush=True)
    print(f"\nbench/train.py {' '.join(bench_args)}; {args.rounds} runs each, alternated")
    for what, name in COLUMNS:
        table = [[t[what] for t in tree_runs] for tree_runs in runs]
        if any(v is None for vals in table for v in vals):
            print(f"(no {name}: a tree's bench/train.py does not print it)")
            continue
        print(f"{what + ' ms: tree':<40}{'median':>10}{'min':>9}{'max':>9}  runs")
        for i, (tree, ts) in enumerate(zip(args.trees, table)):
            print(f"{'AB'[i] + ' ' + tree:<40}{statistics.median(ts):>10.1f}{min(ts):>9.1f}"
                  f"{max(ts):>9.1f}  " + " ".join(f"{t:.1f}" for t in ts))
        a, b = (statistics.median(ts) for ts in table)
        print(f"B / A ({what} ms medians): {b / a:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
