"""The chunk buffer's exact-size pinning and the VMA measurement bench/offload.py relies on, on
CPU: a plain mmap is found with its exact size and resident bytes; the chunk buffer is one
mapping of ceil(bytes / page) pages; cudaHostRegister / Unregister get exactly that range, once,
and a failed registration is an error (a recording cudart stands in for CUDA here: the real pin
is measured on the GPU machine, bench/results/offload_h200.txt)."""

from __future__ import annotations

import mmap

import pytest
import torch

from trainer_bridge.optimizer_offload import ChunkedHostAdamW, HostChunkBuffer, host_mapping

PAGE = mmap.PAGESIZE


def test_host_mapping_finds_a_plain_mmap_exactly():
    # Shared anonymous: its own shmem object, so the kernel never merges it with a neighbour
    # (a private anonymous mapping next to another of the same protection merges into one VMA,
    # which made this test fail now and then).
    m = mmap.mmap(-1, 5 * PAGE, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(m, dtype=torch.uint8)
    t[: 3 * PAGE].fill_(1)  # fault in three pages of five
    for ptr in (t.data_ptr(), t.data_ptr() + 5 * PAGE - 1):
        vma = host_mapping(ptr)
        assert vma["start"] == t.data_ptr()
        assert vma["size"] == 5 * PAGE
        assert 3 * PAGE <= vma["rss"] <= vma["size"]
    with pytest.raises(LookupError, match="no mapping"):
        host_mapping(0x10)  # page zero is never mapped


def test_host_mapping_reads_a_given_smaps(tmp_path):
    smaps = tmp_path / "smaps"
    smaps.write_text("1000-3000 rw-p 00000000 00:00 0\nSize: 8 kB\nRss: 4 kB\nLocked: 0 kB\n"
                     "7000-f000 rw-p 00000000 00:00 0\nSize: 32 kB\nRss: 32 kB\nLocked: 32 kB\n")
    assert host_mapping(0x7fff, str(smaps)) == dict(start=0x7000, size=0x8000, rss=32 << 10,
                                                    locked=32 << 10)
    assert host_mapping(0x1000, str(smaps))["rss"] == 4 << 10
    with pytest.raises(LookupError, match="0x3000"):
        host_mapping(0x3000, str(smaps))  # end is exclusive


class RecordingCudart:
    def __init__(self, error: int = 0):
        self.error, self.calls = error, []

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls.append(("register", ptr, nbytes, flags))
        return self.error

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0


@pytest.mark.parametrize("elems", [PAGE // 4, 1310, 3 * PAGE])  # page multiple or not
def test_chunk_buffer_is_one_exact_mapping_registered_once(elems):
    cudart = RecordingCudart()
    buf = HostChunkBuffer((2, elems), torch.float32, pin=True, cudart=cudart)
    requested = 2 * elems * 4
    pages = -(-requested // PAGE) * PAGE
    assert buf.requested_bytes == requested and buf.mapped_bytes == pages
    assert buf.tensor.shape == (2, elems) and buf.tensor.dtype == torch.float32
    buf.tensor.fill_(1.0)
    vma = host_mapping(buf.tensor.data_ptr())
    assert vma["start"] == buf.tensor.data_ptr()
    assert vma["size"] == pages and vma["rss"] == pages  # its own VMA (MADV_DONTFORK)
    ptr = buf.tensor.data_ptr()
    assert cudart.calls == [("register", ptr, pages, 0)] and buf.pinned
    buf.close()
    buf.close()
    assert cudart.calls[1:] == [("unregister", ptr)] and not buf.pinned


def test_chunk_buffer_unregisters_when_dropped_and_refuses_a_failed_pin():
    cudart = RecordingCudart()
    buf = HostChunkBuffer((4,), torch.float32, pin=True, cudart=cudart)
    view = buf.tensor[1:]  # outlives the buffer object: the pages stay mapped, unpinned
    del buf
    assert [c[0] for c in cudart.calls] == ["register", "unregister"]
    view.fill_(2.0)
    with pytest.raises(RuntimeError, match="cudaHostRegister .* failed with cudaError 2"):
        HostChunkBuffer((4,), torch.float32, pin=True, cudart=RecordingCudart(error=2))
    with pytest.raises(ValueError, match="holds no byte"):
        HostChunkBuffer((0, 3), torch.float32, pin=False)


def test_chunked_adamw_on_cpu_uses_an_unpinned_exact_buffer_and_close_frees_it():
    p = torch.nn.Parameter(torch.randn(3000))
    ref = torch.nn.Parameter(p.detach().clone())
    opt = ChunkedHostAdamW([p], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, chunk_mb=0.01)
    plain = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    for step in range(3):
        grad = torch.randn(3000, generator=torch.Generator().manual_seed(step))
        p.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        plain.step()
        if step == 1:
            opt.close()  # the next step makes a new buffer; results do not change
            assert opt.chunk_buffer is None
    assert torch.equal(p, ref)
    buf = opt.chunk_buffer
    assert not buf.pinned and buf.requested_bytes == 2 * opt.chunk_elems * 4
    assert host_mapping(buf.tensor.data_ptr())["size"] == buf.mapped_bytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs CUDA (GPU machine)")
def test_chunk_buffer_really_pinned_on_cuda():
    buf = HostChunkBuffer((2, 3 * PAGE + 5), torch.float32, pin=True)
    assert buf.tensor.is_pinned()
    assert host_mapping(buf.tensor.data_ptr())["size"] == buf.mapped_bytes
    buf.tensor.copy_(torch.arange(buf.tensor.numel(), dtype=torch.float32).view_as(buf.tensor))
    back = buf.tensor.to("cuda", non_blocking=True).mul_(2).cpu()
    assert torch.equal(back, buf.tensor * 2)
    buf.close()
    assert not buf.tensor.is_pinned()
