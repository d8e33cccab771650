"""How the trainer's step memory grows with the sequence length, on the CPU: forward + backward of
the real model structure of a preset at a reduced width (every layer kind, ratio-1/2 index
sources, Engram, mHC, the preset's vocabulary and indexer heads), through Policy.forward and the
PPO loss, as bench/train.py steps it. Peak = the most bytes torch held at once during the step
(the profiler's CPU memory events), above what was allocated before it.

The attention core is a stand-in with the GPU kernel's memory (it keeps q, kv, the entries, the
selection, o and the [T, H] log-sum-exp for its backward and allocates the input gradients
there): the CPU's torch reference gathers [T, window + top-k, head_dim] per layer, which the
Triton kernel never does and which would hide every other term.

  python bench/long_context_memory.py --seqs 1024,2048,4096

A term that is O(T) doubles with T; O(T^2) quadruples. Rows: the step as the trainer runs it, and
with the selection and the head each in one whole-sequence chunk (their transient blocks as
before chunking; the head no longer keeps [T, vocab] for the backward either way).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import replace
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sglang_dsv41.model.dsv4 import compressor, get_preset, token_logprobs  # noqa: E402
from sglang_dsv41.model.dsv4.model import DSV4ForCausalLM, init_weights  # noqa: E402
from bench.train import Shape, bench_batch  # noqa: E402
from trainer_bridge.config import LossConfig  # noqa: E402
from trainer_bridge.parallelize import is_fp32_param  # noqa: E402
from sglang_dsv41.model.dsv4.context import DSV4Context  # noqa: E402
from trainer_bridge.policy import Policy  # noqa: E402
from trainer_bridge.trainer import forward_backward  # noqa: E402

MiB = 2 ** 20


def reduced(name: str, hidden: int):
    """The preset at width ``hidden``: every structural choice kept (layers and their ratios,
    sources, indexer heads and top-k, window, vocabulary, experts routed per token)."""
    cfg = get_preset(name)
    return replace(cfg, hidden_size=hidden, num_attention_heads=4, head_dim=128,
                   qk_rope_head_dim=64, q_lora_rank=hidden // 2, o_groups=2,
                   o_lora_rank=hidden // 2, index_head_dim=64, moe_intermediate_size=hidden // 4,
                   engram_head_dim=min(cfg.engram_head_dim, 32) if cfg.engram_layer_ids else 0)


class KernelFootprint(torch.autograd.Function):
    """Stand-in for the Triton attention kernel (CUDA only): its saved tensors and gradient
    allocations, not its values (o = q; the gradients reach q only)."""

    @staticmethod
    def forward(ctx, q, kv, sinks, comp_kv, comp_idx):
        out = q.clone()
        lse = q.new_empty(q.shape[:2], dtype=torch.float32)
        ctx.save_for_backward(q, kv, sinks, comp_kv, comp_idx, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, kv, sinks, comp_kv, comp_idx, _, _ = ctx.saved_tensors
        return (grad.clone(), torch.zeros_like(kv), torch.zeros_like(sinks),
                torch.zeros_like(comp_kv), None)


def attend_footprint(self, layer_id, q, kv, sinks, window, scale, comp_kv, comp_idx):
    comp_kv = kv.new_zeros(0, kv.shape[1]) if comp_kv is None else comp_kv.to(q.dtype)
    comp_idx = (torch.zeros(q.shape[0], 0, dtype=torch.int32) if comp_idx is None else comp_idx)
    return KernelFootprint.apply(q, kv, sinks, comp_kv, comp_idx)


def peak_bytes(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak


def step_batch(policy: Policy, seq: int):
    return bench_batch(policy.config, policy.routed_layers, Shape(1, seq))


def saved_bytes(policy: Policy, seq: int) -> int:
    """Bytes the forward keeps for the backward (saved_tensors_hooks; each storage once,
    parameters apart): what a step holds at its peak besides the static state."""
    params = {p.untyped_storage().data_ptr() for p in policy.model.parameters()}
    storages: dict[int, int] = {}

    def keep(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = policy.forward(step_batch(policy, seq), replay=False)
    del out
    return sum(storages.values())


def step_peak(policy: Policy, seq: int) -> int:
    mb = step_batch(policy, seq)

    def step():
        forward_backward(policy, mb, float(mb.loss_mask.sum()), LossConfig(), 1, replay=False)
        policy.model.zero_grad(set_to_none=True)
    return peak_bytes(step)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seqs", default="1024,2048,4096")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                   help="bf16: the compute dtype's weights as FSDP casts them on CUDA (sinks and "
                   "mHC parameters stay fp32)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    # the kernel's memory, not the CPU reference's
    with mock.patch.multiple(DSV4Context, attend=attend_footprint):
        run(args)
    return 0


def run(args) -> None:
    cfg = reduced(args.preset, args.hidden)
    torch.manual_seed(0)
    model = DSV4ForCausalLM(cfg)
    init_weights(model, seed=0)
    if args.dtype == "bf16":
        for name, p in model.named_parameters():
            if not is_fp32_param(name):
                p.data = p.data.to(torch.bfloat16)
    policy = Policy(model, args.preset, torch.device("cpu"), attention_backend="reference")
    shapes = [Shape.parse(s) for s in args.seqs.split(",")]
    if any(shape.n != 1 for shape in shapes):
        raise SystemExit(f"--seqs {args.seqs!r}: one sequence per length here (LENGTH, not "
                         "NxLENGTH)")
    seqs = [shape.length for shape in shapes]
    print(f"{args.preset} at hidden {args.hidden} (vocab {cfg.vocab_size}, "
          f"{cfg.num_hidden_layers} layers, ratios {cfg.compress_ratios}, index heads "
          f"{cfg.index_n_heads}), CPU {args.dtype}")
    print(f"kept for the backward at {seqs[0]} tokens: "
          f"{saved_bytes(policy, seqs[0]) / seqs[0] / 1024:.1f} KiB/token", flush=True)
    print("peak MiB of one forward + backward")
    variants = {"chunked (as trained)": [],
                "whole-sequence blocks": [(compressor, {"SELECTION_CHUNK_PRODUCTS": 1 << 62}),
                                          (token_logprobs, {"LOGPROB_CHUNK_ELEMENTS": 1 << 62})]}
    print(f"{'variant':<24}" + "".join(f"{s:>10}" for s in seqs) + "   growth per doubling")
    for label, patches in variants.items():
        with contextlib.ExitStack() as stack:
            for module, values in patches:
                stack.enter_context(mock.patch.multiple(module, **values))
            peaks = [step_peak(policy, s) for s in seqs]
        growth = " ".join(f"{b / a:.2f}x" for a, b in zip(peaks, peaks[1:]))
        print(f"{label:<24}" + "".join(f"{b / MiB:10.1f}" for b in peaks) + f"   {growth}",
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
