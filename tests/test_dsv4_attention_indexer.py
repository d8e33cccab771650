"""The CSA indexer-score kernel against its torch reference (TRITON_INTERPRET=1 on CPU in CI):
scores, the causal mask (``visible``) with whole tiles nobody sees, bad shapes; the kernel
compiled for an H200."""

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


@pytest.mark.parametrize("tokens,entries", [(37, 21), (40, 40)])
def test_visible_masks_unseen_entries_and_skips_unseen_tiles(tokens, entries):
    """visible[t] entries scored, -inf after (a causal selection's ratio-2 counts, a row that
    sees none, one that sees every entry); the first token blocks see no entry of the last
    tiles, whose products the kernel skips: the same -inf as the reference."""
    gen = torch.Generator().manual_seed(entries)
    q = torch.randn(tokens, 4, 32, generator=gen).to(DEVICE)
    keys = torch.randn(entries, 32, generator=gen).to(DEVICE)
    weights = torch.rand(tokens, 4, generator=gen).to(DEVICE)
    visible = torch.clamp((torch.arange(tokens) + 1) // 2, max=entries)
    visible[5], visible[-1] = 0, entries
    got = indexer_scores(q, keys, weights, 0.5, backend="triton", visible=visible.to(DEVICE))
    want = indexer_scores_reference(q.double(), keys.double(), weights.double(), 0.5,
                                    visible)
    unseen = torch.arange(entries)[None, :] >= visible[:, None]
    assert unseen[:16, 16:].all() and torch.isinf(want[unseen]).all()
    assert torch.equal(torch.isinf(got.cpu()), unseen)
    torch.testing.assert_close(got.cpu().double()[~unseen], want.cpu()[~unseen], rtol=1e-5,
                               atol=1e-5)
    with pytest.raises(ValueError, match="visible"):
        indexer_scores(q, keys, weights, 0.5, backend="triton", visible=visible[:-1])


def test_kernel_compiles_for_the_h200():
    from triton_compile import compile_many_sm90

    types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "w_ptr": "*fp32", "vis_ptr": "*i32",
             "out_ptr": "*fp32"}
    types.update({n: "i32" for n in ("T", "N", "H", "D", "stride_qt", "stride_qh", "stride_k",
                                     "stride_wt", "stride_ot")})
    types["scale"] = "fp32"
    module = "sglang_dsv41.attention.indexer_scores_triton"
    ptx = compile_many_sm90([(module, "_indexer_scores_kernel", types,
                              dict(HAS_VIS=vis, BT=64, BN=64, BD=128, DOT_PREC="tf32"), 4)
                             for vis in (True, False)])
    assert all("mma" in p for p in ptx)


def test_bad_shapes_are_refused():
    q = torch.zeros(4, 2, 16)
    with pytest.raises(ValueError, match="weights"):
        indexer_scores(q, torch.zeros(3, 16), torch.zeros(4, 3), 1.0)
    with pytest.raises(ValueError, match="keys"):
        indexer_scores(q, torch.zeros(3, 8), torch.zeros(4, 2), 1.0)
