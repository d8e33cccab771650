"""The engine's cache in one process (ModelRunner without a world): chunked prefill with padding
rows, mixed extend/decode batches, a prefix restored at a page boundary inside compression
blocks and one restored mid-page by copying a cached page's rows (copy-on-write) all give the
logits of a whole-sequence recompute of the reference model (tiny: every V4.1 layer kind,
Engram with its n-gram history), with SGLang's serving numerics and without; the radix cache's
partial pages; model loading and --dtype."""

from __future__ import annotations

import pytest
import torch

from engine_core_harness import engine_test_model, write_flat_checkpoint
from sglang_dsv41.engine.batch import Req, build_plan
from sglang_dsv41.engine.messages import SamplingParams
from sglang_dsv41.model.dsv4.context import DSV4Context

PAGE = 4


@pytest.fixture(scope="module", params=[True, False], ids=["sglang_numerics", "plain"])
def runner(request, tmp_path_factory):
    from sglang_dsv41.engine.model_runner import ModelRunner
    from sglang_dsv41.server_args import ServerArgs

    cfg, model = engine_test_model()
    path = write_flat_checkpoint(str(tmp_path_factory.mktemp("tiny")), cfg, model)
    args = ServerArgs(model_path=path, device="cpu", page_size=PAGE, max_total_tokens=1024)
    run = ModelRunner(args, None, path, torch.device("cpu"))
    assert run.serving_numerics   # our layout: SGLang's numerics
    run.serving_numerics = request.param
    run.reference = model
    yield run
    run.close()   # releases the shared-memory Engram tables


def forward(runner, mode, reqs, chunks, attn_tp=1):
    """One forward (padded to attn_tp rows); the logits of its sampled rows."""
    hist = runner.cfg.engram_max_ngram_size - 1
    plan = build_plan(mode, reqs, chunks, PAGE, attn_tp, attn_tp > 1, hist, False)
    hidden, _ = runner.forward(plan, [plan.padded_tokens])
    for r, n in zip(reqs, chunks):
        r.num_computed += n
    return runner.compute_logits(hidden, plan.logit_rows)


def recompute(runner, seq) -> torch.Tensor:
    with torch.no_grad():
        ctx = DSV4Context.packed([len(seq)], serving_numerics=runner.serving_numerics)
        return runner.reference(torch.tensor(seq), ctx)[-1]


def close(got, want):
    torch.testing.assert_close(torch.log_softmax(got, -1), torch.log_softmax(want, -1),
                               rtol=0, atol=1e-5)


def test_chunked_prefill_padding_and_mixed_decode_equal_recompute(runner):
    a = Req("a", [(7 * i + 3) % 256 for i in range(70)], SamplingParams(), pages=list(range(1, 21)))
    b = Req("b", [(5 * i + 1) % 256 for i in range(23)], SamplingParams(),
            pages=list(range(60, 40, -1)))            # scattered, descending pages
    forward(runner, "extend", [a], [29], attn_tp=2)
    logits = forward(runner, "extend", [a, b], [41, 23], attn_tp=4)   # both complete
    for req, row in zip((a, b), logits):
        close(row, recompute(runner, req.all_ids))
        req.output_ids.append(int(row.argmax()))
    for step in range(3):
        logits = forward(runner, "decode", [a, b], [1, 1], attn_tp=3 if step == 1 else 1)
        for req, row in zip((a, b), logits):
            close(row, recompute(runner, req.all_ids))
            req.output_ids.append(int(row.argmax()))


def test_decode_pools_only_the_v41_groups_it_completes(runner, monkeypatch):
    """One request decoding alone: steps that complete no ratio-2 group (odd lengths) and steps
    that do, each equal to a whole-sequence recompute, and each V4.1 kv source's compressor
    projects only the rows of the groups a step completes (at most its ratio), not the history
    (the pool keeps every entry and its index keys). Under serving numerics no step rounds the
    V4.1 entries of the history to fp8 again: they are stored as the attention reads them. The
    V4.1 layers read no cached input rows but a ratio-2 pair's first (the indexers take this
    forward's rows only), and the pool keeps inputs only for the ratio-2 kv sources."""
    from sglang_dsv41.model.dsv4 import kv_numerics

    cfg = runner.model.cfg
    assert {n for n in runner.pool.rows if n.endswith(("attn_x", "q_lora"))} == {
        f"layers.{i}.attn_x" for i in cfg.kv_source_layer_ids if cfg.compress_ratios[i] == 2}
    seen, rounded, gathered = {}, [], []
    quantize = kv_numerics.quantize_kv_rows
    monkeypatch.setattr(kv_numerics, "quantize_kv_rows",
                        lambda kv, *a, **k: (rounded.append(kv.shape[0]), quantize(kv, *a, **k))[1])
    gather = runner.pool.gather
    monkeypatch.setattr(runner.pool, "gather", lambda name, slots: (
        gathered.append((name, slots.shape[0])), gather(name, slots))[1])
    hooks = [runner.model.layers[i].attn.compressor.wkv.register_forward_hook(
        lambda m, args, out, i=i: seen.__setitem__(i, args[0].shape[0]))
        for i in cfg.kv_source_layer_ids]
    try:
        r = Req("solo", [(3 * i + 2) % 256 for i in range(37)], SamplingParams(),
                pages=list(range(236, 248)))
        logits = forward(runner, "extend", [r], [37])
        for step in range(4):
            close(logits[0], recompute(runner, r.all_ids))
            r.output_ids.append(int(logits[0].argmax()))
            seen.clear()
            rounded.clear()
            gathered.clear()
            logits = forward(runner, "decode", [r], [1])
            inputs = [(name, rows) for name, rows in gathered if name.endswith("attn_x")]
            assert inputs and all(rows <= 2 for _, rows in inputs), (step, inputs)
            for i, rows in seen.items():
                assert rows <= cfg.compress_ratios[i], (step, i, rows)
            # this step's window row and new entries, the CSA layer's 9-10 pooled entries (V4
            # compressors still pool and round their history); the ratio-1 entries are 38+
            assert bool(rounded) == runner.serving_numerics and max(rounded, default=0) < 16, \
                (step, rounded)
        close(logits[0], recompute(runner, r.all_ids))
    finally:
        for h in hooks:
            h.remove()


def test_prefix_restored_at_a_page_boundary_inside_compression_blocks(runner):
    history = [(11 * i + 5) % 256 for i in range(66)]
    first = Req("t1", history, SamplingParams(), pages=list(range(100, 117)))
    forward(runner, "extend", [first], [66])
    # Turn 2 shares 64 tokens (16 pages: mid HCA block, mid ratio-4 overlap window) by page
    # reference, as the radix cache hands them out, and computes only its own tail.
    second = Req("t2", history[:64] + [9, 8, 7, 6, 5], SamplingParams(),
                 pages=list(range(100, 116)) + [130, 131])
    second.num_computed = 64
    close(forward(runner, "extend", [second], [5])[0], recompute(runner, second.all_ids))


def test_prefix_restored_mid_page_by_copying_the_cached_rows(runner):
    history = [(13 * i + 7) % 256 for i in range(66)]
    first = Req("c1", history, SamplingParams(), pages=list(range(200, 217)))
    forward(runner, "extend", [first], [66])
    # Turn 2 shares 65 tokens: 16 pages by reference and 1 row of page 216, which the prefix
    # cache matches part-way: its row is copied into the request's own page 230 (page 216 is
    # shared and never written), and only the 3 new tokens are computed.
    second = Req("c2", history[:65] + [9, 8, 7], SamplingParams(),
                 pages=list(range(200, 216)) + [230, 231])
    second.num_computed = 65
    hist = runner.cfg.engram_max_ngram_size - 1
    plan = build_plan("extend", [second], [3], PAGE, 1, False, hist, False)
    plan.copy_src, plan.copy_dst = torch.tensor([216 * PAGE]), torch.tensor([230 * PAGE])
    before = runner.pool.rows["layers.0.kv"][216 * PAGE:217 * PAGE].clone()
    hidden, _ = runner.forward(plan, [plan.padded_tokens])
    close(runner.compute_logits(hidden, plan.logit_rows)[0], recompute(runner, second.all_ids))
    assert torch.equal(runner.pool.rows["layers.0.kv"][216 * PAGE:217 * PAGE], before)


def test_radix_cache_keeps_partial_pages_for_copy_on_write_matches():
    from sglang_dsv41.engine.kv_cache import PageAllocator
    from sglang_dsv41.engine.prefix_cache import RadixPrefixCache

    alloc = PageAllocator(16, 4)
    cache = RadixPrefixCache(alloc)
    pages = alloc.alloc(3)
    # A finished request computed 10 tokens: 2 whole pages and 2 rows of a third.
    assert cache.insert(list(range(10)), pages) == 0
    cache.check_integrity()
    m = cache.match_prefix(list(range(9)) + [99, 98])
    assert (m.pages, m.num_tokens, m.copy_page, m.copy_tokens) == (pages[:2], 8, pages[2], 1)
    m = cache.match_prefix(list(range(10)) + [50])
    assert (m.num_tokens, m.copy_page, m.copy_tokens) == (8, pages[2], 2)
    m = cache.match_prefix([0, 1, 2, 3, 4, 5, 77])   # part-way into a whole cached page
    assert (m.pages, m.num_tokens, m.copy_page, m.copy_tokens) == (pages[:1], 4, pages[1], 2)
    assert cache.match_prefix([5, 6]).copy_tokens == 0
    with pytest.raises(ValueError, match="part of one"):
        cache.insert(list(range(10)), pages[:2])
    alloc.decref(pages)                               # the request drops its references
    assert cache.num_cached_pages == 3 and alloc.num_free == 15 - 3
    assert cache.evict(3) == 3 and alloc.num_free == 15
    cache.check_integrity()
    alloc.check()


def test_serving_dtype_keeps_sinks_norms_and_mhc_fp32(runner):
    from sglang_dsv41.loader.serving import load_serving_model

    model = load_serving_model(runner.model_dir, torch.bfloat16, "cpu")
    kinds = {}
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("attn_sink", "ape") or leaf.startswith("hc_") or "norm" in name:
            kinds.setdefault("fp32", set()).add(p.dtype)
        else:
            kinds.setdefault("cast", set()).add(p.dtype)
    assert kinds == {"fp32": {torch.float32}, "cast": {torch.bfloat16}}
    tables = [b for n, b in model.named_buffers() if n.endswith("engram.embed.weight")]
    assert tables and all(t.dtype == torch.float8_e4m3fn for t in tables)


def test_model_path_layouts_and_dummy_load(runner, tmp_path):
    from sglang_dsv41.loader.serving import has_tokenizer, load_serving_model, model_layout

    assert model_layout("tiny") == "preset" and has_tokenizer("tiny")
    assert model_layout(runner.model_dir) == "flat" and not has_tokenizer(runner.model_dir)
    with pytest.raises(ValueError, match="neither a preset"):
        model_layout(str(tmp_path))
    ref = runner.reference.state_dict()
    for name, t in runner.model.state_dict().items():   # the flat checkpoint loaded as written
        assert torch.equal(t, ref[name]), name
    dummy = load_serving_model(runner.model_dir, torch.float32, "cpu", "dummy").state_dict()
    for name, t in dummy.items():
        if name.endswith("tid2eid") or ".engram.embed." in name:
            assert torch.equal(t.view(torch.uint8) if t.dtype.itemsize == 1 else t,
                               ref[name].view(torch.uint8) if t.dtype.itemsize == 1
                               else ref[name]), name
        elif t.is_floating_point() and t.numel() > 1:
            assert t.abs().max() <= 1e-3, name
    with pytest.raises(ValueError, match="load_format"):
        load_serving_model(runner.model_dir, torch.float32, "cpu", "npcache")


def test_two_runners_in_one_process_keep_their_own_engram_tables(tmp_path):
    """Two in-process runners of different checkpoints, alive at once, each read their own
    Engram tables, in shared-memory namespaces of their own (they once shared one named by the
    parent process's pid: under xdist every worker's runners did, the second's tables replaced
    the first's files and the last release unlinked files another worker was attaching); the
    first's tables outlive the second's close. A launch's ranks on a node share one name that
    holds its rendezvous port."""
    from sglang_dsv41.engine.model_runner import ModelRunner, node_namespace
    from sglang_dsv41.loader.engram_layouts import engram_tables
    from sglang_dsv41.model.dsv4.model import init_weights
    from sglang_dsv41.server_args import ServerArgs

    runners = []
    for seed in (1, 2):
        cfg, model = engine_test_model()
        init_weights(model, seed=seed)
        path = write_flat_checkpoint(str(tmp_path / f"m{seed}"), cfg, model)
        args = ServerArgs(model_path=path, device="cpu", page_size=PAGE, max_total_tokens=256)
        runners.append(ModelRunner(args, None, path, torch.device("cpu")))
    try:
        assert all(r.engram_store.layout == "shared" for r in runners)
        names = {r.engram_store.namespace.namespace for r in runners}
        assert len(names) == 2, names
        first, second = ({n: t.weight.float().clone() for n, t in engram_tables(r.model).items()}
                         for r in runners)
        assert first.keys() == second.keys() and first
        assert any(not torch.equal(first[n], second[n]) for n in first)
        runners.pop().close()
        for name, table in engram_tables(runners[0].model).items():
            assert torch.equal(table.weight.float(), first[name]), name
    finally:
        for r in runners:
            r.close()
    assert node_namespace(29500) != node_namespace(29501)
