"""Same-host A/B of bench/train.py between two source trees, runs alternated.

A host-bound step's time moves with the host: on one H200 lease, five runs of the same code took
193-285 ms (bench/results/train_h200.txt, run P). One run per tree cannot show a 10% change; this
runs the trees in turn, A B A B ..., and prints every run, each tree's median and spread, and the
ratio of the medians.

  python bench/ab_train.py --prepare REV [REV ...]
      here, with git: each revision's sglang_dsv41, trainer_bridge and bench into
      build/ab/<short sha> (carry build/ab to a GPU machine: its git may be stale)
  python bench/ab_train.py TREE_A TREE_B [--rounds 4] -- [bench/train.py arguments]
      anywhere: bench/train.py of each tree with that tree first on PYTHONPATH; the step time of
      the first "ours" row of each run
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


def step_ms(stdout: str) -> float:
    """The step time of the first "ours" row bench/train.py printed (a live row or the table's;
    the memory-plan lines also start with "ours" and are skipped)."""
    for line in stdout.splitlines():
        fields = line.split()
        if line.startswith("ours ") and "memory plan" not in line and len(fields) >= 7:
            try:
                return float(fields[-5])
            except ValueError:
                continue  # an OOM row
    raise ValueError("bench/train.py printed no step time of ours:\n" + stdout[-2000:])


def run(tree: str, bench_args: list[str]) -> float:
    tree = os.path.abspath(tree)  # the run's working directory is the tree itself
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, os.path.join(tree, "bench", "train.py"), *bench_args],
                         cwd=tree, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"bench/train.py in {tree} failed:\n{out.stderr[-3000:]}")
    return step_ms(out.stdout)


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
    times: dict[str, list[float]] = {tree: [] for tree in args.trees}
    for r in range(args.rounds):
        for tree in args.trees:
            times[tree].append(run(tree, bench_args))
            print(f"round {r + 1} {tree}: {times[tree][-1]:.1f} ms", flush=True)
    print(f"\nbench/train.py {' '.join(bench_args)}; {args.rounds} runs each, alternated")
    print(f"{'tree':<40}{'median ms':>10}{'min':>9}{'max':>9}  runs")
    for tree, ts in times.items():
        print(f"{tree:<40}{statistics.median(ts):>10.1f}{min(ts):>9.1f}{max(ts):>9.1f}  "
              + " ".join(f"{t:.1f}" for t in ts))
    a, b = (statistics.median(times[t]) for t in args.trees)
    print(f"B / A (medians): {b / a:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
