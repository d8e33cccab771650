"""Where a training step's small ops come from, which layout serves attention's grouped output
projection fastest, and what the model's Triton kernels of its torch paths cost and change.

  python bench/train_ops.py sources --preset tiny --seq 64 [--dtype bfloat16]
      one step of ours (bench/train.py's policy, loss and AdamW) under torch.profiler with
      stacks: the calls of each listed aten op per step, by the innermost project source line
      (the CPU gives the same op counts as the GPU for the torch paths; bf16 compute on the CPU
      shows the dtype casts the GPU makes). On CUDA also the aten ops by device time, and with
      --where aten::copy_ that op's time by input shapes (the GPU's events carry no Python
      stack: the shapes tell which code made them).
  python bench/train_ops.py grouped-proj [--tokens 4096]
      CUDA: forward + backward of the [T, G, I] x [G, R, I] -> [T, G, R] projection (the small
      preset's G 4, I 2048, R 512) for each candidate layout, median of timed repeats, every
      candidate measured --rounds times (a first round on a busy or cold GPU misleads).
  python bench/train_ops.py fused [--tokens 4096 --dim 1024]
      CUDA: mHC's write-back and weighted stream sum, torch expressions vs the Triton kernels
      (forward, forward + backward, relative differences to torch and to float64).
  python bench/train_ops.py hc-weights [--tokens 4096,65536]
      CUDA: mHC's fused weights kernels (pre, post, Sinkhorn comb) forward and forward +
      backward, device time a call (the sums that make one loss of the three outputs
      included), the gradients' relative error against mhc._hc_weights in float64, and the
      ratio to mhc._hc_weights' torch expressions timed in the same run. Run it
      with an older tree first on PYTHONPATH to time that tree's kernels with this script.
  python bench/train_ops.py hc-mix [--tokens 4096,65536 --rounds 2]
      CUDA: mHC's mix kernels (hc_mix_triton, hc 4, D 1024, bf16 streams, 24 outputs) for each
      candidate of HC_MIX_TRIALS (MixTiles): device time of the forward and of the backward
      (d streams and d fn), each launched alone, every candidate measured --rounds times, the
      two's sum as a ratio to the defaults' (the first candidate) in the same round; and the
      outputs' relative errors against float64.
  python bench/train_ops.py lm-head [--tokens 4096 --dim 1024 --vocab 32000]
      CUDA: the fp32 head's log-probabilities (token_logprobs) forward + backward with each
      fp32_gemm (ieee: plain fp32 GEMMs; tf32x3), device time, and the relative error of logp,
      d hidden and d head against float64 on the same inputs; also one plain TF32 pass (what
      torch's "high" fp32 precision gives), for the error it would cost.
  python bench/train_ops.py swiglu [--rows 24576 --inter 512]
      CUDA: the routed experts' clamped SwiGLU on [rows, 2I] bf16 (4k tokens x top-6 of the
      small preset by default): the torch expression vs the fused Triton kernels
      (swiglu_triton.py), device time forward and forward + backward, and the relative error
      of the output and d gate_up against float64.
  python bench/train_ops.py norm [--tokens 4096 --repeats 200]
      CUDA: the model's RMSNorm (torch's fused kernels) vs the plain fp32 expression under
      autograd, bf16 input with an fp32 and a bf16 weight: host time per forward + backward
      (a wall time equal to it means the host, not the GPU, bounds the loop), how many outputs
      differ and the gradients' relative differences.
  python bench/train_ops.py adamw [--preset small --tiles 4096x8,1024x4]
      CUDA: one AdamW step over the preset's parameter shapes with the clipping's grad_scale and
      the bf16 compute copies written: torch's fused AdamW + one _foreach_copy_ vs the Triton
      kernel that writes the copies (adamw_triton.py); device time, GB/s, the parameters'
      largest relative difference after 3 steps; each --tiles entry of the kernel timed, the
      best named last.
  python bench/train_ops.py parity [--preset small --seq 1024 --device cuda]
      one step's gradients: bf16 with those Triton kernels, bf16 with the torch expressions,
      fp32 (the reference); relative differences of each pair.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections import Counter
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.train import Ours, Shape, parse_tiles  # noqa: E402
from sglang_dsv41.model.dsv4 import get_preset  # noqa: E402
from trainer_bridge.dist import close_distributed, init_distributed  # noqa: E402
from trainer_bridge.policy import resolve_device  # noqa: E402

PROJECT_DIRS = ("sglang_dsv41/", "trainer_bridge/")
OPS = ("aten::copy_", "aten::_to_copy", "aten::mul", "aten::clone", "aten::contiguous",
       "aten::cat", "aten::add", "aten::sum")


def ours_step(preset: str, seq: int, dtype: torch.dtype, device: torch.device,
              optimizer: bool = True):
    """One step of bench/train.py's Ours on one sequence of ``seq`` tokens with ``dtype``
    compute: forward, PPO loss, backward and, with ``optimizer``, AdamW; the step returns the
    loss and the policy."""
    runner = Ours(get_preset(preset), init_distributed(device), device, None, "none",
                  compute_dtype=str(dtype).removeprefix("torch."))
    step = runner.stepper(Shape(1, seq), 1, optimizer=optimizer)
    return lambda: (step(), runner.policy)


def parity(args) -> None:
    """One step's loss and gradients (no optimizer) in bf16 with the Triton kernels of the
    model's torch paths (mHC mix, write-back and weighted sum; CUDA only), in bf16
    with their torch expressions, and in fp32 (the accuracy reference), same weights and batch.
    On the CPU both bf16 runs take the torch expressions: the bf16-vs-fp32 floor only."""
    from sglang_dsv41.model.dsv4 import hc_mix_triton, mhc, mhc_streams_triton

    device = torch.device(args.device)

    def loss_and_gradients(step) -> tuple[float, dict[str, torch.Tensor]]:
        loss, policy = step()
        grads = {n: p.grad.full_tensor().float().clone() if hasattr(p.grad, "full_tensor")
                 else p.grad.float().clone() for n, p in policy.model.named_parameters()
                 if p.grad is not None}
        policy.model.zero_grad(set_to_none=True)
        return loss.item(), grads

    runs = {}
    step = ours_step(args.preset, args.seq, torch.bfloat16, device, optimizer=False)
    runs["triton bf16"] = loss_and_gradients(step)
    # mhc's dispatch asks supports() at each call: "no" sends it down the torch expressions
    # and mhc.hc_mix imports hc_mix_fused at each call: the torch Function instead
    with mock.patch.object(mhc_streams_triton, "supports", lambda hc: False), \
            mock.patch.object(hc_mix_triton, "hc_mix_fused", mhc._HcMix.apply):
        runs["torch bf16"] = loss_and_gradients(step)
    # The accuracy reference: the same weights and batch computed in fp32 (torch expressions).
    runs["fp32"] = loss_and_gradients(ours_step(args.preset, args.seq, torch.float32, device,
                                                optimizer=False))
    print(f"parity {args.preset} @ {args.seq} on {device.type}: loss "
          + ", ".join(f"{k} {v[0]:.7f}" for k, v in runs.items()), flush=True)
    for a, b in (("triton bf16", "torch bf16"), ("triton bf16", "fp32"), ("torch bf16", "fp32")):
        ga, gb = runs[a][1], runs[b][1]
        rel = {n: ((ga[n] - gb[n]).norm() / gb[n].norm().clamp_min(1e-30)).item() for n in gb}
        total = (sum((ga[n] - gb[n]).square().sum() for n in gb).sqrt()
                 / sum(gb[n].square().sum() for n in gb).sqrt()).item()
        worst = sorted(rel.items(), key=lambda kv: -kv[1])[:4]
        print(f"  gradients {a} vs {b}: all {total:.2e}; median parameter "
              f"{sorted(rel.values())[len(rel) // 2]:.1e}; worst "
              + ", ".join(f"{n} {v:.1e}" for n, v in worst), flush=True)
    close_distributed()


def op_source(event) -> str:
    """Where an op was called: the innermost enclosing Python frame of this repository's code
    (the profiler records frames as parent events "path(line): function"), else the autograd
    node or optimizer range that ran it (the backward has no Python frames)."""
    node = None
    while event is not None:
        name = event.name
        for top in PROJECT_DIRS:  # frame names are relative or absolute paths
            if top in name:
                return name[name.index(top):]
        if node is None and name.startswith(("autograd::engine::evaluate_function",
                                             "Optimizer.", "FSDP::")):
            node = name
        event = event.cpu_parent
    return node or "<other>"


def sources(args) -> None:
    device = resolve_device(args.device)
    if args.where and device.type != "cuda":
        print(f"train_ops.py sources --where {args.where}: device times need CUDA (the device "
              f"is {device.type})", file=sys.stderr)
        raise SystemExit(2)
    step = ours_step(args.preset, args.seq, getattr(torch, args.dtype), device)
    step()
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts, with_stack=True,
                                record_shapes=bool(args.where)) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    calls: dict[str, Counter] = {op: Counter() for op in OPS}
    device_us: Counter = Counter()
    device_calls: Counter = Counter()
    where_us: Counter = Counter()
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        place = op_source(e)
        if e.name in calls:
            calls[e.name][place] += 1
        if e.self_device_time_total > 0:
            device_us[(e.name, place)] += e.self_device_time_total
            device_calls[(e.name, place)] += 1
            if e.name == args.where:
                where_us[(str(e.input_shapes), place)] += e.self_device_time_total
    if args.where:
        print(f"--- {args.where} by input shapes, one step ---")
        for (shapes, place), us in where_us.most_common(args.top):
            print(f"{us / 1e3:8.3f} ms  {shapes[:70]:70s} {place}")
        if not where_us:
            print(f"(no {args.where} with device time in this step)")
    for op, places in calls.items():
        print(f"--- {op}: {sum(places.values())} calls a step ---")
        for place, n in places.most_common(args.top):
            print(f"{n:6d}  {place}")
    if device_us:
        total = sum(device_us.values()) / 1e3
        print(f"--- aten ops by self device time, one step ({total:.1f} ms in aten ops) ---")
        for (op, place), us in device_us.most_common(3 * args.top):
            print(f"{us / 1e3:8.2f} ms {device_calls[(op, place)]:5d} calls  {op:22s} {place}")
    close_distributed()


def median_us(fn, grad, leaves, backward: bool, repeats: int) -> float:
    """Median device time of fn() (and its backward with ``grad``) over ``repeats`` calls."""
    start = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for k in range(repeats):
        for leaf in leaves:
            leaf.grad = None
        start[k].record()
        out = fn()
        if backward:
            out.backward(grad)
        end[k].record()
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in zip(start, end))
    return ms[len(ms) // 2] * 1e3


def fused_kernels(args) -> None:
    """mhc.hc_expand, mhc.weighted_stream_sum: the torch expressions (forward and autograd or
    hand-written backward) vs the Triton kernels, bf16 activations; and each side's relative
    error against the torch expression in float64 on the same (bf16-valued) inputs."""
    from sglang_dsv41.model.dsv4 import mhc
    from sglang_dsv41.model.dsv4.mhc_streams_triton import (hc_expand_fused,
                                                           weighted_stream_sum_fused)

    dev, t, hc, d = torch.device("cuda"), args.tokens, 4, args.dim
    streams = torch.randn(t, hc, d, device=dev, dtype=torch.bfloat16)
    y = torch.randn(t, d, device=dev, dtype=torch.bfloat16)
    post = torch.rand(t, hc, device=dev) * 2
    comb = torch.rand(t, hc, hc, device=dev)
    pre = torch.rand(t, hc, device=dev)

    grad_expand, grad_sum = torch.randn_like(streams), torch.randn_like(y)
    cases = {"hc_expand torch": (mhc.hc_expand_torch, (streams, y, post, comb), grad_expand),
             "hc_expand triton": (hc_expand_fused, (streams, y, post, comb), grad_expand),
             "weighted_stream_sum torch": (mhc.weighted_stream_sum_torch, (streams, pre),
                                           grad_sum),
             "weighted_stream_sum triton": (weighted_stream_sum_fused, (streams, pre),
                                            grad_sum)}

    def outputs(fn, inputs, grad, dtype=None):
        """-> (leaves, [out, input grads...] in float64)."""
        leaves = [(x if dtype is None else x.to(dtype)).clone().requires_grad_(True)
                  for x in inputs]
        out = fn(*leaves)
        out.backward(grad if dtype is None else grad.to(dtype))
        return leaves, [out.double().detach()] + [x.grad.double() for x in leaves]

    def rel(got, ref):
        return ", ".join(f"{((a - b).norm() / b.norm()).item():.1e}" for a, b in zip(got, ref))

    outs, times = {}, {}  # times: fwd+bwd us; the torch rows come first, the baselines
    for name, (fn, inputs, grad) in cases.items():
        leaves, outs[name] = outputs(fn, inputs, grad)
        exact = outputs(cases[name.replace("triton", "torch")][0], inputs, grad, torch.float64)[1]
        fwd = median_us(lambda: fn(*leaves), grad, leaves, False, args.repeats)
        both = median_us(lambda: fn(*leaves), grad, leaves, True, args.repeats)
        base = name.replace("triton", "torch")
        times[name] = both
        print(f"{name:28s} fwd {fwd:7.1f} us  fwd+bwd {both:7.1f} us "
              f"({times[base] / both:.2f}x the torch expression's)  rel. diff (out, grads) vs "
              f"torch: {rel(outs[name], outs[name.replace('triton', 'torch')])}; vs float64: "
              f"{rel(outs[name], exact)}", flush=True)


def hc_weights_kernels(args) -> None:
    from sglang_dsv41.model.dsv4 import hc_weights_triton, mhc

    dev, hc, iters, eps = torch.device("cuda"), 4, 20, 1e-6
    print(f"hc_weights from {hc_weights_triton.__file__}", flush=True)
    for tokens in (int(t) for t in args.tokens.split(",")):
        gen = torch.Generator().manual_seed(tokens)
        n = (2 + hc) * hc
        inputs = [torch.randn(tokens, n, generator=gen) * 2, torch.randn(n, generator=gen) * 0.5,
                  torch.rand(3, generator=gen) + 0.5]
        grads = [torch.randn(tokens, hc, generator=gen), torch.randn(tokens, hc, generator=gen),
                 torch.randn(tokens, hc, hc, generator=gen)]

        def loss(fn, leaves, gs):
            return sum((o * g).sum() for o, g in zip(fn(*leaves, hc, iters, eps), gs))

        leaves = [x.to(dev).requires_grad_(True) for x in inputs]
        gs = [g.to(dev) for g in grads]
        run = lambda: loss(hc_weights_triton.hc_weights_fused, leaves, gs)  # noqa: E731
        one = torch.ones((), device=dev)
        fwd = median_us(run, one, leaves, False, args.repeats)
        both = median_us(run, one, leaves, True, args.repeats)
        for leaf in leaves:
            leaf.grad = None
        run().backward()
        exact = [x.double().requires_grad_(True) for x in inputs]
        loss(mhc._hc_weights, exact, [g.double() for g in grads]).backward()
        err = ", ".join(f"{((a.grad.cpu().double() - b.grad).norm() / b.grad.norm()).item():.1e}"
                        for a, b in zip(leaves, exact))
        print(f"hc_weights T {tokens:6d}: fwd {fwd:8.1f} us  fwd+bwd {both:8.1f} us  rel. error "
              f"of d mix, d base, d scale vs float64: {err}", flush=True)
        # the baseline of the same run: mhc's torch expressions (Sinkhorn through autograd)
        plain = lambda: loss(mhc._hc_weights, leaves, gs)  # noqa: E731
        torch_both = median_us(plain, one, leaves, True, args.repeats)
        print(f"  torch _hc_weights fwd+bwd {torch_both:8.1f} us: the kernels take "
              f"{both / torch_both:.2f}x its time", flush=True)


class MmPerGroup(torch.autograd.Function):
    """One plain mm per group on the strided row views o[:, g] ([T, I], row stride G*I), the
    outputs stacked; the backward writes each group's gradient in place (out= views)."""

    @staticmethod
    def forward(ctx, o, w):
        ctx.save_for_backward(o, w)
        return torch.stack([torch.mm(o[:, g], w[g].t()) for g in range(o.shape[1])], dim=1)

    @staticmethod
    def backward(ctx, grad):
        o, w = ctx.saved_tensors
        grad_o, grad_w = torch.empty_like(o), torch.empty_like(w)
        for g in range(o.shape[1]):
            torch.mm(grad[:, g], w[g], out=grad_o[:, g])
            torch.mm(grad[:, g].t(), o[:, g], out=grad_w[g])
        return grad_o, grad_w


class BmmGroupMajor(torch.autograd.Function):
    """o copied group-major, bmm on contiguous operands both ways."""

    @staticmethod
    def forward(ctx, o, w):
        og = o.transpose(0, 1).contiguous()
        ctx.save_for_backward(og, w)
        return torch.bmm(og, w.transpose(1, 2)).transpose(0, 1).contiguous()

    @staticmethod
    def backward(ctx, grad):
        og, w = ctx.saved_tensors
        by_group = grad.transpose(0, 1).contiguous()
        grad_o = torch.bmm(by_group, w).transpose(0, 1).contiguous()
        return grad_o, torch.bmm(by_group.transpose(1, 2), og)


# MixTiles fields per candidate, hc-mix mode. The first, the defaults, is the baseline of every
# round's ratios. Older trees' kernels (d streams and d fn as kernels of their own: 8517352 and
# earlier) are timed by their own copy of this script.
HC_MIX_TRIALS = [{}, {"bwd_cols": 64}, {"bwd_cols": 256, "bwd_warps": 8}, {"bwd_rows": 32},
                 {"bwd_tokens": 512}, {"bwd_tokens": 128}, {"bwd_warps": 4},
                 {"bwd_cols": 64, "bwd_tokens": 128}, {"tokens": 16, "k": 128}]


def hc_mix_kernels(args) -> None:
    """Each kernel launched on its own (the launchers hc_mix_fused's autograd Function calls),
    timed by triton.testing.do_bench: through autograd the host's launch time is as long as
    these kernels and the event times would measure it."""
    from dataclasses import replace

    from triton.testing import do_bench

    from sglang_dsv41.model.dsv4 import hc_mix_triton as hm

    dev, hc, d, n, eps = torch.device("cuda"), 4, 1024, 24, 1e-6
    for tokens in (int(t) for t in args.tokens.split(",")):
        gen = torch.Generator().manual_seed(tokens)
        x = (torch.randn(tokens, hc * d, generator=gen) * 3).to(dev, torch.bfloat16)
        fn = (torch.randn(n, hc * d, generator=gen) * 0.1).to(dev)
        grad = torch.randn(tokens, n, generator=gen).to(dev)
        x64 = x.double().requires_grad_(True)
        fn64 = fn.double().requires_grad_(True)
        mix64 = F.linear(x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps), fn64)
        mix64.backward(grad.double())
        print(f"== hc_mix T {tokens}: us (forward | backward: d streams and d fn), do_bench "
              "medians; rel. error vs float64 (mix, d streams in bf16, d fn)", flush=True)
        for r in range(args.rounds):
            baseline = None  # the round's first candidate: the sum of its kernels
            for trial in HC_MIX_TRIALS:
                tiles = replace(hm.MixTiles(), **trial)
                mix, rstd = hm.mix_forward(x, fn, eps, tiles)
                dx, dfn = hm.mix_backward(x, fn, rstd, mix, grad, tiles)
                us = [1e3 * do_bench(f, warmup=10, rep=50) for f in (
                    lambda: hm.mix_forward(x, fn, eps, tiles),
                    lambda: hm.mix_backward(x, fn, rstd, mix, grad, tiles))]
                err = ", ".join(f"{((a.double() - b).norm() / b.norm()).item():.1e}" for a, b in
                                ((mix, mix64), (dx, x64.grad), (dfn, fn64.grad)))
                baseline = baseline or sum(us)
                print(f"round {r} {str(trial or 'defaults'):50s} {us[0]:7.1f} | {us[1]:7.1f}  "
                      f"{sum(us) / baseline:5.2f}x the defaults' time  {err}", flush=True)


def lm_head(args) -> None:
    from sglang_dsv41.model.dsv4 import token_logprobs as tl

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.dim, generator=gen).to(dev)
    weight = (torch.randn(args.vocab, args.dim, generator=gen) * 0.05).to(dev)
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=gen).to(dev)
    upstream = torch.randn(args.tokens, generator=gen).to(dev)

    def grads(fn, h, w):
        h, w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = fn(h, w)
        out.backward(upstream.to(out.dtype))
        return [out.detach().double(), h.grad.double(), w.grad.double()]

    def plain(h, w):
        return F.linear(h, w).log_softmax(-1).gather(1, targets[:, None]).squeeze(1)

    exact = grads(plain, hidden.double(), weight.double())
    print(f"== lm-head T {args.tokens} x D {args.dim} x vocab {args.vocab}: fwd+bwd device "
          f"us (median of {args.repeats}); rel. error vs float64 (logp, d hidden, d head)",
          flush=True)
    base = None
    runs = [(mode, lambda h, w, m=mode: tl.token_logprobs(h, w, targets, m))
            for mode in tl.FP32_GEMMS]

    def rel(got, ref):
        return ((got.double() - ref).abs().max() / ref.abs().max()).item()

    for name, fn in runs + [("one TF32 pass (plain expression)", plain)]:
        one_pass = not name.startswith(tl.FP32_GEMMS)
        with tl.fp32_matmul("tf32") if one_pass else contextlib.nullcontext():
            got = grads(fn, hidden, weight)
            h = hidden.clone().requires_grad_(True)
            w = weight.clone().requires_grad_(True)
            us = median_us(lambda: fn(h, w), upstream, [h, w], True, args.repeats)
        base = base or us
        err = ", ".join(f"{rel(g, e):.1e}" for g, e in zip(got, exact))
        print(f"{name:34s} {us:9.1f} us ({base / us:.2f}x ieee)  {err}", flush=True)
    # Where tf32x3's error comes from, on d hidden = G @ W (K = vocab) with the exact G.
    g64 = exact_logits_grad(hidden.double(), weight.double(), targets, upstream.double())
    g32, want = g64.float(), g64 @ weight.double()
    hi = [tl.split_operand(m, "tf32x3")[0] for m in (g32, weight)]
    with tl.fp32_matmul("tf32"):
        one_tf32 = hi[0] @ hi[1]
    k = args.vocab // 8
    rows = {
        "ieee": rel(g32 @ weight, want),
        "tf32x3": rel(tl.head_mm(tl.split_operand(g32, "tf32x3"),
                                 tl.split_operand(weight, "tf32x3")), want),
        "tf32x3, K in 8 chunks summed in fp32": rel(sum(
            tl.head_mm(tl.split_operand(g32[:, a:a + k], "tf32x3"),
                       tl.split_operand(weight[a:a + k], "tf32x3"))
            for a in range(0, args.vocab, k)), want),
        "TF32-exact operands, one TF32 GEMM": rel(one_tf32,
                                                   hi[0].double() @ hi[1].double()),
        "the same, ieee": rel(hi[0] @ hi[1], hi[0].double() @ hi[1].double()),
    }
    print(f"d hidden = G @ W alone (K = {args.vocab}), rel. error vs float64: " + "; ".join(
        f"{name} {e:.1e}" for name, e in rows.items()), flush=True)


def exact_logits_grad(hidden, weight, targets, upstream):
    """d (sum upstream * logp) / d logits in the inputs' dtype: upstream (onehot - softmax)."""
    g = -(hidden @ weight.t()).softmax(-1) * upstream[:, None]
    g[torch.arange(len(targets), device=g.device), targets] += upstream
    return g


def grouped_proj(args) -> None:
    """Forward and forward + backward of each layout of [T, G, I] x [G, R, I] -> [T, G*R]."""
    from sglang_dsv41.model.dsv4.attention import GroupedProjection

    dev = torch.device("cuda")
    t, g, i, r = args.tokens, 4, 2048, 512
    o0 = torch.randn(t, g * i, device=dev, dtype=torch.bfloat16)
    w0 = torch.randn(g, r, i, device=dev, dtype=torch.bfloat16) / i ** 0.5
    grad = torch.randn(t, g * r, device=dev, dtype=torch.bfloat16)

    def grouped_mm_3d(o, w):  # torch's grouped GEMM, batched form, autograd's backward
        return torch._grouped_mm(o.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)

    cands = {"GroupedProjection (bmm, main)": GroupedProjection.apply,
             "mm per group": MmPerGroup.apply,
             "bmm group-major copies": BmmGroupMajor.apply,
             "_grouped_mm 3d": grouped_mm_3d}
    ref, main_us = None, None
    for name, fn in [item for _ in range(args.rounds) for item in cands.items()]:
        o = o0.clone().requires_grad_(True)
        w = w0.clone().requires_grad_(True)
        try:
            out = fn(o.view(t, g, i), w).reshape(t, g * r)
            out.backward(grad)
        except RuntimeError as e:
            print(f"{name:34s} failed: {str(e).splitlines()[0]}")
            continue
        got = (out.float().clone(), o.grad.float().clone(), w.grad.float().clone())
        ref = got if ref is None else ref
        errs = [((a - b).norm() / b.norm()).item() for a, b in zip(got, ref)]
        times = {phase: median_us(lambda: fn(o.view(t, g, i), w).reshape(t, g * r), grad,
                                  (o, w), phase == "fwd+bwd", args.repeats)
                 for phase in ("fwd", "fwd+bwd")}
        if fn is GroupedProjection.apply:  # the baseline, measured again each round
            main_us = times["fwd+bwd"]
        print(f"{name:34s} fwd {times['fwd']:7.1f} us  fwd+bwd "
              f"{times['fwd+bwd']:7.1f} us ({main_us / times['fwd+bwd']:.2f}x main's)  "
              f"rel. diff vs main: out {errs[0]:.1e} "
              f"d o {errs[1]:.1e} d w {errs[2]:.1e}", flush=True)


def rms_norm(args) -> None:
    import time

    from sglang_dsv41.model.dsv4.norm import RMSNorm

    def plain(x, w, eps):
        h = x.float()
        return (w.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)

    print("rows  dim  weight    path    host us  wall us  host vs plain   (per forward + "
          "backward, clone of x included)")
    for dim in (1024, 512):
        for wdtype in (torch.float32, torch.bfloat16):
            gen = torch.Generator(device="cuda").manual_seed(0)
            x0 = torch.randn(args.tokens, dim, device="cuda", generator=gen,
                             dtype=torch.bfloat16) * 3
            grad = torch.randn(args.tokens, dim, device="cuda", generator=gen,
                               dtype=torch.bfloat16)
            norm = RMSNorm(dim, 1e-6).to("cuda", wdtype)
            with torch.no_grad():
                norm.weight.copy_(1 + 0.1 * torch.randn(dim, device="cuda", generator=gen))
            outs, host_us = {}, {}
            for name, fn in (("plain", lambda x: plain(x, norm.weight, 1e-6)), ("ours", norm)):
                def once():
                    x = x0.clone().requires_grad_(True)
                    y = fn(x)
                    y.backward(grad)
                    return x, y
                for _ in range(3):
                    once()
                norm.weight.grad = None
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(args.repeats):
                    once()
                    norm.weight.grad = None
                host = (time.perf_counter() - t0) / args.repeats
                torch.cuda.synchronize()
                wall = (time.perf_counter() - t0) / args.repeats
                x, y = once()
                outs[name] = (y.detach().float(), x.grad.float(), norm.weight.grad.float())
                norm.weight.grad = None
                host_us[name] = host * 1e6
                print(f"{args.tokens:5d} {dim:4d}  {str(wdtype)[6:]:8s}  {name:6s} "
                      f"{host * 1e6:8.1f} {wall * 1e6:8.1f} "
                      f"{host_us[name] / host_us['plain']:13.2f}x")
            (y0, dx0, dw0), (y1, dx1, dw1) = outs["plain"], outs["ours"]
            rel = lambda a, b: ((a - b).norm() / a.norm()).item()  # noqa: E731
            print(f"    outputs differing from plain: {(y0 != y1).float().mean().item():.2e} "
                  f"(max |diff| {(y0 - y1).abs().max().item():.3g}); rel. error dx "
                  f"{rel(dx0, dx1):.1e}, d weight {rel(dw0, dw1):.1e}")


def swiglu_kernels(args) -> None:
    """The routed experts' clamped SwiGLU on the grouped GEMM's [rows, 2I] bf16 output: the torch
    expression (two views, clamps, silu, product; autograd's backward and its cat) vs the fused
    Triton kernels (swiglu_triton.py); time forward and forward+backward, and each side's
    relative error against the expression in float64 on the same inputs."""
    from sglang_dsv41.model.dsv4 import moe
    from sglang_dsv41.model.dsv4.swiglu_triton import swiglu_packed_triton

    dev, limit = torch.device("cuda"), 10.0
    gu = (torch.randn(args.rows, 2 * args.inter, device=dev) * 4).to(torch.bfloat16)
    grad = torch.randn(args.rows, args.inter, device=dev, dtype=torch.bfloat16)
    cases = {"torch": lambda x: moe.swiglu(*x.chunk(2, dim=-1), limit),
             "triton": lambda x: swiglu_packed_triton(x, limit)}
    exact = gu.double().requires_grad_(True)
    out64 = cases["torch"](exact)
    out64.backward(grad.double())
    times = {}
    for name, fn in cases.items():
        x = gu.clone().requires_grad_(True)
        out = fn(x)
        out.backward(grad)
        errs = [((a.double() - b).norm() / b.norm()).item()
                for a, b in ((out.detach(), out64.detach()), (x.grad, exact.grad))]
        fwd = median_us(lambda: fn(x), grad, [x], False, args.repeats)
        times[name] = median_us(lambda: fn(x), grad, [x], True, args.repeats)
        print(f"swiglu {name:6s} rows {args.rows} I {args.inter}: fwd {fwd:7.1f} us  fwd+bwd "
              f"{times[name]:7.1f} us ({times['torch'] / times[name]:.2f}x the torch "
              f"expression's)  rel. error vs float64 (out, d gate_up): {errs[0]:.1e}, "
              f"{errs[1]:.1e}", flush=True)


def adamw_kernels(args) -> None:
    """One AdamW step over the parameter shapes of a preset (the model built on the meta device,
    its parameters made fp32 on CUDA, the clipping's grad_scale folded in) and the bf16 compute
    copies written: torch's fused AdamW then one _foreach_copy_ (ComputeCopies.refresh) vs the
    Triton kernel that writes the copies itself (adamw_triton.py); device time a step, the
    bytes each moves, and the largest relative difference of the parameters after 3 steps."""
    from torch.optim.adam import adam

    from sglang_dsv41.model.dsv4.model import DSV4ForCausalLM
    from trainer_bridge.adamw_triton import DEFAULT_TILES, AdamWTables, adamw_triton_

    tiles = [parse_tiles(t, "--tiles") for t in args.tiles.split(",")] if args.tiles \
        else [DEFAULT_TILES]
    dev = torch.device("cuda")
    with torch.device("meta"):
        shapes = [p.shape for p in DSV4ForCausalLM(get_preset(args.preset)).parameters()]
    numel = sum(s.numel() for s in shapes)
    hyper = dict(lr=1e-5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    gen = torch.Generator(dev).manual_seed(0)
    start_params = [torch.randn(s, device=dev, generator=gen) * 0.02 for s in shapes]
    # A grad_scale of 1 keeps the shared gradients as they are (torch's kernel writes them back).
    grads = [torch.randn(s, device=dev, generator=gen) * 1e-3 for s in shapes]
    scale = torch.ones((), device=dev)
    tables = AdamWTables()

    def state():
        params = [p.clone() for p in start_params]
        return (params, [torch.zeros_like(p) for p in params],
                [torch.zeros_like(p) for p in params],
                [torch.zeros((), device=dev) for _ in params],
                [torch.empty_like(p, dtype=torch.bfloat16) for p in params])

    sides = {"torch fused + copy": state(), "triton": state()}

    def torch_step(params, m, v, steps, copies):
        adam(params, grads, m, v, [], steps, foreach=False, capturable=False,
             differentiable=False, fused=True, grad_scale=scale, found_inf=None,
             has_complex=False, amsgrad=False, maximize=False, decoupled_weight_decay=True,
             **hyper)
        torch._foreach_copy_(copies, params)

    def triton_step(params, m, v, steps, copies, tile=tiles[0]):
        adamw_triton_(params, grads, m, v, steps, copies, grad_scale=scale, tables=tables,
                      tiles=tile, **hyper)

    fns = {"torch fused + copy": torch_step, "triton": triton_step}
    for name, fn in fns.items():
        for _ in range(3):
            fn(*sides[name])
    diff = max(float(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)))
               for a, b in zip(sides["triton"][0], sides["torch fused + copy"][0]))
    bytes_per = {"torch fused + copy": 4 * 8 + 4 + 2, "triton": 4 * 7 + 2}
    base, best = None, None
    for name, tile in [("torch fused + copy", None)] + [("triton", t) for t in tiles]:
        kwargs = {} if tile is None else {"tile": tile}
        fns[name](*sides[name], **kwargs)  # compiles a new tile
        ms = median_us(lambda: fns[name](*sides[name], **kwargs), None, [], False,
                       args.repeats) / 1e3
        base = base or ms
        if tile is not None and (best is None or ms < best[0]):
            best = (ms, tile)
        gbs = bytes_per[name] * numel / ms / 1e6
        label = name if tile is None else f"{name} {tile[0]}x{tile[1]}"
        print(f"adamw {label:18s} {args.preset}: {len(shapes)} tensors, {numel / 1e9:.2f}B "
              f"parameters: {ms:7.2f} ms a step, {gbs:6.0f} GB/s of {bytes_per[name]} B a "
              f"parameter ({base / ms:.2f}x torch's)", flush=True)
    print(f"adamw best tiles: {best[1][0]}x{best[1][1]}", flush=True)
    print(f"adamw: largest relative difference of the parameters after 3 steps: {diff:.1e}; "
          f"the kernel's offset multiples (fp32, copies; 1: unaligned, scalar accesses) "
          f"{tables.multiples}")


def gradient_path(args) -> None:
    """The gradient path after a one-micro-batch step's backward, over the parameter shapes of a
    preset: written (the copies' bf16 gradients copied into fp32 ones, torch's norm of those,
    the Triton AdamW reading them) vs pending (compute_copies.py: the Triton norm and AdamW
    reading the bf16 gradients where they are); device time of each part and in all."""
    from torch.nn.utils import get_total_norm

    from sglang_dsv41.model.dsv4.model import DSV4ForCausalLM
    from trainer_bridge.adamw_triton import AdamWTables, adamw_triton_, grad_square_sum

    dev = torch.device("cuda")
    with torch.device("meta"):
        shapes = [p.shape for p in DSV4ForCausalLM(get_preset(args.preset)).parameters()]
    gen = torch.Generator(dev).manual_seed(0)
    params = [torch.randn(s, device=dev, generator=gen) * 0.02 for s in shapes]
    low = [(torch.randn(s, device=dev, generator=gen) * 1e-3).bfloat16() for s in shapes]
    f32 = [torch.empty(s, device=dev) for s in shapes]
    m, v = ([torch.zeros_like(p) for p in params] for _ in range(2))
    steps = [torch.zeros((), device=dev) for _ in params]
    copies = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
    none = [None] * len(params)
    hyper = dict(lr=1e-5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    tables = {"written": AdamWTables(), "pending": AdamWTables()}
    scale = torch.ones((), device=dev)
    parts = {
        "written": {
            "copy into fp32": lambda: torch._foreach_copy_(f32, low),
            "norm (torch, fp32)": lambda: get_total_norm(f32),
            "AdamW (fp32 grads)": lambda: adamw_triton_(
                params, f32, m, v, steps, copies, grad_scale=scale,
                tables=tables["written"], **hyper)},
        "pending": {
            "norm (Triton, bf16)": lambda: grad_square_sum(
                params, none, m, v, copies, low, tables=tables["pending"]).sqrt(),
            "AdamW (bf16 pending)": lambda: adamw_triton_(
                params, none, m, v, steps, copies, grad_scale=scale, pending=low,
                tables=tables["pending"], **hyper)}}
    totals = {}
    for side, fns in parts.items():
        totals[side] = 0.0
        for name, fn in fns.items():
            fn()
            ms = median_us(fn, None, [], False, args.repeats) / 1e3
            totals[side] += ms
            print(f"gradient path {side:8s} {name:22s} {ms:7.2f} ms", flush=True)
    print(f"gradient path {args.preset} ({sum(s.numel() for s in shapes) / 1e9:.2f}B "
          f"parameters): written {totals['written']:.2f} ms, pending {totals['pending']:.2f} "
          f"ms ({totals['written'] / totals['pending']:.2f}x)", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sources")
    s.add_argument("--preset", default="tiny")
    s.add_argument("--seq", type=int, default=64)
    s.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    s.add_argument("--device", default="auto")
    s.add_argument("--top", type=int, default=15)
    s.add_argument("--where", default=None, metavar="ATEN_OP",
                   help="also this op's device time by input shapes (CUDA)")
    gp = sub.add_parser("grouped-proj")
    gp.add_argument("--tokens", type=int, default=4096)
    gp.add_argument("--repeats", type=int, default=20)
    gp.add_argument("--rounds", type=int, default=2, help="measure every candidate this often")
    ms = sub.add_parser("fused")
    ms.add_argument("--tokens", type=int, default=4096)
    ms.add_argument("--dim", type=int, default=1024)
    ms.add_argument("--repeats", type=int, default=20)
    hw = sub.add_parser("hc-weights")
    hw.add_argument("--tokens", default="4096,65536")
    hw.add_argument("--repeats", type=int, default=20)
    hm = sub.add_parser("hc-mix")
    hm.add_argument("--tokens", default="4096,65536")
    hm.add_argument("--rounds", type=int, default=2)
    lh = sub.add_parser("lm-head")
    lh.add_argument("--tokens", type=int, default=4096)
    lh.add_argument("--dim", type=int, default=1024)
    lh.add_argument("--vocab", type=int, default=32000)
    lh.add_argument("--repeats", type=int, default=10)
    nm = sub.add_parser("norm")
    nm.add_argument("--tokens", type=int, default=4096)
    nm.add_argument("--repeats", type=int, default=200)
    sw = sub.add_parser("swiglu")
    sw.add_argument("--rows", type=int, default=4096 * 6, help="expert rows (tokens x top-k)")
    sw.add_argument("--inter", type=int, default=512)
    sw.add_argument("--repeats", type=int, default=50)
    aw = sub.add_parser("adamw")
    aw.add_argument("--preset", default="small")
    aw.add_argument("--repeats", type=int, default=10)
    aw.add_argument("--tiles", default=None,
                    help="comma list of ELEMENTSxWARPS of the Triton kernel to time (default: "
                    "adamw_triton.DEFAULT_TILES)")
    gp2 = sub.add_parser("gradient-path")
    gp2.add_argument("--preset", default="small")
    gp2.add_argument("--repeats", type=int, default=10)
    pa = sub.add_parser("parity")
    pa.add_argument("--preset", default="small")
    pa.add_argument("--seq", type=int, default=1024)
    pa.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    {"sources": sources, "grouped-proj": grouped_proj, "fused": fused_kernels,
     "hc-weights": hc_weights_kernels, "hc-mix": hc_mix_kernels, "lm-head": lm_head,
     "norm": rms_norm, "swiglu": swiglu_kernels, "adamw": adamw_kernels,
     "gradient-path": gradient_path, "parity": parity}[args.cmd](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
