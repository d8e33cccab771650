"""The CSA indexer-score kernel against its torch reference (TRITON_INTERPRET=1 on CPU in CI)."""

import os

import pytest
import torch

from sglang_dsv41.attention.indexer_scores import indexer_scores, indexer_scores_reference

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                reason="Triton needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cpu" if INTERPRET else "cuda"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,entries,heads,dim", [(37, 21, 3, 32), (16, 1, 2, 16)])
def test_kernel_scores_match_the_reference(dtype, tokens, entries, heads, dim):
    gen = torch.Generator().manual_seed(tokens)
    q = torch.randn(tokens, heads, dim, generator=gen).to(DEVICE, dtype)
    keys = torch.randn(entries, dim, generator=gen).to(DEVICE, dtype)
    weights = torch.randn(tokens, heads, generator=gen).to(DEVICE)
    # A token whose products are all negative scores exactly 0 on both paths (a relu tie).
    q[0] = 0
    got = indexer_scores(q, keys, weights, dim ** -0.5, backend="triton")
    want = indexer_scores_reference(q.double(), keys.double(), weights.double(), dim ** -0.5)
    assert got.dtype == torch.float32 and got.shape == (tokens, entries)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # The relu bites: some products are negative, so a plain weighted sum would differ.
    assert not torch.allclose(want, torch.einsum("thd,nd,th->tn", q.double(), keys.double(),
                                                 weights.double()) * dim ** -0.5)


def test_bad_shapes_are_refused():
    q = torch.zeros(4, 2, 16)
    with pytest.raises(ValueError, match="weights"):
        indexer_scores(q, torch.zeros(3, 16), torch.zeros(4, 3), 1.0)
    with pytest.raises(ValueError, match="keys"):
        indexer_scores(q, torch.zeros(3, 8), torch.zeros(4, 2), 1.0)
