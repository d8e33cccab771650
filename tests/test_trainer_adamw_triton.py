"""The Triton AdamW kernel (trainer_bridge/adamw_triton.py), under TRITON_INTERPRET=1 on the CPU
(and on CUDA where there is one): torch's AdamW arithmetic over tensors of uneven sizes, the
clipping's grad_scale, the compute copies written from the updated parameters; refusals that
touch nothing; LocalShardAdamW with ComputeCopies: no refresh due after its step, the copies are
the stepped masters."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim.adam import adam

from sglang_dsv41.attention.triton_common import interpreting
from trainer_bridge.adamw_triton import (_FIELDS, DEFAULT_TILES, SQUARE_SUM_CHUNKS,
                                         AdamWTables, adamw_triton_, grad_square_sum)
from trainer_bridge.compute_copies import apply_compute_copies
from trainer_bridge.local_shards import LocalShardAdamW

DEVICES = [d for d in ("cpu", "cuda") if (d == "cpu" and interpreting())
           or (d == "cuda" and torch.cuda.is_available())]
pytestmark = pytest.mark.skipif(not DEVICES, reason="needs TRITON_INTERPRET=1 or CUDA")
BLOCK = DEFAULT_TILES[0]
SIZES = [(BLOCK + 3,), (7, 5), (1,), (0,), (2, BLOCK // 2 + 1)]  # a tensor past one chunk


def tensors(device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(device) for s in SIZES]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaled,tiles", [(False, None), (True, None), (True, (64, 2))],
                         ids=["no-scale", "grad-scale", "grad-scale-64x2"])
def test_equals_torch_adamw_and_writes_the_copies(device, scaled, tiles):
    hyper = dict(lr=3e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    ours, ref = tensors(device), tensors(device)
    m_ours, v_ours = ([torch.zeros_like(p) for p in ours] for _ in range(2))
    m_ref, v_ref = ([torch.zeros_like(p) for p in ref] for _ in range(2))
    s_ours, s_ref = ([torch.zeros((), device=device) for _ in ours] for _ in range(2))
    copies = [torch.empty_like(p, dtype=torch.bfloat16) if i % 2 == 0 else None
              for i, p in enumerate(ours)]
    for step in range(3):
        grads = tensors(device, seed=10 + step)
        scale = torch.tensor(2.5 + step, device=device) if scaled else None
        g_ours = [g.clone() for g in grads]
        adamw_triton_(ours, g_ours, m_ours, v_ours, s_ours, copies, grad_scale=scale,
                      tiles=tiles, **hyper)
        g_ref = [g / scale if scaled else g.clone() for g in grads]
        adam(ref, g_ref, m_ref, v_ref, [], s_ref, foreach=False, capturable=False,
             differentiable=False, fused=None, grad_scale=None, found_inf=None,
             has_complex=False, amsgrad=False, maximize=False, decoupled_weight_decay=True,
             **hyper)
        for a, b in zip(ours + m_ours + v_ours, ref + m_ref + v_ref):
            torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
        for g_o, g in zip(g_ours, grads):  # only read (torch's fused kernel leaves them divided)
            assert torch.equal(g_o, g)
        assert all(float(s) == step + 1 for s in s_ours)
        for c, p in zip(copies, ours):
            if c is not None:
                assert torch.equal(c, p.to(torch.bfloat16))


@pytest.mark.parametrize("device", DEVICES)
def test_refusals_touch_nothing(device):
    p = tensors(device)
    before = [t.clone() for t in p]
    state = [[torch.zeros_like(t) for t in p] for _ in range(3)]
    steps = [torch.zeros((), device=device) for _ in p]
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0)
    bad = {
        "lengths": (p, *state[:2], state[2][:-1], steps, [None] * len(p)),
        "dtype": ([t.double() for t in p], *state, steps, [None] * len(p)),
        "layout": ([t.t() if t.dim() == 2 else t for t in p], *state, steps, [None] * len(p)),
        "copy dtypes": (p, *state, steps,
                        [torch.empty_like(p[0], dtype=torch.bfloat16),
                         torch.empty_like(p[1], dtype=torch.float16)] + [None] * (len(p) - 2)),
        "copy shape": (p, *state, steps, [torch.empty(3, dtype=torch.bfloat16, device=device)]
                       + [None] * (len(p) - 1)),
    }
    for name, args in bad.items():
        with pytest.raises(ValueError, match="adamw_triton_"):
            adamw_triton_(*args, **hyper)
        assert all(torch.equal(a, b) for a, b in zip(p, before)), name
        assert all(float(s) == 0 for s in steps), name
    # Kept tables: a step, then a gradient of another dtype is still refused (and moves nothing
    # further: the step counts stay at the first step's 1).
    tables = AdamWTables()
    grads = [torch.zeros_like(t) for t in p]
    adamw_triton_(p, grads, *state[1:], steps, [None] * len(p), tables=tables, **hyper)
    kept = [t.clone() for t in p]
    grads[1] = grads[1].double()
    with pytest.raises(ValueError, match="adamw_triton_"):
        adamw_triton_(p, grads, *state[1:], steps, [None] * len(p), tables=tables, **hyper)
    assert all(torch.equal(a, b) for a, b in zip(p, kept)) and all(float(s) == 1 for s in steps)
    with pytest.raises(ValueError, match="power of two"):
        adamw_triton_(p, *state, steps, [None] * len(p), tiles=(100, 4), **hyper)
        assert all(torch.equal(a, b) for a, b in zip(p, before)), name
        assert all(float(s) == 0 for s in steps), name


class Gain(nn.Module):
    """A parameter kept fp32 (no compute copy), applied in fp32 as the model's mHC ones are."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return (x.float() * self.weight).to(x.dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_local_shard_adamw_writes_the_compute_copies(device):
    """Two models, one stepped by torch's AdamW then refreshed as before, one by the Triton
    kernel: the same masters, and the kernel's copies already the masters' (no refresh due),
    over steps with the clipping folded in."""
    results = []
    for kernel in ("torch", "triton"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(40, 30), Gain(30), nn.Linear(30, 7)).to(device)
        copies = apply_compute_copies(model, torch.bfloat16, lambda n: n.startswith("1."))
        # each copy on a 16-byte boundary (30 bf16 biases would put the next one off it)
        assert all(c.data_ptr() % 16 == 0 for c in copies.copies)
        opt = LocalShardAdamW(model.parameters(), lr=1e-2, weight_decay=0.05,
                              fused=True if device == "cuda" else None, kernel=kernel,
                              compute_copies=copies if kernel == "triton" else None)
        x = torch.randn(16, 40, generator=torch.Generator().manual_seed(1)).to(device)
        for _ in range(3):
            model(x.bfloat16()).float().square().sum().backward()
            opt.clip_and_step(0.5)  # torch on the CPU: clips, then steps (not fused)
            opt.zero_grad(set_to_none=True)
            if kernel == "triton":
                assert not copies._stepped  # the step wrote them: no refresh due
                assert all(torch.equal(c, m.to(c.dtype))
                           for c, m in zip(copies.copies, copies.masters))
        results.append([p.detach().clone() for p in copies.masters])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_triton_kernel_refuses_amsgrad():
    with pytest.raises(ValueError, match="amsgrad"):
        LocalShardAdamW([nn.Parameter(torch.zeros(3))], amsgrad=True, kernel="triton")


def test_kernel_compiles_for_the_h200_with_16_byte_accesses():
    """Compiled for sm_90 here: with the alignment multiples the whole blocks move 16-byte
    vectors (v4) for every gradient kind (fp32, pending, both: a constant per launch), in the
    step and the norm; without them (a tensor off a 16-byte boundary) every access is
    scalar."""
    import re

    from triton_compile import compile_many_sm90

    common = {"f32_ptr": "*fp32", "copy_ptr": "*bf16", "table_ptr": "*i64", "chunk_ptr": "*i32"}
    types = {**common, "coef_ptr": "*fp32", "scale_ptr": "*fp32", "lr": "fp32",
             "beta1": "fp32", "beta2": "fp32", "eps": "fp32", "weight_decay": "fp32"}
    specs = [("trainer_bridge.adamw_triton", "_adamw_kernel", types,
              dict(HAS_SCALE=True, ROUNDING="tf32", F32_MULTIPLE=f32, COPY_MULTIPLE=cp,
                   GRAD=grad, FIELDS=_FIELDS, BLOCK=DEFAULT_TILES[0]), DEFAULT_TILES[1])
             for f32, cp, grad in ((1, 1, 0), (4, 8, 0), (4, 8, 1), (4, 8, 2))]
    specs += [("trainer_bridge.adamw_triton", "_square_sum_kernel",
               {**common, "out_ptr": "*fp32", "n_chunks": "i32"},
               dict(F32_MULTIPLE=4, COPY_MULTIPLE=8, GRAD=grad, FIELDS=_FIELDS,
                    BLOCK=DEFAULT_TILES[0], CHUNKS=SQUARE_SUM_CHUNKS), DEFAULT_TILES[1])
              for grad in (0, 1)]
    scalar, *aligned = (len(re.findall(r"ld\.global[^\n]*\.v4", ptx))
                        for ptx in compile_many_sm90(specs))
    assert scalar == 0 and all(n > 0 for n in aligned), (scalar, aligned)
    # the fp32 step's vectors: p, g, m, v (4); pending alone reads its gradient as bf16 vectors
    assert aligned[0] >= aligned[1], aligned


def test_bad_adamw_kernel_settings_are_refused(monkeypatch):
    """optim.adamw_kernel: an unknown value is refused by the config; triton where the
    parameters are on the CPU and Triton is not interpreted is refused by build_optimizer
    with the reason, before any optimizer exists."""
    from types import SimpleNamespace

    from trainer_bridge import schedule
    from trainer_bridge.config import OptimConfig, load_config

    with pytest.raises(ValueError, match="optim.adamw_kernel"):
        OptimConfig(adamw_kernel="fast")
    with pytest.raises(ValueError, match="adamw_kernel"):
        load_config("tiny", None, ["optim.adamw_kernel=fast"])
    model = nn.Linear(3, 2)
    policy = SimpleNamespace(model=model, trainable_parameters=model.named_parameters)
    monkeypatch.setattr(schedule, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="must be on CUDA"):
        schedule.build_optimizer(policy, OptimConfig(adamw_kernel="triton"), 2)
    opt, _ = schedule.build_optimizer(policy, OptimConfig(), 2)  # auto: torch's here
    assert opt.kernel == "torch"


@pytest.mark.parametrize("device", DEVICES)
def test_pending_gradients_equal_the_folded_ones(device):
    """The kernels read a gradient pending in the copies' dtype (alone, or added to an fp32
    one) as its fold into fp32 would be: the same step to the bit, the same sum of squares;
    a parameter with neither is refused."""
    hyper = dict(lr=3e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    grads = tensors(device, seed=3)
    pending = [g.bfloat16() if i != 1 else None for i, g in enumerate(grads)]
    f32 = [None if i == 0 else g * 0.5 for i, g in enumerate(grads)]  # 0: pending alone
    folded = [(a if a is not None else 0) + (b.float() if b is not None else 0)
              for a, b in zip(f32, pending)]
    folded = [torch.as_tensor(t).expand(p.shape).contiguous() for t, p in zip(folded, grads)]
    runs = []
    for gs, pend in ((f32, pending), (folded, None)):
        ours = tensors(device)
        state = [[torch.zeros_like(p) for p in ours] for _ in range(2)]
        steps = [torch.zeros((), device=device) for _ in ours]
        copies = [torch.empty_like(p, dtype=torch.bfloat16) for p in ours]
        sq = grad_square_sum(ours, gs, *state, copies, pend)
        adamw_triton_(ours, gs, *state, steps, copies, pending=pend,
                      grad_scale=torch.tensor(2.0, device=device), **hyper)
        runs.append((ours, sq))
    for a, b in zip(runs[0][0], runs[1][0]):
        assert torch.equal(a, b)
    want = sum(float(t.double().square().sum()) for t in folded)
    assert abs(float(runs[0][1]) - want) <= 1e-6 * want
    assert float(runs[0][1]) == float(runs[1][1])
    p = tensors(device)
    state = [[torch.zeros_like(t) for t in p] for _ in range(2)]
    with pytest.raises(ValueError, match="no gradient"):
        adamw_triton_(p, [None] * len(p), *state, [torch.zeros((), device=device)] * len(p),
                      [None] * len(p), **hyper)


@pytest.mark.parametrize("device", DEVICES)
def test_pending_gradients_reach_every_reader(device):
    """After a deferred backward the masters' gradients are pending: another optimizer's step
    (torch's SGD) and the next forward fold them into .grad first; the reader's zero_grad drops
    them; its clip_and_step reads them as the written ones (same masters after the step)."""
    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(40, 30), Gain(30), nn.Linear(30, 7)).to(device)
        copies = apply_compute_copies(model, torch.bfloat16, lambda n: n.startswith("1."))
        opt = LocalShardAdamW(model.parameters(), lr=1e-2, kernel="triton",
                              fused=True if device == "cuda" else None, compute_copies=copies)
        return model, copies, opt

    x = torch.randn(16, 40, generator=torch.Generator().manual_seed(1)).to(device)

    def backward(model, copies, defer):
        if defer:
            copies.defer_next_backward()
        model(x.bfloat16()).float().square().sum().backward()

    model, copies, opt = build()
    backward(model, copies, defer=False)
    written = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.clip_and_step(0.5)
    after_written = [p.detach().clone() for p in model.parameters()]

    model, copies, opt = build()
    backward(model, copies, defer=True)
    assert len(copies.pending) == 4 and model[0].weight.grad is None  # Gain's stays fp32
    torch.optim.SGD(model.parameters(), lr=0.0).step()  # reads .grad: settled first
    assert not copies.pending
    assert all(torch.equal(p.grad, written[n]) for n, p in model.named_parameters())
    opt.zero_grad(set_to_none=True)
    backward(model, copies, defer=True)
    with torch.no_grad():
        model(x.bfloat16())  # a forward settles them too
    assert not copies.pending and torch.equal(model[0].weight.grad, written["0.weight"])
    opt.zero_grad(set_to_none=True)
    backward(model, copies, defer=True)
    opt.zero_grad(set_to_none=True)  # dropped with the rest
    assert not copies.pending and model[0].weight.grad is None
    backward(model, copies, defer=True)
    opt.clip_and_step(0.5)
    assert not copies.pending
    for a, b in zip(after_written, model.parameters()):
        assert torch.equal(a, b)
