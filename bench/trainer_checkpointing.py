"""The trainer itself (``python -m trainer_bridge.train``) at one long context, with each
model.activation_checkpointing policy asked for: auto's start-up plan (its log line), then the
step time, tokens/s and the step's peak device memory (metrics.jsonl's step_s and
mem_peak_bytes), and each policy's speed-up over layer checkpointing measured in the same run.

bench/train.py times the same model and plan outside the trainer; this runs the whole trainer
process (config, policy build, optimizer, plan, micro-batches by loss.token_budget, PPO loss,
optimizer step) on offline rollouts: GROUP samples of LENGTH random tokens a step, one group,
rewards 0..1 (so the advantages are not zero), the response (loss mask) after the first
``--prompt`` tokens.

  python bench/trainer_checkpointing.py --model small --length 98304 --policies auto,layer

A policy whose trainer fails (out of memory, refused plan) gets its last error line as its row.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sglang_dsv41.model.dsv4 import get_preset  # noqa: E402
from trainer_bridge.batch import Sample, random_tokens  # noqa: E402
from trainer_bridge.config import CHECKPOINTING_CHOICES as POLICIES  # noqa: E402
from trainer_bridge.memory_plan import MEMORY_FRACTION  # noqa: E402
from trainer_bridge.rollout import append_record  # noqa: E402

GiB = 2 ** 30
PLAN_LINE = re.compile(r"activation checkpointing \(auto\): .*")


def write_rollouts(path: str, vocab: int, length: int, prompt: int, group: int, steps: int,
                   seed: int = 0) -> None:
    """One record per step: ``group`` samples of ``length`` tokens, one GRPO group."""
    for step in range(steps):
        samples = []
        for i in range(group):
            tokens = random_tokens(vocab, length, seed=seed + step * group + i)
            mask = [0] * prompt + [1] * (length - prompt)
            # about a uniform distribution's logprob, as an untrained model's sampler gives
            logprobs = [0.0] * prompt + [-math.log(vocab)] * (length - prompt)
            samples.append(Sample(tokens=tokens, loss_mask=mask, rollout_logprobs=logprobs,
                                  reward=i / max(1, group - 1), group_id=0))
        append_record(path, step, samples)


def run_trainer(policy: str, args, rollouts: str, out_dir: str) -> dict:
    cmd = [sys.executable, "-m", "trainer_bridge.train",
           f"model.model_path={args.model}", f"model.activation_checkpointing={policy}",
           f"model.memory_fraction={args.memory_fraction}", "model.r3=false",
           "rollout.source=offline", f"rollout.offline_path={rollouts}",
           f"loss.token_budget={args.length}", "loss.kl_coef=0", "loss.mini_batches=1",
           f"steps={args.steps}", "checkpoint_every=0", f"out_dir={out_dir}", "plots=false",
           "tensorboard=false", *args.overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          timeout=args.timeout)
    log = proc.stdout + proc.stderr
    plan = PLAN_LINE.search(log)
    if proc.returncode != 0:
        last = [line for line in log.splitlines() if line.strip()][-1:] or ["(no output)"]
        return {"policy": policy, "error": last[0][-160:], "plan": plan and plan.group(0)}
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()][args.warmup:]
    if not rows:
        return {"policy": policy, "error": f"no step after {args.warmup} warm-up",
                "plan": plan and plan.group(0)}
    return {"policy": policy, "plan": plan and plan.group(0),
            "step_s": statistics.median(r["step_s"] for r in rows),
            "peak": max(r["mem_peak_bytes"] for r in rows),
            "steps": len(rows)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help="preset name (random weights)")
    p.add_argument("--length", type=int, default=65536, help="tokens of each sample")
    p.add_argument("--prompt", type=int, default=1024, help="tokens outside the loss mask")
    p.add_argument("--group", type=int, default=2, help="samples a step (one micro-batch each)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the median")
    p.add_argument("--policies", default="auto,layer",
                   help=f"comma list of {', '.join(POLICIES)}")
    p.add_argument("--memory-fraction", type=float, default=MEMORY_FRACTION,
                   help="model.memory_fraction (auto's share of the device)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a trainer may take")
    p.add_argument("overrides", nargs="*", help="more section.key=value for every trainer")
    args = p.parse_args(argv)
    policies = list(dict.fromkeys(args.policies.split(",")))
    bad = [x for x in policies if x not in POLICIES]
    if bad:
        raise SystemExit(f"--policies {','.join(bad)}: one of {', '.join(POLICIES)}")
    if not 0 < args.prompt < args.length:
        raise SystemExit(f"--prompt {args.prompt}: between 0 and --length {args.length}")
    if args.group < 1 or args.steps <= args.warmup or args.warmup < 0:
        raise SystemExit("--group >= 1 and 0 <= --warmup < --steps")
    cfg = get_preset(args.model)
    if args.length > cfg.max_position_embeddings:
        raise SystemExit(f"--length {args.length} exceeds {args.model}'s context "
                         f"{cfg.max_position_embeddings}")
    with tempfile.TemporaryDirectory() as tmp:
        rollouts = os.path.join(tmp, "rollouts.jsonl")
        write_rollouts(rollouts, cfg.vocab_size, args.length, args.prompt, args.group,
                       args.steps)
        results = [run_trainer(x, args, rollouts, os.path.join(tmp, x)) for x in policies]
    tokens = args.group * args.length
    print(f"trainer_bridge.train, model {args.model}, {args.group} x {args.length} tokens a "
          f"step (one micro-batch each), median of {args.steps - args.warmup} steps after "
          f"{args.warmup} warm-up; peak = the step's max allocated (mem_peak_bytes); "
          f"memory_fraction {args.memory_fraction}")
    print(f"{'policy':<10} {'step ms':>9} {'tokens/s':>9} {'peak GiB':>9}  vs layer")
    layer = next((r for r in results if r["policy"] == "layer" and "step_s" in r), None)
    for r in results:
        if "error" in r:
            print(f"{r['policy']:<10} failed: {r['error']}")
            continue
        ratio = f"{layer['step_s'] / r['step_s']:.2f}x" if layer else "-"
        peak = f"{r['peak'] / GiB:9.2f}" if r["peak"] else f"{'n/a':>9}"  # 0: not on CUDA
        print(f"{r['policy']:<10} {1e3 * r['step_s']:9.1f} {tokens / r['step_s']:9.0f} "
              f"{peak}  {ratio}")
    for r in results:
        if r.get("plan"):
            print(f"{r['policy']}: {r['plan']}")
    return 0 if all("step_s" in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
