"""trainer_bridge/fsdp_copy_in.py: FSDP2's reduce-scatter copy-in as one torch.cat equals
torch._chunk_cat bit for bit (uneven dim-0 sizes zero-padded, bf16 -> fp32, other dims,
non-contiguous inputs), refuses an output of another size instead of resizing it, and is the
op's kernel once installed (the FSDP2 tests run their reductions through it: parallelize_policy
installs it for the mesh's device)."""

from __future__ import annotations

import pytest
import torch

from trainer_bridge import fsdp_copy_in


def reference(tensors, dim, num_chunks, out_dtype):
    return torch._chunk_cat([t.to(out_dtype) for t in tensors], dim, num_chunks)


CASES = [
    # (shapes, dim, num_chunks, in dtype, out dtype)
    ([(7, 5), (7,), (3, 7), (1, 4)], 0, 2, torch.float32, torch.float32),
    ([(7, 5), (8, 3, 2), (1,)], 0, 3, torch.bfloat16, torch.float32),
    ([(6, 4), (6, 3)], 0, 1, torch.bfloat16, torch.bfloat16),
    ([(2, 5, 3), (2, 4)], 1, 2, torch.float32, torch.float32),
]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA: torch's CUDA kernel of the op"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shapes,dim,num_chunks,dtype,out_dtype", CASES)
def test_chunk_cat_equals_torchs(shapes, dim, num_chunks, dtype, out_dtype, device):
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=gen).to(device, dtype) for s in shapes]
    # a non-contiguous one: the same values laid out transposed
    tensors[0] = tensors[0].transpose(0, 1).contiguous().transpose(0, 1)
    want = reference(tensors, dim, num_chunks, out_dtype)
    out = torch.full(want.shape, float("nan"), dtype=out_dtype, device=device)
    fsdp_copy_in.chunk_cat(tensors, dim, num_chunks, out)
    assert torch.equal(out, want)
    flat = torch.full((want.numel(),), float("nan"), dtype=out_dtype,  # FSDP's buffer, viewed
                      device=device)
    fsdp_copy_in.chunk_cat(tensors, dim, num_chunks, flat.view(*want.shape[:dim + 1], -1))
    assert torch.equal(flat.view(want.shape), want)


def test_chunk_cat_refuses_an_output_of_another_size():
    with pytest.raises(RuntimeError):
        fsdp_copy_in.chunk_cat([torch.ones(4, 2)], 0, 2, torch.empty(2, 5))


def test_installed_kernel_is_ours():
    import torch.distributed.fsdp  # noqa: F401 (defines fsdp::chunk_cat)

    fsdp_copy_in.install("cpu")
    fsdp_copy_in.install("cpu")  # once per process
    assert "fsdp_copy_in.py" in torch._C._dispatch_dump("fsdp::chunk_cat")
    t = [torch.randn(5, 3), torch.randn(2)]
    out = torch.empty(2, 10)
    torch.ops.fsdp.chunk_cat(t, 0, 2, out=out)
    assert torch.equal(out, torch._chunk_cat(t, 0, 2))
    with pytest.raises(RuntimeError):  # ours: no silent resize of a wrong-size buffer
        torch.ops.fsdp.chunk_cat(t, 0, 2, out=torch.empty(2, 9))
