"""AdamW as one Triton kernel over every tensor of a parameter group, which also writes each
parameter's compute-dtype copy (compute_copies.py) as it stores the parameter.

Without it a step on one rank with compute copies is torch's fused AdamW (reads parameter,
gradient and both moments, writes them back: the gradient too when the clipping rides in as
``grad_scale``) and then ``ComputeCopies.refresh``, a second pass that reads every fp32
parameter again to write its copy: 38 bytes a parameter. Here the copy is written from the
updated value still in registers: 32 bytes. The arithmetic is torch's (decoupled weight decay,
bias corrections from each tensor's own step count, gradient
divided by ``grad_scale`` and written back so, as torch's fused kernel leaves it); the results
equal torch's to fp32 rounding, not to the bit (the bias corrections are computed by torch on
the stacked step counts, torch's kernel computes them in its own).

Tensors are reached through a table of their addresses (one row per tensor: parameter,
gradient, the moments, the copy or 0, the element count) and programs through a table of
(tensor, first element) chunks: one launch for the group, whatever the number of tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_dsv41.attention.triton_common import dot_precision, to_dtype

BLOCK = 4096  # elements a program updates
_FIELDS = 6  # param, grad, exp_avg, exp_avg_sq, copy (0: none), numel


@triton.jit
def _adamw_kernel(table_ptr, chunk_ptr, coef_ptr, scale_ptr, lr, beta1, beta2, eps,
                  weight_decay, HAS_SCALE: tl.constexpr, COPY_DTYPE: tl.constexpr,
                  ROUNDING: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    i = tl.load(chunk_ptr + 2 * pid)
    start = tl.load(chunk_ptr + 2 * pid + 1).to(tl.int64) * BLOCK
    row = table_ptr + i * 6
    p_ptr = tl.load(row).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    copy_addr = tl.load(row + 4)
    numel = tl.load(row + 5)
    step_size = tl.load(coef_ptr + 2 * i)  # lr / (1 - beta1^step)
    bc2_sqrt = tl.load(coef_ptr + 2 * i + 1)  # sqrt(1 - beta2^step)
    offs = start + tl.arange(0, BLOCK)
    mask = offs < numel
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    if HAS_SCALE:
        g = g / tl.load(scale_ptr)
        tl.store(g_ptr + offs, g, mask=mask)
    p = p * (1.0 - lr * weight_decay)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * (m / (tl.sqrt(v) / bc2_sqrt + eps))
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if copy_addr != 0:  # round to nearest even (to_dtype: also in the interpreter)
        copy_ptr = copy_addr.to(tl.pointer_type(COPY_DTYPE))
        tl.store(copy_ptr + offs, to_dtype(p, COPY_DTYPE, ROUNDING), mask=mask)


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


class ChunkTable:
    """The (tensor, chunk) table of a list of element counts, built once per group layout (the
    parameters' shapes do not change; the addresses may, and are read each step)."""

    def __init__(self):
        self._numels: tuple[int, ...] | None = None
        self._chunks: torch.Tensor | None = None

    def get(self, numels: tuple[int, ...], device: torch.device) -> torch.Tensor:
        if numels != self._numels or self._chunks is None or self._chunks.device != device:
            pairs = [(i, c) for i, n in enumerate(numels) for c in range(triton.cdiv(n, BLOCK))]
            self._chunks = torch.tensor(pairs, dtype=torch.int32).reshape(-1, 2).to(device)
            self._numels = numels
        return self._chunks


def adamw_triton_(params: list[torch.Tensor], grads: list[torch.Tensor],
                  exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                  steps: list[torch.Tensor], copies: list[torch.Tensor | None], *, lr: float,
                  beta1: float, beta2: float, eps: float, weight_decay: float,
                  grad_scale: torch.Tensor | None = None,
                  chunks: ChunkTable | None = None) -> None:
    """One AdamW step in place over fp32 contiguous tensors of one device (torch's
    ``adam(..., fused=True, decoupled_weight_decay=True)`` arithmetic): each step count
    incremented, each parameter, moment and (with ``grad_scale``: divided by it) gradient
    updated, and each parameter's ``copies`` entry (a tensor of its shape in one compute dtype,
    or None) set to the new value in its dtype."""
    if not params:
        return
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    if len({len(x) for x in (*lists, steps, copies)}) != 1:
        raise ValueError("adamw_triton_: the lists differ in length")
    device = params[0].device
    copy_dtypes = {c.dtype for c in copies if c is not None}
    if len(copy_dtypes) > 1 or not copy_dtypes <= set(_TL_DTYPES):
        raise ValueError(f"adamw_triton_: copies in one of {list(_TL_DTYPES)}, one dtype; "
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
    torch._foreach_add_(steps, 1)
    step = torch.stack([s.to(device=device, dtype=torch.float32) for s in steps])
    coef = torch.stack([lr / (1 - beta1 ** step), (1 - beta2 ** step).sqrt()], 1).contiguous()
    table = torch.tensor([[p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(),
                           0 if c is None else c.data_ptr(), p.numel()]
                          for p, g, m, v, c in zip(*lists, copies)], dtype=torch.int64)
    if device.type == "cuda":  # torch's pinned-memory cache keeps it until the upload ran
        table = table.pin_memory().to(device, non_blocking=True)
    numels = tuple(p.numel() for p in params)
    chunk_table = (chunks or ChunkTable()).get(numels, device)
    if chunk_table.shape[0] == 0:
        return
    copy_dtype = _TL_DTYPES[next(iter(copy_dtypes))] if copy_dtypes else tl.float32
    scale = grad_scale if grad_scale is not None else coef  # unread without HAS_SCALE
    _adamw_kernel[(chunk_table.shape[0],)](
        table, chunk_table, coef, scale, float(lr), float(beta1), float(beta2), float(eps),
        float(weight_decay), HAS_SCALE=grad_scale is not None, COPY_DTYPE=copy_dtype,
        ROUNDING=dot_precision(torch.bfloat16), BLOCK=BLOCK, num_warps=8)
