"""FSDP2's reduce-scatter copy-in (the ``fsdp::chunk_cat`` op) as one torch.cat.

After a layer's backward FSDP2 copies the group's unsharded gradients into its reduce-scatter
buffer with ``torch._chunk_cat``. That op's CUDA kernel builds its launch metadata on the host
with one entry per tile of the gradients' bytes (aten/src/ATen/native/cuda/TensorShape.cu,
``get_chunk_cat_metadata``): on an H200, 1.0 ms of host time per decoder-layer group of the
``small`` preset, 13.3 of the 27 ms FSDP's post-backward hooks held the backward's host thread a
step, in a backward whose GPU waits for the host (bench/results/train_h200.txt, run S). The
same copy as a torch.cat of every gradient's [num_chunks, chunk] view costs host time per
tensor, not per byte (bench/launch_overhead.py).

Same values as torch's op, bit for bit (tests/test_trainer_fsdp_copy_in.py): dim-0 sizes that
do not divide into the chunks are zero-padded, and bf16 gradients are cast into an fp32 buffer
(FSDP's fp32 reduce of a bf16 compute group). ``install`` registers it as the op's kernel for a
device type, for the whole process (FSDP2 has no per-module hook for its copy-in).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

_installed: dict[str, torch.library.Library] = {}


def chunk_cat(tensors: list[torch.Tensor], dim: int, num_chunks: int,
              out: torch.Tensor) -> None:
    """torch._chunk_cat(tensors, dim, num_chunks, out=out): each tensor, zero-padded along
    ``dim`` to a multiple of num_chunks, cut into num_chunks chunks there; chunk i of every
    tensor, flattened, concatenated in order, is row i of ``out`` [*lead, num_chunks, -1]."""
    views = []
    for t in tensors:
        size = t.size(dim)
        padded = -(-size // num_chunks) * num_chunks
        if padded != size:
            t = F.pad(t, [0, 0] * (t.dim() - 1 - dim) + [0, padded - size])
        views.append(t.reshape(*t.shape[:dim], num_chunks, -1))
    # a view of out's exact size (raises where they differ): cat never resizes it
    rows = out.view(*views[0].shape[:-1], sum(v.shape[-1] for v in views))
    if all(v.dtype == out.dtype for v in views):
        torch.cat(views, dim=dim + 1, out=rows)
    else:  # into another dtype torch.cat copies tensor by tensor, a launch each (35 a layer,
        # 296 us of host on an H200): one cat in the gradients' dtype, then one cast
        rows.copy_(torch.cat(views, dim=dim + 1))


def install(device_type: str) -> None:
    """Make ``chunk_cat`` fsdp::chunk_cat's kernel on ``device_type`` (once per process)."""
    key = {"cuda": "CUDA", "cpu": "CPU"}.get(device_type)
    if key is None or key in _installed:
        return
    import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401 (defines the op)

    lib = torch.library.Library("fsdp", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": the point
        warnings.simplefilter("ignore", UserWarning)
        lib.impl("chunk_cat", chunk_cat, key, allow_override=True)  # torch 2.11: default False
    _installed[key] = lib  # the registration lives as long as its Library object
