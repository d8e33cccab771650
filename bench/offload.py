"""Host memory and time of the optimizer step for --optimizer-offload none | fsdp | chunked, on
the same model in one run, beside the planner's prediction (sglang_dsv41.plan.memory).

CPU (2 gloo ranks):  python bench/offload.py --model offload-50m --ranks 2
GPU (1 rank, NCCL):  python bench/offload.py --model offload-50m --ranks 1 --chunk-mb 96

Each mode runs in fresh processes (RSS never shrinks back cleanly). Per rank: RSS baseline after
the process group is up and before the model exists; psutil RSS sampled every 1 ms by a thread
during optimizer.step() of the last step; host bytes = peak - baseline. On CPU the "device" is
host memory too, so the tensors a mode keeps on the device (shards and grads; Adam state for
none) are counted exactly from their storages and subtracted; on CUDA they are not in RSS.
Pinned bytes, requested beside reserved: reserved is the size of the VMAs (/proc/self/smaps)
holding the offload path's pinned tensors, the kernel's figure, not torch's stats (empty on torch
2.11). chunked: its one registered chunk buffer, and, as the reference, a caching-allocator
pinned tensor of the same request made in the same process. fsdp: FSDP2's pinned shards and
grads. On CPU nothing is pinned: the chunk buffer's plain mapping is shown. Summed over ranks.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
import ctypes
import gc
import os
import sys
import threading
import time

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # big tensors return to the OS on free

import psutil  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sglang_dsv41.model.dsv4.config import DSV4Config  # noqa: E402
from sglang_dsv41.model.dsv4.model import DSV4ForCausalLM, init_weights  # noqa: E402
from sglang_dsv41.model.dsv4.presets import get_preset  # noqa: E402
from sglang_dsv41.ports import free_port  # noqa: E402
from trainer_bridge.dist import run_spawned  # noqa: E402
from trainer_bridge.batch import Sample, pack  # noqa: E402
from trainer_bridge.config import ModelConfig, OptimConfig  # noqa: E402
from trainer_bridge.optimizer_offload import (MIB, OFFLOAD_MODES, host_mapping,  # noqa: E402
                                              host_mappings, offload_optimizer,
                                              set_pinned_alloc_conf)
from trainer_bridge.policy import Policy, policy_from_model  # noqa: E402
from trainer_bridge.schedule import build_optimizer  # noqa: E402


def model_config(name: str) -> DSV4Config:
    """A preset, or ``offload-50m``: the tiny-v4 preset (sliding, CSA and HCA layers, hash
    layers, mHC, hc_head) at 8 layers, widened to over 50M parameters, all trained (fp32 sinks,
    mHC, routers and head)."""
    if name != "offload-50m":
        return get_preset(name)
    return replace(get_preset("tiny-v4"), num_hidden_layers=8,
                   compress_ratios=[0, 4, 128, 4, 0, 4, 128, 4], hidden_size=512,
                   n_routed_experts=8,
                   moe_intermediate_size=512, q_lora_rank=128, o_lora_rank=128,
                   num_attention_heads=8, head_dim=64, qk_rope_head_dim=16)


def build(cfg: DSV4Config, mesh, device: torch.device, mode: str, chunk_mb: float, *,
          lm_head_fp32: bool = True, seed: int = 0, steps: int = 4):
    """The policy sharded for ``mode`` and its optimizer + LR schedule, as the trainer builds
    them; router gates stay trainable so fp32 router weights go through the optimizer."""
    model = DSV4ForCausalLM(cfg)
    init_weights(model, seed=seed)
    # FSDP in every mode, also on one GPU (one_rank's copies would change the baseline); the
    # plain fp32 head GEMMs and no unsharded accumulation, as this bench has always measured.
    policy = policy_from_model(
        model, ModelConfig(model_path="bench", freeze_router=False, lm_head_fp32=lm_head_fp32,
                           lm_head_gemm="ieee", serving_numerics=False,
                           accumulate_unsharded="never", one_rank="fsdp"),
        mesh, device, optimizer_offload=mode)
    optim_cfg = OptimConfig(lr=1e-3, sink_lr=2e-3, weight_decay=0.1, sink_frozen_frac=0.0,
                            sink_ramp_frac=0.5, optimizer_offload=mode, offload_chunk_mb=chunk_mb)
    opt, sched = build_optimizer(policy, optim_cfg, steps)
    opt, sched = offload_optimizer(opt, sched, mode, chunk_mb)
    return policy, opt, sched


def micro_batch(cfg: DSV4Config, rank: int, step: int, tokens: int):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    samples = []
    for n in (tokens // 2, tokens - tokens // 2):
        toks = torch.randint(0, 256, (n,), generator=gen).tolist()
        s = Sample(toks, [0] * 2 + [1] * (n - 2), [0.0] * n, 1.0, 0)
        s.advantage = 1.0 - 0.5 * rank + 0.1 * step
        samples.append(s)
    return pack(samples, list(range(cfg.num_hidden_layers)), False, cfg.num_experts_per_tok)


def train_step(policy: Policy, opt, sched, mb, max_grad_norm: float = 1.0,
               around_step=None) -> float:
    """Forward, backward, clip, optimizer step (inside ``around_step``), LR step; the loss."""
    opt.zero_grad(set_to_none=True)
    out = policy.forward(mb, replay=False)
    mask = mb.loss_mask.to(out.logprobs.device)
    loss = -(out.logprobs * mb.advantages.to(mask.device) * mask).sum() / mask.sum()
    loss.backward()
    params = [p for _, p in policy.trainable_parameters()]
    torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    if around_step is None:
        opt.step()
    else:
        around_step(opt.step)
    sched.step()
    return float(loss.detach())


class PeakRss:
    """Samples this process's RSS in a thread while the wrapped call runs."""

    def __init__(self, interval_s: float = 0.001):
        self.proc, self.interval_s, self.peak = psutil.Process(), interval_s, 0

    def __call__(self, fn) -> None:
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                self.peak = max(self.peak, self.proc.memory_info().rss)
                time.sleep(self.interval_s)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            fn()
        finally:
            done.set()
            thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


def _storage_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.untyped_storage().nbytes()


def device_resident_bytes(policy: Policy, opt, mode: str) -> int:
    """Bytes of the tensors this mode keeps on the compute device (not host memory)."""
    if mode == "fsdp":
        return 0
    seen, total = set(), 0
    tensors = [p for p in policy.model.parameters()] + \
        [p.grad for p in policy.model.parameters() if p.grad is not None]
    if mode == "none":
        tensors += [v for s in opt.state.values() for v in s.values() if v.dim() > 0]
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        key = local.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += local.untyped_storage().nbytes()
    return total


def measure_worker(rank: int, world: int, port: int, model: str, mode: str, chunk_mb: float,
                   steps: int, tokens: int, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from trainer_bridge.dist import close_distributed, init_distributed

    try:
        device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
        if device.type == "cuda":  # the pinned cap is set where fsdp pins (offload_policy_for)
            torch.cuda.set_device(device)
        info = init_distributed(device)
        cfg = model_config(model)
        baseline = psutil.Process().memory_info().rss
        policy, opt, sched = build(cfg, info.mesh, device, mode, chunk_mb, steps=steps)
        n_local = sum(p.to_local().numel() for _, p in policy.trainable_parameters())
        for step in range(steps - 1):
            train_step(policy, opt, sched, micro_batch(cfg, rank, step, tokens))
        _trim_heap()
        peak, step_s = PeakRss(), [0.0]
        train_step(policy, opt, sched, micro_batch(cfg, rank, steps - 1, tokens),
                   around_step=lambda fn: _timed(fn, peak, step_s))
        host = peak.peak - baseline - (device_resident_bytes(policy, opt, mode)
                                       if device.type == "cpu" else 0)
        pinned = pinned_bytes(policy, opt, mode)
        queue.put((rank, dict(n_local=n_local, host=host, step_s=step_s[0], pinned=pinned,
                              rss_delta=peak.peak - baseline)))
        close_distributed()
    except Exception:
        import traceback

        queue.put((rank, {"error": traceback.format_exc()}))


def _trim_heap() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them after the model build and the
    activations are freed), so RSS shows what is live."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: RSS keeps freed heap pages, figures read high
        pass


def _timed(fn, peak: PeakRss, box) -> None:
    def run() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        box[0] = time.perf_counter() - t

    peak(run)


def _mappings_bytes(ptrs: list[int]) -> dict[str, int]:
    """Summed size / Rss of the distinct VMAs holding these addresses."""
    vmas = {m["start"]: m for m in host_mappings(ptrs).values()}
    return {k: sum(m.get(k, 0) for m in vmas.values()) for k in ("size", "rss")}


def pinned_bytes(policy: Policy, opt, mode: str) -> dict[str, int]:
    """requested / reserved (VMA size) / rss bytes of this mode's pinned host tensors; for
    chunked also ref_*: a caching-allocator pinned tensor of the same request, and torch's own
    reserved figure where its stats have one (-1: empty)."""
    out = dict(requested=0, reserved=0, rss=0, ref_reserved=0, ref_torch=0)
    if mode == "chunked" and opt.chunk_buffer is not None:
        buf = opt.chunk_buffer
        vma = host_mapping(buf.tensor.data_ptr())
        out.update(requested=buf.requested_bytes, reserved=vma["size"], rss=vma["rss"])
        if torch.cuda.is_available():
            ref = torch.empty(buf.requested_bytes, dtype=torch.uint8, pin_memory=True)
            ref.fill_(0)  # touch it, as the chunk buffer is touched
            out["ref_reserved"] = host_mapping(ref.data_ptr())["size"]
            stats = torch.cuda.memory.host_memory_stats()
            out["ref_torch"] = int(stats.get("reserved_bytes.current", -1))
    elif mode == "fsdp" and torch.cuda.is_available():
        tensors = [t for p in policy.model.parameters() for t in (p, p.grad) if t is not None]
        pinned = {loc.untyped_storage().data_ptr(): loc.untyped_storage().nbytes()
                  for loc in (t.to_local() if hasattr(t, "to_local") else t for t in tensors)
                  if loc.is_pinned()}
        vmas = _mappings_bytes(list(pinned))
        out.update(requested=sum(pinned.values()), reserved=vmas["size"], rss=vmas["rss"])
    return out


def run_mode(model: str, mode: str, ranks: int, chunk_mb: float, steps: int,
             tokens: int) -> dict:
    from sglang_dsv41.plan.memory import optimizer_host_bytes  # the planner's one formula

    port = free_port()
    results = dict(run_spawned(measure_worker, [(r, ranks, port, model, mode, chunk_mb, steps,
                                                 tokens) for r in range(ranks)],
                               timeout=600, join_timeout=30))
    errors = [r["error"] for r in results.values() if "error" in r]
    if errors:
        raise RuntimeError(errors[0])
    out = {k: sum(r[k] for r in results.values()) for k in ("n_local", "host", "rss_delta")}
    out["step_s"] = max(r["step_s"] for r in results.values())
    out["pinned"] = {k: sum(r["pinned"][k] for r in results.values())
                     for k in next(iter(results.values()))["pinned"]}
    out["predicted"] = optimizer_host_bytes(out["n_local"], mode, int(chunk_mb * MIB), ranks)
    return out


def print_pinned_notes(rows: dict) -> None:
    if not torch.cuda.is_available():
        print("# pin columns on CPU: nothing is pinned (no CUDA); chunked shows its plain host "
              "buffer's mapping (requested vs VMA), fsdp has no host buffer of its own")
        return
    if "chunked" in rows:
        pin = rows["chunked"]["pinned"]
        torch_fig = (f"{pin['ref_torch'] / MIB:.2f} MiB" if pin["ref_torch"] >= 0
                     else "empty (no reserved_bytes key)")
        print(f"# chunked: cudaHostRegister'd buffer, reserved == requested: "
              f"{pin['reserved'] == pin['requested']}; reference torch.empty(pin_memory=True) of "
              f"the same {pin['requested'] / MIB:.2f} MiB in the same processes: VMA "
              f"{pin['ref_reserved'] / MIB:.2f} MiB; torch host_memory_stats reserved: {torch_fig}")
    if "fsdp" in rows:
        pin = rows["fsdp"]["pinned"]
        print(f"# fsdp: FSDP2's pinned shards + grads from the caching allocator (pinned cap set: "
              f"{set_pinned_alloc_conf()}): VMA / requested = "
              f"{pin['reserved'] / max(pin['requested'], 1):.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="offload-50m", help="offload-50m or a model preset")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=list(OFFLOAD_MODES), choices=OFFLOAD_MODES)
    p.add_argument("--chunk-mb", type=float, default=24.0)
    p.add_argument("--steps", type=int, default=3, help="the last one is measured")
    p.add_argument("--tokens", type=int, default=64, help="tokens per rank and step")
    args = p.parse_args(argv)
    if args.ranks < 1 or args.steps < 2:
        p.error("--ranks must be >= 1 and --steps >= 2 (the first step creates the state)")
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (gloo)"
    print(f"# bench/offload.py model={args.model} ranks={args.ranks} chunk={args.chunk_mb} MiB "
          f"device={dev} torch={torch.__version__}")
    rows = {m: run_mode(args.model, m, args.ranks, args.chunk_mb, args.steps, args.tokens)
            for m in args.modes}
    n = next(iter(rows.values()))["n_local"]
    print(f"# N = {n} trained parameters (summed over ranks); host = peak RSS in the optimizer "
          "step - baseline (- device-resident tensors on CPU); pinned on CUDA only")
    # "none" keeps nothing of the optimizer on the host: its figure is the training process's
    # own host overhead (kernels, gloo, allocator), the planner's separate base row.
    base = rows["none"]["host"] if "none" in rows else 0
    print(f"# optimizer host = host - host(none) = {base / MIB:.1f} MiB of runtime overhead")
    print(f"{'mode':8} {'host MiB':>9} {'optim MiB':>9} {'optim/N':>7} {'planner MiB':>11} "
          f"{'pred err':>8} {'rss MiB':>8} {'step ms':>8} {'pin req MiB':>11} "
          f"{'pin VMA MiB':>11} {'pin Rss MiB':>11}")
    for mode, r in rows.items():
        net = r["host"] - base
        err = (r["predicted"] - net) / net if net > 0 else float("nan")
        pin = r["pinned"]
        print(f"{mode:8} {r['host'] / MIB:9.1f} {net / MIB:9.1f} {net / n:7.2f} "
              f"{r['predicted'] / MIB:11.1f} {err:8.1%} {r['rss_delta'] / MIB:8.1f} "
              f"{r['step_s'] * 1e3:8.1f} {pin['requested'] / MIB:11.2f} "
              f"{pin['reserved'] / MIB:11.2f} {pin['rss'] / MIB:11.2f}")
    print_pinned_notes(rows)
    if "chunked" in rows and "fsdp" in rows:
        c, f = rows["chunked"]["host"] - base, rows["fsdp"]["host"] - base
        limit = 12.5 * n + args.ranks * args.chunk_mb * MIB
        print(f"# chunked vs fsdp: optimizer host {1 - c / f:.1%} lower, raw host "
              f"{1 - rows['chunked']['host'] / rows['fsdp']['host']:.1%} lower; chunked "
              f"{c / n:.2f}N <= 12.5N + chunks ({limit / MIB:.1f} MiB): {c <= limit}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
