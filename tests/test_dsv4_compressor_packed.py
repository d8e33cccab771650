"""The compressor pools every packed sequence's entries in one pass (compressor.entry_windows),
and HCA's selection covers them in one pass too (all_visible_index):
the entries and gradients of a packed batch equal those of each sequence alone (to fp32
rounding: the parameters' gradients are summed over all entries at once), sequences too short
for an entry included, and the number of kernels a forward and backward launch does not grow
with the number of sequences."""

from __future__ import annotations

import collections

import pytest
import torch

from bench.packed_launches import KernelCalls
from sglang_dsv41.model.dsv4.compressor import Compressor, all_visible_index

FREQS = 1.0 / (10000 ** (torch.arange(0, 8, dtype=torch.float32) / 8))


def compressor(ratio: int, seed: int = 0) -> Compressor:
    torch.manual_seed(seed)
    m = Compressor(32, 16, ratio, 1e-6)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p))
    return m


def bounds_of(lens: list[int]) -> list[tuple[int, int]]:
    ends = [0]
    for n in lens:
        ends.append(ends[-1] + n)
    return list(zip(ends[:-1], ends[1:]))


def run(m: Compressor, x: torch.Tensor, bounds, grad_seed: int = 1):
    x = x.clone().requires_grad_()
    m.zero_grad()
    entries, starts = m(x, bounds, FREQS)
    if entries.numel():
        gen = torch.Generator().manual_seed(grad_seed)
        entries.backward(torch.randn(entries.shape, generator=gen))
    return entries.detach(), starts, x.grad, {n: p.grad for n, p in m.named_parameters()}


@pytest.mark.parametrize("ratio,lens", [(4, [9, 3, 17, 4, 0, 8]), (4, [8, 8]),
                                        (128, [300, 100, 520, 256]), (2, [3, 2, 7])])
def test_packed_entries_and_gradients_equal_each_sequence_alone(ratio, lens):
    m = compressor(ratio)
    x = torch.randn(sum(lens), 32, generator=torch.Generator().manual_seed(2))
    bounds = bounds_of(lens)
    entries, starts, gx, gp = run(m, x, bounds)
    assert starts == [0, *torch.tensor([n // ratio for n in lens]).cumsum(0).tolist()]
    want_gx = torch.zeros_like(x)
    want_gp = collections.defaultdict(float)
    for s, (a, b) in enumerate(bounds):
        # each sequence alone, fed the slice of the packed output gradient that is its own
        alone = compressor(ratio)
        xs = x[a:b].clone().requires_grad_()
        e, st = alone(xs, [(0, b - a)], FREQS)
        torch.testing.assert_close(entries[starts[s]:starts[s + 1]], e.detach(), rtol=0,
                                   atol=1e-6)
        if e.numel():
            gen = torch.Generator().manual_seed(1)
            g = torch.randn(entries.shape, generator=gen)[starts[s]:starts[s + 1]]
            e.backward(g)
            want_gx[a:b] = xs.grad
            for n, p in alone.named_parameters():
                want_gp[n] = want_gp[n] + p.grad
    torch.testing.assert_close(gx, want_gx, rtol=1e-5, atol=1e-6)
    for n, g in gp.items():
        torch.testing.assert_close(g, want_gp[n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ratio", [4, 128])
def test_kernels_do_not_grow_with_the_packed_sequences(ratio):
    m = compressor(ratio)
    counts = {}
    for n_seqs in (2, 7):
        lens = [3 * ratio + 1] * n_seqs
        x = torch.randn(sum(lens), 32)
        with KernelCalls() as k:
            run(m, x, bounds_of(lens))
        counts[n_seqs] = k.calls
    assert counts[2] == counts[7], counts


@pytest.mark.parametrize("ratio,lens", [(4, [9, 3, 17, 4, 0, 8]), (128, [600, 1, 700]),
                                        (4, [37])])
def test_hca_selection_of_packed_sequences(ratio, lens):
    """Row t of sequence s selects its sequence's entries 0..seen-1 (seen = (position + 1) //
    ratio) as packed rows entry_starts[s] + j, -1 past them; in int32, one pass."""
    bounds = bounds_of(lens)
    positions = torch.cat([torch.arange(n) for n in lens])
    counts = [n // ratio for n in lens]
    starts = [0, *torch.tensor(counts).cumsum(0).tolist()]
    got = all_visible_index(positions, bounds, starts, ratio)
    assert got.dtype == torch.int32 and got.shape == (sum(lens), max(counts))
    for s, (a, b) in enumerate(bounds):
        for t in range(a, b):
            seen = (t - a + 1) // ratio
            want = [starts[s] + j if j < seen else -1 for j in range(max(counts))]
            assert got[t].tolist() == want, (s, t)


def test_hca_selection_launches_do_not_grow_with_the_packed_sequences():
    calls = {}
    for n_seqs in (2, 7):
        lens = [300] * n_seqs
        starts = [0, *range(2, 2 * n_seqs + 1, 2)]
        positions = torch.cat([torch.arange(n) for n in lens])
        with KernelCalls() as k:
            all_visible_index(positions, bounds_of(lens), starts, 128)
        calls[n_seqs] = k.calls
    assert calls[2] == calls[7], calls


def test_hca_selection_of_rows_outside_the_sequences_is_empty():
    """Rows no sequence's bounds cover (the engine pads a batch) select nothing; bounds out of
    order or overlapping are refused."""
    positions = torch.cat([torch.arange(9), torch.zeros(2, dtype=torch.long),
                           torch.arange(6), torch.zeros(3, dtype=torch.long)])
    bounds, starts = [(0, 9), (11, 17)], [0, 2, 3]  # a gap of 2 rows, 3 padding rows at the end
    got = all_visible_index(positions, bounds, starts, 4)
    assert (got[9:11] == -1).all() and (got[17:] == -1).all()
    assert got.dtype == torch.int32
    assert got[8].tolist() == [0, 1] and got[11 + 2].tolist() == [-1, -1]
    assert got[11 + 3].tolist() == [2, -1]
    for bad in ([(0, 9), (8, 17)], [(11, 17), (0, 9)], [(0, 21)]):
        with pytest.raises(ValueError, match="not ordered"):
            all_visible_index(positions, bad, starts, 4)
