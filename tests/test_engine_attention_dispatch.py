"""The embedded engine's attention dispatch (EngineForwardContext.attend): a decode forward runs
the paged decode over the pool through the plan's page table, every other forward the prefill
attention over windows gathered from the pool; both on the backend SGLANG_DSV41_ATTENTION_BACKEND
picks. The Triton backend (CPU under TRITON_INTERPRET=1, or CUDA) gives the reference backend's
greedy tokens and logprobs on the same engine requests, and the paged decode equals the window
gather on its own, padding rows and the dummy page included."""

from __future__ import annotations

import os

import pytest
import torch

from engine_core_harness import engine_test_model, write_flat_checkpoint
from sglang_dsv41.attention import BACKEND_ENV
from sglang_dsv41.engine.batch import Req, build_plan, idle_plan
from sglang_dsv41.engine.forward_context import EngineForwardContext, cu_of
from sglang_dsv41.engine.kv_cache import DUMMY_PAGE, TokenRowPool
from sglang_dsv41.engine.messages import SamplingParams
from sglang_dsv41.model.dsv4.context import DSV4Context

PAGE = 4
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _backends_on(device: str) -> list:
    """(device, backend) pairs runnable here; the others are skipped, not dropped."""
    cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    triton_cpu = pytest.mark.skipif(not INTERPRET, reason="Triton on CPU needs TRITON_INTERPRET=1")
    if device == "cuda":
        return [pytest.param("cuda", b, marks=cuda, id=f"cuda-{b}")
                for b in ("reference", "triton")]
    return [pytest.param("cpu", "reference", id="cpu-reference"),
            pytest.param("cpu", "triton", marks=triton_cpu, id="cpu-triton")]


# ---- attend in decode mode against the window gather -------------------------------------------

def _decode_case(device: str, padding_tp: int):
    """Three sequences (shorter than the window, exactly one window, longer) adding one token
    each, on scattered pages, padded to a multiple of padding_tp rows; the pool holds random
    history and a dummy page full of large values that no real query may read."""
    torch.manual_seed(0)
    heads, dim, window, comp = 4, 32, 8, 5
    lens = [3, 8, 21]
    pool = TokenRowPool({"layers.0.kv": dim}, num_pages=16, page_size=PAGE,
                        dtype=torch.float32, device=torch.device(device))
    pool.rows["layers.0.kv"].normal_()
    pool.rows["layers.0.kv"][DUMMY_PAGE * PAGE:(DUMMY_PAGE + 1) * PAGE] = 1e4
    pages = [[9], [3, 14], [15, 2, 7, 11, 5, 12]]
    reqs = []
    for i, (n, p) in enumerate(zip(lens, pages)):
        req = Req(f"r{i}", list(range(n)), SamplingParams(), pages=p)
        req.num_computed = n - 1
        reqs.append(req)
    plan = build_plan("decode", reqs, [1] * len(reqs), PAGE, padding_tp, padding_tp > 1, 0,
                      False)
    rows = plan.input_ids.shape[0]
    q = torch.randn(rows, heads, dim, device=device)
    kv = torch.randn(rows, dim, device=device)
    sinks = torch.randn(heads, device=device)
    comp_kv = torch.randn(comp, dim, device=device)
    comp_idx = torch.randint(-1, comp, (rows, 3), device=device)
    return plan, pool, (q, kv, sinks, window, dim ** -0.5, comp_kv, comp_idx)


def _attend(plan, pool, args, backend):
    ctx = EngineForwardContext(cu_seqlens=cu_of(plan.extend_lens, pool.rows["layers.0.kv"].device),
                               positions=plan.positions.to(args[0].device),
                               attention_backend=backend, plan=plan, pool=pool)
    return ctx.attend(0, *args)


@pytest.mark.parametrize("device,backend", _backends_on("cpu") + _backends_on("cuda"))
@pytest.mark.parametrize("padding_tp", [1, 4], ids=["unpadded", "padded"])
def test_decode_attend_equals_the_window_gather(device, backend, padding_tp):
    plan, pool, args = _decode_case(device, padding_tp)
    table = plan.decode_page_table
    assert table.dtype == torch.int32 and table.shape == (3, 6)
    assert table[0].tolist() == [9] + [DUMMY_PAGE] * 5 and table[1].tolist()[2:] == [0] * 4
    before = pool.rows["layers.0.kv"].clone()
    got = _attend(plan, pool, args, backend)
    # The old path on the same pool: each query's window gathered, the torch reference core.
    pool.rows["layers.0.kv"].copy_(before)
    plan.decode_page_table = None
    want = _attend(plan, pool, args, "reference")
    n = plan.num_tokens
    assert got.shape == args[0].shape and (plan.input_ids.shape[0] > n) == (padding_tp > 1)
    torch.testing.assert_close(got[:n], want[:n], rtol=0, atol=1e-4)
    assert got.abs().max() < 100                    # nothing read from the dummy page
    assert not got[n:].any()                        # padding rows: zeros


@pytest.mark.parametrize("device,backend", _backends_on("cpu") + _backends_on("cuda"))
def test_idle_plan_attends_to_nothing(device, backend):
    plan = idle_plan()
    assert plan.decode_page_table is None
    pool = TokenRowPool({"layers.0.kv": 32}, 2, PAGE, torch.float32, torch.device(device))
    q = torch.randn(1, 4, 32, device=device)
    out = _attend(plan, pool, (q, torch.randn(1, 32, device=device), None, 8, 0.2, None, None),
                  backend)
    assert out.shape == q.shape and not out.any()


def test_extend_plans_have_no_page_table():
    req = Req("x", list(range(6)), SamplingParams(), pages=[1, 2])
    assert build_plan("extend", [req], [6], PAGE, 1, False, 0, False).decode_page_table is None
    req.num_computed = 5        # an extend chunk of one token per sequence decodes in place
    assert build_plan("extend", [req], [1], PAGE, 1, False, 0, False).decode_page_table.tolist() \
        == [[1, 2]]


# ---- the same engine requests on both backends --------------------------------------------------

@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    from sglang_dsv41.engine.model_runner import ModelRunner
    from sglang_dsv41.server_args import ServerArgs

    cfg, model = engine_test_model()
    path = write_flat_checkpoint(str(tmp_path_factory.mktemp("tiny")), cfg, model)
    run = ModelRunner(ServerArgs(model_path=path, device="cpu", page_size=PAGE,
                                 max_total_tokens=512), None, path, torch.device("cpu"))
    assert run.cfg.window_size == 16
    run.reference = model
    yield run
    run.close()


def _serve(runner) -> list[tuple[str, list[int], int, torch.Tensor]]:
    """Greedy requests through the runner: a prompt shorter than the window (16) and a longer one
    in chunked prefill with padding rows, decoded together (padded too), then a turn restoring
    the longer one's prefix mid-page (copy-on-write) and decoding. -> (rid, tokens so far,
    sampled token, logprobs) of every sampled row, in order."""
    hist = runner.cfg.engram_max_ngram_size - 1
    short = Req("short", [(7 * i + 3) % 256 for i in range(10)], SamplingParams(),
                pages=[1, 2, 3, 4])
    long = Req("long", [(5 * i + 1) % 256 for i in range(27)], SamplingParams(),
               pages=list(range(30, 21, -1)))              # scattered, descending
    sampled = []

    def step(mode, reqs, chunks, attn_tp=1, copy=None):
        plan = build_plan(mode, reqs, chunks, PAGE, attn_tp, attn_tp > 1, hist, False)
        if copy:
            plan.copy_src, plan.copy_dst = (torch.tensor(c) for c in copy)
        assert (plan.decode_page_table is not None) == (mode == "decode")
        hidden, _ = runner.forward(plan, [plan.padded_tokens])
        logp = torch.log_softmax(runner.compute_logits(hidden, plan.logit_rows).float(), -1)
        done = [r for r, n in zip(reqs, chunks) if r.num_computed + n == len(r.all_ids)]
        for r, n in zip(reqs, chunks):
            r.num_computed += n
        for r, row in zip(done, logp):
            sampled.append((r.rid, r.all_ids, int(row.argmax()), row))
            r.output_ids.append(sampled[-1][2])

    step("extend", [short, long], [10, 12], attn_tp=4)     # long: first chunk
    step("extend", [long], [15])
    for tp in (1, 3):                                      # tp 3: a padded decode batch
        step("decode", [short, long], [1, 1], attn_tp=tp)
    # long's first 25 tokens: 6 whole pages by reference, position 24 copied from page 24
    turn = Req("turn", long.all_ids[:25] + [9, 8, 7], SamplingParams(),
               pages=list(range(30, 24, -1)) + [40, 41])
    turn.num_computed = 25
    step("extend", [turn], [3], copy=([24 * PAGE], [40 * PAGE]))
    step("decode", [turn, short], [1, 1])
    return sampled


@pytest.mark.skipif(not INTERPRET, reason="Triton on CPU needs TRITON_INTERPRET=1")
def test_triton_backend_serves_the_reference_tokens_and_logprobs(runner, monkeypatch):
    from sglang_dsv41.attention import dsv4_triton_backward, dsv4_triton_decode

    calls = {"prefill": 0, "decode": 0}

    def counted(kind, fn):
        def run(*a, **kw):
            calls[kind] += 1
            return fn(*a, **kw)
        return run

    monkeypatch.setattr(dsv4_triton_backward, "dsv4_attention_triton",
                        counted("prefill", dsv4_triton_backward.dsv4_attention_triton))
    monkeypatch.setattr(dsv4_triton_decode, "dsv4_decode_triton",
                        counted("decode", dsv4_triton_decode.dsv4_decode_triton))
    monkeypatch.setenv(BACKEND_ENV, "reference")
    want = _serve(runner)
    assert calls == {"prefill": 0, "decode": 0}
    monkeypatch.setenv(BACKEND_ENV, "triton")
    got = _serve(runner)
    layers = runner.cfg.num_hidden_layers   # 3 extend and 3 decode forwards, every layer
    assert calls == {"prefill": 3 * layers, "decode": 3 * layers}
    assert [(rid, tok) for rid, _, tok, _ in got] == [(rid, tok) for rid, _, tok, _ in want]
    assert len(got) == 9
    for (_, seq, tok, g), (_, _, _, w) in zip(got, want):
        torch.testing.assert_close(g[tok], w[tok], rtol=0, atol=1e-4)
        torch.testing.assert_close(g, w, rtol=0, atol=1e-4)
        # and the reference backend's rows are the whole-sequence recompute's
        with torch.no_grad():
            logits = runner.reference(torch.tensor(seq), DSV4Context.packed(
                [len(seq)], serving_numerics=runner.serving_numerics))[-1]
        torch.testing.assert_close(w, torch.log_softmax(logits.float(), -1), rtol=0, atol=1e-5)
