"""DSV4 sparse sink attention kernels against the float64 torch reference.

CI runs these on the CPU under TRITON_INTERPRET=1 (tiny shapes, 16-wide tiles); on a CUDA
machine they run on the GPU. Inputs are drawn fresh each run (`seed` fixture); the reference sees
the same rounded inputs upcast to float64.
"""

import dataclasses
import functools
import os

import pytest
import torch

from sglang_dsv41.attention import dsv4_attention
from sglang_dsv41.attention.dsv4_reference import dsv4_attention_reference
from sglang_dsv41.attention.dsv4_triton_backward import dsv4_attention_triton
from sglang_dsv41.attention.dsv4_triton_forward import DSV4Blocks, default_blocks, selection_tile
from sglang_dsv41.attention.triton_common import ptx_global_loads, wgmma_applies

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                reason="Triton needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cpu" if INTERPRET else "cuda"
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-3}


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                        device=DEVICE)


def _rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300)).item()


def hca_selection(lens, ratio):
    """Every compressed block complete before the query, per packed sequence (the HCA rule)."""
    rows, base, most = [], 0, max(max(lens) // ratio, 1)
    for n in lens:
        for pos in range(n):
            ready = (pos + 1) // ratio
            rows.append([base + c for c in range(ready)] + [-1] * (most - ready))
        base += n // ratio
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE), base


def csa_selection(lens, ratio, topk, gen):
    """Random top-k of the blocks complete before the query, no repeats, invalid picks -1 last."""
    rows, base = [], 0
    for n in lens:
        for pos in range(n):
            ready = (pos + 1) // ratio
            pick = (torch.randperm(ready, generator=gen)[:topk] + base).tolist()
            rows.append(pick + [-1] * (topk - len(pick)))
        base += n // ratio
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE), base


def _compare(lens, heads, dim, window, dtype, comp_rows, comp_idx, with_sinks=True, scale=0.2,
             blocks=None):
    total = sum(lens)
    q = torch.randn(total, heads, dim, device=DEVICE).to(dtype)
    kv = torch.randn(total, dim, device=DEVICE).to(dtype)
    sinks = torch.randn(heads, device=DEVICE) if with_sinks else None
    comp = torch.randn(comp_rows, dim, device=DEVICE).to(dtype) if comp_idx is not None else None
    ins = [x for x in (q, kv, sinks, comp) if x is not None]
    dout = torch.randn(total, heads, dim, device=DEVICE).to(dtype)

    def run(leaves, fn, grad_out=dout, **kw):
        it = iter(leaves)
        args = [next(it), next(it), next(it) if with_sinks else None, _cu(lens), window, scale,
                next(it) if comp is not None else None, comp_idx]
        out = fn(*args, **kw)
        # The reference never reads a 0-row comp_kv: its gradient is then zeros, not absent.
        grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype), allow_unused=True)
        return out, [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]

    ours = functools.partial(dsv4_attention, backend="triton") if blocks is None else \
        functools.partial(dsv4_attention_triton, blocks=blocks)
    out, grads = run([x.clone().requires_grad_() for x in ins], ours)
    ref, ref_grads = run([x.double().requires_grad_() for x in ins], dsv4_attention_reference)
    names = ["q", "kv", "sinks", "comp_kv"][:len(ins)] if with_sinks else ["q", "kv", "comp_kv"]
    if comp_rows == 0 and comp is not None:
        assert not grads[-1].any() and grads[-1].shape == (0, dim)
        grads, ref_grads = grads[:-1], ref_grads[:-1]
    if with_sinks:
        # dsinks[h] = -sum_t P_sink[t, h] * (dO . O)[t, h], and the kernel's dO . O reads its
        # own rounded output, as FlashAttention's does: a few sums whose terms can cancel, so
        # that rounding alone (0.2-0.4% a term in bf16) can pass 1% of the sum. Its reference
        # is the float64 one with dO . O taken from our output: the reference's gradient under
        # dO scaled per (token, head) by ours / exact (dsinks is linear in dO . O).
        exact = (dout.double() * ref.detach()).sum(-1, keepdim=True)
        own = (dout.double() * out.detach().double()).sum(-1, keepdim=True)
        ratio = torch.where(exact == 0, 1.0, own / exact)
        ref_grads[2] = run([x.double().requires_grad_() for x in ins], dsv4_attention_reference,
                           grad_out=dout.double() * ratio)[1][2]
    errs = {"out": _rel(out, ref)} | {f"d{n}": _rel(g, r) for n, g, r in
                                     zip(names, grads, ref_grads)}
    bad = {k: v for k, v in errs.items() if not v <= TOL[dtype]}
    assert not bad, f"relative errors over {TOL[dtype]}: {bad} (all: {errs})"
    return out, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
def test_every_layer_kind_matches_float64_reference(seed, kind, dtype):
    # Three packed sequences: one shorter than the window, windows cut at each start.
    lens, ratio, gen = [5, 37, 22], 4, torch.Generator().manual_seed(seed)
    comp_idx, rows = {"sliding": (None, 0), "hca": hca_selection(lens, ratio),
                      "csa": csa_selection(lens, ratio, 3, gen)}[kind]
    _compare(lens, heads=4, dim=32, window=16, dtype=dtype, comp_rows=rows, comp_idx=comp_idx)


def test_padding_empty_selection_and_no_sinks(seed):
    lens, gen = [9, 20], torch.Generator().manual_seed(seed)
    idx, rows = csa_selection(lens, 2, 4, gen)
    # Whole tiles of -1 (skipped by the kernels) and queries that select nothing.
    idx = torch.cat([idx, torch.full((idx.shape[0], 20), -1, dtype=torch.int32,
                                     device=DEVICE)], 1)
    _compare(lens, heads=3, dim=48, window=8, dtype=torch.float32, comp_rows=rows,
             comp_idx=idx, with_sinks=False)
    # An empty compressed set (no rows at all), and K = 0.
    empty = torch.full((sum(lens), 2), -1, dtype=torch.int32, device=DEVICE)
    _compare(lens, heads=3, dim=32, window=8, dtype=torch.float32, comp_rows=0, comp_idx=empty)
    _compare(lens, heads=3, dim=32, window=8, dtype=torch.float32, comp_rows=0,
             comp_idx=empty[:, :0])


def test_selection_tiles_narrower_than_the_window_tiles(seed):
    # 32-key tiles and 3 picks: the forward walks the picks in 16-key tiles
    # (what HCA at 4k tokens does on the GPU with 64-key tiles and 32 picks).
    lens, gen = [21, 14], torch.Generator().manual_seed(seed)
    idx, rows = csa_selection(lens, 2, 3, gen)
    blocks = dataclasses.replace(default_blocks(4), fwd_bn=32, ds_bn=32, dq_bn=32)
    assert selection_tile(idx.shape[1], blocks.fwd_bn, blocks) == 16
    _compare(lens, 4, 32, 20, torch.float32, rows, idx, blocks=blocks)


def test_window_slots_in_whole_tiles_and_aligned_tails(seed):
    # A 40-key window in 32-slot tiles: a token's window slots (from its first key rounded down
    # to 16) are 40-55, so the dQ pass takes one whole tile and one or two 16-slot ones, and the
    # window dKV pass's 32-key blocks meet tokens whose slots start at any multiple of 16;
    # packed sequences start at unaligned rows.
    lens, gen = [70, 45, 3], torch.Generator().manual_seed(seed)
    idx, rows = csa_selection(lens, 4, 3, gen)
    blocks = dataclasses.replace(default_blocks(4), dq_bn=32, dkv_bn=32, ds_bn=32)
    _compare(lens, 4, 32, 40, torch.float32, rows, idx, blocks=blocks)


def test_selection_over_several_tiles(seed):
    # Up to 40 picks in 16-key tiles: the P/dS pass adds a selection tile's dKV in the loop that
    # scores the next tile; tokens whose picks end inside a tile, on a tile's edge (16, 32), or
    # fill three tiles.
    lens, gen = [60, 33], torch.Generator().manual_seed(seed)
    idx, rows = csa_selection(lens, 1, 40, gen)
    blocks = dataclasses.replace(default_blocks(4), fwd_bn=16, ds_bn=16, dq_bn=16)
    _compare(lens, 4, 32, 8, torch.float32, rows, idx, blocks=blocks)


@pytest.mark.skipif(INTERPRET, reason="the GPU's own tiles at real head shapes: too slow for "
                                        "the interpreter (its tiles are 16 wide)")
@pytest.mark.parametrize("heads", [16, 48, 64])
@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
def test_gpu_tiles_at_real_head_shapes(seed, kind, heads):
    # default_blocks(heads) on the GPU: 64-head blocks with 4-warp P/dS steps (48 heads: a
    # quarter of each block's rows masked), or the 16-head tiles; on sm_90 at 48 and 64 heads
    # the forward is dsv4_gluon's kernel. D 512 and window 128 as in V4-Flash, two packed
    # sequences longer than the window; CSA with up to 150 picks: three 64-key selection tiles
    # (the P/dS pass's fused loop); sliding without sinks.
    lens, gen = [300, 211], torch.Generator().manual_seed(seed)
    idx, rows = {"sliding": (None, 0), "hca": hca_selection(lens, 16),
                 "csa": csa_selection(lens, 2, 150, gen)}[kind]
    _compare(lens, heads, 512, 128, torch.bfloat16, rows, idx, with_sinks=kind != "sliding")


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available() or not wgmma_applies(
    torch.empty(1, 64, 512, device="cuda", dtype=torch.bfloat16)),
    reason="the Gluon forward needs an sm_90 GPU and Gluon")
def test_gpu_forward_at_64_heads_is_the_gluon_kernel(seed, monkeypatch):
    """At 64 heads, bf16, D 512 on sm_90 the forward never launches the Triton kernel, and its
    output and LSE (which the backward reads) agree with the Triton forward's (fwd_wgmma off)."""
    from sglang_dsv41.attention import dsv4_triton_forward as fwd
    from sglang_dsv41.attention.dsv4_reference import sequence_first_rows

    lens, gen = [300, 211], torch.Generator().manual_seed(seed)
    idx, rows = csa_selection(lens, 2, 150, gen)
    total = sum(lens)
    q = torch.randn(total, 64, 512, device=DEVICE, dtype=torch.bfloat16)
    kv = torch.randn(total, 512, device=DEVICE, dtype=torch.bfloat16)
    comp = torch.randn(rows, 512, device=DEVICE, dtype=torch.bfloat16)
    sinks = torch.randn(64, device=DEVICE)
    ckv, cidx, sel_end = fwd.selection_or_empty(comp, idx, total, 512, kv)
    args = (q, kv, sinks, sequence_first_rows(_cu(lens), total), 128, 512 ** -0.5, ckv, cidx,
            sel_end)
    triton_kernel = fwd._dsv4_fwd_kernel
    with monkeypatch.context() as m:
        m.setattr(fwd, "_dsv4_fwd_kernel", None)  # launching it would raise TypeError
        out, lse = fwd.dsv4_forward(*args, default_blocks(64))
    assert fwd._dsv4_fwd_kernel is triton_kernel
    out_t, lse_t = fwd.dsv4_forward(*args, dataclasses.replace(default_blocks(64),
                                                               fwd_wgmma=False))
    assert _rel(out, out_t) < 1e-2
    assert (lse - lse_t).abs().max().item() < 1e-2


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available() or not wgmma_applies(
    torch.empty(1, 64, 512, device="cuda", dtype=torch.bfloat16)),
    reason="the Gluon forward needs an sm_90 GPU and Gluon")
def test_gpu_forward_runs_are_bitwise_equal(seed):
    """The Gluon forward has no atomics and a fixed order of sums: repeated runs agree to the
    bit (a tile read before all of its copies landed would not), over 2,048 tokens of CSA with
    up to 512 picks (up to ten key tiles a token) and of HCA (three)."""
    from sglang_dsv41.attention import dsv4_triton_forward as fwd
    from sglang_dsv41.attention.dsv4_reference import sequence_first_rows

    gen = torch.Generator().manual_seed(seed)
    lens = [2048]
    total = sum(lens)
    q = torch.randn(total, 64, 512, device=DEVICE, dtype=torch.bfloat16)
    kv = torch.randn(total, 512, device=DEVICE, dtype=torch.bfloat16)
    sinks = torch.randn(64, device=DEVICE)
    first = sequence_first_rows(_cu(lens), total)
    for idx, rows in (csa_selection(lens, 2, 512, gen), hca_selection(lens, 128)):
        comp = torch.randn(rows, 512, device=DEVICE, dtype=torch.bfloat16)
        ckv, cidx, sel_end = fwd.selection_or_empty(comp, idx, total, 512, kv)
        runs = [fwd.dsv4_forward(q, kv, sinks, first, 128, 512 ** -0.5, ckv, cidx, sel_end,
                                 default_blocks(64)) for _ in range(4)]
        for out, lse in runs[1:]:
            assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1])


def test_a_gluon_forward_this_triton_cannot_build_falls_back(seed, monkeypatch, caplog):
    """Where the Gluon forward does not build, the forward warns once and runs the Triton
    kernel, with the same results."""
    from types import SimpleNamespace

    from sglang_dsv41.attention import dsv4_triton_forward as fwd, triton_common

    monkeypatch.setattr(triton_common, "_warned", set())
    monkeypatch.setattr(fwd, "wgmma_applies", lambda *tensors: True)
    monkeypatch.setattr(fwd, "gluon_kernels", lambda: SimpleNamespace(
        launch_forward=lambda *args, **kwargs: "CompilationError: no such builtin"))
    lens, gen = [21, 14], torch.Generator().manual_seed(seed)
    idx, rows = csa_selection(lens, 2, 3, gen)
    with caplog.at_level("WARNING", logger=triton_common.__name__):
        for _ in range(2):
            _compare(lens, 4, 32, 8, torch.float32, rows, idx)
    warned = [r.getMessage() for r in caplog.records if "does not build" in r.getMessage()]
    assert len(warned) == 1 and "forward" in warned[0] and "no such builtin" in warned[0]


def test_dsink_and_window_dkv_are_bitwise_deterministic(seed):
    # dkv of the window keys comes from the key-major kernel (one owner per key, no atomics).
    lens = [30, 17]
    idx, rows = hca_selection(lens, 4)
    runs = []
    for _ in range(2):
        torch.manual_seed(seed)
        grads = _compare(lens, 4, 32, 8, torch.float32, rows, idx)[1]
        runs.append((grads[2], grads[1]))
    assert torch.equal(runs[0][0], runs[1][0]), f"dsink differs between identical runs: {runs}"
    assert torch.equal(runs[0][1], runs[1][1]), "window dkv differs between identical runs"


def test_backward_passes_read_ds_and_p_as_asynchronous_copies():
    """Without a GPU: the dQ and window dKV passes at the 64-head GPU tiles, built for sm_90 with
    this Triton, load their dS and P tiles (and every other operand of their loops) with cp.async
    and no plain 16-bit global load: each token's slots read as whole aligned vectors. Slots
    started at a token's own window start were gathered element by element, 64 scalar loads a
    thread in the window dKV pass."""
    from triton_compile import compile_many_sm90

    from sglang_dsv41.attention.dsv4_triton_backward import dkv_window_rows

    b = DSV4Blocks()
    bhh, tb = dkv_window_rows(64, b)
    ptrs = ("q_ptr", "kv_ptr", "comp_ptr", "do_ptr", "p_ptr", "ds_ptr", "dq_ptr", "dkv_ptr")
    types = {n: "*bf16" for n in ptrs} | {n: "*i32" for n in ("idx_ptr", "end_ptr", "first_ptr")}
    ints = ("T", "H", "D", "window", "wslots", "ds_row", "num_sel", "stride_qt", "stride_qh",
            "stride_kv", "stride_c", "stride_idx")
    types |= {n: "i32" for n in ints}
    module = "sglang_dsv41.attention.dsv4_triton_backward"
    ptx = compile_many_sm90([
        (module, "_dsv4_dq_kernel", types,
         dict(BH=b.dq_bh, BN=b.dq_bn, BD=b.dq_bd, DOT_PREC="tf32"), b.dq_warps, ints,
         b.dq_stages),
        (module, "_dsv4_dkv_window_kernel", types,
         dict(BN=b.dkv_bn, BHH=bhh, TB=tb, BD=b.dkv_bd, DOT_PREC="tf32"), b.dkv_warps, ints,
         b.dkv_stages)])
    for name, p in zip(("dQ", "window dKV"), ptx):
        copies, plain, scalar = ptx_global_loads(p)
        assert copies and not scalar, f"{name}: {copies} cp.async, {scalar} 16-bit loads"
        assert name != "window dKV" or not plain, f"window dKV: {plain} plain global loads"


def test_hostile_inputs_get_clear_errors():
    q, kv = torch.randn(6, 2, 16), torch.randn(6, 16)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    comp = torch.randn(3, 16)
    with pytest.raises(ValueError, match="end at T=6"):
        dsv4_attention(q, kv, None, torch.tensor([0, 5], dtype=torch.int32), 4, 1.0)
    with pytest.raises(ValueError, match=r"lie in \[-1, 3\)"):
        dsv4_attention(q, kv, None, cu, 4, 1.0, comp, torch.full((6, 1), 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="without comp_kv"):
        dsv4_attention(q, kv, None, cu, 4, 1.0, None, torch.zeros(6, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="share a dtype"):
        dsv4_attention(q, kv.double(), None, cu, 4, 1.0)
    with pytest.raises(ValueError, match="unknown"):
        dsv4_attention(q, kv, None, cu, 4, 1.0, backend="cuda_magic")
    # Tile sizes become tl.arange extents: a bad one is refused where it is set, not in Triton.
    with pytest.raises(ValueError, match=r"DSV4Blocks.ds_bd=48: must be a power of two >= 16"):
        DSV4Blocks(ds_bd=48)
    with pytest.raises(ValueError, match=r"DSV4Blocks.fwd_bn=8"):
        dataclasses.replace(default_blocks(4), fwd_bn=8)
    with pytest.raises(ValueError, match=r"DSV4Blocks.dkv_rows=24"):
        DSV4Blocks(dkv_rows=24)
