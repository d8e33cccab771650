"""Does a graphed step hold the compute copies' gradients pending, and what host time does the
Triton AdamW's walk over its groups take? bench/train.py run with counting wrappers around
MicroBatchGraphs._add_grads (held vs all gradients a layout kind makes; the first compute copy's
gradient not held, with its strides), adamw_triton._check (table rebuilds) and
LocalShardAdamW._kernel_groups (host ms, calls). Figures: bench/results/train_h200.txt run AA.

  python bench/pending_probe.py --preset small --steps 4 --warmup 2 --no-twin --seqs 4096 \
      --transformers none --cuda-graphs
"""
import collections
import os
import runpy
import sys
import time

import trainer_bridge.adamw_triton as aw
import trainer_bridge.local_shards as ls
import trainer_bridge.micro_batch_graphs as mbg

stats = collections.Counter()
orig_add = mbg.MicroBatchGraphs._add_grads


def add_grads(self, layout, grads):
    orig_add(self, layout, grads)
    kind = layout.key[-1]
    stats[f"{kind}: held"] = len(layout.pending)
    pairs = [(p, g) for p, g in zip(self.params, grads) if g is not None]
    stats[f"{kind}: all"] = len(pairs)
    if kind.endswith("deferred") and not stats["printed"]:
        stats["printed"] = 1
        held = {id(p) for p, _ in layout.pending}
        for p, g in pairs:
            if id(p) not in held and self.copies.copy_of(p) is not None:
                print("not held:", tuple(p.shape), g.stride(), g.is_contiguous(), flush=True)


orig_check = aw._check


def check(*a):
    stats["table rebuilds"] += 1
    return orig_check(*a)


orig_groups = ls.LocalShardAdamW._kernel_groups


def groups(self):
    t = time.perf_counter()
    out = orig_groups(self)
    stats["kernel_groups ms"] += (time.perf_counter() - t) * 1e3
    stats["kernel_groups calls"] += 1
    return out


mbg.MicroBatchGraphs._add_grads = add_grads
aw._check = check
ls.LocalShardAdamW._kernel_groups = groups
sys.argv = ["bench/train.py"] + sys.argv[1:]
try:
    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py"),
                   run_name="__main__")
finally:
    print("probe:", dict(stats), flush=True)
