"""One rank: FSDP2's mixed precision without FSDP (torchtitan applies no FSDP on one rank either).

FSDP2 over a single rank shards nothing, yet its hooks still work parameter by parameter: each
layer's pre-forward casts and copies every parameter on its own (torch's world-size-1 path:
a ``.to`` and a ``copy_`` each) and its post-backward copies, "reduces" and re-wraps every
gradient. On an H200 that held the host 1.3-2.6 ms a layer in the forward and 27 ms a backward
(bench/results/train_h200.txt, run S), in a step the host bounds.

ComputeCopies gives the same numerics in a few multi-tensor kernels a step. The fp32 master
weights stay the model's parameters (the optimizer, DCP checkpoints and weight sync see them as
with FSDP); each parameter that FSDP would compute in the compute dtype gets a persistent
compute-dtype copy. The root's forward pre-hook refreshes the copies when a master may have
changed (one ``_foreach_copy_``) and puts them in the modules' place. A master changes in
place: through an optimizer step, which a global step hook notes (torch's fused AdamW does not
bump the tensors' version counters), or through any other in-place op (a checkpoint load),
which bumps them. The backward's end (a callback queued by a hook on the output) copies or
adds the copies' gradients into the masters' fp32 gradients (one flat buffer a step, as FSDP's
reduce output) and puts the masters back; a forward without a graph puts them back at its
end. The parameters FSDP keeps in fp32 (sinks, mHC, the router, the head when lm_head_fp32)
are used as they are.

Pending gradients: with a reader (the Triton AdamW, LocalShardAdamW kernel="triton"), the
backward after ``defer_next_backward`` (the trainer's last micro-batch of a step,
Policy.micro_batch) leaves the copies' gradients where they are instead of copying or adding
them into the fp32 ones: the reader's norm and step read them there, and a step's single
micro-batch never writes fp32 gradients at all (the copy read 2 and wrote 4 bytes a parameter,
and the norm and step then read 4 where they now read 2: 2.5 + ~1.5 ms of a 4k step of the
``small`` preset on one H200). Until then a master's gradient is its .grad (None where none
was written) plus its pending one: anything else that would read the gradients folds them in
first (``settle``: the next forward's pre-hook, a captured micro-batch's run, another
optimizer's step), the reader's step consumes them and its zero_grad drops them.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch import nn
from torch.autograd import Variable
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)


class ComputeCopies:
    def __init__(self, model: nn.Module, compute_dtype: torch.dtype,
                 keeps_fp32: Callable[[str], bool]):
        self.slots: list[tuple[nn.Module, str]] = []
        self.masters: list[nn.Parameter] = []
        for module_name, module in model.named_modules():
            for name, p in module._parameters.items():
                full = f"{module_name}.{name}" if module_name else name
                if p is not None and p.dtype != compute_dtype and not keeps_fp32(full):
                    self.slots.append((module, name))
                    self.masters.append(p)
        views = aligned_views([p.numel() for p in self.masters], compute_dtype,
                              self.masters[0].device if self.masters else torch.device("cpu"))
        self.copies = [nn.Parameter(view.view_as(p), requires_grad=p.requires_grad)
                       for view, p in zip(views, self.masters)]
        self.trained = [i for i, p in enumerate(self.masters) if p.requires_grad]
        self._versions: list[int] | None = None  # the masters' when last copied
        self._stepped = False  # an optimizer stepped since
        self._written_by_step = False  # the ending step wrote the copies itself
        self._graphs = 0  # forwards whose backward has not ended
        self._copy_of = {id(p): c for p, c in zip(self.masters, self.copies)}
        self._index_of = {id(p): i for i, p in enumerate(self.masters)}
        # index -> the compute-dtype gradient not yet in the master's .grad (module docstring)
        self.pending: dict[int, torch.Tensor] = {}
        self._reader: weakref.ref | None = None
        self._defer_next = False
        self._hooks = [model.register_forward_pre_hook(self._swap_in),
                       model.register_forward_hook(self._after_forward),
                       register_optimizer_step_pre_hook(_settle_for_others(weakref.ref(self))),
                       register_optimizer_step_post_hook(_mark_stepped(weakref.ref(self)))]

    @property
    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.copies)

    def in_forward(self, p: nn.Parameter) -> torch.Tensor:
        """The tensor the forward computes with for the model's parameter ``p``: its compute
        copy, or ``p`` itself (a parameter kept fp32)."""
        return self._copy_of.get(id(p), p)

    def copy_of(self, p: torch.Tensor) -> torch.Tensor | None:
        """The compute copy of the master ``p``, None for a parameter without one."""
        return self._copy_of.get(id(p))

    def written_by_step(self) -> None:
        """The optimizer step that is ending wrote the copies of the masters it updated
        (LocalShardAdamW with the Triton kernel): no refresh is due for it."""
        self._written_by_step = True

    def refresh(self) -> None:
        """The masters into the copies when a master may have changed since the last copy (one
        ``_foreach_copy_``). The forward's pre-hook calls it; so does a captured micro-batch
        graph before each replay (micro_batch_graphs.py), since a replay runs no hooks."""
        versions = [p._version for p in self.masters]
        if self.masters and (self._stepped or versions != self._versions):
            with torch.no_grad():
                torch._foreach_copy_(self.copies, self.masters)  # the masters' versions stay
            self._versions, self._stepped = versions, False

    # ---- pending gradients (module docstring) -----------------------------------------------
    def set_reader(self, optimizer) -> None:
        """``optimizer`` reads the pending gradients (its step and norm) and drops them (its
        zero_grad); defer_next_backward leaves gradients pending only while it lives."""
        self._reader = weakref.ref(optimizer)

    def reader(self):
        return None if self._reader is None else self._reader()

    def defer_next_backward(self) -> None:
        """The next backward's gradients of the copies stay pending, when there is a reader
        (else a no-op); one backward only."""
        self._defer_next = self.reader() is not None

    def take_defer(self) -> bool:
        """Whether the backward that is ending leaves its gradients pending (and the request
        spent): _backward_end's, and a captured micro-batch's (micro_batch_graphs.py)."""
        defer, self._defer_next = self._defer_next, False
        return defer

    def add_pending(self, master: nn.Parameter, grad: torch.Tensor) -> None:
        i = self._index_of[id(master)]
        if i in self.pending:  # settled first by whoever starts a backward: never two
            raise RuntimeError("ComputeCopies: a second pending gradient for one parameter")
        self.pending[i] = grad

    def pending_by_master(self) -> dict[int, torch.Tensor]:
        """id(master) -> its pending gradient."""
        return {id(self.masters[i]): g for i, g in self.pending.items()}

    def settle(self, buffers: dict[int, torch.Tensor] | None = None) -> None:
        """The pending gradients into the masters' fp32 ones: added where a master has one,
        copied where not, into ``buffers[id(master)]`` when given (a captured micro-batch's
        persistent ones; a missing one is made and kept there) or one new flat buffer."""
        if not self.pending:
            return
        pairs = [(self.masters[i], g) for i, g in sorted(self.pending.items())]
        self.pending = {}
        self._into_masters(pairs, buffers)

    def drop_pending(self) -> None:
        self.pending = {}

    def _into_masters(self, pairs, buffers=None) -> None:
        """fp32 (+)= compute dtype, promoted as FSDP's reduce output is: copied into a fresh
        gradient where a master has none, added where it has one."""
        added = [(m, g) for m, g in pairs if m.grad is not None]
        fresh = [(m, g) for m, g in pairs if m.grad is None]
        if added:
            torch._foreach_add_([m.grad for m, _ in added], [g for _, g in added])
        if fresh:
            if buffers is None:
                views = aligned_views([m.numel() for m, _ in fresh], fresh[0][0].dtype,
                                      fresh[0][0].device)
            else:  # made the first time one is needed: a step that settles none needs none
                new = [m for m, _ in fresh if id(m) not in buffers]
                for m, view in zip(new, aligned_views([m.numel() for m in new],
                                                      fresh[0][0].dtype, fresh[0][0].device)):
                    buffers[id(m)] = view.view_as(m)
                views = [buffers[id(m)] for m, _ in fresh]
            for (m, _), view in zip(fresh, views):
                m.grad = view.view_as(m)
            torch._foreach_copy_([m.grad for m, _ in fresh], [g for _, g in fresh])

    def _swap_in(self, module, args) -> None:
        self.settle()  # before this forward's backward adds to the copies' gradients
        self.refresh()
        for (owner, name), copy in zip(self.slots, self.copies):
            owner._parameters[name] = copy

    def restore(self) -> None:
        """Puts the masters back in the modules (idempotent); a failed step calls it too."""
        for (owner, name), master in zip(self.slots, self.masters):
            owner._parameters[name] = master

    def _after_forward(self, module, args, output) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad:
            self._graphs += 1
            output.register_hook(self._queue_backward_end)
        elif not self._graphs:
            self.restore()

    def _queue_backward_end(self, grad: torch.Tensor) -> None:
        Variable._execution_engine.queue_callback(self._backward_end)

    def _backward_end(self) -> None:
        """The compute copies' gradients into the masters' fp32 gradients: copied into one
        flat buffer where the step's first backward made them, added where they exist; left
        pending after defer_next_backward."""
        pairs = [(self.masters[i], self.copies[i].grad) for i in self.trained
                 if self.copies[i].grad is not None]
        defer = self.take_defer()
        for m, g in pairs:
            if defer and holdable(g):
                self.add_pending(m, g)
        self._into_masters([(m, g) for m, g in pairs if not (defer and holdable(g))])
        for i in self.trained:
            self.copies[i].grad = None
        self._graphs = max(0, self._graphs - 1)
        if not self._graphs:
            self.restore()

    def abandon(self) -> None:
        """After a forward whose backward will not run (a failed step): no graph is pending,
        the masters are back."""
        self._graphs = 0
        for c in self.copies:
            c.grad = None
        self.restore()


def holdable(grad: torch.Tensor) -> bool:
    """Whether a gradient can stay pending: the AdamW kernel walks it in the parameter's
    element order, so it must be contiguous (a graph's raw gradient may be a transposed view:
    that one is written into the fp32 gradient as before)."""
    return grad.is_contiguous()


ALIGN_BYTES = 16


def aligned_views(numels: list[int], dtype: torch.dtype, device: torch.device
                  ) -> list[torch.Tensor]:
    """1-D views of one new buffer, of these lengths, each starting on a 16-byte boundary (a
    kernel moves 16-byte vectors only where a tensor starts on one: the Triton AdamW among
    them, adamw_triton.py)."""
    per = max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
    starts, end = [], 0
    for n in numels:
        starts.append(end)
        end += -(-n // per) * per
    flat = torch.empty(end, dtype=dtype, device=device)
    return [flat[s:s + n] for s, n in zip(starts, numels)]


def _settle_for_others(ref: weakref.ref):
    """A global optimizer step pre-hook: an optimizer other than the reader that holds any of
    the masters reads .grad, so the pending gradients go into it first."""
    def hook(optimizer, args, kwargs) -> None:
        copies = ref()
        if copies is None or not copies.pending or optimizer is copies.reader():
            return
        if any(id(p) in copies._copy_of for group in optimizer.param_groups
               for p in group["params"]):
            copies.settle()
    return hook


def _mark_stepped(ref: weakref.ref):
    """A global optimizer step post-hook: notes on the copies a step of an optimizer that holds
    any of their masters (not a frozen reference model's); a weak reference, so that the hook
    does not keep them alive."""
    def hook(optimizer, args, kwargs) -> None:
        copies = ref()
        if copies is None:
            return
        if copies._written_by_step:
            copies._written_by_step = False
        elif any(id(p) in copies._copy_of for group in optimizer.param_groups
                 for p in group["params"]):
            copies._stepped = True
    return hook


def apply_compute_copies(model: nn.Module, compute_dtype: torch.dtype,
                         keeps_fp32: Callable[[str], bool]) -> ComputeCopies:
    copies = ComputeCopies(model, compute_dtype, keeps_fp32)
    model.compute_copies = copies  # for Policy.forward (a failed step) and bench/train.py
    return copies
