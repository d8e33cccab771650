"""AdamW as one Triton kernel over every tensor of a parameter group, which also writes each
parameter's compute-dtype copy (compute_copies.py) as it stores the parameter.

Without it a step on one rank with compute copies is torch's fused AdamW (reads parameter,
gradient and both moments, writes them back: the gradient too when the clipping rides in as
``grad_scale``) and then ``ComputeCopies.refresh``, a second pass that reads every fp32
parameter again to write its copy: 38 bytes a parameter. Here the copy is written from the
updated value still in registers, and the gradient, divided by ``grad_scale`` as it is read, is
not written back (torch's kernel leaves it divided; nothing reads a gradient between the step
and the next zero_grad): 30 bytes. The arithmetic is torch's (decoupled weight decay, bias
corrections from each tensor's own step count); the results equal torch's to fp32 rounding, not
to the bit (the bias corrections are computed by torch on the stacked step counts, torch's
kernel computes them in its own).

Tensors are reached through a table of element offsets from two anchor tensors the kernel takes
as arguments (one fp32, one of the copies' dtype; one row per tensor: parameter, gradient, the
moments, the copy, whether there is a copy, the element count) and programs through a table of
(tensor, chunk) pairs: one launch for the group, whatever the number of tensors. When every
tensor starts on a 16-byte boundary (ComputeCopies aligns its views) the offsets are declared
multiples of 16 bytes, which lets the loads and stores be 16-byte vectors: with raw addresses
read from a table the compiler knows no alignment and moves 4 bytes at a time (23.2 vs 17.1 ms
for torch's kernel over the ``small`` preset on an H200; 13.9 ms with vectors and the tiles
below, bench/results/train_h200.txt run Y).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_dsv41.attention.triton_common import dot_precision, to_dtype

from .compute_copies import ALIGN_BYTES

# (elements a program updates, warps). On an H200 over the small preset's 1.46B parameters
# (bench/train_ops.py adamw --tiles, bench/results/train_h200.txt run Y): 2048x8 13.86 ms,
# 1024x4 13.98, 8192x16 14.65, 2048x4 15.05, 4096x8 16.84; torch's fused kernel and the
# copies' refresh 17.11. bench/train.py --adamw-tiles sets this for its run.
DEFAULT_TILES = (2048, 8)
_FIELDS = 7  # param, grad, exp_avg, exp_avg_sq, copy offsets; has copy; numel


@triton.jit
def _offset(row, k: tl.constexpr, MULTIPLE: tl.constexpr):
    off = tl.load(row + k)
    if MULTIPLE > 1:
        off = tl.multiple_of(off, MULTIPLE)
    return off


@triton.jit
def _adamw_kernel(f32_ptr, copy_ptr, table_ptr, chunk_ptr, coef_ptr, scale_ptr, lr, beta1,
                  beta2, eps, weight_decay, HAS_SCALE: tl.constexpr, ROUNDING: tl.constexpr,
                  F32_MULTIPLE: tl.constexpr, COPY_MULTIPLE: tl.constexpr,
                  FIELDS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    i = tl.load(chunk_ptr + 2 * pid)
    start = tl.load(chunk_ptr + 2 * pid + 1).to(tl.int64) * BLOCK
    row = table_ptr + i * FIELDS
    p_ptr = f32_ptr + _offset(row, 0, F32_MULTIPLE)
    g_ptr = f32_ptr + _offset(row, 1, F32_MULTIPLE)
    m_ptr = f32_ptr + _offset(row, 2, F32_MULTIPLE)
    v_ptr = f32_ptr + _offset(row, 3, F32_MULTIPLE)
    c_ptr = copy_ptr + _offset(row, 4, COPY_MULTIPLE)
    has_copy = tl.load(row + 5)
    numel = tl.load(row + 6)
    step_size = tl.load(coef_ptr + 2 * i)  # lr / (1 - beta1^step)
    bc2_sqrt = tl.load(coef_ptr + 2 * i + 1)  # sqrt(1 - beta2^step)
    offs = start + tl.arange(0, BLOCK)
    # A whole block unmasked: a mask against a count of unknown alignment would keep every
    # access scalar.
    if start + BLOCK <= numel:
        _update(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, has_copy, offs, numel, step_size, bc2_sqrt,
                scale_ptr, lr, beta1, beta2, eps, weight_decay, HAS_SCALE, ROUNDING, False)
    else:
        _update(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, has_copy, offs, numel, step_size, bc2_sqrt,
                scale_ptr, lr, beta1, beta2, eps, weight_decay, HAS_SCALE, ROUNDING, True)


@triton.jit
def _update(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, has_copy, offs, numel, step_size, bc2_sqrt,
            scale_ptr, lr, beta1, beta2, eps, weight_decay, HAS_SCALE: tl.constexpr,
            ROUNDING: tl.constexpr, MASKED: tl.constexpr):
    mask = offs < numel if MASKED else None
    p = tl.load(p_ptr + offs, mask=mask, other=0.0 if MASKED else None)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0 if MASKED else None)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0 if MASKED else None)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0 if MASKED else None)
    if HAS_SCALE:
        g = g / tl.load(scale_ptr)
    p = p * (1.0 - lr * weight_decay)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * (m / (tl.sqrt(v) / bc2_sqrt + eps))
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if has_copy != 0:  # round to nearest even (to_dtype: also in the interpreter)
        tl.store(c_ptr + offs, to_dtype(p, c_ptr.dtype.element_ty, ROUNDING), mask=mask)


_COPY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class AdamWTables:
    """A group's device tables, kept between steps: the (tensor, chunk) pairs, rebuilt when the
    element counts change; the offsets, rebuilt (and the tensors checked) when an address, a
    gradient's dtype or an element count does (gradients set to None and made anew each step
    may move; a graph's persistent ones do not)."""

    def __init__(self):
        self._chunks_key: tuple | None = None
        self.chunks: torch.Tensor | None = None
        self._addresses: tuple[int, ...] | None = None
        self.offsets: torch.Tensor | None = None
        self.multiples = (1, 1)

    def chunks_for(self, numels: tuple[int, ...], block: int, device: torch.device
                   ) -> torch.Tensor:
        key = (numels, block)
        if key != self._chunks_key or self.chunks is None or self.chunks.device != device:
            pairs = [(i, c) for i, n in enumerate(numels) for c in range(triton.cdiv(n, block))]
            self.chunks = torch.tensor(pairs, dtype=torch.int32).reshape(-1, 2).to(device)
            self._chunks_key = key
        return self.chunks

    def offsets_for(self, lists, copies, anchors) -> torch.Tensor:
        """lists: (params, grads, exp_avgs, exp_avg_sqs); anchors: (fp32 tensor, copy-dtype
        tensor). Checks the tensors when their addresses are new."""
        f32, cp = anchors
        # The gradients are the tensors made anew (a new one may reuse a freed one's address):
        # their dtypes are in the key too, the element counts for the table's last column.
        addresses = tuple(t.data_ptr() for group in lists for t in group) + tuple(
            0 if c is None else c.data_ptr() for c in copies) + (f32.data_ptr(), cp.data_ptr())
        addresses += tuple(g.dtype for g in lists[1]) + tuple(p.numel() for p in lists[0])
        if addresses == self._addresses and self.offsets is not None:
            return self.offsets
        _check(lists, copies)
        base_f, base_c = f32.data_ptr(), cp.data_ptr()
        size_f, size_c = f32.element_size(), cp.element_size()
        rows = [[(t.data_ptr() - base_f) // size_f for t in ts]
                + [0 if c is None else (c.data_ptr() - base_c) // size_c, int(c is not None),
                   ts[0].numel()]
                for *ts, c in zip(*lists, copies)]
        fp32_aligned = all(a % ALIGN_BYTES == 0 for group in lists for a in
                           (t.data_ptr() for t in group)) and base_f % ALIGN_BYTES == 0
        copy_aligned = all(c.data_ptr() % ALIGN_BYTES == 0 for c in copies
                           if c is not None) and base_c % ALIGN_BYTES == 0
        self.multiples = (ALIGN_BYTES // size_f if fp32_aligned else 1,
                          ALIGN_BYTES // size_c if copy_aligned else 1)
        table = torch.tensor(rows, dtype=torch.int64).reshape(-1, _FIELDS)
        if f32.device.type == "cuda":  # torch's pinned-memory cache keeps it until it is copied
            table = table.pin_memory().to(f32.device, non_blocking=True)
        self.offsets, self._addresses = table, addresses
        return table


def _check(lists, copies) -> None:
    params = lists[0]
    device = params[0].device
    copy_dtypes = {c.dtype for c in copies if c is not None}
    if len(copy_dtypes) > 1 or not copy_dtypes <= set(_COPY_DTYPES):
        raise ValueError(f"adamw_triton_: copies in one of {list(_COPY_DTYPES)}, one dtype; "
                         f"got {copy_dtypes}")
    for group in lists:
        for t in group:
            if t.dtype != torch.float32 or t.device != device or not t.is_contiguous():
                raise ValueError("adamw_triton_: fp32 contiguous tensors on one device, got "
                                 f"{t.dtype} {t.device} contiguous={t.is_contiguous()}")
    for p, g, m, v, c in zip(*lists, copies):
        if not (p.shape == g.shape == m.shape == v.shape) or (c is not None and (
                c.shape != p.shape or c.device != device or not c.is_contiguous())):
            raise ValueError(f"adamw_triton_: mismatched tensors for a parameter of shape "
                             f"{tuple(p.shape)}")


def adamw_triton_(params: list[torch.Tensor], grads: list[torch.Tensor],
                  exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                  steps: list[torch.Tensor], copies: list[torch.Tensor | None], *, lr: float,
                  beta1: float, beta2: float, eps: float, weight_decay: float,
                  grad_scale: torch.Tensor | None = None,
                  tables: AdamWTables | None = None,
                  tiles: tuple[int, int] | None = None) -> None:
    """One AdamW step in place over fp32 contiguous tensors of one device (torch's
    ``adam(..., fused=True, decoupled_weight_decay=True)`` arithmetic): each step count
    incremented, each parameter and moment updated from its gradient (divided by
    ``grad_scale`` when given; the gradients are only read), and each parameter's ``copies``
    entry (a tensor of its shape in one compute dtype, or None) set to the new value in its
    dtype. ``tables``: the group's, kept between steps;
    ``tiles``: (elements a program, warps), DEFAULT_TILES when None."""
    if not params:
        return
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    if len({len(x) for x in (*lists, steps, copies)}) != 1:
        raise ValueError("adamw_triton_: the lists differ in length")
    block, warps = tiles or DEFAULT_TILES
    if block < 16 or block & (block - 1):
        raise ValueError(f"adamw_triton_: a block of {block} elements: a power of two >= 16")
    tables = tables or AdamWTables()
    copy_anchor = next((c for c in copies if c is not None), params[0])
    offsets = tables.offsets_for(lists, copies, (params[0], copy_anchor))
    device = params[0].device
    chunks = tables.chunks_for(tuple(p.numel() for p in params), block, device)
    torch._foreach_add_(steps, 1)
    if chunks.shape[0] == 0:
        return
    step = torch.stack([s.to(device=device, dtype=torch.float32) for s in steps])
    coef = torch.stack([lr / (1 - beta1 ** step), (1 - beta2 ** step).sqrt()], 1).contiguous()
    scale = grad_scale if grad_scale is not None else coef  # unread without HAS_SCALE
    f32_multiple, copy_multiple = tables.multiples
    _adamw_kernel[(chunks.shape[0],)](
        params[0], copy_anchor, offsets, chunks, coef, scale, float(lr), float(beta1),
        float(beta2), float(eps), float(weight_decay), HAS_SCALE=grad_scale is not None,
        ROUNDING=dot_precision(torch.bfloat16), F32_MULTIPLE=f32_multiple,
        COPY_MULTIPLE=copy_multiple, FIELDS=_FIELDS, BLOCK=block, num_warps=warps)
