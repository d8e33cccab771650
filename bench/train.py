"""Training-step throughput: tokens/s and MFU of the policy (FSDP2 wrapping, mixed precision,
PPO loss, AdamW step) with our sink-attention kernel vs the eager torch reference, same run.

GPU (the real measurement): python bench/train.py --preset small --seq 4096
CPU smoke check:            python bench/train.py --preset tiny --seq 64 --steps 2

The real DSV4 model (sglang_dsv41/model/dsv4), sharded by trainer_bridge.parallelize; the
attention backend goes through DSV4Context.attention_backend.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sglang_dsv41.model.dsv4 import DSV4Config, get_preset  # noqa: E402
from sglang_dsv41.model.dsv4.model import DSV4ForCausalLM, init_weights  # noqa: E402
from trainer_bridge.batch import Sample, pack  # noqa: E402
from trainer_bridge.config import LossConfig, OptimConfig  # noqa: E402
from trainer_bridge.dist import close_distributed, init_distributed  # noqa: E402
from trainer_bridge.loss import ppo_loss  # noqa: E402
from trainer_bridge.parallelize import parallelize_policy  # noqa: E402
from trainer_bridge.policy import Policy  # noqa: E402
from trainer_bridge.schedule import build_optimizer  # noqa: E402

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def active_params(cfg: DSV4Config) -> int:
    """Matmul parameters one token passes through: everything but the embedding, the idle
    routed experts and the Engram tables (buffers, looked up, not multiplied)."""
    with torch.device("meta"):
        model = DSV4ForCausalLM(cfg)
    total = sum(p.numel() for n, p in model.named_parameters() if n != "embed.weight")
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    idle = cfg.n_routed_experts - cfg.num_experts_per_tok
    return total - cfg.num_hidden_layers * idle * per_expert


def step_flops(cfg: DSV4Config, seq: int, batch: int) -> float:
    """6 N T for the matmuls plus 3 x forward attention (4 H D per query-key pair): the window,
    plus on compressed layers the selected entries (index_topk on ratio 4, every visible entry
    on 128, the shared top-k selection on 1/2)."""
    pairs = 0
    for layer in range(cfg.num_hidden_layers):
        ratio = cfg.compress_ratio(layer)
        for i in range(seq):
            pairs += min(i + 1, cfg.window_size)
            if ratio:
                seen = (i + 1) // ratio
                pairs += seen if ratio == 128 else min(seen, cfg.index_topk)
    attn = 3 * 4 * cfg.num_attention_heads * cfg.head_dim * pairs * batch
    return 6.0 * active_params(cfg) * seq * batch + attn


def run_backend(backend: str, cfg: DSV4Config, args, mesh, device) -> dict:
    torch.manual_seed(0)
    model = DSV4ForCausalLM(cfg)
    init_weights(model, seed=0)
    for name, p in model.named_parameters():
        if name.endswith("ffn.gate.weight"):
            p.requires_grad_(False)
    model.to(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    parallelize_policy(model, mesh, compute_dtype=dtype, lm_head_fp32=True)
    policy = Policy(model, "bench", device, attention_backend=backend)
    opt, _ = build_optimizer(policy, OptimConfig(lr=1e-5, sink_frozen_frac=0, sink_ramp_frac=0), 1)
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(args.batch):
        toks = torch.randint(0, min(cfg.vocab_size, 256), (args.seq,), generator=gen).tolist()
        s = Sample(toks, [0] + [1] * (args.seq - 1), [0.0] * args.seq, 1.0, i)
        s.advantage = 1.0
        samples.append(s)
    mb = pack(samples, policy.routed_layers, use_routing=False)
    mb.old_logprobs = torch.zeros(mb.targets.shape[0])
    times = []
    prof = None
    for i in range(args.warmup + args.steps):
        if args.profile and i == args.warmup:
            prof = torch.profiler.profile(activities=_profiler_activities(device))
            prof.__enter__()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = policy.forward(mb, replay=False)
        dev = out.logprobs.device
        ppo_loss(out.logprobs, mb.old_logprobs.to(dev), mb.rollout_logprobs.to(dev),
                 mb.advantages.to(dev), mb.loss_mask.to(dev), LossConfig(),
                 global_tokens=float(mb.loss_mask.sum()), world_size=1).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    if prof is not None:
        prof.__exit__(None, None, None)
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(f"--- {backend}: top ops over {args.steps} steps ---")
        print(prof.key_averages().table(sort_by=key, row_limit=15))
    step_s = sorted(times)[len(times) // 2]
    tokens = args.seq * args.batch
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    del policy, model, opt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return {"step_s": step_s, "tokens_per_s": tokens / step_s,
            "tflops": step_flops(cfg, args.seq, args.batch) / step_s / 1e12, "peak_mem": peak}


def _profiler_activities(device: torch.device) -> list:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--backends", default="triton,reference",
                   help="comma list: our kernel (triton) and the eager torch reference")
    p.add_argument("--profile", action="store_true",
                   help="print the top ops of the timed steps (torch.profiler) per backend")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="device bf16 peak for MFU (default: known GPUs; none on CPU)")
    args = p.parse_args(argv)
    cfg = get_preset(args.preset)
    if args.seq > cfg.max_position_embeddings:
        raise SystemExit(f"--seq {args.seq} exceeds the preset's context")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak = args.peak_tflops
    if peak is None and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    info = init_distributed(device)
    rows = {}
    try:
        for backend in args.backends.split(","):
            if backend == "triton" and device.type != "cuda" and \
                    os.environ.get("TRITON_INTERPRET") != "1":
                print(f"{backend}: skipped (needs CUDA or TRITON_INTERPRET=1)")
                continue
            rows[backend] = run_backend(backend, cfg, args, info.mesh, device)
    finally:
        close_distributed()
    print(f"\n{args.preset} ({active_params(cfg) / 1e6:.1f}M active params), seq {args.seq} "
          f"x batch {args.batch}, {device.type}, median of {args.steps} steps")
    print(f"{'backend':<10} {'step ms':>9} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>7} "
          f"{'mem GiB':>8}")
    for name, r in rows.items():
        mfu = f"{100 * r['tflops'] / peak:.1f}%" if peak else "n/a"
        print(f"{name:<10} {1e3 * r['step_s']:9.1f} {r['tokens_per_s']:10.0f} "
              f"{r['tflops']:8.2f} {mfu:>7} {r['peak_mem'] / 2**30:8.2f}")
    if len(rows) == 2:
        (a, ra), (b, rb) = rows.items()
        print(f"speed-up {a} / {b}: {ra['tokens_per_s'] / rb['tokens_per_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
