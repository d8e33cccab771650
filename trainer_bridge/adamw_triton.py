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
# Chunks a program of the gradient norm's square sums. One a program (the step's tiles, a few
# KiB) spent it on dependent table loads: 1.01 ms over the small preset's 1.46B parameters on an
# H200 (2.8 TB/s of its bf16 gradients); with 8, their loads in flight together, 0.82 ms
# (bench/results/train_h200.txt, run AG).
SQUARE_SUM_CHUNKS = 8
# param, grad, exp_avg, exp_avg_sq, copy, pending gradient offsets; has copy; numel (which
# gradients a row has is its launch's GRAD: AdamWTables.chunks_for)
_FIELDS = 8


@triton.jit
def _offset(row, k: tl.constexpr, MULTIPLE: tl.constexpr):
    off = tl.load(row + k)
    if MULTIPLE > 1:
        off = tl.multiple_of(off, MULTIPLE)
    return off


@triton.jit
def _adamw_kernel(f32_ptr, copy_ptr, table_ptr, chunk_ptr, coef_ptr, scale_ptr, lr, beta1,
                  beta2, eps, weight_decay, HAS_SCALE: tl.constexpr, ROUNDING: tl.constexpr,
                  F32_MULTIPLE: tl.constexpr, COPY_MULTIPLE: tl.constexpr, GRAD: tl.constexpr,
                  FIELDS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    i = tl.load(chunk_ptr + 3 * pid)
    start = tl.load(chunk_ptr + 3 * pid + 1).to(tl.int64) * BLOCK
    row = table_ptr + i * FIELDS
    numel = tl.load(row + 7)
    step_size = tl.load(coef_ptr + 2 * i)  # lr / (1 - beta1^step)
    bc2_sqrt = tl.load(coef_ptr + 2 * i + 1)  # sqrt(1 - beta2^step)
    offs = start + tl.arange(0, BLOCK)
    # A whole block unmasked: a mask against a count of unknown alignment would keep every
    # access scalar.
    if start + BLOCK <= numel:
        _update(f32_ptr, copy_ptr, row, offs, numel, step_size, bc2_sqrt, scale_ptr, lr, beta1,
                beta2, eps, weight_decay, HAS_SCALE, ROUNDING, F32_MULTIPLE, COPY_MULTIPLE,
                GRAD, False)
    else:
        _update(f32_ptr, copy_ptr, row, offs, numel, step_size, bc2_sqrt, scale_ptr, lr, beta1,
                beta2, eps, weight_decay, HAS_SCALE, ROUNDING, F32_MULTIPLE, COPY_MULTIPLE,
                GRAD, True)


@triton.jit
def _gradient(f32_ptr, copy_ptr, row, offs, mask, F32_MULTIPLE: tl.constexpr,
              COPY_MULTIPLE: tl.constexpr, GRAD: tl.constexpr, MASKED: tl.constexpr):
    """A row's gradient block in fp32: its fp32 gradient (GRAD 0), its pending compute-dtype
    one (1: the step's last micro-batch, compute_copies.py), or their sum (2), rounded once as
    the fp32 += the pending add that it replaces. A constant per launch: chosen per row at run
    time, the branches kept the loads from being vectors (16.5 vs 10.7 ms over the small
    preset on an H200, bench/train_ops.py gradient-path)."""
    other = 0.0 if MASKED else None
    if GRAD != 1:
        g = tl.load(f32_ptr + _offset(row, 1, F32_MULTIPLE) + offs, mask=mask, other=other)
    if GRAD != 0:
        q = tl.load(copy_ptr + _offset(row, 5, COPY_MULTIPLE) + offs, mask=mask,
                    other=other).to(tl.float32)
        g = q if GRAD == 1 else g + q
    return g


@triton.jit
def _update(f32_ptr, copy_ptr, row, offs, numel, step_size, bc2_sqrt, scale_ptr, lr, beta1,
            beta2, eps, weight_decay, HAS_SCALE: tl.constexpr, ROUNDING: tl.constexpr,
            F32_MULTIPLE: tl.constexpr, COPY_MULTIPLE: tl.constexpr, GRAD: tl.constexpr,
            MASKED: tl.constexpr):
    mask = offs < numel if MASKED else None
    other = 0.0 if MASKED else None
    p_ptr = f32_ptr + _offset(row, 0, F32_MULTIPLE)
    m_ptr = f32_ptr + _offset(row, 2, F32_MULTIPLE)
    v_ptr = f32_ptr + _offset(row, 3, F32_MULTIPLE)
    p = tl.load(p_ptr + offs, mask=mask, other=other)
    g = _gradient(f32_ptr, copy_ptr, row, offs, mask, F32_MULTIPLE, COPY_MULTIPLE, GRAD, MASKED)
    m = tl.load(m_ptr + offs, mask=mask, other=other)
    v = tl.load(v_ptr + offs, mask=mask, other=other)
    if HAS_SCALE:
        g = g / tl.load(scale_ptr)
    p = p * (1.0 - lr * weight_decay)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * (m / (tl.sqrt(v) / bc2_sqrt + eps))
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if tl.load(row + 6) != 0:  # round to nearest even (to_dtype: also in the interpreter)
        c_ptr = copy_ptr + _offset(row, 4, COPY_MULTIPLE)
        tl.store(c_ptr + offs, to_dtype(p, c_ptr.dtype.element_ty, ROUNDING), mask=mask)


@triton.jit
def _square_sum_kernel(f32_ptr, copy_ptr, table_ptr, chunk_ptr, out_ptr, n_chunks,
                       F32_MULTIPLE: tl.constexpr, COPY_MULTIPLE: tl.constexpr,
                       GRAD: tl.constexpr, FIELDS: tl.constexpr, BLOCK: tl.constexpr,
                       CHUNKS: tl.constexpr):
    """out[chunk's place among all kinds'] = the sum of squares of its chunk's gradient
    (_gradient): summed in one order however the rows divide into kinds. CHUNKS chunks a
    program (SQUARE_SUM_CHUNKS), each summed on its own as one a program was."""
    for j in tl.static_range(CHUNKS):
        c = tl.program_id(0) * CHUNKS + j
        if c < n_chunks:
            i = tl.load(chunk_ptr + 3 * c)
            start = tl.load(chunk_ptr + 3 * c + 1).to(tl.int64) * BLOCK
            row = table_ptr + i * FIELDS
            numel = tl.load(row + 7)
            offs = start + tl.arange(0, BLOCK)
            if start + BLOCK <= numel:
                g = _gradient(f32_ptr, copy_ptr, row, offs, None, F32_MULTIPLE, COPY_MULTIPLE,
                              GRAD, False)
            else:
                g = _gradient(f32_ptr, copy_ptr, row, offs, offs < numel, F32_MULTIPLE,
                              COPY_MULTIPLE, GRAD, True)
            tl.store(out_ptr + tl.load(chunk_ptr + 3 * c + 2), tl.sum(g * g))


_COPY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class AdamWTables:
    """A group's device tables, kept between steps: the (tensor, chunk) pairs, rebuilt when the
    element counts change; the offsets, rebuilt (and the tensors checked) when an address, a
    gradient's dtype or an element count does (gradients set to None and made anew each step
    may move; a graph's persistent ones do not)."""

    def __init__(self):
        self._chunks_key: tuple | None = None
        self.chunks: dict[int, torch.Tensor] | None = None
        self.places = 0  # chunks over every kind
        self._addresses: tuple | None = None
        self.offsets: torch.Tensor | None = None
        self.multiples = (1, 1)

    def chunks_for(self, numels: tuple[int, ...], kinds: tuple[int, ...], block: int,
                   device: torch.device) -> dict[int, torch.Tensor]:
        """gradient kind (_gradient's GRAD) -> its rows' (tensor, chunk, place among every
        row's chunks) triples: a launch each."""
        key = (numels, kinds, block)
        if key != self._chunks_key or self.chunks is None or any(
                c.device != device for c in self.chunks.values()):
            triples: dict[int, list] = {k: [] for k in sorted(set(kinds))}
            place = 0
            for i, (n, k) in enumerate(zip(numels, kinds)):
                for c in range(triton.cdiv(n, block)):
                    triples[k].append((i, c, place))
                    place += 1
            self.chunks = {k: torch.tensor(t, dtype=torch.int32).reshape(-1, 3).to(device)
                           for k, t in triples.items()}
            self.places = place
            self._chunks_key = key
        return self.chunks

    def offsets_for(self, lists, copies, pending, anchors) -> torch.Tensor:
        """lists: (params, grads, exp_avgs, exp_avg_sqs), a gradient None where its pending
        one stands alone; anchors: (fp32 tensor, copy-dtype tensor). Checks the tensors when
        their addresses are new."""
        f32, cp = anchors
        # The gradients are the tensors made anew (a new one may reuse a freed one's address):
        # their dtypes are in the key too, the element counts for the table's last column.
        low = [*copies, *pending]
        addresses = tuple(_address(t) for group in lists for t in group) + tuple(
            _address(t) for t in low) + (f32.data_ptr(), cp.data_ptr())
        addresses += tuple(None if t is None else t.dtype for t in (*lists[1], *pending))
        addresses += tuple(p.numel() for p in lists[0])
        if addresses == self._addresses and self.offsets is not None:
            return self.offsets
        _check(lists, copies, pending)
        base_f, base_c = f32.data_ptr(), cp.data_ptr()
        size_f, size_c = f32.element_size(), cp.element_size()
        rows = [[0 if t is None else (t.data_ptr() - base_f) // size_f for t in ts]
                + [0 if t is None else (t.data_ptr() - base_c) // size_c for t in (c, q)]
                + [int(c is not None), ts[0].numel()]
                for *ts, c, q in zip(*lists, copies, pending)]
        fp32_aligned = all(_address(t) % ALIGN_BYTES == 0 for group in lists for t in group
                           ) and base_f % ALIGN_BYTES == 0
        copy_aligned = all(_address(t) % ALIGN_BYTES == 0 for t in low) and \
            base_c % ALIGN_BYTES == 0
        self.multiples = (ALIGN_BYTES // size_f if fp32_aligned else 1,
                          ALIGN_BYTES // size_c if copy_aligned else 1)
        table = torch.tensor(rows, dtype=torch.int64).reshape(-1, _FIELDS)
        if f32.device.type == "cuda":  # torch's pinned-memory cache keeps it until it is copied
            table = table.pin_memory().to(f32.device, non_blocking=True)
        self.offsets, self._addresses = table, addresses
        return table


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _check(lists, copies, pending) -> None:
    params = lists[0]
    device = params[0].device
    low_dtypes = {t.dtype for t in (*copies, *pending) if t is not None}
    if len(low_dtypes) > 1 or not low_dtypes <= set(_COPY_DTYPES):
        raise ValueError(f"adamw_triton_: copies and pending gradients in one of "
                         f"{list(_COPY_DTYPES)}, one dtype; got {low_dtypes}")
    for group in lists:
        for t in group:
            if t is not None and (t.dtype != torch.float32 or t.device != device
                                  or not t.is_contiguous()):
                raise ValueError("adamw_triton_: fp32 contiguous tensors on one device, got "
                                 f"{t.dtype} {t.device} contiguous={t.is_contiguous()}")
    for p, g, m, v, c, q in zip(*lists, copies, pending):
        low = [t for t in (c, q) if t is not None]
        if g is None and q is None:
            raise ValueError(f"adamw_triton_: no gradient for a parameter of shape "
                             f"{tuple(p.shape)}")
        if not (p.shape == m.shape == v.shape) or (g is not None and g.shape != p.shape) or \
                any(t.shape != p.shape or t.device != device or not t.is_contiguous()
                    for t in low):
            raise ValueError(f"adamw_triton_: mismatched tensors for a parameter of shape "
                             f"{tuple(p.shape)}")


class _Launch:
    """What both kernels take for one group: the anchors, the tables, the tiles."""

    def __init__(self, params, grads, exp_avgs, exp_avg_sqs, copies, pending, tables, tiles):
        n = len(params)
        if any(len(x) != n for x in (grads, exp_avgs, exp_avg_sqs, copies, pending)):
            raise ValueError("adamw_triton_: the lists differ in length")
        self.block, self.warps = tiles or DEFAULT_TILES
        if self.block < 16 or self.block & (self.block - 1):
            raise ValueError(f"adamw_triton_: a block of {self.block} elements: a power of "
                             "two >= 16")
        tables = tables or AdamWTables()
        self.f32 = params[0]
        self.low = next((t for t in (*copies, *pending) if t is not None), params[0])
        self.offsets = tables.offsets_for((params, grads, exp_avgs, exp_avg_sqs), copies,
                                          pending, (self.f32, self.low))
        kinds = tuple(int(g is None) if q is None or g is None else 2
                      for g, q in zip(grads, pending))  # _gradient's GRAD
        self.chunks = tables.chunks_for(tuple(p.numel() for p in params), kinds, self.block,
                                        params[0].device)
        self.multiples = tables.multiples
        self.places = tables.places


def adamw_triton_(params: list[torch.Tensor], grads: list[torch.Tensor | None],
                  exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                  steps: list[torch.Tensor], copies: list[torch.Tensor | None], *, lr: float,
                  beta1: float, beta2: float, eps: float, weight_decay: float,
                  grad_scale: torch.Tensor | None = None,
                  pending: list[torch.Tensor | None] | None = None,
                  tables: AdamWTables | None = None,
                  tiles: tuple[int, int] | None = None) -> None:
    """One AdamW step in place over fp32 contiguous tensors of one device (torch's
    ``adam(..., fused=True, decoupled_weight_decay=True)`` arithmetic): each step count
    incremented, each parameter and moment updated from its gradient (divided by
    ``grad_scale`` when given; the gradients are only read), and each parameter's ``copies``
    entry (a tensor of its shape in one compute dtype, or None) set to the new value in its
    dtype. ``pending``: per parameter a gradient in the copies' dtype still to be added to its
    fp32 one (or standing for it where that is None; ComputeCopies.pending), or None.
    ``tables``: the group's, kept between steps; ``tiles``: (elements a program, warps),
    DEFAULT_TILES when None."""
    if not params:
        return
    if len(steps) != len(params):
        raise ValueError("adamw_triton_: the lists differ in length")
    launch = _Launch(params, grads, exp_avgs, exp_avg_sqs, copies,
                     pending or [None] * len(params), tables, tiles)
    device = params[0].device
    torch._foreach_add_(steps, 1)
    if not any(c.shape[0] for c in launch.chunks.values()):
        return
    step = torch.stack([s.to(device=device, dtype=torch.float32) for s in steps])
    coef = torch.stack([lr / (1 - beta1 ** step), (1 - beta2 ** step).sqrt()], 1).contiguous()
    scale = grad_scale if grad_scale is not None else coef  # unread without HAS_SCALE
    f32_multiple, copy_multiple = launch.multiples
    for kind, chunks in launch.chunks.items():
        if chunks.shape[0]:
            _adamw_kernel[(chunks.shape[0],)](
                launch.f32, launch.low, launch.offsets, chunks, coef, scale, float(lr),
                float(beta1), float(beta2), float(eps), float(weight_decay),
                HAS_SCALE=grad_scale is not None, ROUNDING=dot_precision(torch.bfloat16),
                F32_MULTIPLE=f32_multiple, COPY_MULTIPLE=copy_multiple, GRAD=kind,
                FIELDS=_FIELDS, BLOCK=launch.block, num_warps=launch.warps)


def grad_square_sum(params: list[torch.Tensor], grads: list[torch.Tensor | None],
                    exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                    copies: list[torch.Tensor | None],
                    pending: list[torch.Tensor | None] | None = None, *,
                    tables: AdamWTables | None = None,
                    tiles: tuple[int, int] | None = None) -> torch.Tensor:
    """The sum of squares of the gradients adamw_triton_ would read for these tensors (fp32
    and pending summed as it sums them), as a 0-d fp32 tensor: the clipping's norm in one pass
    over the tables the step then reuses. Per-chunk fp32 sums, then torch's sum of those:
    a fixed order."""
    if not params:
        return torch.zeros(())
    device = params[0].device
    launch = _Launch(params, grads, exp_avgs, exp_avg_sqs, copies,
                     pending or [None] * len(params), tables, tiles)
    parts = torch.empty(launch.places, device=device, dtype=torch.float32)
    f32_multiple, copy_multiple = launch.multiples
    for kind, chunks in launch.chunks.items():
        if chunks.shape[0]:
            _square_sum_kernel[(triton.cdiv(chunks.shape[0], SQUARE_SUM_CHUNKS),)](
                launch.f32, launch.low, launch.offsets, chunks, parts, chunks.shape[0],
                F32_MULTIPLE=f32_multiple, COPY_MULTIPLE=copy_multiple, GRAD=kind,
                FIELDS=_FIELDS, BLOCK=launch.block, CHUNKS=SQUARE_SUM_CHUNKS,
                num_warps=launch.warps)
    return parts.sum()
