"""Sink attention on one GPU: our Triton kernels vs torch SDPA (no sinks, the ceiling) vs eager
attention with sinks, plus paged decode against the measured device-copy bandwidth.

    python bench/attention.py            # the table
    python bench/attention.py --check bf16|fp32|decode|det   # only: correctness vs float64,
                                                             # or dsink determinism
    python bench/attention.py --sweep    # only: time a few tile configs at S=4096

FLOP convention (causal, as REFERENCE.md): forward 2*2*B*H*S^2*D/2 = 2*B*H*S^2*D,
forward+backward 3.5*2*B*H*S^2*D. Every ratio is against baselines measured in this same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from sglang_dsv41.attention import sink_attention_reference, sink_decode_reference
from sglang_dsv41.attention.triton_common import default_prefill_blocks
from sglang_dsv41.attention.triton_decode import sink_decode_triton
from sglang_dsv41.attention.triton_prefill import sink_attention_triton

B, H, D = 4, 32, 64
DEVICE = "cuda"


def rel_err(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def make_inputs(b, s, h, hkv, d, dtype, sinks=True, s_k=None):
    s_k = s_k or s
    q = torch.randn(b * s, h, d, device=DEVICE, dtype=dtype)
    k = torch.randn(b * s_k, hkv, d, device=DEVICE, dtype=dtype)
    v = torch.randn(b * s_k, hkv, d, device=DEVICE, dtype=dtype)
    sk = torch.randn(h, device=DEVICE, dtype=torch.float32) if sinks else None
    cu_q = torch.arange(0, b + 1, device=DEVICE, dtype=torch.int32) * s
    cu_k = torch.arange(0, b + 1, device=DEVICE, dtype=torch.int32) * s_k
    return q, k, v, sk, cu_q, cu_k


def check(part):
    """Out/dq/dk/dv/dsink against the float64 reference on the same (rounded) inputs; `part` is
    bf16, fp32, decode or det (so the parts can compile in parallel processes)."""
    cases = [dict(s=1024, hkv=8, window=None), dict(s=1024, hkv=2, window=256),
             dict(s=700, hkv=4, window=None, s_k=1024), dict(s=1024, hkv=8, window=None,
                                                              sinks=False),
             dict(s=300, hkv=8, window=64, s_k=200, sinks=False)]  # rows with no visible key
    worst = 0.0
    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-3)):
        if part != str(dtype).split(".")[-1].replace("bfloat16", "bf16").replace("float32",
                                                                                "fp32"):
            continue
        for c in cases:
            q, k, v, sk, cu_q, cu_k = make_inputs(2, c["s"], 8, c["hkv"], D, dtype,
                                                  c.get("sinks", True), c.get("s_k"))
            do = torch.randn_like(q)
            ins = [x for x in (q, k, v, sk) if x is not None]
            leaves = [x.detach().requires_grad_() for x in ins]
            sk_l = leaves[3] if sk is not None else None
            out = sink_attention_triton(*leaves[:3], sk_l, cu_q, cu_k, True, c["window"])
            grads = torch.autograd.grad(out, leaves, do)
            ref_leaves = [x.detach().double().requires_grad_() for x in ins]
            ref = sink_attention_reference(*ref_leaves[:3], ref_leaves[3] if sk is not None
                                           else None, cu_q, cu_k, True, c["window"])
            ref_grads = torch.autograd.grad(ref, ref_leaves, do.double())
            errs = [rel_err(out, ref)] + [rel_err(g, r) for g, r in zip(grads, ref_grads)]
            worst = max(worst, max(errs) / tol)
            names = ["out", "dq", "dk", "dv", "dsink"][: len(errs)]
            finite = all(torch.isfinite(x).all() for x in (out, *grads))
            ok = all(e <= tol for e in errs) and finite
            print(f"check {str(dtype):15s} {c} " + " ".join(f"{n}={e:.2e}" for n, e in
                  zip(names, errs)) + f" finite={finite}  {'OK' if ok else 'FAIL'}", flush=True)
    if part == "decode":
        for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-3)):
            qd, kc, vc, pt, sl, sk = make_decode(16, 2048, 8, 2, dtype, page_size=16)
            for window in (None, 300):
                out = sink_decode_triton(qd, kc, vc, pt, sl, sk, window)
                ref = sink_decode_reference(qd.double(), kc.double(), vc.double(), pt, sl, sk,
                                            window)
                e = rel_err(out, ref)
                worst = max(worst, e / tol)
                print(f"check decode {dtype} window={window} out={e:.2e} "
                      f"{'OK' if e <= tol else 'FAIL'}", flush=True)
    if part == "det":
        # Two backward passes at the benchmark shape: bitwise equal dsink (and grads).
        q, k, v, sk, cu_q, cu_k = make_inputs(B, 4096, H, H, D, torch.bfloat16)
        do = torch.randn_like(q)
        runs = []
        for _ in range(2):
            leaves = [x.detach().requires_grad_() for x in (q, k, v, sk)]
            out = sink_attention_triton(*leaves, cu_q, cu_k, True, None)
            runs.append(torch.autograd.grad(out, leaves, do))
        same = [torch.equal(a, b) for a, b in zip(*runs)]
        print(f"determinism B={B} H={H} S=4096 bf16: dsink bitwise equal={same[3]} "
              f"(dq,dk,dv bitwise equal={same[:3]})")
        worst = worst if all(same) else math.inf
    print(f"check {part}: worst error / tolerance = {worst:.3f} -> "
          f"{'PASS' if worst <= 1 else 'FAIL'}")


def check_head_dim(d):
    """Wide heads (v41-flash: D=512, one KV head, window 128): bf16 errors and a timing."""
    worst = 0.0
    for window in (128, None):
        q, k, v, sk, cu_q, cu_k = make_inputs(2, 512, 8, 1, d, torch.bfloat16)
        do = torch.randn_like(q)
        leaves = [x.detach().requires_grad_() for x in (q, k, v, sk)]
        out = sink_attention_triton(*leaves, cu_q, cu_k, True, window)
        grads = torch.autograd.grad(out, leaves, do)
        ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v, sk)]
        ref = sink_attention_reference(*ref_leaves, cu_q, cu_k, True, window)
        ref_grads = torch.autograd.grad(ref, ref_leaves, do.double())
        errs = [rel_err(out, ref)] + [rel_err(g, r) for g, r in zip(grads, ref_grads)]
        worst = max(worst, max(errs) / 1e-2)
        print(f"check D={d} bf16 window={window} " + " ".join(
            f"{n}={e:.2e}" for n, e in zip(["out", "dq", "dk", "dv", "dsink"], errs)), flush=True)
    qd = torch.randn(16, 8, d, device=DEVICE, dtype=torch.bfloat16)
    kc = torch.randn(16 * 32, 64, 1, d, device=DEVICE, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    pt = torch.randperm(16 * 32, device=DEVICE, dtype=torch.int32).view(16, 32)
    sl = torch.randint(1, 2048, (16,), device=DEVICE, dtype=torch.int32)
    sk = torch.randn(8, device=DEVICE)
    e = rel_err(sink_decode_triton(qd, kc, vc, pt, sl, sk),
                sink_decode_reference(qd.double(), kc.double(), vc.double(), pt, sl, sk))
    worst = max(worst, e / 1e-2)
    print(f"check D={d} decode bf16 out={e:.2e}", flush=True)
    q, k, v, sk, cu_q, cu_k = make_inputs(1, 4096, 64, 1, d, torch.bfloat16)
    for window in (128, None):
        t = time_fwd_bwd(lambda a, b_, c, s_: sink_attention_triton(a, b_, c, s_, cu_q, cu_k,
                                                                    True, window),
                         (q, k, v, sk), torch.randn_like(q))
        print(f"time D={d} B=1 Hq=64 Hkv=1 S=4096 window={window}: fwd {t[0]:.3f} ms, "
              f"fwd+bwd {t[1]:.3f} ms", flush=True)
    print(f"check D={d}: worst error / tolerance = {worst:.3f} -> "
          f"{'PASS' if worst <= 1 else 'FAIL'}")


def make_decode(batch, ctx, hq, hkv, dtype, page_size=64):
    pages_per_seq = ctx // page_size
    num_pages = batch * pages_per_seq
    kc = torch.randn(num_pages, page_size, hkv, D, device=DEVICE, dtype=dtype)
    vc = torch.randn_like(kc)
    pt = torch.randperm(num_pages, device=DEVICE, dtype=torch.int32).view(batch, pages_per_seq)
    sl = torch.full((batch,), ctx, device=DEVICE, dtype=torch.int32)
    sl[::3] = ctx - 37  # ragged tails
    q = torch.randn(batch, hq, D, device=DEVICE, dtype=dtype)
    return q, kc, vc, pt, sl, torch.randn(hq, device=DEVICE)


def eager_sinks(q, k, v, sinks, scale):
    """gpt-oss style eager attention: extra sink logit column, softmax, drop it."""
    s = q.shape[2]
    qk = torch.matmul(q, k.transpose(-1, -2)) * scale
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    qk = qk.masked_fill(~mask, float("-inf"))
    col = sinks.to(qk.dtype).view(1, -1, 1, 1).expand(qk.shape[0], -1, s, 1)
    w = torch.softmax(torch.cat([qk, col], -1), dim=-1)[..., :-1]
    return torch.matmul(w, v)


def time_fwd_bwd(fn, inputs, do):
    leaves = [x.detach().requires_grad_() for x in inputs]
    t_fwd = do_bench(lambda: fn(*leaves), warmup=10, rep=50)

    def step():
        torch.autograd.grad(fn(*leaves), leaves, do)

    return t_fwd, do_bench(step, warmup=10, rep=50)


def sdpa_ceiling(qkv_bhsd, do_bhsd, scale):
    """Fastest SDPA without sinks over backends (flash, cuDNN) and layouts: (times, names)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    best = [(math.inf, "none"), (math.inf, "none")]
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        for layout in ("bshd", "bhsd"):
            ins = qkv_bhsd if layout == "bshd" else [x.contiguous() for x in qkv_bhsd]
            do = do_bhsd if layout == "bshd" else do_bhsd.contiguous()
            try:
                with sdpa_kernel(backend):
                    times = time_fwd_bwd(lambda a, b_, c: F.scaled_dot_product_attention(
                        a, b_, c, is_causal=True, scale=scale), ins, do)
            except RuntimeError:  # backend not available for this build/shape
                continue
            for i in (0, 1):
                if times[i] < best[i][0]:
                    best[i] = (times[i], f"{name}/{layout}")
    return (best[0][0], best[1][0]), (best[0][1], best[1][1])


def prefill_rows(s, blocks=None):
    q, k, v, sk, cu_q, cu_k = make_inputs(B, s, H, H, D, torch.bfloat16)
    do = torch.randn_like(q)
    scale = D ** -0.5
    fwd_flops, fb_flops = 2 * B * H * s * s * D, 3.5 * 2 * B * H * s * s * D

    def ours(q_, k_, v_, s_):
        return sink_attention_triton(q_, k_, v_, s_, cu_q, cu_k, True, None, scale, blocks)

    t_ours = time_fwd_bwd(ours, (q, k, v, sk), do)
    as_bhsd = [x.view(B, s, H, D).transpose(1, 2) for x in (q, k, v)]
    do_bhsd = do.view(B, s, H, D).transpose(1, 2)
    t_sdpa, sdpa_via = sdpa_ceiling(as_bhsd, do_bhsd, scale)
    try:
        t_eager = time_fwd_bwd(lambda a, b_, c, d_: eager_sinks(a, b_, c, d_, scale),
                               as_bhsd + [sk], do_bhsd)
    except torch.OutOfMemoryError:
        t_eager = (math.nan, math.nan)
    torch.cuda.empty_cache()
    rows = []
    for mode, idx, flops in (("fwd", 0, fwd_flops), ("fwd+bwd", 1, fb_flops)):
        tf = [flops / (t[idx] * 1e-3) / 1e12 for t in (t_ours, t_sdpa, t_eager)]
        rows.append(f"| {s:5d} | {mode:7s} | {t_ours[idx]:8.3f} | {tf[0]:7.1f} | {tf[1]:7.1f} | "
                    f"{tf[2]:8.1f} | {tf[0] / tf[1]:6.2f}x | {tf[0] / tf[2]:7.1f}x | "
                    f"{sdpa_via[idx]:12s} |")
    return rows


def decode_row(hkv):
    batch, ctx = 64, 8192
    q, kc, vc, pt, sl, sk = make_decode(batch, ctx, H, hkv, torch.bfloat16)
    t = do_bench(lambda: sink_decode_triton(q, kc, vc, pt, sl, sk), warmup=10, rep=100)
    read = sum(int(n) for n in sl.tolist()) * hkv * D * 2 * kc.element_size()
    gbs = read / (t * 1e-3) / 1e9
    src = torch.empty(kc.numel() * 2, dtype=kc.dtype, device=DEVICE)
    dst = torch.empty_like(src)
    t_copy = do_bench(lambda: dst.copy_(src), warmup=10, rep=100)
    copy_gbs = 2 * src.numel() * src.element_size() / (t_copy * 1e-3) / 1e9
    return (f"| decode B={batch} ctx={ctx} Hq={H} Hkv={hkv} D={D} bf16 page=64 | {t * 1e3:8.1f} us "
            f"| {gbs:7.0f} GB/s | copy {copy_gbs:7.0f} GB/s | {gbs / copy_gbs:5.2f}x |")


def sweep():
    base = default_prefill_blocks(D)
    fwd = [(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 4, 2), (64, 64, 4, 3)]
    dkdv = [(128, 32, 4, 3), (128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 8, 3), (128, 64, 8, 3)]
    dq = [(128, 32, 4, 3), (128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 8, 3), (128, 64, 8, 3)]
    combos = [dataclasses.replace(base, fwd_m=m, fwd_n=n, fwd_warps=w, fwd_stages=st)
              for m, n, w, st in fwd]
    combos += [dataclasses.replace(base, dkdv_n=a[0], dkdv_m=a[1], dkdv_warps=a[2],
                                   dkdv_stages=a[3], dq_m=b[0], dq_n=b[1], dq_warps=b[2],
                                   dq_stages=b[3]) for a, b in zip(dkdv, dq)]
    s = 4096
    q, k, v, sk, cu_q, cu_k = make_inputs(B, s, H, H, D, torch.bfloat16)
    do = torch.randn_like(q)
    fb_flops = 3.5 * 2 * B * H * s * s * D
    for blocks in combos:
        try:
            t_fwd, t_fb = time_fwd_bwd(lambda q_, k_, v_, s_: sink_attention_triton(
                q_, k_, v_, s_, cu_q, cu_k, True, None, None, blocks), (q, k, v, sk), do)
            print(f"{blocks}: fwd {t_fwd:.3f} ms ({2 * B * H * s * s * D / t_fwd / 1e9:.0f} TF) "
                  f"fwd+bwd {t_fb:.3f} ms ({fb_flops / t_fb / 1e9:.0f} TF) "
                  f"bwd {t_fb - t_fwd:.3f} ms", flush=True)
        except Exception as exc:  # a config that fails to compile must not end the sweep
            print(blocks, "failed:", repr(exc)[:300], flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", choices=("bf16", "fp32", "decode", "det"))
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--head-dim", type=int, help="only: wide-head correctness and timing")
    ap.add_argument("--seqs", default="1024,4096,8192")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"triton {__import__('triton').__version__}")
    if args.check:
        return check(args.check)
    if args.sweep:
        return sweep()
    if args.head_dim:
        return check_head_dim(args.head_dim)
    print(f"\nPrefill, bf16, causal, B={B} H={H} D={D}, sinks on for ours and eager, none for "
          "SDPA. TFLOP/s: fwd = 2*2*B*H*S^2*D/2, fwd+bwd = 3.5*2*B*H*S^2*D.")
    print("SDPA = the fastest of torch SDPA flash/cuDNN backends x [B,S,H,D]/[B,H,S,D] layouts "
          "(column 'SDPA via').")
    print("|     S | pass    | ours ms  | ours TF | SDPA TF | eager TF | vs SDPA | vs eager | "
          "SDPA via     |")
    print("|-------|---------|----------|---------|---------|----------|---------|----------|"
          "--------------|")
    for s in (int(x) for x in args.seqs.split(",")):
        for row in prefill_rows(s):
            print(row, flush=True)
    print("\nDecode (split-K, paged, sinks): GB/s = K+V bytes read / time; copy = torch "
          "copy_ of a tensor the size of both caches, (read + write) bytes / time.")
    for hkv in (8, 32):
        print(decode_row(hkv), flush=True)


if __name__ == "__main__":
    main()
