"""Log-probabilities of given tokens under the LM head, a chunk of rows at a time.

``logp[i] = log_softmax(hidden[i] @ W^T)[targets[i]]``. Written plainly, autograd keeps the fp32
[rows, vocab] logits, their log_softmax and, in the backward, gradients of the same size: at
65,536 tokens and the ``small`` preset's 32,000-token vocabulary each such block is 7.8 GiB.
Here the forward keeps nothing of size vocab (but when every row fits one chunk: then it keeps
that chunk's log_softmax, at most the memory the backward's recompute would take, and the
backward skips the recompute); the backward recomputes one chunk of logits at a
time and turns it into that chunk's gradients (``d logp / d logits = onehot - softmax``), with
the same operations autograd runs on the plain path (log_softmax, exp of it), so the two agree
to the last bits but for the order the head's gradient is summed in.

The logits are computed in the weight's dtype and read in fp32, as ``head(x).float()`` does, so
a bf16 head (``--no-fp32-lm-head``) keeps its meaning; the gradients reach ``hidden`` and ``W``
in their dtypes, the weight's summed over the chunks in fp32.

An fp32 head's three GEMMs (logits, d hidden, d W) run as ``fp32_gemm`` says: "ieee", plain
fp32 (on an H200 cuBLAS runs them without tensor cores: 17.0 ms forward + backward at the small
preset's 4k tokens x 1024 x 32,000), or "tf32x3" (CUTLASS's 3xTF32): each operand split into
a TF32-exact part and a remainder, and the three products that matter summed on TF32 tensor
cores. The tensor cores' own sums lose bits over a long inner dimension (measured on an H200,
bench/train_ops.py lm-head: one TF32 GEMM of TF32-exact operands over K = 32,000 is 1.4e-4 off
float64, fp32 FMAs 7.9e-6), so the inner dimension goes in chunks of TF32_K_CHUNK, each added
in the fp32 epilogue of its GEMM (addmm). tests/test_trainer_logprob_chunked.py holds logp and
both gradients to float64 next to the plain fp32 path. "tf32x3-logits" runs the logits
(the forward, the backward's recompute) as tf32x3 and the two gradient GEMMs as one TF32 product
each: the log-probabilities (the PPO ratio's, compared with the server's) keep fp32 accuracy,
the gradients TF32's (d hidden 5.6e-4 off float64 on an H200, 7x finer than the bf16 rounding
it gets next and every other layer's gradient has) at a third of the backward's tensor-core work.
"""

from __future__ import annotations

import contextlib

import torch

# fp32 logits held at once (one chunk's, 512 MiB); read at call time so tests can shrink it.
LOGPROB_CHUNK_ELEMENTS = 1 << 27


FP32_GEMMS = ("ieee", "tf32x3", "tf32x3-logits")


def gradient_gemm(fp32_gemm: str) -> str:
    """The mode of the backward's two gradient GEMMs: "tf32" (one TF32 product) for
    "tf32x3-logits", else the logits' own."""
    return "tf32" if fp32_gemm == "tf32x3-logits" else fp32_gemm


def logprob_chunk_rows(vocab: int) -> int:
    return max(1, LOGPROB_CHUNK_ELEMENTS // max(1, vocab))


def split_operand(x: torch.Tensor, fp32_gemm: str, inplace: bool = False
                  ) -> tuple[torch.Tensor, ...]:
    """x -> the parts head_mm multiplies: (x,), or for "tf32x3" (and "tf32x3-logits", whose
    logits are tf32x3's) on an fp32 tensor (hi, lo):
    hi keeps TF32's 10 mantissa bits (the rest cleared: exact), lo = x - hi (exact in fp32; TF32
    keeps 10 bits of it in the product). inplace: lo is x itself (x is then lost). On a CPU,
    which has no TF32, the three products are fp32 ones (what the CPU tests check: the split's
    algebra)."""
    if fp32_gemm not in ("tf32x3", "tf32x3-logits") or x.dtype != torch.float32:
        return (x,)
    x = x.contiguous()
    hi = (x.view(torch.int32) & -8192).view(torch.float32)  # & ~0x1FFF
    return hi, (x.sub_(hi) if inplace else x - hi)


def transposed(parts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(p.t() for p in parts)


@contextlib.contextmanager
def fp32_matmul(precision: str):
    """fp32 GEMMs on CUDA as ``precision`` ("ieee" | "tf32") says, whatever the process set.
    torch's setting is process-wide: other threads' fp32 GEMMs in this window would follow it
    too (the trainer's forward and backward never run at once)."""
    prev = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = precision
    try:
        yield
    finally:
        torch.backends.cuda.matmul.fp32_precision = prev


# Inner-dimension chunk of a tf32x3 GEMM (head_mm; module docstring). One H200, the small
# preset's head at 4k tokens (bench/train_ops.py lm-head): in chunks of 1024, forward + backward
# 12.3 ms and d hidden 5.0e-6, d head 4.2e-6 off float64 (fp32 FMAs: 17.0 ms, 8.5e-6, 2.1e-6);
# unchunked 9.8 ms, 1.4e-4, 1.5e-5. 4096 keeps d hidden's 32,000-long sum in 8 chunks and d
# head's (4096 rows) whole: fewer GEMM launches in a step whose host is the bound.
TF32_K_CHUNK = 4096


def head_mm(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...],
            out: torch.Tensor | None = None, tf32: bool = False) -> torch.Tensor:
    """a @ b (plus out, in place, when given) from split_operand's parts: one GEMM (fp32, or one
    TF32 product when ``tf32``), or for (hi, lo) parts hi_a lo_b + lo_a hi_b + hi_a hi_b on
    TF32 tensor cores, the small products first, the inner dimension in chunks of TF32_K_CHUNK
    each added by a GEMM's fp32 epilogue (module docstring)."""
    if len(a) == 1:
        with fp32_matmul("tf32" if tf32 else "ieee"):
            prod = a[0] @ b[0]
        return prod if out is None else out.add_(prod)
    with fp32_matmul("tf32"):
        for k in range(0, a[0].shape[1], TF32_K_CHUNK):
            (a_hi, a_lo), (b_hi, b_lo) = ([p.narrow(dim, k, min(TF32_K_CHUNK, p.shape[dim] - k))
                                            for p in parts] for parts, dim in ((a, 1), (b, 0)))
            out = a_hi @ b_lo if out is None else out.addmm_(a_hi, b_lo)
            out.addmm_(a_lo, b_hi)
            out.addmm_(a_hi, b_hi)
    return out


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                fp32_gemm: str) -> torch.Tensor:
        rows = hidden.shape[0]
        step = logprob_chunk_rows(weight.shape[0])
        logp = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        ctx.kept = None
        w_parts = split_operand(weight, fp32_gemm)  # once for every chunk
        for a in range(0, rows, step):
            b = min(a + step, rows)
            chunk = _logits(hidden[a:b], w_parts, fp32_gemm).float().log_softmax(dim=-1)
            logp[a:b] = chunk.gather(1, targets[a:b, None]).squeeze(1)
            if b - a == rows:
                # One chunk holds every row: keep it (one chunk's memory, the budget the
                # backward's recompute needs anyway) and skip the backward's recompute of the
                # logits, a [rows, D] x [D, vocab] fp32 GEMM.
                ctx.kept = chunk
        ctx.save_for_backward(hidden, weight, targets)
        ctx.fp32_gemm = fp32_gemm
        return logp

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden, weight, targets = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if need_weight else None
        rows = hidden.shape[0]
        step = logprob_chunk_rows(weight.shape[0])
        grad = grad.float()
        grad_gemm = gradient_gemm(ctx.fp32_gemm)
        # The weight's parts, split once for every chunk: the recompute's (when the forward
        # kept no chunk) and the gradient GEMMs' (the same parts when the modes are one).
        w_parts = None if ctx.kept is not None else split_operand(weight, ctx.fp32_gemm)
        w_grad_parts = w_parts if w_parts is not None and grad_gemm == ctx.fp32_gemm \
            else split_operand(weight, grad_gemm)
        tf32 = grad_gemm == "tf32"
        for a in range(0, rows, step):
            b = min(a + step, rows)
            g = grad[a:b, None]
            if ctx.kept is not None:  # the forward's only chunk, used once
                log_softmax, ctx.kept = ctx.kept, None
            else:
                log_softmax = _logits(hidden[a:b], w_parts, ctx.fp32_gemm).float() \
                    .log_softmax(dim=-1)
            # d logp / d logits = onehot(target) - softmax, times the incoming gradient
            g_logits = log_softmax.exp_().mul_(-g)
            g_logits.scatter_add_(1, targets[a:b, None], g)
            g_parts = split_operand(g_logits.to(weight.dtype), grad_gemm, inplace=True)
            if need_hidden:
                grad_hidden[a:b] = head_mm(g_parts, w_grad_parts, tf32=tf32)
            if need_weight:
                head_mm(transposed(g_parts), split_operand(hidden[a:b], grad_gemm),
                        out=grad_weight, tf32=tf32)
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None


def _logits(hidden: torch.Tensor, w_parts: tuple[torch.Tensor, ...], fp32_gemm: str
            ) -> torch.Tensor:
    """hidden @ W^T from W's split_operand parts (head_mm: one GEMM or the three products)."""
    return head_mm(split_operand(hidden, fp32_gemm), transposed(w_parts))


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                   fp32_gemm: str = "ieee") -> torch.Tensor:
    """hidden [N, D] (the weight's dtype), weight [vocab, D], targets int64 [N] -> fp32 [N]
    log-probabilities, differentiable in hidden and weight; fp32_gemm: FP32_GEMMS (module
    docstring)."""
    if fp32_gemm not in FP32_GEMMS:
        raise ValueError(f"token_logprobs: fp32_gemm {fp32_gemm!r} is not one of {FP32_GEMMS}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or \
            targets.shape != hidden.shape[:1]:
        raise ValueError(f"token_logprobs: hidden {tuple(hidden.shape)}, weight "
                         f"{tuple(weight.shape)} and targets {tuple(targets.shape)} must be "
                         "[N, D], [vocab, D] and [N]")
    if not targets.is_cuda:  # on a GPU the bounds are the caller's (check_targets on the host)
        check_targets(targets, weight.shape[0])
    return _ChunkedTokenLogprobs.apply(hidden, weight, targets.to(torch.int64), fp32_gemm)


def check_targets(targets: torch.Tensor, vocab: int) -> None:
    """Targets must be token ids of the head's vocabulary. Call it where they are on the host
    (the trainer's micro-batch): reading a device tensor's bounds back would make the host wait
    for the GPU once per micro-batch."""
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        raise ValueError(f"token_logprobs: targets must lie in [0, {vocab})")
