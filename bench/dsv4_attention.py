"""DSV4 sparse sink attention on one GPU at V4-Flash head shapes (64 heads, D 512, window 128):
our Triton kernels vs transformers' eager DeepseekV4 attention, per layer kind, plus decode.

    python bench/dsv4_attention.py                 # the table (4k, 16k, 64k) and decode
    python bench/dsv4_attention.py --sweep [dkv..] # only: tile configs at 4k CSA and HCA
    python bench/dsv4_attention.py --decode-sweep  # only: decode tile configs
    python bench/dsv4_attention.py --lengths 4096  # fewer lengths
    python bench/dsv4_attention.py --profile       # only: kernel split of the core, module ops
    python bench/dsv4_attention.py --core-only     # table/profile without the module rows

Rows: "core" = the attention the kernel replaces (scores, sinks, softmax, values) on the same
q/kv/selection; the whole attention module (projections, compressor, indexer, RoPE) at the same
shapes, both against transformers' DeepseekV4Attention with attn_implementation eager:
"tf module" = transformers' module with our kernel registered (register_transformers_attention),
"our module" = our model's attention module (sglang_dsv41/model/dsv4/attention.py). FLOPs count only the pairs the sparse pattern
attends: forward 4*H*D per (query, key) pair, forward+backward 3.5x that. Eager is marked OOM
where it runs out of memory. Decode bandwidth = bytes of keys read / time, vs a device copy.
On a machine with an older transformers, install the 5.23 wheel into a side path first:
`pip install --no-deps --target /tmp/site .whl/*.whl; PYTHONPATH=/tmp/site:$PWD python ...`.
"""

from __future__ import annotations

import argparse
import types

import torch
from triton.testing import do_bench

from sglang_dsv41.attention import register_transformers_attention
from sglang_dsv41.attention.dsv4_triton_decode import dsv4_decode_triton
from sglang_dsv41.attention.dsv4_triton_backward import dsv4_attention_triton
from sglang_dsv41.attention.dsv4_triton_forward import DSV4Blocks, default_blocks

H, D, W, DEV, DT = 64, 512, 128, "cuda", torch.bfloat16
KINDS = {"sliding": None, "CSA": 4, "HCA": 128}
PEAK = 989.0


def selection(kind, total, topk=512):
    ratio = KINDS[kind]
    if ratio is None:
        return 0, None
    comp = total // ratio
    ready = (torch.arange(total, device=DEV) + 1) // ratio
    cols = torch.arange(comp, device=DEV)
    future = cols[None, :] >= ready[:, None]
    if kind == "HCA":
        return comp, torch.where(future, -1, cols[None, :]).int()
    scores = torch.rand(total, comp, device=DEV).masked_fill_(future, float("-inf"))
    top = scores.topk(min(topk, comp), dim=-1).indices                      # like the indexer
    return comp, torch.where(top >= ready[:, None], -1, top).int()


def pairs(total, idx):
    win = torch.clamp(torch.arange(total, device=DEV) + 1, max=W).sum().item()
    return win + (0 if idx is None else (idx >= 0).sum().item())


def measure(fn, reps=20):
    """-> (ms, peak GiB above the inputs) or (None, 'OOM')."""
    try:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        return do_bench(fn, warmup=10, rep=reps * 10), peak
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None, "OOM"


def core_inputs(kind, total):
    comp, idx = selection(kind, total)
    q = (torch.randn(total, H, D, device=DEV) * 0.5).to(DT).requires_grad_()
    kv = torch.randn(total, D, device=DEV).to(DT).requires_grad_()
    ckv = torch.randn(max(comp, 1), D, device=DEV).to(DT)[:comp].requires_grad_() if comp \
        else None
    sinks = torch.randn(H, device=DEV, requires_grad=True)
    return q, kv, ckv, idx, sinks


def ours_core(q, kv, ckv, idx, sinks, blocks=None, backward=True):
    total = q.shape[0]
    cu = torch.tensor([0, total], dtype=torch.int32, device=DEV)
    dout = torch.randn_like(q)

    def run():
        out = dsv4_attention_triton(q, kv, sinks, cu, W, D ** -0.5, ckv, idx, blocks)
        if backward:
            out.backward(dout)
    return run


def eager_core(q, kv, ckv, idx, sinks, backward=True):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import eager_attention_forward

    total = q.shape[0]
    comp = 0 if ckv is None else ckv.shape[0]
    i = torch.arange(total, device=DEV)
    mask = torch.full((1, 1, total, total + comp), float("-inf"), device=DEV, dtype=DT)
    band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - W)
    mask[0, 0, :, :total].masked_fill_(band, 0)
    if comp:
        keep = torch.zeros(total, comp + 1, device=DEV, dtype=torch.bool)
        keep.scatter_(1, torch.where(idx >= 0, idx.long(), comp), True)
        mask[0, 0, :, total:].masked_fill_(keep[:, :comp], 0)
    module = types.SimpleNamespace(num_key_value_groups=H, sinks=sinks, training=False)
    qh = q.detach().transpose(0, 1)[None].requires_grad_()
    dout = torch.randn(1, total, H, D, device=DEV, dtype=DT)

    def run():
        keys = kv if ckv is None else torch.cat([kv, ckv])
        out, _ = eager_attention_forward(module, qh, keys[None, None], keys[None, None], mask,
                                         scaling=D ** -0.5)
        if backward:
            out.backward(dout)
    return run


def module_runner(kind, total, impl):
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (DeepseekV4Attention,
                                                                      DeepseekV4RotaryEmbedding)

    types_ = {"sliding": "sliding_attention", "CSA": "compressed_sparse_attention",
              "HCA": "heavily_compressed_attention"}
    config = DeepseekV4Config(num_hidden_layers=1, layer_types=[types_[kind]],
                              mlp_layer_types=["moe"], num_nextn_predict_layers=0)
    config._attn_implementation = impl
    torch.manual_seed(0)
    attn = DeepseekV4Attention(config, 0).to(DEV, DT)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.02)
    rotary = DeepseekV4RotaryEmbedding(config).to(DEV)
    x = torch.randn(1, total, config.hidden_size, device=DEV, dtype=DT, requires_grad=True)
    pos = torch.arange(total, device=DEV)[None]
    emb = {t: rotary(x, pos, layer_type=t) for t in ("main", "compress")}
    i = torch.arange(total, device=DEV)
    mask = torch.where((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - W), 0.0,
                       float("-inf")).to(DT)[None, None]

    def run():
        out, _ = attn(x, emb, pos, mask)
        out.float().square().mean().backward()
    return run


def our_module_runner(kind, total):
    """Our model's attention module at the same shapes as transformers' (V4-Flash defaults)."""
    from sglang_dsv41.model.dsv4.attention import Attention
    from sglang_dsv41.model.dsv4.config import DSV4Config
    from sglang_dsv41.model.dsv4.context import DSV4Context
    from sglang_dsv41.model.dsv4.model import default_dtype

    ratio = {"sliding": 0, "CSA": 4, "HCA": 128}[kind]
    cfg = DSV4Config(num_hidden_layers=1, compress_ratios=[ratio], num_hash_layers=0)
    torch.manual_seed(0)
    with default_dtype(DT):
        attn = Attention(cfg, 0).to(DEV)
    with torch.no_grad():
        for p in attn.parameters():
            if p.dim() > 1 and p.dtype == DT:
                torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(total, cfg.hidden_size, device=DEV, dtype=DT, requires_grad=True)
    ctx = DSV4Context.packed([total], DEV)

    def run():
        attn(x, ctx).float().square().mean().backward()
    return run


def fmt(ms, peak, flops=None):
    if ms is None:
        return f"{peak:>9} {'':>7} {'':>8}"
    tf = f"{flops / ms / 1e9:7.1f}" if flops else f"{'':>7}"
    return f"{ms:9.2f} {tf} {peak:8.2f}"


def table(lengths, core_only=False):
    name = register_transformers_attention()
    print(f"H={H} D={D} window={W} bf16; ms | TFLOP/s of the sparse pattern (peak {PEAK}) | "
          f"peak GiB; ratio = eager ms / ours ms")
    print(f"{'tokens':>6} {'kind':>7} {'what':>14} | {'ours ms':>9} {'TF/s':>7} {'GiB':>8} | "
          f"{'eager ms':>9} {'':>7} {'GiB':>8} | ratio")
    for total in lengths:
        for kind in KINDS:
            torch.manual_seed(0)
            ins = core_inputs(kind, total)
            fwd_flops = 4 * H * D * pairs(total, ins[3])
            for what, bwd, flops in (("core fwd", False, fwd_flops),
                                     ("core fwd+bwd", True, 3.5 * fwd_flops)):
                ours = measure(ours_core(*ins, backward=bwd))
                eager = measure(eager_core(*ins, backward=bwd)) if total <= 16384 else \
                    (None, "not run")
                ratio = f"{eager[0] / ours[0]:6.1f}x" if eager[0] and ours[0] else "   -"
                print(f"{total:6d} {kind:>7} {what:>14} | {fmt(*ours, flops)} | "
                      f"{fmt(*eager)} | {ratio}", flush=True)
            del ins
            if core_only:
                continue
            eager = measure(module_runner(kind, total, "eager"), reps=5) if total <= 16384 \
                else (None, "not run")
            torch.cuda.empty_cache()
            for what, runner in (("tf module f+b", lambda: module_runner(kind, total, name)),
                                 ("our module f+b", lambda: our_module_runner(kind, total))):
                ours = measure(runner(), reps=5)
                ratio = f"{eager[0] / ours[0]:6.1f}x" if eager[0] and ours[0] else "   -"
                print(f"{total:6d} {kind:>7} {what:>14} | {fmt(*ours)} | {fmt(*eager)} | "
                      f"{ratio}", flush=True)
                torch.cuda.empty_cache()


def decode(batch=512, seq=8192, page=64, heads=H):
    """Kernel launcher directly (dsv4_decode validates with host syncs, not timed here)."""
    big = torch.empty(2**30, dtype=torch.uint8, device=DEV)
    copy_ms = do_bench(lambda: big.clone())
    copy_bw = 2 * big.numel() / copy_ms / 1e6
    del big
    pages = batch * seq // page
    cache = torch.randn(pages, page, D, device=DEV).to(DT)
    table_ = torch.randperm(pages, device=DEV).int().view(batch, seq // page)
    lens = torch.full((batch,), seq, device=DEV)
    q = torch.randn(batch, heads, D, device=DEV).to(DT)
    sinks = torch.randn(heads, device=DEV)
    print(f"decode: {heads} heads, batch {batch}, {seq} cached tokens each, page {page}; copy "
          f"{copy_bw:.0f} GB/s")
    for kind, k in (("sliding", 0), ("HCA", seq // 128), ("CSA", 512)):
        comp = torch.randn(batch * seq // 4, D, device=DEV).to(DT)
        idx = torch.randint(0, comp.shape[0], (batch, k), device=DEV).int() if k else None
        lens32 = lens.int()
        ms = do_bench(lambda: dsv4_decode_triton(q, cache, table_, lens32, sinks, W, D ** -0.5,
                                                 comp if k else None, idx))
        moved = batch * (W + k) * D * 2 + 2 * q.numel() * 2
        bw = moved / ms / 1e6
        print(f"  {kind:>7} K={k:4d}: {ms * 1e3:8.1f} us  {bw:6.0f} GB/s  "
              f"{100 * bw / copy_bw:5.1f}% of copy", flush=True)


def profile(total=4096, core_only=False):
    """Kernel time split of one CSA and HCA core forward+backward, then of our attention module."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    runs = [("CSA core", lambda: ours_core(*core_inputs("CSA", total)), 9),
            ("HCA core", lambda: ours_core(*core_inputs("HCA", total)), 9)]
    if not core_only:
        runs += [("CSA our module", lambda: our_module_runner("CSA", total), 25),
                 ("sliding our module", lambda: our_module_runner("sliding", total), 12)]
    for what, make, rows in runs:
        run = make()
        run()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        print(f"# {what}, {total} tokens", flush=True)
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows),
              flush=True)


# Configs tried by --sweep, per kernel: (tile, keys, warps, stages); tile = heads for fwd/ds,
# D columns for dq/dkv/dcomp; "narrow_selection": that DSV4Blocks switch. The default's own
# config is always tried first.
SWEEP_TRIALS = {
    "narrow_selection": [(False,), (True,)],
    "fwd": [(64, 32, 8, 3), (32, 64, 4, 2)],
    "ds": [(32, 64, 8, 2), (64, 32, 8, 2), (32, 64, 4, 2)],
    "dq": [(256, 64, 8, 2), (128, 32, 4, 3), (64, 64, 4, 2)],
    "dkv": [(64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2)],
    "dcomp": [(64, 64, 4, 2), (128, 32, 4, 3)],
}


def sweep(kernels, total=4096):
    """Tile configs of the given kernels at 4k, CSA and HCA, one kernel's config varied at a
    time from the defaults; per kernel, the config with the least CSA + HCA time is named if it
    beats the default's by 2% (less is within run-to-run noise), else the default."""
    import dataclasses

    ins = {kind: core_inputs(kind, total) for kind in ("CSA", "HCA")}
    flops = {kind: 4 * H * D * pairs(total, ins[kind][3]) for kind in ins}
    base = default_blocks(H)
    for kernel in kernels:
        names = (kernel,) if kernel == "narrow_selection" else tuple(
            f"{kernel}_{f}" for f in ("bh" if kernel in ("fwd", "ds") else "bd", "bn", "warps",
                                      "stages"))
        own = tuple(getattr(base, n) for n in names)
        bwd = kernel != "fwd"
        times = {}
        for config in [own] + [c for c in SWEEP_TRIALS[kernel] if c != own]:
            blocks = dataclasses.replace(base, **dict(zip(names, config)))
            row, both = [], 0.0
            for kind in ins:
                try:
                    ms = do_bench(ours_core(*ins[kind], blocks=blocks, backward=bwd))
                    both += ms
                    row.append(f"{kind} {ms:.3f} ms "
                               f"{(3.5 if bwd else 1) * flops[kind] / ms / 1e9:.0f} TF/s")
                except Exception as e:  # resource limits of a config: report and go on
                    both = float("inf")
                    row.append(f"{kind} {type(e).__name__}")
            times[config] = both
            print(f"{'fwd+bwd' if bwd else 'fwd'} {kernel}={config}"
                  f"{' (default)' if config == own else ''}: {'; '.join(row)}", flush=True)
        best = min(times, key=times.get)
        best = best if times[best] < 0.98 * times[own] else own
        print(f"best {kernel}: " + " ".join(f"{n}={v}" for n, v in zip(names, best)),
              flush=True)


def decode_sweep(batch=512, seq=8192, page=64):
    """Decode tile configs (heads per program, keys per tile, warps, stages) per head count."""
    cache = torch.randn(batch * seq // page, page, D, device=DEV).to(DT)
    table_ = torch.randperm(cache.shape[0], device=DEV).int().view(batch, seq // page)
    lens = torch.full((batch,), seq, device=DEV, dtype=torch.int32)
    comp = torch.randn(batch * seq // 4, D, device=DEV).to(DT)
    for heads in (64, 8):
        q = torch.randn(batch, heads, D, device=DEV).to(DT)
        sinks = torch.randn(heads, device=DEV)
        for k in (0, 512):
            idx = torch.randint(0, comp.shape[0], (batch, k), device=DEV).int() if k else None
            configs = ([(64, 32, 8, 2), (64, 32, 8, 3), (64, 32, 16, 2), (64, 64, 16, 2),
                        (64, 32, 16, 3)] if heads > 16 else
                       [(16, 64, 4, 2), (16, 32, 4, 3), (16, 64, 4, 3), (16, 128, 8, 2)])
            for bh, bn, warps, stages in configs:
                b = DSV4Blocks(bh, bn, warps, stages)
                try:
                    ms = do_bench(lambda: dsv4_decode_triton(q, cache, table_, lens, sinks, W,
                                                             D ** -0.5, comp if k else None, idx,
                                                             blocks=b))
                    print(f"decode H={heads} K={k} bh={bh} bn={bn} w={warps} s={stages}: "
                          f"{ms * 1e3:.1f} us {batch * (W + k) * D * 2 / ms / 1e6:.0f} GB/s",
                          flush=True)
                except Exception as e:
                    print(f"decode H={heads} K={k} bh={bh} bn={bn}: {type(e).__name__}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", nargs="*", choices=sorted(SWEEP_TRIALS), default=None,
                        help="only: tile sweeps of these kernels (all when none named)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--no-decode", action="store_true")
    parser.add_argument("--core-only", action="store_true",
                        help="table and profile: the attention core rows only, no module")
    parser.add_argument("--only-decode", action="store_true")
    parser.add_argument("--decode-sweep", action="store_true")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    if args.profile or args.sweep is not None or args.decode_sweep:
        if args.sweep is not None:
            sweep(args.sweep or sorted(SWEEP_TRIALS))
        if args.profile:
            profile(core_only=args.core_only)
        if args.decode_sweep:
            decode_sweep()
    elif args.only_decode:
        decode()
        decode(heads=8)
    else:
        table(args.lengths, args.core_only)
        if not args.no_decode:
            decode()
            decode(heads=8)
