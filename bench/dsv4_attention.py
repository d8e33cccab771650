"""DSV4 sparse sink attention on one GPU at V4-Flash head shapes (64 heads, D 512, window 128):
our Triton kernels vs transformers' eager DeepseekV4 attention, per layer kind, plus decode (at
64 heads on Hopper the forward and the decode are the Gluon kernel, dsv4_gluon.py, as the
trainer and the engine run them).

    python bench/dsv4_attention.py                 # the table (4k, 16k, 64k) and decode
    python bench/dsv4_attention.py --sweep [dkv..] # only: tile configs at 4k CSA and HCA
    python bench/dsv4_attention.py --heads 16 --sweep  # the same at 16 heads (the small preset)
    python bench/dsv4_attention.py --heads 16 --ab-rounds 3  # only: old vs default tiles
    python bench/dsv4_attention.py --decode-sweep  # only: decode tile configs
    python bench/dsv4_attention.py --decode-parts  # only: 64-head wgmma decode, copies vs MMAs
    python bench/dsv4_attention.py --decode-compile  # only, no GPU: decode kernels for sm_90
    python bench/dsv4_attention.py --training-compile  # only, no GPU: training kernels, sm_90
    python bench/dsv4_attention.py --lengths 4096  # fewer lengths
    python bench/dsv4_attention.py --profile       # only: kernel split of the core, module ops
    python bench/dsv4_attention.py --profile-module --lengths 4096  # only: our module per kind
    python bench/dsv4_attention.py --core-only     # table/profile without the module rows
    python bench/dsv4_attention.py --heads 16 --probe-atomics  # only: the selection dKV's cost

Rows: "core" = the attention the kernel replaces (scores, sinks, softmax, values) on the same
q/kv/selection; the whole attention module (projections, compressor, indexer, RoPE) at the same
shapes, both against transformers' DeepseekV4Attention with attn_implementation eager: "tf module"
= transformers' module with our kernel registered (register_transformers_attention), "our module" =
our model's attention module (sglang_dsv41/model/dsv4/attention.py). FLOPs count only the pairs the
sparse pattern attends: forward 4*H*D per (query, key) pair, forward+backward 3.5x that. A core's
backward is torch.autograd.grad of its inputs on both sides (differentiable). Eager is marked OOM
where it runs out of memory. Decode bandwidth = bytes moved (keys, picks, q, out) / time, vs a 1
GiB device copy; each row also times a copy of its own bytes (read + write), the memory system's
reference at that size.
On a machine with an older transformers, install the 5.23 wheel into a side path first:
`pip install --no-deps --target /tmp/site .whl/*.whl; PYTHONPATH=/tmp/site:$PWD python ...`.
"""

from __future__ import annotations

import argparse
import types

import torch
import triton
from triton.testing import do_bench

from sglang_dsv41.attention import register_transformers_attention
from sglang_dsv41.attention.dsv4_triton_decode import DecodeTiles, dsv4_decode_triton
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


def differentiable(*tensors):
    """The core's inputs that get gradients. Both cores' backward is torch.autograd.grad of
    these: the kernels' work is the gradients; adding them into .grad, as .backward() did over
    the timer's repeats (aten::add_ 0.19 ms in the 4k CSA profile at 64 heads), is the autograd
    engine's, counted on neither side (the table's times moved by less than their noise)."""
    return [t for t in tensors if t is not None]


def ours_core(q, kv, ckv, idx, sinks, blocks=None, backward=True):
    total = q.shape[0]
    cu = torch.tensor([0, total], dtype=torch.int32, device=DEV)
    dout = torch.randn_like(q)

    inputs = differentiable(q, kv, ckv, sinks)

    def run():
        out = dsv4_attention_triton(q, kv, sinks, cu, W, D ** -0.5, ckv, idx, blocks)
        if backward:
            torch.autograd.grad(out, inputs, dout)
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

    inputs = differentiable(qh, kv, ckv, sinks)

    def run():
        keys = kv if ckv is None else torch.cat([kv, ckv])
        out, _ = eager_attention_forward(module, qh, keys[None, None], keys[None, None], mask,
                                         scaling=D ** -0.5)
        if backward:
            torch.autograd.grad(out, inputs, dout)
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


def decode_inputs(batch, seq, page, heads):
    """A batch of requests with `seq` cached tokens each on shuffled pages, one query each, and
    a compressed pool of seq/4 rows per request (CSA and HCA picks are random rows of it)."""
    pages = batch * seq // page
    cache = torch.randn(pages, page, D, device=DEV).to(DT)
    table_ = torch.randperm(pages, device=DEV).int().view(batch, seq // page)
    lens = torch.full((batch,), seq, device=DEV, dtype=torch.int32)
    q = torch.randn(batch, heads, D, device=DEV).to(DT)
    sinks = torch.randn(heads, device=DEV)
    comp = torch.randn(batch * seq // 4, D, device=DEV).to(DT)
    picks = {kind: torch.randint(0, comp.shape[0], (batch, k), device=DEV).int() if k else None
             for kind, k in (("sliding", 0), ("HCA", seq // 128), ("CSA", 512))}
    return cache, table_, lens, q, sinks, comp, picks


def decode_bytes(q, picks):
    """Bytes a decode step must move: each request's window keys (through its pages) and
    selected rows, its picks (int32), q and out. The page table (W/page entries a request) and
    the split kernels' partial outputs are not counted: overhead, not work."""
    batch, heads, _ = q.shape
    k = 0 if picks is None else picks.shape[1]
    return batch * (W + k) * D * 2 + batch * k * 4 + 2 * q.numel() * 2


def decode_timer(fn):
    """GPU time (us) of fn replayed from a CUDA graph, as the engine's decode runs it, so the
    host's launch cost does not hide the kernels."""
    from triton.testing import do_bench_cudagraph

    fn()
    return do_bench_cudagraph(fn, rep=50) * 1e3


def same_bytes_copy_us(nbytes: int) -> float:
    """GPU time (us) of a device copy that reads and writes ``nbytes`` in all (a kernel's
    reference at its own size: one launch of this many bytes does not reach the 1 GiB copy's
    bandwidth), timed like the kernels (decode_timer)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    return decode_timer(lambda: dst.copy_(src))


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device clone (read + write): the decode's bandwidth reference."""
    big = torch.empty(2**30, dtype=torch.uint8, device=DEV)
    copy_ms = do_bench(lambda: big.clone())
    return 2 * big.numel() / copy_ms / 1e6


def decode(batch=512, seq=8192, page=64, heads=H):
    """Kernel launcher directly (dsv4_decode validates with host syncs, not timed here):
    GPU time from a CUDA graph, and the eager call (host launch cost included) next to it."""
    copy_bw = copy_bandwidth()
    cache, table_, lens, q, sinks, comp, picks = decode_inputs(batch, seq, page, heads)
    print(f"decode: {heads} heads, batch {batch}, {seq} cached tokens each, page {page}; copy "
          f"{copy_bw:.0f} GB/s (1 GiB clone, read + write); bytes = keys via pages + selected "
          f"rows + picks + q + out")
    for kind, idx in picks.items():
        def run():
            return dsv4_decode_triton(q, cache, table_, lens, sinks, W, D ** -0.5,
                                      comp if idx is not None else None, idx)
        us = decode_timer(run)
        eager_us = do_bench(run) * 1e3
        nbytes = decode_bytes(q, idx)
        bw = nbytes / us / 1e3
        keys = W + (0 if idx is None else idx.shape[1])
        tflops = 4 * heads * D * keys * batch / us / 1e6
        same_us = same_bytes_copy_us(nbytes)
        print(f"  {kind:>7} K={keys - W:4d}: {us:8.1f} us  {bw:6.0f} GB/s  "
              f"{100 * bw / copy_bw:5.1f}% of copy  {tflops:6.1f} TFLOP/s | same-bytes copy "
              f"{same_us:6.1f} us, {100 * same_us / us:5.1f}% of its bandwidth | eager call "
              f"{eager_us:8.1f} us", flush=True)


def profile_module(total=4096, rows=30):
    """Our attention module alone per layer kind: its forward+backward time, then its op split
    (self CUDA time, ops grouped by input shape; an op row and its kernel rows count the same
    time twice, the total does not)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    for kind in KINDS:
        run = our_module_runner(kind, total)
        ms, peak = measure(run, reps=5)
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                           record_shapes=True) as prof:
            run()
            torch.cuda.synchronize()
        print(f"# {kind} our module f+b, {total} tokens: {ms:.2f} ms, peak {peak:.2f} GiB",
              flush=True)
        print(prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=40,
            max_shapes_column_width=60), flush=True)
        torch.cuda.empty_cache()


def profile(total=4096):
    """Kernel time split of one CSA and one HCA core forward+backward (the module's split:
    profile_module)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    for kind in ("CSA", "HCA"):
        run = ours_core(*core_inputs(kind, total))
        run()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        print(f"# {kind} core, {total} tokens", flush=True)
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=9),
              flush=True)


# Configs tried by --sweep, per head count (--heads) and kernel: (tile, keys, warps, stages[, D
# step]); tile = heads for fwd/ds, D columns for dq/dkv; D step (ds): D columns a step of its
# scores' loop; "narrow_selection", "fwd_wgmma": those DSV4Blocks switches ("fwd" sweeps the
# Triton forward's tiles: with fwd_wgmma off). The default's own config is always tried first.
# Lost before (bench/results/dsv4_attention_h200.txt): the forward with its scores summed over
# D in steps as the P/dS pass does; a separate selection dKV kernel after the P/dS pass; window
# dKV programs of 256-512 columns or 128 keys (fewer re-reads of q and dO, 11-190% slower).
SWEEP_TRIALS = {
    64: {
        "narrow_selection": [(False,), (True,)],
        "fwd_wgmma": [(False,), (True,)],
        "fwd": [(64, 32, 8, 3), (32, 64, 4, 2)],
        "ds": [(64, 64, 4, 4, 64), (64, 64, 4, 3, 32), (64, 32, 4, 3, 64), (64, 128, 4, 3, 64),
               (64, 64, 4, 2, 128), (64, 128, 8, 3, 64), (64, 128, 8, 2, 64), (64, 64, 8, 3, 64),
               (64, 128, 8, 3, 32), (64, 64, 4, 2, 64)],
        "dq": [(256, 64, 8, 2), (128, 32, 4, 3), (64, 64, 4, 2), (128, 64, 4, 3),
               (128, 128, 8, 2)],
        "dkv": [(64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2), (128, 64, 4, 3),
                (256, 64, 8, 2), (128, 128, 8, 2)],
        "dkv_rows": [(64,), (128,)],
    },
    16: {  # the small preset's heads
        "narrow_selection": [(False,), (True,)],
        "fwd": [(16, 64, 8, 2), (16, 64, 4, 3), (16, 128, 4, 2), (16, 32, 2, 3), (16, 128, 8, 2)],
        "ds": [(16, 64, 4, 3, 64), (16, 128, 4, 3, 64), (16, 64, 4, 3, 128), (16, 128, 4, 3, 128),
               (16, 128, 8, 3, 64), (16, 64, 4, 4, 64), (16, 32, 2, 3, 128)],
        "dq": [(256, 64, 4, 2), (512, 64, 8, 2), (128, 128, 4, 2), (64, 64, 4, 2),
               (256, 32, 4, 3)],
        "dkv": [(256, 64, 4, 2), (128, 128, 4, 2), (64, 64, 4, 2), (128, 64, 4, 3),
                (256, 64, 8, 2), (128, 64, 8, 2)],
        "dkv_rows": [(16,), (32,), (64,), (128,)],
    },
}


def sweep(kernels, total=4096):
    """Tile configs of the given kernels at 4k, every kind (the window kernels serve the
    sliding layers alone), one kernel's config varied at a time from the defaults; per kernel,
    the config with the least summed time is named if it beats the default's by 2% (less is
    within run-to-run noise), else the default."""
    import dataclasses

    ins = {kind: core_inputs(kind, total) for kind in KINDS}
    flops = {kind: 4 * H * D * pairs(total, ins[kind][3]) for kind in ins}
    base = default_blocks(H)
    for kernel in kernels:
        names = (kernel,) if kernel in ("narrow_selection", "dkv_rows", "fwd_wgmma") else tuple(
            f"{kernel}_{f}" for f in ("bh" if kernel in ("fwd", "ds") else "bd", "bn", "warps",
                                      "stages") + (("bd",) if kernel == "ds" else ()))
        base_k = dataclasses.replace(base, fwd_wgmma=False) if kernel == "fwd" else base
        own = tuple(getattr(base_k, n) for n in names)
        bwd = kernel not in ("fwd", "fwd_wgmma")
        times = {}
        for config in [own] + [c for c in SWEEP_TRIALS[H][kernel] if c != own]:
            blocks = dataclasses.replace(base_k, **dict(zip(names, config)))
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


def ab_rounds(rounds, total=4096):
    """The cores of every kind, fwd+bwd, in rounds alternating the 64-head tiles (at this head
    count's blocks, the old) with default_blocks(H) (the new), and their ratio each round."""
    bh = max(16, min(64, triton.next_power_of_2(H)))
    configs = {"64-head tiles": DSV4Blocks(fwd_bh=bh, ds_bh=bh, dq_bh=bh),
               f"default_blocks({H})": default_blocks(H)}
    ins = {kind: core_inputs(kind, total) for kind in KINDS}
    for rnd in range(rounds):
        ms = {name: {kind: do_bench(ours_core(*x, blocks=blocks), warmup=25, rep=200)
                     for kind, x in ins.items()} for name, blocks in configs.items()}
        for name, times in ms.items():
            print(f"round {rnd} {name:18s}: "
                  + "  ".join(f"{kind} {t:.3f}" for kind, t in times.items()) + " ms", flush=True)
        old, new = ms.values()
        print(f"round {rnd} {'ratio new / old':18s}: "
              + "  ".join(f"{kind} {new[kind] / old[kind]:.3f}" for kind in old), flush=True)


def probe_atomics(total=4096, rounds=3):
    """The 4k CSA core fwd+bwd three ways, in rounds: as built; the selection dKV stored with
    plain stores instead of atomic adds (racy: a wrong dcomp, timing only); without the
    selection dKV (its MMAs and adds gone). Each variant is a copy of dsv4_triton_backward.py
    with that statement rewritten, imported from a temporary file."""
    import importlib.util
    import inspect
    import pathlib
    import tempfile

    from sglang_dsv41.attention import dsv4_triton_backward as built

    source = inspect.getsource(built)
    atomic = ("tl.atomic_add(dcomp_ptr + row[:, None].to(tl.int64) * D + cols[None, :], dc,\n"
              "                          mask=valid[:, None] & cmask[None, :], sem=\"relaxed\")")
    assert atomic in source, "the selection dKV's atomic add moved: update this probe"
    variants = {"as built": built}
    folder = pathlib.Path(tempfile.mkdtemp())
    for name, statement in (("plain stores", atomic.replace("tl.atomic_add", "tl.store")
                             .replace(', sem="relaxed"', "")),
                            ("no selection dKV", "pass")):
        path = folder / f"probe_{len(variants)}.py"
        path.write_text(source.replace(atomic, statement))
        spec = importlib.util.spec_from_file_location(
            f"sglang_dsv41.attention.probe_{len(variants)}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        variants[name] = module
    ins = core_inputs("CSA", total)
    cu = torch.tensor([0, total], dtype=torch.int32, device=DEV)
    dout = torch.randn_like(ins[0])
    q, kv, ckv, idx, sinks = ins
    blocks = default_blocks(H)
    print(f"# 4k CSA core fwd+bwd, {H} heads, {(idx >= 0).sum().item()} (token, pick) pairs",
          flush=True)
    for rnd in range(rounds):
        row, built_ms = [], None
        for name, module in variants.items():
            def run(module=module):
                module.dsv4_attention_triton(q, kv, sinks, cu, W, D ** -0.5, ckv, idx,
                                             blocks).backward(dout)
            ms = do_bench(run, warmup=25, rep=200)
            built_ms = built_ms or ms
            row.append(f"{name} {ms:.3f} ms ({ms / built_ms:.2f}x as built)")
        print(f"round {rnd}: " + "  ".join(row), flush=True)


# Decode configs tried by --decode-sweep per head count: DecodeTiles(bh, bn, warps, stages,
# splits[, wgmma]); splits 0 = split_count's choice; the default's own config first. Configs
# that lost before (other key tiles, two splits, 32-head blocks, 8 warps at 8 heads, 4 warps at
# 8 heads, double-buffered key tiles): bench/results/dsv4_attention_h200.txt. Five stages are
# the fewest at which Triton 3.6 double-buffers the key tile (--decode-compile: the loop's wait
# no longer drains every copy in flight); they lost at both head counts. wgmma: the Gluon kernel
# at 64 heads (stages = key buffers in its ring); the Triton kernel's best config after them.
DECODE_TRIALS = {
    64: [(64, 64, 8, 2, 0, True), (64, 32, 8, 3, 0, True), (64, 32, 8, 2, 0, True),
         (64, 64, 8, 2, 0)],
    8: [(16, 16, 2, 2, 0), (16, 32, 4, 3, 0), (16, 16, 2, 4, 0)],
}


def decode_sweep(batch=512, seq=8192, page=64):
    """Decode tile configs per head count and layer kind (GPU time from a CUDA graph, and the
    share of the 1 GiB copy's bandwidth); names the config with the least sliding + HCA + CSA
    time per head count."""
    copy_bw = copy_bandwidth()
    print(f"decode sweep: batch {batch}, {seq} cached tokens each, page {page}; copy "
          f"{copy_bw:.0f} GB/s (1 GiB clone, read + write)", flush=True)
    for heads, trials in DECODE_TRIALS.items():
        cache, table_, lens, q, sinks, comp, picks = decode_inputs(batch, seq, page, heads)
        totals, first_out = {}, {}
        for config in trials:
            tiles, row, total = DecodeTiles(*config), [], 0.0
            for kind, idx in picks.items():
                try:
                    def run():
                        return dsv4_decode_triton(q, cache, table_, lens, sinks, W, D ** -0.5,
                                                  comp if idx is not None else None, idx,
                                                  tiles=tiles)
                    us = decode_timer(run)
                    total += us
                    bw = decode_bytes(q, idx) / us / 1e3
                    # Each config's output against the first config's: tiles reorder the sums.
                    diff = (run().float() - first_out.setdefault(kind, run().float())).abs()
                    row.append(f"{kind} {us:6.1f} us {bw:5.0f} GB/s {100 * bw / copy_bw:4.1f}% "
                               f"|d| {diff.max().item():.1e}")
                except Exception as e:  # resource limits of a config: report and go on
                    total = float("inf")
                    row.append(f"{kind} {type(e).__name__}")
            totals[config] = total
            print(f"decode H={heads} {config}: " + "; ".join(row), flush=True)
        print(f"best decode H={heads}: {min(totals, key=totals.get)}", flush=True)
        cache = comp = None  # freed before the next head count's inputs
        torch.cuda.empty_cache()


def decode_once(heads, batch=512, seq=8192, page=64):
    """Each layer kind's default decode at ``heads`` run twice, the second run to be profiled
    from outside (ncu --launch-skip 1 --launch-count 1 per kind, kernels filtered by name)."""
    cache, table_, lens, q, sinks, comp, picks = decode_inputs(batch, seq, page, heads)
    for kind, idx in picks.items():
        for _ in range(2):
            dsv4_decode_triton(q, cache, table_, lens, sinks, W, D ** -0.5,
                               comp if idx is not None else None, idx)
        torch.cuda.synchronize()
        print(f"decode once: {heads} heads, {kind}", flush=True)


def core_once(kind, total=4096):
    """Our core's forward + backward of one layer kind at ``total`` tokens run twice, the
    second to be profiled from outside (ncu --kernel-name regex:_dsv4_ --launch-skip 4
    --launch-count 4: forward, P/dS, dQ, window dKV)."""
    run = ours_core(*core_inputs(kind, total))
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    print(f"core once: {kind}, {total} tokens, {H} heads", flush=True)


def decode_parts(batch=512, seq=8192, page=64, heads=64):
    """The 64-head wgmma decode of each DECODE_TRIALS[64] wgmma config as built, with only its
    key copies (no MMAs, no softmax) and with only its MMAs and softmax (no key copies; the
    query and output still move): where a tile's time goes."""
    import functools

    from sglang_dsv41.attention import dsv4_gluon

    copy_bw = copy_bandwidth()
    cache, table_, lens, q, sinks, comp, picks = decode_inputs(batch, seq, page, heads)
    launch = dsv4_gluon.launch
    print(f"decode parts: {heads} heads, batch {batch}, {seq} cached tokens each, page {page}; "
          f"copy {copy_bw:.0f} GB/s; % = the decode's bytes over the time, of the copy's")
    try:
        for config in [c for c in DECODE_TRIALS[heads] if len(c) > 5 and c[5]]:
            tiles = DecodeTiles(*config)
            for parts, what in ((0, "as built"), (1, "copies only"), (2, "MMAs + softmax only")):
                dsv4_gluon.launch = functools.partial(launch, parts=parts)
                row = []
                for kind, idx in picks.items():
                    def run():
                        return dsv4_decode_triton(q, cache, table_, lens, sinks, W, D ** -0.5,
                                                  comp if idx is not None else None, idx,
                                                  tiles=tiles)
                    us = decode_timer(run)
                    pct = 100 * decode_bytes(q, idx) / us / 1e3 / copy_bw
                    row.append(f"{kind} {us:6.1f} us {pct:4.1f}%")
                print(f"{config} {what:>19}: " + "; ".join(row), flush=True)
    finally:
        dsv4_gluon.launch = launch


def compile_report(kernel, types_: dict, consts: dict, aligned: set, arch: int, warps: int,
                   stages: int) -> dict:
    """``kernel`` compiled for sm_<arch> without a GPU (the installed Triton and its ptxas; the
    integer arguments named in ``aligned`` marked multiples of 16, as a launch at the bench
    shapes marks them) -> registers and spill bytes a thread, shared memory, its MMA
    instructions (wgmma: Hopper's warpgroup MMA; mma.sync: the Ampere one), asynchronous
    copies, and its waits that drain every copy in flight."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    from sglang_dsv41.attention.triton_common import compile_for_gpu, ptx_global_loads

    try:  # the ptxas Triton compiles with (Triton 3.9: a newer one than bin/ptxas)
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(arch).path
    except (ImportError, TypeError):
        ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    names = [p.name for p in kernel.params]
    types_ = {n: types_.get(n, "*i32" if n.endswith("_ptr") else "i32") for n in names
              if n not in consts}
    compiled = compile_for_gpu(kernel, types_, consts, aligned, arch, num_warps=warps,
                               num_stages=stages)
    ptx = compiled.asm["ptx"]
    cp_async, ld_global, ld_global_16 = ptx_global_loads(ptx)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        info = subprocess.run([str(ptxas), f"-arch=sm_{arch}a", "-v", f.name, "-o",
                               "/dev/null"], capture_output=True, text=True).stderr
    return dict(regs=int(re.search(r"Used (\d+) registers", info).group(1)),
                spills=int(re.search(r"(\d+) bytes spill stores", info).group(1)),
                shared=compiled.metadata.shared, wgmma=ptx.count("wgmma.mma_async"),
                # each dot's warps over (rows, columns) and its wgmma tiles: a [N, 1] layout on
                # N/4 warpgroups of one 64-row tile computes that tile N/4 times over
                mma_warps=sorted(set(re.findall(r"nvidia_mma<\{[^}]*warpsPerCTA = \[(\d+, \d+)\]",
                                                compiled.asm["ttgir"]))),
                wgmma_shapes=sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+)",
                                                   ptx))),
                mma_sync=ptx.count("mma.sync"), cp_async=cp_async,
                ld_global=ld_global, ld_global_16=ld_global_16,
                drains=compiled.asm["ttgir"].count("num = 0 : i32"))


def decode_compile_report(arch=90):
    """The decode split kernel (Triton's or, wgmma, Gluon's) of each DECODE_TRIALS config
    compiled for sm_<arch> without a GPU (compile_report): registers, spills, shared memory,
    and how many of its waits drain every copy in flight (async_wait num=0: one at the top of
    each loop iteration and one after each loop)."""
    from sglang_dsv41.attention.dsv4_gluon import _dsv4_wgmma_kernel
    from sglang_dsv41.attention.dsv4_triton_decode import _dsv4_decode_split_kernel

    types_ = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "comp_ptr": "*bf16", "o_ptr": "*bf16",
              "sink_ptr": "*fp32", "part_ptr": "*fp32", "ml_ptr": "*fp32", "qk_scale": "fp32"}
    aligned = {"D", "window", "stride_kv", "stride_c", "stride_idx", "stride_page"}
    for heads, trials in DECODE_TRIALS.items():
        for config in trials:
            tiles = DecodeTiles(*config)
            kernel = _dsv4_wgmma_kernel if tiles.wgmma else _dsv4_decode_split_kernel
            consts = dict(HAS_SINK=True, PAGE=64, BN=tiles.bn, SPLITS=max(tiles.splits, 1))
            if tiles.wgmma:
                consts.update(STAGES=tiles.stages, PARTS=0, PAGED=True)
            else:
                consts.update(BH=tiles.bh, BD=D, DOT_PREC="tf32")
            r = compile_report(kernel, types_, consts,
                               aligned | ({"H"} if heads % 16 == 0 else set()), arch,
                               tiles.warps, tiles.stages)
            print(f"decode H={heads} {config}: {r['regs']} registers, {r['spills']} B spill "
                  f"stores, {r['shared']} B shared, {r['drains']} waits draining all copies; "
                  f"MMA warps {r['mma_warps']}, {r['wgmma']} wgmma {r['wgmma_shapes']}, "
                  f"{r['cp_async']} cp.async, {r['ld_global']} plain global loads "
                  f"({r['ld_global_16']} of 16 bits)", flush=True)


def training_compile_report(arch=90):
    """The training kernels (forward, P/dS pass, dQ, window dKV) at default_blocks of 16 heads
    (the small preset) and 64 (V4-Flash) compiled for sm_<arch> without a GPU (compile_report):
    which MMA instructions they use, their asynchronous copies (the pipelined gathers), shared
    memory, registers and spills."""
    from sglang_dsv41.attention import dsv4_triton_backward as bwd, dsv4_triton_forward as fwd

    types_ = {n: "*bf16" for n in ("q_ptr", "kv_ptr", "comp_ptr", "o_ptr", "do_ptr", "p_ptr",
                                    "ds_ptr", "dq_ptr", "dkv_ptr")}
    types_.update({n: "*fp32" for n in ("lse_ptr", "delta_ptr", "dcomp_ptr", "sink_ptr")})
    types_.update(qk_scale="fp32", scale="fp32")
    aligned = {"H", "D", "window", "num_sel", "wslots", "ds_row", "T", "stride_qt", "stride_qh",
               "stride_kv", "stride_c", "stride_idx", "stride_ot", "stride_oh"}
    for heads in (16, 64):
        b = default_blocks(heads)
        bhh, tb = bwd.dkv_window_rows(heads, b)
        kernels = {
            "forward": (fwd._dsv4_fwd_kernel, dict(HAS_SINK=True, BH=b.fwd_bh, BN=b.fwd_bn,
                                                   BNS=b.fwd_bn, BD=D, DOT_PREC="tf32"),
                        b.fwd_warps, b.fwd_stages),
            "P/dS": (bwd._dsv4_ds_kernel, dict(BH=b.ds_bh, BN=b.ds_bn, BC=b.ds_bd,
                                               DOT_PREC="tf32"), b.ds_warps, b.ds_stages),
            "dQ": (bwd._dsv4_dq_kernel, dict(BH=b.dq_bh, BN=b.dq_bn, BD=b.dq_bd,
                                             DOT_PREC="tf32"), b.dq_warps, b.dq_stages),
            "window dKV": (bwd._dsv4_dkv_window_kernel,
                           dict(BN=b.dkv_bn, BHH=bhh, TB=tb, BD=b.dkv_bd, DOT_PREC="tf32"),
                           b.dkv_warps, b.dkv_stages)}
        if heads == 64:  # what runs there on sm_90 (DSV4Blocks.fwd_wgmma)
            from sglang_dsv41.attention import dsv4_gluon

            kernels["forward (Gluon)"] = (dsv4_gluon._dsv4_wgmma_kernel,
                                          dsv4_gluon.forward_constants(True),
                                          dsv4_gluon.FORWARD_WARPS, 2)
        for name, (kernel, consts, warps, stages) in kernels.items():
            r = compile_report(kernel, types_, consts, aligned, arch, warps, stages)
            print(f"H={heads} {name:15s} {warps} warps {stages} stages: wgmma {r['wgmma']:4d}, "
                  f"mma.sync {r['mma_sync']:4d}, cp.async {r['cp_async']:3d}, "
                  f"ld.global {r['ld_global']:3d} ({r['ld_global_16']:3d} of 16 bits), "
                  f"{r['shared']:6d} B shared, {r['regs']} registers, {r['spills']} B spill "
                  "stores", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", nargs="*", choices=sorted(SWEEP_TRIALS[H]), default=None,
                        help="only: tile sweeps of these kernels (all when none named)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--heads", type=int, default=H, choices=sorted(SWEEP_TRIALS),
                        help="heads of --sweep and --ab-rounds")
    parser.add_argument("--ab-rounds", type=int, default=0,
                        help="only: this many rounds of the 4k cores, 64-head tiles vs "
                             "default_blocks(--heads)")
    parser.add_argument("--profile-module", action="store_true",
                        help="only: our attention module per kind, time and op split at 4k")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--no-decode", action="store_true")
    parser.add_argument("--core-only", action="store_true",
                        help="table and --profile: the attention core only, not the module")
    parser.add_argument("--only-decode", action="store_true")
    parser.add_argument("--decode-sweep", action="store_true")
    parser.add_argument("--decode-once", type=int, default=0, metavar="HEADS",
                        help="only: each kind's decode at HEADS heads twice, for a profiler")
    parser.add_argument("--core-once", choices=("sliding", "CSA", "HCA"), default=None,
                        help="only: that kind's core fwd+bwd twice at --lengths[0], for a "
                             "profiler")
    parser.add_argument("--decode-parts", action="store_true",
                        help="only: the 64-head wgmma decode as built, copies only, MMAs only")
    parser.add_argument("--probe-atomics", action="store_true",
                        help="only: the 4k CSA core with the selection dKV's atomic adds, "
                             "plain stores in their place, and without it (at --heads)")
    parser.add_argument("--decode-compile", action="store_true",
                        help="only, no GPU: registers, spills, shared memory of the decode "
                             "configs compiled for sm_90")
    parser.add_argument("--training-compile", action="store_true",
                        help="only, no GPU: MMA instructions, async copies, shared memory, "
                             "registers of the training kernels compiled for sm_90")
    args = parser.parse_args()
    if args.decode_compile or args.training_compile:
        print("triton", triton.__version__, "sm_90, no GPU")
        (decode_compile_report if args.decode_compile else training_compile_report)()
        raise SystemExit
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    H = args.heads
    if args.probe_atomics:
        probe_atomics()
    elif args.ab_rounds:
        ab_rounds(args.ab_rounds)
    elif args.profile_module:
        profile_module(args.lengths[0])
    elif args.profile or args.sweep is not None or args.decode_sweep:
        if args.sweep is not None:
            sweep(args.sweep or sorted(SWEEP_TRIALS[H]))
        if args.profile:
            profile()
            if not args.core_only:
                profile_module()
        if args.decode_sweep:
            decode_sweep()
    elif args.core_once:
        core_once(args.core_once, args.lengths[0])
    elif args.decode_once:
        decode_once(args.decode_once)
    elif args.decode_parts:
        decode_parts()
    elif args.only_decode:
        decode()
        decode(heads=8)
    else:
        table(args.lengths, args.core_only)
        if not args.no_decode:
            decode()
            decode(heads=8)
