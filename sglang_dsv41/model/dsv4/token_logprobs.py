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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# fp32 logits held at once (one chunk's, 512 MiB); read at call time so tests can shrink it.
LOGPROB_CHUNK_ELEMENTS = 1 << 27


def logprob_chunk_rows(vocab: int) -> int:
    return max(1, LOGPROB_CHUNK_ELEMENTS // max(1, vocab))


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
                ) -> torch.Tensor:
        rows = hidden.shape[0]
        step = logprob_chunk_rows(weight.shape[0])
        logp = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        ctx.kept = None
        for a in range(0, rows, step):
            b = min(a + step, rows)
            chunk = F.linear(hidden[a:b], weight).float().log_softmax(dim=-1)
            logp[a:b] = chunk.gather(1, targets[a:b, None]).squeeze(1)
            if b - a == rows:
                # One chunk holds every row: keep it (one chunk's memory, the budget the
                # backward's recompute needs anyway) and skip the backward's recompute of the
                # logits, a [rows, D] x [D, vocab] fp32 GEMM.
                ctx.kept = chunk
        ctx.save_for_backward(hidden, weight, targets)
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
        for a in range(0, rows, step):
            b = min(a + step, rows)
            g = grad[a:b, None]
            if ctx.kept is not None:  # the forward's only chunk, used once
                log_softmax, ctx.kept = ctx.kept, None
            else:
                log_softmax = F.linear(hidden[a:b], weight).float().log_softmax(dim=-1)
            # d logp / d logits = onehot(target) - softmax, times the incoming gradient
            g_logits = log_softmax.exp_().mul_(-g)
            g_logits.scatter_add_(1, targets[a:b, None], g)
            g_logits = g_logits.to(weight.dtype)
            if need_hidden:
                grad_hidden[a:b] = g_logits @ weight
            if need_weight:
                grad_weight += g_logits.t() @ hidden[a:b]
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
                   ) -> torch.Tensor:
    """hidden [N, D] (the weight's dtype), weight [vocab, D], targets int64 [N] -> fp32 [N]
    log-probabilities, differentiable in hidden and weight."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or \
            targets.shape != hidden.shape[:1]:
        raise ValueError(f"token_logprobs: hidden {tuple(hidden.shape)}, weight "
                         f"{tuple(weight.shape)} and targets {tuple(targets.shape)} must be "
                         "[N, D], [vocab, D] and [N]")
    if not targets.is_cuda:  # on a GPU the bounds are the caller's (check_targets on the host)
        check_targets(targets, weight.shape[0])
    return _ChunkedTokenLogprobs.apply(hidden, weight, targets.to(torch.int64))


def check_targets(targets: torch.Tensor, vocab: int) -> None:
    """Targets must be token ids of the head's vocabulary. Call it where they are on the host
    (the trainer's micro-batch): reading a device tensor's bounds back would make the host wait
    for the GPU once per micro-batch."""
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        raise ValueError(f"token_logprobs: targets must lie in [0, {vocab})")
